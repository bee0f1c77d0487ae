"""FP8 MoE experts: the FP8 grouped matmul (core.fp8.grouped) against fp32 and against the exact
product of its quantized operands, the amaxes it reports through ``scale``'s gradient, the windows
and ragged_dot backends in agreement, and a small MoE layer with FP8 on against the fp32 layer."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from core import parallel_state as ps
from core.fp8 import FP8_SCALE, FP8Config, delayed_update, fp8_ragged_dot, init_delayed_state
from core.param_metadata import unbox
from core.transformer.moe import MoEConfig, MoELayer
from core.transformer.moe.grouped_gemm import WindowedGemm

T, IN, OUT = 64, 48, 40
SIZES = (20, 0, 25, 9)  # an empty expert, and 10 padding rows past the groups
VALID = sum(SIZES)
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@functools.cache
def _data():
    """Rows (padding rows 100x larger: they must not set the scale), weights, output gradient."""
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k1, (T, IN), jnp.float32)
    x = x.at[VALID:].multiply(100.0)
    w = jax.random.normal(k2, (len(SIZES), IN, OUT), jnp.float32) * 0.05
    dy = jax.random.normal(k3, (T, OUT), jnp.float32)
    dy = dy.at[VALID:].multiply(100.0)
    return x, w, dy, jnp.asarray(SIZES, jnp.int32)


def _grads(dot, x, w, dy, gs, scale):
    """``(y, dx, dw, dscale)`` of ``dot(x, w, gs, scale)`` under the loss ``sum(y * dy)``."""
    @jax.jit
    def run(x, w, s):
        y, vjp = jax.vjp(lambda x, w, s: dot(x, w, gs, s), x, w, s)
        return (y, *vjp(dy))
    return run(x, w, scale)


def _fp8(config, gemm=None):
    return lambda x, w, gs, s: fp8_ragged_dot(x, w, gs, config=config, scale=s, gemm=gemm)


def _fp32(x, w, gs, s):
    return lax.ragged_dot(x, w, gs) + 0.0 * jnp.sum(s)


def _fake_quant(a, scale, dtype):
    """numpy ``sat_cast(a * scale)`` read back as fp32 values."""
    fmax = float(jnp.finfo(dtype).max)
    return np.clip(np.asarray(a, np.float32) * np.float32(scale), -fmax, fmax).astype(dtype).astype(np.float32)


def _np_grouped(a, b):
    """Per-group products of numpy rows ``a`` and weights ``b [E, in, out]``; padding rows zero."""
    out = np.zeros((a.shape[0], b.shape[2]), np.float32)
    start = 0
    for e, n in enumerate(SIZES):
        out[start:start + n] = a[start:start + n] @ b[e]
        start += n
    return out


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))


def _amaxes(x, w, dy):
    return np.array([np.abs(x[:VALID]).max(), np.abs(w).max(), np.abs(dy[:VALID]).max()], np.float32)


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_tensorwise_equals_the_quantized_operands_grouped_product(fmt):
    """Forward, dgrad and wgrad are exactly the per-expert fp32 products of the FP8-rounded operands
    scaled back, with scales ``fp8_max / amax`` over the grouped rows only (the padding rows, 100x
    larger, change nothing); padding rows and the empty expert get zeros."""
    x, w, dy, gs = _data()
    config = FP8Config(fp8=fmt, fp8_recipe="tensorwise")
    bwd = config.backward_dtype
    y, dx, dw, _ = _grads(_fp8(config), x, w, dy, gs, jnp.ones(3))
    ax, aw, ady = _amaxes(x, w, dy)
    sx, sw, sdy = 448.0 / ax, 448.0 / aw, float(jnp.finfo(bwd).max) / ady
    xq, wq = _fake_quant(x, sx, jnp.float8_e4m3fn), _fake_quant(w, sw, jnp.float8_e4m3fn)
    dyq = _fake_quant(dy, sdy, bwd)
    np.testing.assert_allclose(y, _np_grouped(xq, wq) / (sx * sw), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dx, _np_grouped(dyq, wq.transpose(0, 2, 1)) / (sdy * sw), rtol=1e-5, atol=1e-6)
    start = np.cumsum((0,) + SIZES)
    want_dw = np.stack([xq[s:e].T @ dyq[s:e] for s, e in zip(start[:-1], start[1:])]) / (sdy * sx)
    np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(y)[VALID:]) and not np.any(np.asarray(dx)[VALID:])
    assert not np.any(np.asarray(dw)[1])  # the empty expert


# Expected relative RMS error (tests/test_fp8_linear.py derives them): 0.036 for E4M3 x E4M3,
# 0.057 for E5M2 x E4M3. Bounds: at most 25% over, at least half (else nothing was quantized).
_E4M3_E4M3, _E5M2_E4M3 = 0.036, 0.057


@pytest.mark.parametrize("fmt,recipe", [("e4m3", "tensorwise"), ("hybrid", "tensorwise"), ("e4m3", "delayed"),
                                        ("hybrid", "delayed")])
def test_error_against_fp32_is_fp8_rounding(fmt, recipe):
    """Output, input gradient and weight gradient within FP8's expected rounding error of fp32
    (delayed: with the scales a step on the same tensors leaves), over the grouped rows."""
    x, w, dy, gs = _data()
    config = FP8Config(fp8=fmt, fp8_recipe=recipe)
    scale = jnp.asarray(np.asarray(config.slot_maxes(), np.float32) / _amaxes(x, w, dy))
    got = _grads(_fp8(config), x, w, dy, gs, scale)
    want = _grads(_fp32, x, w, dy, gs, scale)
    bwd_expected = _E5M2_E4M3 if fmt == "hybrid" else _E4M3_E4M3
    for name, g, r, expected in [("y", got[0], want[0], _E4M3_E4M3), ("dx", got[1], want[1], bwd_expected),
                                 ("dw", got[2], want[2], bwd_expected)]:
        err = _rel(np.asarray(g)[:VALID] if name != "dw" else g, np.asarray(r)[:VALID] if name != "dw" else r)
        assert 0.5 * expected < err < 1.25 * expected, (name, err, expected)


@pytest.mark.parametrize("gemm", [None, WindowedGemm(8)], ids=["ragged_dot", "windows"])
def test_scale_gradient_is_the_amaxes(gemm):
    """Under the delayed recipe ``scale``'s cotangent is exactly ``[amax(x), amax(w), amax(dy)]``
    over the grouped rows, whatever the scales; the scales do set the quantization."""
    x, w, dy, gs = _data()
    config = FP8Config(fp8="hybrid", fp8_recipe="delayed")
    scale = jnp.array([50.0, 3000.0, 1000.0], jnp.float32)
    y, _, _, ds = _grads(_fp8(config, gemm), x, w, dy, gs, scale)
    np.testing.assert_array_equal(ds, _amaxes(x, w, dy))
    y2 = _grads(_fp8(config, gemm), x, w, dy, gs, scale * 2.0)[0]
    assert not np.array_equal(y, y2)
    with pytest.raises(ValueError, match="delayed recipe"):
        fp8_ragged_dot(x, w, gs, config=config)


@pytest.mark.parametrize("sizes,window", [(SIZES, None), (SIZES, 8), ((0, 54, 0, 0), 16), ((0, 0, 0, 0), None)])
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_windows_equal_ragged_dot_in_fp8(sizes, window, fmt):
    """The CPU's windows backend (with pass 2, with every row in one expert, with no rows at all)
    computes what ``ragged_dot`` does on the same FP8 operands: outputs, gradients, amaxes."""
    x, w, dy, _ = _data()
    gs = jnp.asarray(sizes, jnp.int32)
    config = FP8Config(fp8=fmt, fp8_recipe="tensorwise")
    got = _grads(_fp8(config, WindowedGemm(window)), x, w, dy, gs, jnp.ones(3))
    want = _grads(_fp8(config), x, w, dy, gs, jnp.ones(3))
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * max(1e-6, float(np.abs(np.asarray(r)).max())))


def test_fp8_wgrad_off_is_high_precision():
    """``fp8_wgrad=False``: the weight gradient is the fp32 one (exactly), dgrad stays FP8."""
    x, w, dy, gs = _data()
    config = FP8Config(fp8="hybrid", fp8_recipe="tensorwise", fp8_wgrad=False)
    got = _grads(_fp8(config), x, w, dy, gs, jnp.ones(3))
    want = _grads(_fp32, x, w, dy, gs, jnp.ones(3))
    np.testing.assert_allclose(got[2], want[2], rtol=1e-5, atol=1e-6)
    assert _rel(np.asarray(got[1])[:VALID], np.asarray(want[1])[:VALID]) > 0.5 * _E5M2_E4M3


# --- the MoE layer ---------------------------------------------------------------------------

S, B, H, F, FS, E = 8, 4, 32, 64, 48, 4
LAYER = dict(num_experts=E, moe_ffn_hidden_size=F, moe_router_topk=2, swiglu=True, moe_shared_expert_intermediate_size=FS,
             moe_token_dispatcher_type="alltoall")
_Y_EXPECTED = 3 ** 0.5 * _E4M3_E4M3  # the layer output's relative error (test below)
IMPLEMENTATIONS = {"windows": dict(moe_grouped_gemm=True, moe_grouped_gemm_implementation="windows"),
                   "ragged_dot": dict(moe_grouped_gemm=True, moe_grouped_gemm_implementation="ragged_dot"),
                   "sequential": dict(moe_grouped_gemm=False)}


def _layer(implementation, fp8):
    return MoELayer(MoEConfig(**LAYER, **IMPLEMENTATIONS[implementation]), H, fp8=fp8)


def _mapped(fn):
    """``fn`` inside ``shard_map`` over one device (the layer reads the mesh axes' sizes)."""
    mesh = ps.build_parallel_state(devices=jax.devices()[:1]).mesh
    return jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)


def _shard(fn):
    return jax.jit(_mapped(fn), compiler_options=FAST_COMPILE)


@functools.cache
def _layer_inputs():
    """Activations, the test loss's output weights, and fp32 parameters (a std-0.1 init, so the
    experts' GEMMs are not negligible next to the residual-free output)."""
    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (S, B, H), jnp.float32)
    out_w = jax.random.normal(kw, (S, B, H), jnp.float32)
    variables = _shard(lambda x: unbox(_layer("windows", None).init(jax.random.key(2), x)))(x)
    params = jax.tree.map(lambda p: p * 5.0, variables["params"])  # init std 0.02 -> 0.1
    return x, out_w, params


def _layer_run(implementation, fp8, variables):
    """``(y, d loss / d variables)`` of the layer under the loss ``sum(y * out_w)``."""
    x, out_w, _ = _layer_inputs()
    module = _layer(implementation, fp8)

    def f(v, x):
        def loss(v):
            y, _ = module.apply(v, x)
            return jnp.sum(y * out_w), y
        (_, y), g = jax.value_and_grad(loss, has_aux=True)(v)
        return y, g
    return _shard(lambda v: f(v, x))(variables)


@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
def test_fp8_layer_is_within_fp8_error_of_fp32(implementation):
    """Hybrid tensorwise FP8 on the routed experts (each implementation) and the shared expert: the
    output and the gradients of the expert and shared weights and of the router (high precision
    itself; its gradient carries the experts' outputs) within FP8's error of the fp32 layer. The
    program has E4M3 operands."""
    _, _, params = _layer_inputs()
    config = FP8Config(fp8="hybrid", fp8_recipe="tensorwise")
    y, g = _layer_run(implementation, config, {"params": params})
    y32, g32 = _layer_run(implementation, None, {"params": params})
    errors = {"y": _rel(y, y32)}
    for path in [("experts", "weight1"), ("experts", "weight2"), ("shared_experts", "fc1", "weight"),
                 ("shared_experts", "fc2", "weight"), ("router", "weight")]:
        errors["/".join(path)] = _rel(functools.reduce(dict.get, path, g["params"]),
                                      functools.reduce(dict.get, path, g32["params"]))
    # fc2's own rounding (0.036) plus fc1's carried through SwiGLU's gate and up:
    # sqrt(3) x 0.036 = 0.062 expected; the gradients add E5M2's (0.057) on the way back.
    assert errors["y"] < 1.25 * _Y_EXPECTED, errors
    router = errors.pop("router/weight")  # a sum over experts of y_e . dy: it cancels, so less precise
    assert max(errors.values()) < 0.12 and min(errors.values()) > 0.5 * _E4M3_E4M3, errors
    assert router < 0.2, router
    x, _, _ = _layer_inputs()
    jaxpr = str(jax.make_jaxpr(_mapped(lambda v: _layer(implementation, config).apply(v, x)))({"params": params}))
    assert "f8_e4m3fn" in jaxpr


def test_delayed_layer_creates_its_scales_and_reports_amaxes():
    """Under the delayed recipe init creates ``fc1_scale``/``fc2_scale`` for the experts and the
    shared expert's ``fc1``/``fc2`` scales (none for the router); a step with unit scales reports the
    amaxes as the scales' gradient, and with the scales the delayed update derives from them the
    layer is within FP8's error of fp32."""
    x, _, params = _layer_inputs()
    config = FP8Config(fp8="hybrid", fp8_recipe="delayed")
    variables = _shard(lambda x: unbox(_layer("windows", config).init(jax.random.key(2), x)))(x)
    scales = variables[FP8_SCALE]
    assert set(scales) == {"experts", "shared_experts"}
    assert set(scales["experts"]) == {"fc1_scale", "fc2_scale"}
    assert set(scales["shared_experts"]) == {"fc1", "fc2"}
    for leaf in jax.tree.leaves(scales):
        np.testing.assert_array_equal(leaf, np.ones(3, np.float32))
    _, g = _layer_run("windows", config, {"params": params, FP8_SCALE: scales})
    amaxes = g[FP8_SCALE]
    for leaf in jax.tree.leaves(amaxes):
        assert np.all(np.asarray(leaf) > 0)
    # The weights' amax is theirs: the experts' fc1 reports max |weight1| over every expert.
    np.testing.assert_array_equal(amaxes["experts"]["fc1_scale"][1], np.abs(params["experts"]["weight1"]).max())
    updated = jax.tree.map(lambda a: delayed_update(init_delayed_state(config), a, config)["scale"], amaxes)
    y, _ = _layer_run("windows", config, {"params": params, FP8_SCALE: updated})
    y32, _ = _layer_run("windows", None, {"params": params})
    assert _rel(y, y32) < 1.25 * _Y_EXPECTED, _rel(y, y32)
