"""Transformer building blocks: the attention's q/k/v split (its hand-written VJP equals autodiff of
the plain expression) and rotary in both attention layouts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core.transformer.attention import split_qkv
from core.transformer.rotary_pos_embedding import apply_rotary


@pytest.mark.parametrize("layout,perm", [("bnsd", (3, 1, 2, 0, 4)), ("bsnd", (3, 1, 0, 2, 4))])
def test_split_qkv_value_and_gradient_equal_autodiff(layout, perm):
    """``split_qkv`` ([s, b, heads, 3, d] -> three [b, heads, s, d] or [b, s, heads, d]) and its
    VJP equal the plain transpose-and-unstack under autodiff."""
    s, b, heads, d = 6, 2, 3, 4
    qkv = jax.random.normal(jax.random.key(0), (s, b, heads, 3, d))
    ref = lambda x: tuple(jnp.transpose(x, perm))
    split = lambda x: split_qkv(x, layout)
    shape = ref(qkv)[0].shape
    cots = tuple(jax.random.normal(k, shape) for k in jax.random.split(jax.random.key(1), 3))
    for got, want in zip(split(qkv), ref(qkv), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    got, want = (jax.jit(lambda c, f=f: jax.vjp(f, qkv)[1](c)[0])(cots) for f in (split, ref))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_rotary_is_the_same_in_both_layouts():
    x = jax.random.normal(jax.random.key(2), (2, 3, 8, 4))  # [b, heads, s, d]
    bnsd = apply_rotary(x, 10000.0, "bnsd")
    bsnd = apply_rotary(jnp.swapaxes(x, 1, 2), 10000.0, "bsnd")
    np.testing.assert_allclose(np.asarray(jnp.swapaxes(bsnd, 1, 2)), np.asarray(bnsd), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(bnsd[:, :, 0]), np.asarray(x[:, :, 0]))  # position 0: no rotation


def test_transformer_layer_runs_from_a_transformer_config_as_from_the_gpt_config():
    """``TransformerLayer`` needs only ``TransformerConfig``'s fields: built from one, it has the
    parameters and output of the layer built from a ``GPTConfig`` with the same fields (tp=2)."""
    from jax.sharding import PartitionSpec as P

    from core import parallel_state as ps
    from core.models.gpt import GPTConfig
    from core.param_metadata import init_sharded_params
    from core.transformer.transformer_config import TransformerConfig
    from core.transformer.transformer_layer import TransformerLayer

    fields = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                  position_embedding_type="rope", normalization="RMSNorm", swiglu=True)
    state = ps.build_parallel_state(tensor_model_parallel_size=2)
    x = jax.random.normal(jax.random.key(3), (8, 2, 32))  # [s, b, h]
    outs = []
    for config in (TransformerConfig(**fields), GPTConfig(vocab_size=64, seq_length=8, **fields)):
        config.validate(2)
        layer = TransformerLayer(config)
        params, specs, _ = init_sharded_params(layer.init, state.mesh, (jax.random.key(0), x), (P(), P()))
        run = jax.shard_map(layer.apply, mesh=state.mesh, in_specs=(specs, P()), out_specs=P(), check_vma=False)
        outs.append((params, jax.jit(run)(params, x)))
    (p1, y1), (p2, y2) = outs
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), p1, p2)
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y2))
