"""The FP8 linear (core.fp8.linear): its GEMMs' operand dtypes, its exact quantization semantics,
its error against fp32 within FP8's rounding, and the amaxes it reports through ``scale``'s gradient."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core.fp8 import FP8Config, current_scale, delayed_state_shape, delayed_update, fp8_linear, init_delayed_state

T, IN, OUT = 64, 128, 96


def _data():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k1, (T, IN), jnp.float32)
    w = jax.random.normal(k2, (OUT, IN), jnp.float32) * 0.02
    dy = jax.random.normal(k3, (T, OUT), jnp.float32)
    return x, w, dy


def _grads(config, x, w, dy, scale=None):
    """``(y, dx, dw, amaxes)``: the layer's output, input/weight grads and ``scale``'s gradient."""
    scale = jnp.ones(3, jnp.float32) if scale is None else scale

    def f(x, w, s):
        return jnp.sum(fp8_linear(x, w, config=config, scale=s) * dy)

    dx, dw, ds = jax.grad(f, argnums=(0, 1, 2))(x, w, scale)
    return fp8_linear(x, w, config=config, scale=scale), dx, dw, ds


def _fake_quant(a, scale, dtype):
    """numpy reference of ``sat_cast(a * scale)`` read back as fp32 values."""
    fmax = float(jnp.finfo(dtype).max)
    return np.clip(np.asarray(a, np.float32) * np.float32(scale), -fmax, fmax).astype(dtype).astype(np.float32)


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_tensorwise_equals_the_quantized_operands_product(fmt):
    """The three GEMMs compute exactly the fp32 products of the FP8-rounded operands scaled
    back, with scales ``fp8_max / amax`` of each current tensor (up to fp32 summation order)."""
    x, w, dy = _data()
    config = FP8Config(fp8=fmt, fp8_recipe="tensorwise")
    bwd = config.backward_dtype
    y, dx, dw, _ = _grads(config, x, w, dy)
    sx, sw = 448.0 / np.abs(x).max(), 448.0 / np.abs(w).max()
    sdy = float(jnp.finfo(bwd).max) / np.abs(dy).max()
    xq, wq = _fake_quant(x, sx, jnp.float8_e4m3fn), _fake_quant(w, sw, jnp.float8_e4m3fn)
    dyq = _fake_quant(dy, sdy, bwd)
    np.testing.assert_allclose(y, xq @ wq.T / (sx * sw), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dx, dyq @ wq / (sdy * sw), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dw, dyq.T @ xq / (sdy * sx), rtol=1e-5, atol=1e-5)


# Expected error. Rounding to a format with p mantissa bits leaves a relative error uniform over
# one spacing (2^-p of the leading power of two): its RMS over significands uniform in [1, 2) is
# 2^-p / sqrt(12) * sqrt(E[1/m^2]) = 2^-p * 0.204, i.e. 0.0255 for E4M3 (p=3) and 0.051 for
# E5M2 (p=2). A dot of K independent products has relative RMS error sqrt(e_a^2 + e_b^2):
# 0.036 for E4M3 x E4M3 and 0.057 for E5M2 x E4M3. The bounds allow 25% over that and require
# at least half of it (less would mean the operands were not quantized).
_E4M3_E4M3, _E5M2_E4M3 = 0.036, 0.057


@pytest.mark.parametrize("fmt,recipe", [("e4m3", "tensorwise"), ("hybrid", "tensorwise"), ("e4m3", "delayed"),
                                        ("hybrid", "delayed")])
def test_error_against_fp32_is_fp8_rounding(fmt, recipe):
    x, w, dy = _data()
    config = FP8Config(fp8=fmt, fp8_recipe=recipe)
    maxes = config.slot_maxes()
    # Delayed scales as the update after a step on the same tensors would leave them.
    scale = jnp.array([maxes[0] / np.abs(x).max(), maxes[1] / np.abs(w).max(), maxes[2] / np.abs(dy).max()])
    y, dx, dw, _ = _grads(config, x, w, dy, scale)
    bwd_expected = _E5M2_E4M3 if fmt == "hybrid" else _E4M3_E4M3
    for got, ref, expected in ((y, x @ w.T, _E4M3_E4M3), (dx, dy @ w, bwd_expected), (dw, dy.T @ x, bwd_expected)):
        err = _rel(got, ref)
        assert 0.5 * expected < err < 1.25 * expected, (err, expected)


def test_no_fp8_wgrad_keeps_the_weight_gradient_in_high_precision():
    x, w, dy = _data()
    _, dx, dw, _ = _grads(FP8Config(fp8="hybrid", fp8_recipe="tensorwise", fp8_wgrad=False), x, w, dy)
    np.testing.assert_allclose(dw, dy.T @ x, rtol=1e-5, atol=1e-5)
    assert _rel(dx, dy @ w) > 0.5 * _E5M2_E4M3


def test_scale_gradient_is_the_amaxes_and_microbatches_combine_with_max():
    x, w, dy = _data()
    config = FP8Config(fp8="hybrid", fp8_recipe="delayed")
    _, _, _, amaxes = _grads(config, x, w, dy, jnp.full(3, 2.0))
    np.testing.assert_array_equal(amaxes, [np.abs(x).max(), np.abs(w).max(), np.abs(dy).max()])

    # Two microbatches in a scan: amaxes accumulate with max, parameter grads with sum.
    scale = jnp.full(3, 2.0)
    xs, dys = jnp.stack([x, 3.0 * x]), jnp.stack([2.0 * dy, dy])

    def body(carry, mb):
        gw, acc = carry
        xm, dym = mb
        g_w, g_s = jax.grad(lambda w, s: jnp.sum(fp8_linear(xm, w, config=config, scale=s) * dym),
                            argnums=(0, 1))(w, scale)
        return (gw + g_w, jnp.maximum(acc, g_s)), None

    (_, acc), _ = jax.lax.scan(body, (jnp.zeros_like(w), jnp.zeros(3)), (xs, dys))
    np.testing.assert_allclose(acc, [3 * np.abs(x).max(), np.abs(w).max(), 2 * np.abs(dy).max()], rtol=1e-6)


def test_delayed_scales_follow_the_previous_steps_amaxes():
    """Three steps of linear + update: each step quantizes with the scales the previous step's
    amaxes gave (history 1, most_recent: ``fp8_max / amax``), starting from unit scales."""
    x, w, dy = _data()
    config = FP8Config(fp8="hybrid", fp8_recipe="delayed")
    state = init_delayed_state(config)
    scales = [np.ones(3, np.float32)]
    for step in range(3):
        xs, dys = x * (step + 1.0), dy / (step + 1.0)
        y, _, _, amaxes = _grads(config, xs, w, dys, state["scale"])
        sx, sw = scales[-1][0], scales[-1][1]
        xq, wq = _fake_quant(xs, sx, jnp.float8_e4m3fn), _fake_quant(w, sw, jnp.float8_e4m3fn)
        np.testing.assert_allclose(y, xq @ wq.T / (sx * sw), rtol=1e-5, atol=1e-6)
        state = delayed_update(state, amaxes, config)
        expected = np.array([448.0, 448.0, 57344.0], np.float32) / np.array(
            [np.abs(xs).max(), np.abs(w).max(), np.abs(dys).max()], np.float32)
        np.testing.assert_allclose(state["scale"], expected, rtol=1e-6)
        scales.append(expected)


def test_tensorwise_has_no_state_and_ignores_scale():
    x, w, dy = _data()
    config = FP8Config(fp8="e4m3", fp8_recipe="tensorwise")
    assert delayed_state_shape(config) == {}
    assert delayed_state_shape(FP8Config(fp8="e4m3", fp8_recipe="delayed", fp8_amax_history_len=4), (2,)) == {
        "amax_history": jax.ShapeDtypeStruct((2, 4, 3), jnp.float32),
        "scale": jax.ShapeDtypeStruct((2, 3), jnp.float32)}
    ref = fp8_linear(x, w, config=config)
    np.testing.assert_array_equal(fp8_linear(x, w, config=config, scale=jnp.full(3, 7.0)), ref)
    with pytest.raises(ValueError, match="delayed"):
        fp8_linear(x, w, config=FP8Config(fp8="e4m3"))


def test_current_scale_edge_cases():
    got = current_scale(jnp.array([2.0, 0.0, jnp.inf, jnp.nan, 1.5e-38]), 448.0)  # 448 / 1.5e-38 overflows fp32
    np.testing.assert_array_equal(got, np.array([224.0, 1.0, 1.0, 1.0, np.finfo(np.float32).max], np.float32))


def _dot_operand_types(hlo: str) -> list[tuple[str, str]]:
    """The element types of every ``stablehlo.dot_general``'s two operands, sorted."""
    pattern = re.compile(r"stablehlo\.dot_general .*: \(tensor<(?:\d+x)*(\w+)>, tensor<(?:\d+x)*(\w+)>\)")
    return sorted(pattern.findall(hlo))


@pytest.mark.parametrize("fmt,wgrad,expected", [
    ("e4m3", True, [("f8E4M3FN", "f8E4M3FN")] * 3),
    ("hybrid", True, [("f8E4M3FN", "f8E4M3FN")] + [("f8E5M2", "f8E4M3FN")] * 2),
    ("hybrid", False, [("f32", "f32"), ("f8E4M3FN", "f8E4M3FN"), ("f8E5M2", "f8E4M3FN")]),
])
def test_lowered_gemms_take_fp8_operands(fmt, wgrad, expected):
    """fprop, dgrad and wgrad are dots on FP8 operands (E5M2 gradients under hybrid), the
    pattern XLA:GPU rewrites to cuBLASLt FP8 GEMMs."""
    x, w, dy = _data()
    config = FP8Config(fp8=fmt, fp8_recipe="delayed", fp8_wgrad=wgrad)

    def loss(x, w, s):
        return jnp.sum(fp8_linear(x, w, config=config, scale=s) * dy)

    # value_and_grad: the loss's gradient does not need the forward's output, the value does.
    hlo = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(x, w, jnp.ones(3)).as_text()
    assert _dot_operand_types(hlo) == sorted(expected)
