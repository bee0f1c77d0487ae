"""``FusedRMSNorm`` (C++ kernel through XLA's FFI on CPU) equals flax's RMSNorm: values and
gradients (input and scale) within fp32 rounding, the same parameters, flax's own code where it
falls back (bf16, ``use_scale=False``, other axes, a mask, the env switch)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core.fusions import FusedRMSNorm
from core.fusions.cpu_kernels import register_kernels
from core.fusions.fused_layer_norm import fused_rms_norm, fused_rms_norm_available

needs_kernel = pytest.mark.skipif(not fused_rms_norm_available(), reason="no C++ compiler: XLA fallback only")


def _case(shape, seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k[0], shape) * 3.0 + 1.5
    scale = 1.0 + 0.3 * jax.random.normal(k[1], shape[-1:])
    cot = jax.random.normal(k[2], shape)
    return x, scale, cot


def _flax(x, scale, eps):
    return nn.RMSNorm(epsilon=eps).apply({"params": {"scale": scale}}, x)


def _uses_kernel(fn, *args) -> bool:
    return "mcj_rms_norm_forward" in str(jax.make_jaxpr(fn)(*args))


@needs_kernel
@pytest.mark.parametrize("shape,eps", [((16, 4, 64), 1e-6), ((7, 37), 1e-5), ((2, 3, 5, 256), 1e-6), ((1, 8), 1e-3),
                                       ((9, 2, 129), 1e-6)])
def test_matches_flax_values_and_grads(shape, eps):
    x, scale, cot = _case(shape)
    loss = lambda f: jax.jit(jax.value_and_grad(lambda x, s: jnp.vdot(f(x, s, eps), cot), argnums=(0, 1)))
    np.testing.assert_allclose(jax.jit(fused_rms_norm, static_argnums=2)(x, scale, eps),
                               _flax(x, scale, eps), rtol=1e-5, atol=1e-5)
    (got_v, got_g), (want_v, want_g) = loss(fused_rms_norm)(x, scale), loss(_flax)(x, scale)
    np.testing.assert_allclose(got_v, want_v, rtol=1e-5)
    for got, want in zip(got_g, want_g, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want))))


@needs_kernel
def test_deterministic_and_under_vmap():
    x, scale, cot = _case((3, 10, 33))
    f = jax.jit(fused_rms_norm, static_argnums=2)
    np.testing.assert_array_equal(f(x, scale, 1e-6), f(x, scale, 1e-6))
    stacked = jnp.stack([scale, scale * 2.0, scale - 1.0])
    vm = lambda norm: jax.jit(jax.vmap(lambda x, s: norm(x, s, 1e-6)))
    np.testing.assert_allclose(vm(fused_rms_norm)(x, stacked), vm(_flax)(x, stacked), rtol=1e-5, atol=1e-5)
    grads = lambda norm: jax.grad(lambda x, s: jnp.vdot(vm(norm)(x, s), cot), argnums=(0, 1))(x, stacked)
    for got, want in zip(grads(fused_rms_norm), grads(_flax), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want))))


@needs_kernel
def test_module_runs_the_kernel_with_flax_parameters():
    x, _, cot = _case((8, 2, 48))
    fused, plain = FusedRMSNorm(), nn.RMSNorm()
    params = plain.init(jax.random.key(1), x)
    assert jax.tree.map(jnp.shape, fused.init(jax.random.key(1), x)) == jax.tree.map(jnp.shape, params)
    params = jax.tree.map(lambda p: p + 0.1 * jnp.arange(p.shape[-1]), params)  # not all ones
    assert _uses_kernel(fused.apply, params, x)
    np.testing.assert_allclose(jax.jit(fused.apply)(params, x), plain.apply(params, x), rtol=1e-5, atol=1e-5)
    grads = lambda m: jax.jit(jax.grad(lambda p, x: jnp.vdot(m.apply(p, x), cot), argnums=(0, 1)))(params, x)
    for got, want in zip(jax.tree.leaves(grads(fused)), jax.tree.leaves(grads(plain)), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want))))


@pytest.mark.parametrize("kwargs,dtype", [({}, jnp.bfloat16), ({"use_scale": False}, jnp.float32),
                                          ({"reduction_axes": (-2, -1), "feature_axes": -1}, jnp.float32),
                                          ({"dtype": jnp.bfloat16}, jnp.float32)])
def test_falls_back_to_flax(kwargs, dtype):
    x = _case((4, 6, 32))[0].astype(dtype)
    fused, plain = FusedRMSNorm(**kwargs), nn.RMSNorm(**kwargs)
    params = plain.init(jax.random.key(1), x)
    assert jax.tree.map(jnp.shape, fused.init(jax.random.key(1), x)) == jax.tree.map(jnp.shape, params)
    assert not _uses_kernel(fused.apply, params, x)
    got, want = fused.apply(params, x), plain.apply(params, x)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_mask_falls_back_to_flax():
    x = _case((4, 6, 32))[0]
    mask = jnp.arange(32) < 20
    params = nn.RMSNorm().init(jax.random.key(1), x)
    np.testing.assert_array_equal(FusedRMSNorm().apply(params, x, mask=mask), nn.RMSNorm().apply(params, x, mask=mask))


def test_env_switch_disables_the_kernel(monkeypatch):
    monkeypatch.setenv("MCJ_FUSED_RMS_NORM", "0")
    targets = (("mcj_rms_norm_forward", "RMSNormForward"), ("mcj_rms_norm_backward", "RMSNormBackward"))
    assert register_kernels.__wrapped__("rms_norm_cpu.cc", targets, "MCJ_FUSED_RMS_NORM") is False
