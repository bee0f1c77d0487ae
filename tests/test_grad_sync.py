"""Which group reduces what: bucket all-reduce / reduce-scatter, dense vs expert buffers."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from core import parallel_state as ps
from core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from core.distributed.grad_sync import reduce_gradient_buckets
from core.distributed.param_and_grad_buffer import build_buffer_specs
from core.param_metadata import ParamInfo


def _reduce(state, ddp_config, values_per_rank):
    """Reduce one dense and one expert buffer whose grads on rank r are values_per_rank(r)."""
    shapes = [(64, 4), (3,), (128,)]
    infos = [ParamInfo(P()), ParamInfo(P()), ParamInfo(P(), expert=True)]
    specs = build_buffer_specs(shapes, [jnp.float32] * 3, infos, data_parallel_size=state.data_parallel_size,
                               bucket_size=100, use_distributed_optimizer=ddp_config.use_distributed_optimizer,
                               grad_reduce_in_fp32=False)
    names = state.mesh.axis_names
    ranks = jnp.asarray(state.device_ranks, jnp.float32)

    def body(rank):
        r = rank.reshape(())
        buffers = [tuple(jnp.full(n, values_per_rank(r), jnp.float32) for n in s.bucket_sizes()) for s in specs]
        out = reduce_gradient_buckets(buffers, specs, ddp_config, state)
        return jax.tree.map(lambda x: x[None, None, None, None, None], out)

    out = jax.jit(jax.shard_map(body, mesh=state.mesh, in_specs=P(*names), out_specs=P(*names), check_vma=False))(ranks)
    return specs, out


@pytest.mark.parametrize("use_distributed_optimizer", [False, True])
def test_all_ones_reduce_to_one(use_distributed_optimizer):
    state = ps.build_parallel_state()
    specs, out = _reduce(state, DistributedDataParallelConfig(use_distributed_optimizer=use_distributed_optimizer),
                         lambda r: 1.0)
    for spec, buckets in zip(specs, out):
        for bucket, size in zip(buckets, spec.bucket_sizes()):
            local = np.asarray(bucket).reshape(8, -1)
            assert local.shape[1] == (size // 8 if use_distributed_optimizer else size)
            np.testing.assert_array_equal(local, 1.0)


@pytest.mark.parametrize("use_distributed_optimizer", [False, True])
def test_rank_dependent_grads_reveal_the_reducing_group(use_distributed_optimizer):
    # ep=2: dense grads reduce over all 8 dp ranks, expert grads over the 4 expert-dp ranks.
    state = ps.build_parallel_state(expert_model_parallel_size=2)
    _, (dense, expert) = _reduce(state, DistributedDataParallelConfig(use_distributed_optimizer=use_distributed_optimizer),
                                 lambda r: 2.0**r)
    by_rank = {int(r): i for i, r in enumerate(state.device_ranks.ravel())}
    for rank in range(8):
        dense_group = state.group_of(rank, state.data_parallel_axis_name)
        expert_group = state.group_of(rank, ("dp",))
        assert len(dense_group) == 8 and len(expert_group) == 4
        want_dense = sum(2.0**r for r in dense_group) / 8
        want_expert = sum(2.0**r for r in expert_group) / 8
        for b in dense:
            np.testing.assert_allclose(np.asarray(b).reshape(8, -1)[by_rank[rank]], want_dense)
        for b in expert:
            np.testing.assert_allclose(np.asarray(b).reshape(8, -1)[by_rank[rank]], want_expert)
    assert sorted(map(sorted, state.groups(("dp",)))) == [[0, 2, 4, 6], [1, 3, 5, 7]]


def _collectives(jaxpr) -> list:
    """Every collective / concatenate equation of a jaxpr, nested jaxprs included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("psum", "pmean", "psum2", "concatenate", "reduce_scatter", "all_gather",
                                  "ppermute"):
            found.append(eqn)
        for p in eqn.params.values():
            inner = getattr(p, "jaxpr", p)
            if isinstance(inner, jax.extend.core.Jaxpr):
                found.extend(_collectives(inner))
    return found


def test_replicated_reduction_all_reduces_the_gradients_without_a_flat_copy():
    # Without the distributed optimizer each parameter's reduced gradient is what the optimizer
    # reads (Megatron's main_grad): a psum of each bucket's gradients (which XLA's all-reduce
    # combiner merges into one collective), no flat buffer to build and slice.
    from core.distributed.grad_sync import reduce_gradients

    state = ps.build_parallel_state()
    shapes = [(64, 4), (3,), (128,), (5, 5)]
    infos = [ParamInfo(P())] * 4
    specs = build_buffer_specs(shapes, [jnp.float32] * 4, infos, data_parallel_size=8, bucket_size=100,
                               use_distributed_optimizer=False, grad_reduce_in_fp32=False)
    assert len(specs[0].layout.bucket_indices) == 2  # [(5, 5), (128,)], [(3,), (64, 4)]
    names = state.mesh.axis_names

    def body(rank):
        r = rank.reshape(())
        leaves = [jnp.full(s, 2.0**r, jnp.float32) for s in shapes]
        out = reduce_gradients(leaves, specs, DistributedDataParallelConfig(), state)
        return [x[None, None, None, None, None] for x in out]

    fn = jax.shard_map(body, mesh=state.mesh, in_specs=P(*names), out_specs=P(*names), check_vma=False)
    ranks = jnp.asarray(state.device_ranks, jnp.float32)
    eqns = _collectives(jax.make_jaxpr(fn)(ranks).jaxpr)
    assert [e.primitive.name for e in eqns] == ["psum"] * len(shapes)
    out = jax.jit(fn)(ranks)
    for x, shape in zip(out, shapes):
        assert x.shape[5:] == shape
        np.testing.assert_allclose(np.asarray(x), sum(2.0**r for r in range(8)) / 8)
