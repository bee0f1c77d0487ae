"""core.distributed.collectives on 8 simulated devices: every reduce-scatter implementation."""

import jax
import numpy as np
import pytest
from collectives_reference import expected_all_reduce, expected_reduce_scatter
from jax.sharding import PartitionSpec as P

from core import parallel_state as ps
from core.distributed.collectives import all_gather, all_reduce, reduce_scatter


def _run_per_rank(state, fn, per_rank):
    """Apply fn to each rank's slice per_rank[r] inside shard_map; returns outputs by rank."""
    names = state.mesh.axis_names
    grid = per_rank[state.device_ranks.ravel()].reshape(state.device_ranks.shape + per_rank.shape[1:])
    nd = len(names)

    def wrapped(v):
        out = fn(v.reshape(v.shape[nd:]))
        return out.reshape((1,) * nd + out.shape)

    out = jax.jit(jax.shard_map(wrapped, mesh=state.mesh, in_specs=P(*names), out_specs=P(*names), check_vma=False))(grid)
    out = np.asarray(out).reshape((-1,) + np.asarray(out).shape[nd:])
    result = np.empty_like(out)
    result[state.device_ranks.ravel()] = out
    return result


def _group_axes(state, axes_kind):
    """The mesh axes of a data-parallel ("dp") or tensor-parallel ("tp") group, and the
    ``axis_name`` to pass to a collective (a single axis as a plain string)."""
    axes = state.data_parallel_axis_name if axes_kind == "dp" else ("tp",)
    return axes, axes if len(axes) > 1 else axes[0]


@pytest.mark.parametrize("impl", ["psum_scatter", "ring", "all_reduce", "auto"])
@pytest.mark.parametrize("tp,axes_kind", [(1, "dp"), (2, "dp"), (4, "tp"), (2, "tp")])
@pytest.mark.parametrize("shape,dim", [((64,), 0), ((3, 40), 1), ((16, 5), 0)])
def test_reduce_scatter_matches_numpy(impl, tp, axes_kind, shape, dim):
    state = ps.build_parallel_state(tp)
    axes, axis_name = _group_axes(state, axes_kind)
    n = int(np.prod([state.mesh.shape[a] for a in axes]))
    if shape[dim] % n:
        pytest.skip("does not divide")
    per_rank = np.random.default_rng(0).normal(size=(8, *shape)).astype(np.float32)
    got = _run_per_rank(state, lambda v: reduce_scatter(v, axis_name, scatter_dimension=dim, impl=impl), per_rank)
    np.testing.assert_allclose(got, expected_reduce_scatter(state, per_rank, axes, dim), rtol=1e-5, atol=1e-5)


def test_all_gather_inverts_reduce_scatter_layout():
    state = ps.build_parallel_state(1)
    per_rank = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
    got = _run_per_rank(state, lambda v: all_gather(v, state.data_parallel_axis_name), per_rank)
    np.testing.assert_array_equal(got, np.broadcast_to(per_rank.reshape(-1), (8, 32)))


def test_reduce_scatter_rejects_indivisible():
    state = ps.build_parallel_state(1)
    with pytest.raises(ValueError, match=r"size 10 is not divisible by the size 8"):
        _run_per_rank(state, lambda v: reduce_scatter(v, ("dp", "ep")), np.ones((8, 10), np.float32))


@pytest.mark.parametrize("impl", ["psum", "reduce_scatter_all_gather", "auto"])
@pytest.mark.parametrize("tp,axes_kind", [(1, "dp"), (2, "dp"), (2, "tp")])
@pytest.mark.parametrize("shape", [(64,), (3, 5), (1,)])  # (3, 5) and (1,): padded to the group size
@pytest.mark.parametrize("average", [False, True])
def test_all_reduce_matches_numpy(impl, tp, axes_kind, shape, average):
    state = ps.build_parallel_state(tp)
    axes, axis_name = _group_axes(state, axes_kind)
    per_rank = np.random.default_rng(1).normal(size=(8, *shape)).astype(np.float32)
    got = _run_per_rank(state, lambda v: all_reduce(v, axis_name, average=average, impl=impl), per_rank)
    np.testing.assert_allclose(got, expected_all_reduce(state, per_rank, axes, average), rtol=1e-5, atol=1e-5)


def test_all_reduce_rejects_unknown_impl():
    state = ps.build_parallel_state(1)
    with pytest.raises(ValueError, match="unknown all_reduce impl"):
        _run_per_rank(state, lambda v: all_reduce(v, ("dp", "ep"), impl="tree"), np.ones((8, 4), np.float32))
