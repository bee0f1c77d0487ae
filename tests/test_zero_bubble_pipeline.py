"""ZB-H1 execution (one process, 8 simulated devices): the executor equals the 1F1B executor on a
toy model, its buffers hold no more activations than the table's bound, and GPT pretraining with
``--pipeline-schedule zb-h1`` equals one device (losses and parameters after 5 steps) across
compositions of tp/SP, dp, the distributed optimizer, cp, MoE, recompute, bf16, FP8 and ZeRO-3."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from pipeline_toys import MB, H, toy_stage_step
from pretrain_harness import TINY, cached_by_flags, layout_trainer, train_step_temp_kib

from core import parallel_state as ps
from core.pipeline_parallel.schedules import (
    forward_backward_no_pipelining,
    forward_backward_pipelining_without_interleaving,
    forward_backward_pipelining_zero_bubble,
    get_forward_backward_func,
)
from core.pipeline_parallel.table_driven import execute_stages
from core.pipeline_parallel.zero_bubble import build_zb_h1_timeline
from core.pipeline_parallel.zero_bubble_executor import (
    execute_stages_zb_h1,
    live_activation_bound,
    zb_h1_buffer_sizes,
)
from core.training.arguments import ArgumentError, model_config, parse_args, validate_args


@pytest.mark.parametrize("pp,m,w_recompute", [(2, 2, False), (2, 5, False), (4, 4, False), (4, 8, False),
                                               (4, 9, False), (2, 5, True), (4, 9, True)])
def test_executor_equals_1f1b_executor(pp, m, w_recompute):
    state = ps.build_parallel_state(pipeline_model_parallel_size=pp, devices=jax.devices()[:pp])
    rng = np.random.default_rng(pp * 10 + m)
    chunk = {"w": rng.normal(size=(pp, 1, H, H)).astype(np.float32) / 2,
             "b": rng.normal(size=(pp, 1, H)).astype(np.float32)}
    amax = (1.0 + rng.random(size=(pp, 1))).astype(np.float32)
    shared = {"emb": rng.normal(size=(H, H)).astype(np.float32)}
    data = {"x": rng.normal(size=(m, MB, H)).astype(np.float32), "t": rng.normal(size=(m, MB, H)).astype(np.float32)}
    step = lambda p, sp, d, r, vs: toy_stage_step(p, sp, d, r, vs, pp - 1)

    def body(chunk, amax, shared, data):
        p = (jax.tree.map(lambda a: a[0], chunk), amax[0])
        kw = dict(stage_metrics=True, chunk_grad_combine=("sum", "max"))
        outs = [execute_stages(step, data, p, shared, **kw),
                execute_stages_zb_h1(step, data, p, shared, w_recompute=w_recompute, **kw)]
        lift = lambda tree: jax.tree.map(lambda a: a[None], tree)
        return tuple(lift((jnp.stack([d["loss"] for d in o[0]]), o[1], o[2], jnp.stack([d["sum"] for d in o[4]])))
                     for o in outs)

    ref, zb = jax.jit(jax.shard_map(body, mesh=state.mesh, in_specs=(P("pp"), P("pp"), P(), P()),
                                    out_specs=P("pp"), check_vma=False))(chunk, amax, shared, data)
    assert np.any(np.asarray(ref[0]) != 0) and np.any(np.asarray(ref[2]["emb"]) != 0)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7), ref, zb)


@pytest.mark.parametrize("pp,m", [(2, 2), (2, 5), (4, 4), (4, 8), (4, 9), (4, 16)])
def test_live_buffers_within_table_bound(pp, m):
    timeline = build_zb_h1_timeline(m, pp)
    np.testing.assert_array_equal(live_activation_bound(timeline), timeline.peak_live_activations())
    assert max(live_activation_bound(timeline)) <= pp  # 1F1B's count
    # The least idle time any schedule can have with equal F, B, W: pp - 1 units per rank; in
    # Megatron's bubble time fraction a third of 1F1B's (p-1)/m.
    assert np.all(timeline.idle_slots() == pp - 1)
    assert timeline.bubble_time_fraction() == pytest.approx((pp - 1) / m / 3)
    sizes = zb_h1_buffer_sizes(timeline)
    assert max(sizes.inputs, sizes.residuals, sizes.output_grads) <= pp


# ---- GPT pretraining through launch/pretrain.py's path ---------------------------------------------------------

ITERS = 5
ZB = ("--pipeline-schedule", "zb-h1")
MOE = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--moe-aux-loss-coeff", "0.01",
       "--moe-token-dispatcher-type", "alltoall", "--moe-router-dtype", "fp32")
FP8 = ("--fp8-format", "hybrid", "--fp8-recipe", "delayed")
FSDP = ("--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params")


def _run(tp: int, pp: int, devices: list, flags: tuple) -> tuple[list[float], list[np.ndarray]]:
    """Losses of ``ITERS`` steps and the parameters after them (host arrays)."""
    trainer = layout_trainer(tp, pp, devices, ITERS, flags)
    losses = [trainer.step()["loss"] for _ in range(ITERS)]
    return losses, [np.asarray(x) for x in jax.tree.leaves(trainer.params)]


@pytest.fixture(scope="module")
def references():
    """One-device runs by flags (computed on first use)."""
    return cached_by_flags(lambda flags: _run(1, 1, [jax.local_devices()[0]], flags))


def _assert_matches(actual, expected, rtol: float, params_atol: float = 6e-5) -> None:
    """Losses within ``rtol``; parameters within ``rtol`` plus ``params_atol`` (by default 2% of one
    step's update at lr 3e-3: Adam's first steps move weights with near-zero gradients by float
    noise), and on average much closer."""
    (losses, params), (ref_losses, ref_params) = actual, expected
    assert ref_losses[-1] < ref_losses[0]  # it learns
    np.testing.assert_allclose(losses, ref_losses, rtol=rtol)
    for a, e in zip(params, ref_params, strict=True):
        n = min(a.shape[0], e.shape[0])  # vocabulary padding differs by tp: compare the real rows
        a, e = a[:n], e[:n]
        np.testing.assert_allclose(a, e, rtol=rtol, atol=params_atol)
        assert float(np.mean(np.abs(a - e))) < 20 * rtol * 3e-3


# (tp, pp, model flags, layout flags): microbatches m = global batch / (micro batch 2 x dp).
CASES = {
    # pp2, m = 2pp = 4 (dp2): tp2 with SP under Megatron-FSDP ZeRO-3.
    "tp2_pp2_dp2_sp_zero3_m4": (2, 2, (), ("--sequence-parallel", *FSDP)),
    # pp2, m = 5 (odd; dp1): tp2 with SP and context parallelism.
    "tp2_pp2_cp2_sp_m5": (2, 2, ("--global-batch-size", "10"), ("--sequence-parallel", "--context-parallel-size", "2")),
    # pp4, m = 5 (odd; dp1): tp2, W recomputing the forward.
    "tp2_pp4_w_recompute_m5": (2, 4, ("--global-batch-size", "10"), ("--zero-bubble-w-recompute",)),
    # pp4, m = pp = 4 (dp2): the distributed optimizer and recompute.
    "pp4_dp2_distopt_recompute_m4": (1, 4, (), ("--use-distributed-optimizer", "--recompute-activations")),
    # pp2, m = pp = 2 (dp4): MoE layers with expert parallelism.
    "pp2_dp4_ep2_moe_m2": (1, 2, MOE, ("--expert-model-parallel-size", "2")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_zb_h1_pretraining_equals_one_device(references, case):
    tp, pp, model, layout = CASES[case]
    _assert_matches(_run(tp, pp, jax.devices(), model + layout + ZB), references(model), rtol=1e-4)


def test_w_recompute_keeps_1f1b_activation_memory():
    # pp4, m 8: with W recomputing the forward the step holds stage inputs and output gradients,
    # as the 1F1B executor holds inputs, within the 1.05x; B's residuals take far more.
    one_f_one_b, residuals, recompute = (train_step_temp_kib(4, ("--seq-length", "64", *f))
                                         for f in ((), ZB, ZB + ("--zero-bubble-w-recompute",)))
    assert recompute <= 1.05 * one_f_one_b < residuals


def test_zb_h1_fp8_delayed_equals_one_device_and_1f1b(references):
    # pp4, m = 2pp = 8 (tp2, dp1): the FP8 amaxes reach the scales through the "max" combine of W's
    # cotangents. The losses equal one device's; a weight whose quantisation rounds the other way
    # in this layout moves by up to a step, so the parameters are compared with 1F1B's in the same layout.
    model = FP8 + ("--global-batch-size", "16")
    losses, params = _run(2, 4, jax.devices(), model + ZB)
    np.testing.assert_allclose(losses, references(model)[0], rtol=1e-3)
    one_f_one_b = _run(2, 4, jax.devices(), model)
    np.testing.assert_allclose(losses, one_f_one_b[0], rtol=1e-6)
    for a, e in zip(params, one_f_one_b[1], strict=True):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-7)


def test_zb_h1_bf16_trains_close_to_fp32(references):
    # pp2, m = 2pp = 4 (tp2, dp2) with SP: bf16 activations, fp32 params.
    losses, _ = _run(2, 2, jax.devices(), ("--bf16", "--sequence-parallel") + ZB)
    assert np.all(np.isfinite(losses))
    np.testing.assert_allclose(losses, references(())[0], rtol=3e-2)


# ---- selection -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags,message", [
    (("--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2"),
     "--pipeline-schedule zb-h1 runs one model chunk per stage; --virtual-pipeline-model-parallel-size 2 needs "
     "interleaved"),
    (("--pipeline-model-parallel-size", "4", "--global-batch-size", "4", "--tensor-model-parallel-size", "1"),
     "--pipeline-schedule zb-h1 needs at least pipeline-model-parallel-size 4 microbatches per step, got 1"),
], ids=["vpp", "too-few-microbatches"])
def test_zb_h1_flag_refuses_what_it_cannot_run(flags, message):
    args = parse_args([*TINY, "--tensor-model-parallel-size", "2", *ZB, *flags])
    with pytest.raises(ArgumentError) as err:
        validate_args(args, 8)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_interleaved_flag_needs_virtual_stages():
    args = parse_args([*TINY, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                       "--pipeline-schedule", "interleaved"])
    with pytest.raises(ArgumentError, match="--pipeline-schedule interleaved needs --virtual-pipeline"):
        validate_args(args, 8)


def test_flag_reaches_the_model_config():
    assert model_config(parse_args([*TINY, *ZB])).pipeline_schedule == "zb-h1"
    assert model_config(parse_args(TINY)).pipeline_schedule is None


def test_get_forward_backward_func_picks_zb_h1():
    pp2 = ps.build_parallel_state(pipeline_model_parallel_size=2, devices=jax.devices()[:2])
    vpp2 = ps.build_parallel_state(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                                   devices=jax.devices()[:2])
    one = ps.build_parallel_state(devices=jax.devices()[:1])
    assert get_forward_backward_func(pp2, schedule="zb-h1") is forward_backward_pipelining_zero_bubble
    assert get_forward_backward_func(pp2) is forward_backward_pipelining_without_interleaving
    assert get_forward_backward_func(one, schedule="zb-h1") is forward_backward_no_pipelining
    with pytest.raises(ValueError, match="does not fit virtual_pipeline_model_parallel_size 2"):
        get_forward_backward_func(vpp2, schedule="zb-h1")


def test_megatron_contract_equals_1f1b():
    # forward_backward_pipelining_zero_bubble on Megatron's contract: the losses and grads of 1F1B.
    pp, m = 4, 6
    state = ps.build_parallel_state(pipeline_model_parallel_size=pp, devices=jax.devices()[:pp])
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(pp, H, H)).astype(np.float32) / 2, "b": rng.normal(size=(pp, H)).astype(np.float32)}
    x = rng.normal(size=(m, MB, H)).astype(np.float32)
    stage_fn = lambda p, x: jnp.tanh(x @ p["w"] + p["b"])

    def forward_step_func(d, model):
        y = model(d)
        return y, lambda y: (jnp.mean(y ** 2), {"loss": jnp.mean(y ** 2)})

    def body(p, x):
        p = jax.tree.map(lambda a: a[0], p)
        out = []
        for schedule in (forward_backward_pipelining_without_interleaving, forward_backward_pipelining_zero_bubble):
            losses, g, _ = schedule(forward_step_func=forward_step_func, data_iterator=iter(x), model=(stage_fn, p),
                                    num_microbatches=m)
            out.append((jnp.stack([d["loss"] for d in losses])[None], jax.tree.map(lambda a: a[None], g)))
        return tuple(out)

    ref, zb = jax.jit(jax.shard_map(body, mesh=state.mesh, in_specs=(P("pp"), P()), out_specs=P("pp"),
                                    check_vma=False))(params, x)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7), ref, zb)


def test_w_recompute_flag_needs_a_zero_bubble_schedule():
    assert model_config(parse_args([*TINY, *ZB, "--zero-bubble-w-recompute"])).zero_bubble_w_recompute
    args = parse_args([*TINY, "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
                       "--zero-bubble-w-recompute"])
    with pytest.raises(ArgumentError, match="^--zero-bubble-w-recompute needs --pipeline-schedule zb-h1 or zb-v, "
                                            "got None$"):
        validate_args(args, 2)
