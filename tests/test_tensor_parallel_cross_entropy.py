"""Vocab-parallel cross entropy equals full-softmax cross entropy (value and gradient)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tp_harness import run_per_rank

from core import parallel_state as ps
from core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

VOCAB = 32


def _reference(logits, target, eps):
    """Megatron's smoothing definition on the full vocabulary: 1-eps on target, eps/(V-1) elsewhere."""
    onehot = jax.nn.one_hot(target, VOCAB)
    labels = onehot * (1 - eps) + (1 - onehot) * eps / (VOCAB - 1)
    return optax.softmax_cross_entropy(logits, labels)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_matches_full_softmax(tp, eps):
    state = ps.build_parallel_state(tp)
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 3, VOCAB)).astype(np.float32) * 3
    target = rng.integers(0, VOCAB, size=(6, 3))
    weights = rng.normal(size=(6, 3)).astype(np.float32)
    want_loss = _reference(logits, target, eps)
    want_grad = jax.grad(lambda lg: jnp.sum(_reference(lg, target, eps) * weights))(logits)

    def body(local_logits, tgt, w):
        loss, vjp = jax.vjp(lambda lg: vocab_parallel_cross_entropy(lg, tgt, eps), local_logits)
        return loss, vjp(w)[0]

    per_rank_logits = []
    for r in range(8):
        i = state.group_rank(r, ("tp",))
        per_rank_logits.append(np.split(logits, tp, axis=-1)[i])
    loss, grad = run_per_rank(state, body, np.stack(per_rank_logits), np.stack([target] * 8), np.stack([weights] * 8))
    for r in range(8):
        i = state.group_rank(r, ("tp",))
        np.testing.assert_allclose(loss[r], want_loss, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(grad[r], np.split(np.asarray(want_grad), tp, axis=-1)[i], rtol=1e-5, atol=1e-6)


def test_bad_smoothing_is_rejected():
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        vocab_parallel_cross_entropy(jnp.zeros((2, 4)), jnp.zeros(2, jnp.int32), 1.5)


def test_megatron_reference_values():
    """Megatron's test_cross_entropy: tp=4, every rank's logits arange(0,8).repeat(16,4), targets arange(0,32,2).

    The global vocabulary is 128 (four identical 32-wide shards), so the loss is
    log(16 * sum(exp(0..7))) - target % 8: 10.2309, 8.2309, 6.2309, 4.2309, repeating.
    """
    state = ps.build_parallel_state(4)  # 8 devices: tp=4 x dp=2
    local = np.tile(np.arange(8, dtype=np.float32), (16, 4))
    target = np.arange(0, 32, 2)
    loss = run_per_rank(state, lambda lg, t: vocab_parallel_cross_entropy(lg, t), np.stack([local] * 8),
                        np.stack([target] * 8))
    want = np.tile(np.array([10.2309, 8.2309, 6.2309, 4.2309], np.float32), 4)
    for r in range(8):
        np.testing.assert_allclose(loss[r], want, atol=1e-4)
