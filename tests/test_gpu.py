"""The GPU test set: run on a GPU host with ``PYTHONPATH=. python -m pytest -m gpu tests`` (the
README test command is the CPU suite and skips these). Matmuls run at ``highest`` precision
where results are compared with fp32 references (the GPU default is TF32); bf16 results are
compared with tolerances that fit bf16.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_helpers import assert_close as _close
from attention_helpers import qkv
from attention_helpers import value_and_grads as _value_and_grads

from core.transformer.dot_product_attention import attention_implementation, causal_attention, preferred_layout


def _on_gpu() -> bool:
    try:
        return jax.devices()[0].platform == "gpu"
    except RuntimeError:
        return False


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _on_gpu(), reason="needs a GPU")]


def test_bf16_attention_runs_cudnn_and_matches_the_fp32_reference():
    assert preferred_layout() == "bsnd"
    q, k, v = qkv((2, 256, 4, 64), jnp.bfloat16, qk_scale=1.0)
    assert attention_implementation(q, k, v, "bsnd") == "cudnn"
    hlo = jax.jit(lambda q, k, v: causal_attention(q, k, v, "bsnd")).lower(q, k, v).as_text()
    assert "cudnn" in hlo.lower() or "custom_call" in hlo  # the cuDNN fused attention custom call
    with jax.default_matmul_precision("highest"):
        want = _value_and_grads(lambda q, k, v: causal_attention(q, k, v, "bsnd", "xla"),
                                *(x.astype(jnp.float32) for x in (q, k, v)))
    _close(_value_and_grads(lambda q, k, v: causal_attention(q, k, v, "bsnd"), q, k, v), want, 3e-2)


def test_bf16_document_mask_runs_cudnn_and_matches_the_fp32_reference():
    """Packed documents (``--sft``, ``--reset-attention-mask``): the segment mask reaches cuDNN's flash
    attention as a mask (JAX turns it into an additive bias), no fallback to XLA."""
    q, k, v = qkv((2, 256, 4, 64), jnp.bfloat16, qk_scale=1.0)
    segments = jnp.asarray(np.repeat([[0] * 100 + [1] * 60 + [2] * 96], 2, axis=0), jnp.int32)
    assert attention_implementation(q, k, v, "bsnd", masked=True) == "cudnn"
    with jax.default_matmul_precision("highest"):
        want = _value_and_grads(lambda q, k, v: causal_attention(q, k, v, "bsnd", "xla", segment_ids=segments),
                                *(x.astype(jnp.float32) for x in (q, k, v)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a cuDNN refusal warns and runs XLA's
        got = _value_and_grads(lambda q, k, v: causal_attention(q, k, v, "bsnd", segment_ids=segments), q, k, v)
    _close(got, want, 3e-2)


def test_fp32_attention_runs_xla_and_matches_the_blocked_loop():
    q, k, v = qkv((2, 256, 4, 64), jnp.float32, qk_scale=1.0)
    assert attention_implementation(q, k, v, "bsnd") == "xla"
    with jax.default_matmul_precision("highest"):
        got = _value_and_grads(lambda q, k, v: causal_attention(q, k, v, "bsnd"), q, k, v)
        want = _value_and_grads(lambda q, k, v: causal_attention(q, k, v, "bsnd", "blocked"), q, k, v)
    _close(got, want, 1e-4)


def test_training_on_the_gpus_equals_one_gpu():
    """DDP (and the whole pretraining step) over every GPU of this host equals one GPU: 4 iterations,
    fp32 at highest matmul precision, 1e-4 relative."""
    from pretrain_harness import layout_losses, reference_losses

    with jax.default_matmul_precision("highest"):
        reference = reference_losses(4)
        losses = layout_losses(1, 1, jax.devices(), iters=4)
    np.testing.assert_allclose(losses, reference, rtol=1e-4)


def test_bf16_pretraining_learns():
    from pretrain_harness import layout_losses

    losses = layout_losses(1, 1, jax.devices()[:1], iters=20, extra=("--bf16", "--lr", "3e-3"))
    assert np.isfinite(losses).all() and losses[-1] < losses[0] - 0.5, losses


@pytest.mark.parametrize("granularity", ["selective", "full"])
def test_bf16_recompute_keeps_the_losses(granularity):
    # In bf16 the attention is cuDNN's custom call: selective recompute keeps the linear layers'
    # outputs and reruns it in the backward, a path the CPU suite never takes.
    from pretrain_harness import layout_losses

    one = jax.devices()[:1]
    base = layout_losses(1, 1, one, iters=5, extra=("--bf16",))
    got = layout_losses(1, 1, one, iters=5, extra=("--bf16", "--recompute-granularity", granularity))
    np.testing.assert_allclose(got, base, rtol=1e-2)


def test_cpu_settings_stay_off_and_mfu_uses_the_datasheet():
    from core.runtime.jax_backend import jax_runs_on_cpu
    from core.training.device_peak import datasheet_peak, device_peak

    assert not jax_runs_on_cpu()  # decided before JAX started: the CPU-only settings were not applied
    peak = device_peak(jnp.bfloat16)
    kind = jax.devices()[0].device_kind
    assert peak.source == ("datasheet" if datasheet_peak(kind, "bfloat16") else "measured"), (kind, peak)


@pytest.mark.parametrize("comm_type", ["p2p", "all_gather"])
def test_context_parallel_blocks_run_xla_on_the_gpu_and_match_causal_attention(comm_type):
    """A cp mesh of one GPU runs the load-balanced block schedule (chunks 0 and 1 of 2, already in
    order at cp=1) with XLA's einsum blocks: fp32 values and grads equal the model's attention, and
    bf16 stays within bf16's tolerance of them."""
    from functools import partial

    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from core.context_parallel import context_parallel_attention
    from core.context_parallel._blocks import kernel_block

    mesh = Mesh(np.array(jax.devices()[:1]), ("cp",))
    spec = P(None, "cp")
    attention = partial(context_parallel_attention, comm_type=comm_type, layout="bsnd")
    cp_attention = lambda q, k, v: jax.shard_map(attention, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)(q, k, v)
    q, k, v = qkv((2, 256, 4, 64), jnp.float32, qk_scale=1.0)
    assert kernel_block(jnp.zeros((2, 4, 1, 128, 64)), k, v) is None  # the CPU kernel only on the CPU backend
    with jax.default_matmul_precision("highest"):
        want = _value_and_grads(lambda q, k, v: causal_attention(q, k, v, "bsnd", "xla"), q, k, v)
        _close(_value_and_grads(cp_attention, q, k, v), want, 1e-4)
    bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    _close(_value_and_grads(cp_attention, *bf16), want, 3e-2)


@pytest.mark.parametrize("implementation,window", [("ragged_dot", None), ("windows", None), ("windows", 16)])
def test_grouped_mlp_matches_the_expert_loop(implementation, window):
    """The MoE experts off the CPU run ``lax.ragged_dot`` by default; the row windows (the CPU's
    default, ``--moe-grouped-gemm-implementation windows``) run on a GPU too, with and without
    their second pass (a 16-row window overflows every group). ``GroupedMLP``'s values and grads
    equal ``SequentialMLP``'s (fp32, highest precision), with an empty group and padding rows."""
    from jax.sharding import PartitionSpec as P

    from core import parallel_state as ps
    from core.transformer.moe.experts import GroupedMLP, SequentialMLP, default_grouped_implementation

    assert default_grouped_implementation() == "ragged_dot"
    rng = np.random.default_rng(0)
    m, h, f, e = 512, 64, 96, 8
    sizes = np.bincount(rng.integers(0, e - 1, m - 37), minlength=e)  # the last expert gets none
    rows = jnp.asarray(rng.normal(size=(m, h)), jnp.float32)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    shapes = {"weight1": (e, h, f), "weight2": (e, f, h), "bias1": (e, f), "bias2": (e, h)}
    params = {"params": {k: jnp.asarray(rng.normal(size=v) * 0.1, jnp.float32) for k, v in shapes.items()}}
    mesh = ps.build_parallel_state(devices=jax.devices()[:1]).mesh
    outs = []
    for module in (GroupedMLP(e, h, f, window=window, implementation=implementation), SequentialMLP(e, h, f)):
        def loss(p, r, module=module):
            return jnp.sum(jnp.sin(module.apply(p, r, group_sizes)[: m - 37]))

        fn = jax.jit(jax.shard_map(jax.value_and_grad(loss, argnums=(0, 1)), mesh=mesh, in_specs=(P(), P()),
                                   out_specs=P(), check_vma=False))
        if isinstance(module, GroupedMLP):
            assert ("ragged_dot" in str(jax.make_jaxpr(fn)(params, rows))) == (implementation == "ragged_dot")
        with jax.default_matmul_precision("highest"):
            outs.append(fn(params, rows))
    _close(outs[0], outs[1], 1e-4)


def test_moe_bf16_pretraining_learns():
    from pretrain_harness import layout_losses

    moe = ("--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--moe-grouped-gemm",
           "--moe-aux-loss-coeff", "0.01", "--moe-token-dispatcher-type", "alltoall")
    losses = layout_losses(1, 1, jax.devices()[:1], iters=20, extra=("--bf16", "--lr", "3e-3", *moe))
    assert np.isfinite(losses).all() and losses[-1] < losses[0] - 0.5, losses


def test_async_save_by_the_writer_process_holds_the_gpu_values(tmp_path):
    """The writer process copies GPU shards (device to pinned host memory, as orbax stages its
    copies on GPUs, then into its shared buffer) and writes them from its CPU twin job; the
    training process's arrays are donated meanwhile."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from core.checkpointing import CheckpointSaver, restore_checkpoint

    mesh = Mesh(np.array(jax.devices()), ("x",))
    rows = 8 * len(jax.devices())
    host = np.arange(rows * 64, dtype=np.float32).reshape(rows, 64)
    state = {"w": jax.device_put(host, NamedSharding(mesh, P("x"))),
             "b": jax.device_put(jnp.ones(64, jnp.bfloat16), NamedSharding(mesh, P()))}
    saver = CheckpointSaver(str(tmp_path), async_save=True)
    assert saver.writer == "process" and saver.pinned_host_transfer
    saver.save(1, state, {"iteration": 1})
    jax.block_until_ready(jax.jit(lambda t: jax.tree.map(lambda x: x * 0, t), donate_argnums=0)(state))
    saver.wait()
    assert saver._process.pinned_host_transfer  # the staging did not fall back to pageable copies
    saver.close()
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in state.items()}
    restored, meta = restore_checkpoint(str(tmp_path), 1, target)
    np.testing.assert_array_equal(np.asarray(restored["w"]), host)
    assert restored["b"].dtype == jnp.bfloat16 and (np.asarray(restored["b"]) == 1).all() and meta == {"iteration": 1}
