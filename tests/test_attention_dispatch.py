"""Attention by backend: which implementation runs where, and that they agree.

On CPU every implementation can run (cuDNN aside), so the GPU path's XLA attention is checked
here against the blocked loop and the C++ kernel in value and gradients (fp32), in both layouts,
and a GPT trained with the GPU layout and implementation forced equals the CPU path's losses.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_helpers import assert_close as _assert_close
from attention_helpers import qkv as _inputs
from attention_helpers import value_and_grads as _value_and_grads

import core.transformer.attention as attention
import core.transformer.dot_product_attention as dot_product_attention
from core.fusions import fused_attention_available
from core.transformer.dot_product_attention import attention_implementation, causal_attention, preferred_layout


def _x(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


def test_gpu_dispatch():
    bf16 = [_x((2, 128, 4, 64), jnp.bfloat16)] * 3
    assert attention_implementation(*bf16, "bsnd", backend="gpu") == "cudnn"
    assert attention_implementation(*[_x((2, 128, 4, 64), jnp.float16)] * 3, "bsnd", backend="cuda") == "cudnn"
    assert attention_implementation(*[_x((2, 128, 4, 64))] * 3, "bsnd", backend="gpu") == "xla"  # fp32
    assert attention_implementation(*[_x((2, 128, 4, 160), jnp.bfloat16)] * 3, "bsnd", backend="gpu") == "xla"
    assert attention_implementation(*[_x((2, 128, 4, 60), jnp.bfloat16)] * 3, "bsnd", backend="gpu") == "xla"
    assert attention_implementation(*bf16, "bsnd", backend="tpu") == "xla"
    assert preferred_layout("gpu") == "bsnd" and preferred_layout("cpu") == "bnsd"


def test_cpu_dispatch():
    kernel = "cpu_kernel" if fused_attention_available() else "blocked"
    assert attention_implementation(*[_x((2, 4, 64, 16))] * 3, "bnsd", backend="cpu") == kernel
    # The same tensors in the other layout: [b, s=64, heads=4, d]; heads are not the kernel's s.
    assert attention_implementation(*[_x((2, 64, 4, 16))] * 3, "bsnd", backend="cpu") == kernel
    assert attention_implementation(*[_x((2, 4, 64, 16), jnp.bfloat16)] * 3, "bnsd", backend="cpu") == "blocked"
    assert attention_implementation(*[_x((2, 4, 40, 16))] * 3, "bnsd", backend="cpu") == "blocked"


def test_bad_layout_or_implementation_is_a_clear_error():
    q = jnp.zeros((1, 1, 16, 16))
    with pytest.raises(ValueError, match="layout must be one of"):
        causal_attention(q, q, q, "bhsd")
    with pytest.raises(ValueError, match="implementation must be one of"):
        causal_attention(q, q, q, implementation="flash")


@pytest.mark.parametrize("layout", ["bnsd", "bsnd"])
@pytest.mark.parametrize("impl", ["blocked", "cpu_kernel"])
def test_xla_implementation_matches_the_cpu_paths(layout, impl):
    """fp32: the GPU path's XLA attention equals the blocked loop and the C++ kernel, value and grads."""
    if impl == "cpu_kernel" and not fused_attention_available():
        pytest.skip("no C++ compiler")
    shape = (2, 4, 64, 16) if layout == "bnsd" else (2, 64, 4, 16)
    q, k, v = _inputs(shape)
    xla = _value_and_grads(lambda q, k, v: causal_attention(q, k, v, layout, "xla"), q, k, v)
    _assert_close(xla, _value_and_grads(lambda q, k, v: causal_attention(q, k, v, layout, impl), q, k, v), 2e-5)


def test_layouts_agree():
    q, k, v = _inputs((2, 3, 48, 16))
    swap = lambda x: jnp.swapaxes(x, 1, 2)
    for impl in ["blocked", "xla"]:
        out = causal_attention(q, k, v, "bnsd", impl)
        np.testing.assert_allclose(swap(causal_attention(swap(q), swap(k), swap(v), "bsnd", impl)), out,
                                   rtol=1e-6, atol=1e-6)


def test_bf16_scores_accumulate_in_fp32():
    """bf16 inputs: the blocked loop (fp32 scores) and XLA's attention (fp32 logits) agree to bf16
    output rounding, and both are close to the fp32 result of the same bf16 values."""
    q, k, v = _inputs((1, 2, 64, 32), jnp.bfloat16)
    blocked = causal_attention(q, k, v, "bnsd", "blocked")
    xla = causal_attention(q, k, v, "bnsd", "xla")
    exact = causal_attention(*(x.astype(jnp.float32) for x in (q, k, v)), "bnsd", "xla")
    assert blocked.dtype == xla.dtype == jnp.bfloat16
    _assert_close(blocked, exact, 1e-2)
    _assert_close(xla, exact, 1e-2)


def test_gpt_with_the_gpu_layout_and_xla_attention_trains_like_the_cpu_path(monkeypatch):
    """Three iterations of a rotary GPT: the GPU path (bsnd layout, XLA attention) forced on CPU
    gives the CPU path's losses (fp32, 1e-5 relative)."""
    from pretrain_harness import layout_losses

    devices = jax.local_devices()[:2]
    extra = ("--position-embedding-type", "rope")
    cpu = layout_losses(1, 1, devices, iters=3, extra=extra)
    monkeypatch.setattr(attention, "preferred_layout", lambda: "bsnd")
    monkeypatch.setattr(dot_product_attention, "attention_implementation", lambda *a, **k: "xla")
    gpu_path = layout_losses(1, 1, devices, iters=3, extra=extra)
    np.testing.assert_allclose(gpu_path, cpu, rtol=1e-5)
