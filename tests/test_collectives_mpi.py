"""Reduce-scatter implementations across real processes (gloo on CPU), numerically."""

import jax
import numpy as np
import pytest
from collectives_reference import expected_all_reduce, expected_reduce_scatter
from jax.sharding import PartitionSpec as P

from core import parallel_state as ps
from core.distributed.collectives import (
    SPLIT_ALL_REDUCE_MIN_BYTES,
    all_reduce,
    default_all_reduce_impl,
    default_reduce_scatter_impl,
    reduce_scatter,
)

pytestmark = pytest.mark.mpi(min_size=8)


def test_auto_picks_the_ring_on_multiprocess_cpu():
    if jax.default_backend() == "cpu":
        assert default_reduce_scatter_impl() == "ring"
        assert default_all_reduce_impl(SPLIT_ALL_REDUCE_MIN_BYTES) == "reduce_scatter_all_gather"
        assert default_all_reduce_impl(SPLIT_ALL_REDUCE_MIN_BYTES - 4) == "psum"
        assert default_all_reduce_impl(SPLIT_ALL_REDUCE_MIN_BYTES, 2) == "psum"  # two ranks: no gain


_SIZES = [(1, 64), (2, 4096), (1, 262144 + 8 * 128)]


def _run_across_processes(state, fn, numel):
    """Give rank r the data ``per_rank[r]`` (rank-dependent and exactly representable: a sum
    reveals which ranks were reduced), apply ``fn`` to the flat vector inside shard_map, and
    return ``(per_rank, this rank's flat output)``."""
    world, rank = state.world_size, jax.process_index()
    per_rank = np.stack([np.arange(numel, dtype=np.float32) % 7 + 2.0**r for r in range(world)])
    names = state.mesh.axis_names
    local = per_rank[rank].reshape((1,) * len(names) + (numel,))
    x = jax.make_array_from_process_local_data(jax.NamedSharding(state.mesh, P(*names)), local)

    def f(v):
        out = fn(v.reshape(numel))
        return out.reshape((1,) * len(names) + out.shape)

    out = jax.jit(jax.shard_map(f, mesh=state.mesh, in_specs=P(*names), out_specs=P(*names), check_vma=False))(x)
    (got,) = [np.asarray(s.data).ravel() for s in out.addressable_shards]
    return per_rank, got


# Raw gloo psum_scatter only at a large size: a small one would slow every later large
# collective of this test session (the stall this module exists to avoid).
@pytest.mark.parametrize(
    "impl,tp,numel",
    [(i, *s) for i in ("auto", "all_reduce") for s in _SIZES] + [("psum_scatter", *_SIZES[-1])],
)
def test_reduce_scatter_across_processes(impl, tp, numel):
    state = ps.build_parallel_state(tp)
    axes = state.data_parallel_axis_name
    per_rank, got = _run_across_processes(state, lambda v: reduce_scatter(v, axes, impl=impl), numel)
    np.testing.assert_array_equal(got, expected_reduce_scatter(state, per_rank, axes, 0)[jax.process_index()])


# 2**20 + 3 floats: above the split threshold and not divisible by the group (padded).
@pytest.mark.parametrize("impl", ["auto", "psum"])
@pytest.mark.parametrize("tp,numel,average", [(1, 64, False), (1, 2**20 + 3, False), (2, 2**20 + 3, True)])
def test_all_reduce_across_processes(impl, tp, numel, average):
    state = ps.build_parallel_state(tp)
    axes = state.data_parallel_axis_name
    per_rank, got = _run_across_processes(state, lambda v: all_reduce(v, axes, average=average, impl=impl), numel)
    # Exactly representable sums (means of a power-of-two group): equal whatever the order.
    np.testing.assert_array_equal(got, expected_all_reduce(state, per_rank, axes, average)[jax.process_index()])
