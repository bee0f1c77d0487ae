"""``FusedLayerNorm`` (C++ kernel through XLA's FFI on CPU) equals flax's LayerNorm: values and
gradients within fp32 rounding (1e-5), the same parameters, flax's own code where it falls back."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core.fusions import FusedLayerNorm, fused_layer_norm_available
from core.fusions.cpu_kernels import SOURCE_DIR, compile_kernel
from core.fusions.fused_layer_norm import fused_layer_norm

needs_kernel = pytest.mark.skipif(not fused_layer_norm_available(), reason="no C++ compiler: XLA fallback only")


def _case(shape, seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(k[0], shape) * 3.0 + 1.5
    scale = 1.0 + 0.3 * jax.random.normal(k[1], shape[-1:])
    bias = 0.2 * jax.random.normal(k[2], shape[-1:])
    cot = jax.random.normal(k[3], shape)
    return x, scale, bias, cot


def _flax(x, scale, bias, eps):
    return nn.LayerNorm(epsilon=eps).apply({"params": {"scale": scale, "bias": bias}}, x)


@needs_kernel
@pytest.mark.parametrize("shape,eps", [((16, 4, 64), 1e-5), ((7, 37), 1e-6), ((2, 3, 5, 256), 1e-5), ((1, 8), 1e-3)])
def test_matches_flax_values_and_grads(shape, eps):
    x, scale, bias, cot = _case(shape)
    loss = lambda f: jax.jit(jax.value_and_grad(lambda x, s, b: jnp.vdot(f(x, s, b, eps), cot), argnums=(0, 1, 2)))
    np.testing.assert_allclose(jax.jit(fused_layer_norm, static_argnums=3)(x, scale, bias, eps),
                               _flax(x, scale, bias, eps), rtol=1e-5, atol=1e-5)
    (got_v, got_g), (want_v, want_g) = loss(fused_layer_norm)(x, scale, bias), loss(_flax)(x, scale, bias)
    np.testing.assert_allclose(got_v, want_v, rtol=1e-5)
    for got, want in zip(got_g, want_g, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * float(jnp.max(jnp.abs(want))))


@needs_kernel
def test_deterministic_and_under_vmap():
    x, scale, bias, _ = _case((3, 10, 32))
    f = jax.jit(fused_layer_norm, static_argnums=3)
    np.testing.assert_array_equal(f(x, scale, bias, 1e-5), f(x, scale, bias, 1e-5))
    stacked = jnp.stack([scale, scale * 2.0, scale - 1.0])
    got = jax.vmap(lambda x, s: fused_layer_norm(x, s, bias, 1e-5))(x, stacked)
    want = jax.vmap(lambda x, s: _flax(x, s, bias, 1e-5))(x, stacked)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_module_has_flax_parameters_and_falls_back_for_bf16():
    x, *_ = _case((4, 6, 32))
    fused, plain = FusedLayerNorm(epsilon=1e-5), nn.LayerNorm(epsilon=1e-5)
    params = plain.init(jax.random.key(1), x)
    assert jax.tree.map(jnp.shape, fused.init(jax.random.key(1), x)) == jax.tree.map(jnp.shape, params)
    np.testing.assert_allclose(fused.apply(params, x), plain.apply(params, x), rtol=1e-5, atol=1e-5)
    xb = x.astype(jnp.bfloat16)
    got, want = fused.apply(params, xb), plain.apply(params, xb)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_compile_failure_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(RuntimeError, match="compiling layer_norm_cpu.cc failed"):
        compile_kernel(SOURCE_DIR / "layer_norm_cpu.cc", tmp_path / "k.so")
    assert not list(tmp_path.iterdir())  # no partial library left behind
