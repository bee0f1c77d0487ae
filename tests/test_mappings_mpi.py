"""The Megatron mappings across 8 real processes (tp=4, pp=2), forward and backward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from test_tensor_parallel_mappings import TABLE, _expect
from tp_harness import value_and_input_grad

from core import parallel_state as ps

pytestmark = pytest.mark.mpi(min_size=8)


def _run(state, fn, *per_rank):
    names = state.mesh.axis_names
    rank = jax.process_index()
    spec = P(*names)
    arrays = [jax.make_array_from_process_local_data(jax.NamedSharding(state.mesh, spec),
                                                     a[rank].reshape((1,) * len(names) + a.shape[1:])) for a in per_rank]

    def wrapped(*xs):
        out = fn(*[x.reshape(x.shape[len(names):]) for x in xs])
        return jax.tree.map(lambda o: o.reshape((1,) * len(names) + o.shape), out)

    out = jax.jit(jax.shard_map(wrapped, mesh=state.mesh, in_specs=spec, out_specs=spec, check_vma=False))(*arrays)
    return jax.tree.map(lambda o: np.asarray(o.addressable_shards[0].data).reshape(o.shape[len(names):]), out)


def test_ones_times_rank_all_reduce_6_and_22():
    from core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
    )

    state = ps.initialize_model_parallel(4, 2)
    rank = jax.process_index()
    x = np.stack([np.full((4,), r, np.float32) for r in range(8)])
    out, grad = _run(state, lambda a, c: value_and_input_grad(reduce_from_tensor_model_parallel_region, a, c), x, x)
    np.testing.assert_array_equal(out, 6.0 if rank < 4 else 22.0)
    np.testing.assert_array_equal(grad, rank)  # backward of reduce_from is the identity
    out, grad = _run(state, lambda a, c: value_and_input_grad(copy_to_tensor_model_parallel_region, a, c), x, x)
    np.testing.assert_array_equal(out, rank)
    np.testing.assert_array_equal(grad, 6.0 if rank < 4 else 22.0)  # backward of copy_to all-reduces


@pytest.mark.parametrize("fn,forward,backward,dim", TABLE)
def test_mapping_forward_and_backward_across_processes(fn, forward, backward, dim):
    state = ps.initialize_model_parallel(4, 2)
    rank = jax.process_index()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 8, 2, 8)).astype(np.float32)
    want_out = _expect(forward, x, state, dim)
    cot = rng.normal(size=want_out.shape).astype(np.float32)
    out, grad = _run(state, lambda a, c: value_and_input_grad(fn, a, jnp.asarray(c)), x, cot)
    np.testing.assert_allclose(out, want_out[rank], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(grad, _expect(backward, cot, state, dim)[rank], rtol=1e-5, atol=1e-6)
