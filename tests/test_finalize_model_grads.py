"""finalize_model_grads: sequence-parallel and per-head (tp_partial_grad) grads over tp, tied embeddings over pp, token scaling."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from core import parallel_state as ps
from core.distributed.distributed_data_parallel import DistributedDataParallel
from core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from core.distributed.finalize_model_grads import allreduce_model_parallel_grads
from core.optimizer import get_megatron_optimizer
from core.optimizer.optimizer_config import OptimizerConfig
from core.param_metadata import ParamInfo, with_parallel_metadata
from core.training.train_step import make_train_step


@pytest.mark.parametrize("flag", ["sequence_parallel", "tp_partial_grad"])
def test_sequence_parallel_norm_grads_summed_over_tp(flag):
    # A norm-like scale applied to sequence shards (or, tp_partial_grad, to each rank's heads as
    # the q/k norms are): each tp rank sees a different slice, so its grad is partial; after the
    # tp sum every tp rank holds the full single-device grad.
    state = ps.build_parallel_state(2)
    x = np.random.default_rng(0).normal(size=(16, 6)).astype(np.float32)  # [seq, hidden]
    w = np.linspace(0.5, 1.5, 6).astype(np.float32)
    loss = lambda w, xs: jnp.sum(jnp.tanh(xs * w))
    want = jax.grad(loss)(w, x)

    def body(w, xs):
        g = jax.grad(loss)(w, xs)
        (g,) = allreduce_model_parallel_grads([g], [ParamInfo(P(), **{flag: True})], state)
        return g[None]

    spec = P(("pp", "dp", "ep", "cp", "tp"))
    got = jax.jit(jax.shard_map(body, mesh=state.mesh, in_specs=(P(), P("tp")), out_specs=spec, check_vma=False))(w, x)
    for g in np.asarray(got):
        np.testing.assert_allclose(g, want, rtol=1e-5)


class _TwoStage(nn.Module):
    """SPMD 2-stage model: stage 0 embeds and applies its layer, stage 1 its layer and the tied output."""

    vocab: int = 11
    hidden: int = 8

    @nn.compact
    def __call__(self, tokens):
        emb = self.param("embedding", with_parallel_metadata(nn.initializers.normal(1.0), (None, None),
                                                             shared_embedding=True), (self.vocab, self.hidden))
        w = self.param("stage_weight", with_parallel_metadata(nn.initializers.normal(0.3), ("pp", None, None)),
                       (1, self.hidden, self.hidden))[0]
        stage = lax.axis_index("pp")
        h = jnp.tanh(emb[tokens] @ w)  # stage 0's work (garbage on stage 1, discarded below)
        h = lax.ppermute(h, "pp", [(0, 1)])  # to stage 1
        h = jnp.tanh(h @ w)
        logits = h @ emb.T
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, (tokens + 1) % self.vocab).mean()
        return jnp.where(stage == 1, loss, 0.0)


def _reference_loss(params, tokens):
    emb, w = params["embedding"], params["stage_weight"]
    h = jnp.tanh(jnp.tanh(emb[tokens] @ w[0]) @ w[1])
    return optax.softmax_cross_entropy_with_integer_labels(h @ emb.T, (tokens + 1) % emb.shape[0]).mean()


def test_tied_embedding_identical_on_both_stages_and_equal_to_single_device():
    state = ps.build_parallel_state(pipeline_model_parallel_size=2)
    module = _TwoStage()
    ddp = DistributedDataParallel(state, DistributedDataParallelConfig(use_distributed_optimizer=True), module)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=0.5, weight_decay=0.0, sgd_momentum=0.0), [ddp])
    tokens0 = jnp.zeros((2, 5), jnp.int32)
    params = ddp.init(jax.random.key(0), tokens0)
    ref = {k: np.asarray(v) for k, v in params["params"].items()}
    opt_state = opt.init_state(params)
    step = make_train_step(ddp, opt, lambda p, tok: module.apply(p, tok), num_microbatches=2)
    rng = np.random.default_rng(0)
    for _ in range(3):
        tokens = rng.integers(0, 11, size=(16, 5)).astype(np.int32)
        params, opt_state, _ = step(params, opt_state, ddp.shard_batch(tokens))
        g = jax.grad(_reference_loss)(ref, tokens)
        ref = {k: ref[k] - 0.5 * np.asarray(g[k]) for k in ref}
    emb_copies = [np.asarray(s.data) for s in params["params"]["embedding"].addressable_shards]
    for copy in emb_copies:
        np.testing.assert_array_equal(copy, emb_copies[0])
    np.testing.assert_allclose(emb_copies[0], ref["embedding"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(params["params"]["stage_weight"]), ref["stage_weight"], rtol=1e-5, atol=1e-6)
