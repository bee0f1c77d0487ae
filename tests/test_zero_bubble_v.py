"""ZB-V execution (one process, 8 simulated devices): the executor equals the interleaved 1F1B
executor on a toy model (compared by virtual stage: the two place chunk 1 differently), its
buffers match the table's activation bound, and GPT pretraining with ``--pipeline-schedule zb-v``
equals one device (losses and parameters after 5 steps, in layer order) across tp/SP, dp, the
distributed optimizer, ZeRO-3, cp, recompute, MoE with expert bias, bf16 and FP8 delayed scaling at
pp2 and pp4 with m = pp, 2pp and odd counts; checkpoints move between ZB-V's V placement and the interleaved one."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from pipeline_toys import MB, H, toy_stage_step
from pretrain_harness import TINY, cached_by_flags, layout_trainer, train_step_temp_kib

from core import parallel_state as ps
from core.checkpointing.layer_order import from_layer_order, to_layer_order
from core.pipeline_parallel.schedules import (
    forward_backward_no_pipelining,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_zero_bubble_v,
    get_forward_backward_func,
)
from core.pipeline_parallel.table_driven import execute_stages
from core.pipeline_parallel.utils import V_PLACEMENT, virtual_stage
from core.pipeline_parallel.zero_bubble import build_zb_v_timeline, interleaved_1f1b_peak_live, v_stage
from core.pipeline_parallel.zero_bubble_executor import (
    build_plan,
    execute_stages_zb_v,
    live_activation_bound,
    v_stages,
    zb_buffer_sizes,
)
from core.training.arguments import ArgumentError, model_config, parse_args, validate_args


def _by_rank(per_stage: np.ndarray, stage_of) -> np.ndarray:
    """[2 pp, ...] per virtual stage -> [pp, 2, ...] per (rank, chunk) under ``stage_of``."""
    pp = per_stage.shape[0] // 2
    return np.stack([np.stack([per_stage[stage_of(r, c)] for c in range(2)]) for r in range(pp)])


@pytest.mark.parametrize("pp,m,w_recompute", [(2, 2, False), (2, 5, False), (4, 4, False), (4, 8, False),
                                               (4, 9, False), (2, 5, True), (4, 8, True)])
def test_executor_equals_interleaved_executor(pp, m, w_recompute):
    state = ps.build_parallel_state(pipeline_model_parallel_size=pp, devices=jax.devices()[:pp])
    rng = np.random.default_rng(pp * 10 + m)
    w = rng.normal(size=(2 * pp, H, H)).astype(np.float32) / 2
    b = rng.normal(size=(2 * pp, H)).astype(np.float32)
    amax = (1.0 + rng.random(size=(2 * pp,))).astype(np.float32)
    shared = {"emb": rng.normal(size=(H, H)).astype(np.float32)}
    data = {"x": rng.normal(size=(m, MB, H)).astype(np.float32), "t": rng.normal(size=(m, MB, H)).astype(np.float32)}
    step = lambda p, sp, d, r, vs: toy_stage_step(p, sp, d, r, vs, 2 * pp - 1)
    placements = {"interleaved": lambda r, c: c * pp + r, "v": lambda r, c: v_stage(pp, r, c)}

    def body(execute):
        def run(chunk, amax, shared, data):
            out = execute(step, data, (jax.tree.map(lambda a: a[0], chunk), amax[0]), shared, num_model_chunks=2,
                          stage_metrics=True, chunk_grad_combine=("sum", "max"),
                          microbatch_group_size_per_vp_stage=m)  # interleaved 1F1B's any-m grouping
            lift = lambda tree: jax.tree.map(lambda a: a[None], tree)
            return lift((jnp.stack([d["loss"] for d in out[0]]), out[1], out[2],
                         jnp.stack([d["sum"] for d in out[4]])))

        return jax.jit(jax.shard_map(run, mesh=state.mesh, in_specs=(P("pp"), P("pp"), P(), P()),
                                     out_specs=P("pp"), check_vma=False))

    results = {}
    zb_v = functools.partial(execute_stages_zb_v, w_recompute=w_recompute)
    for name, execute in (("interleaved", execute_stages), ("v", zb_v)):
        place = placements[name]
        chunk = {"w": _by_rank(w, place), "b": _by_rank(b, place)}
        results[name] = jax.device_get(body(execute)(chunk, _by_rank(amax, place), shared, data))
    ref, zb = list(results["interleaved"]), list(results["v"])
    ref_losses, zb_losses = ref[0].reshape(pp, m), zb[0].reshape(pp, m)
    # The loss stage is rank pp - 1's chunk 1 interleaved, rank 0's chunk 1 in the V.
    np.testing.assert_allclose(zb_losses[0], ref_losses[pp - 1], rtol=1e-6)
    assert np.any(ref_losses[pp - 1] != 0) and not np.any(zb_losses[1:])
    for name, fix in (("interleaved", ref), ("v", zb)):  # chunk grads back to virtual-stage order
        place = placements[name]
        fix[1] = jax.tree.map(lambda a, place=place: np.stack([a[r, c] for s in range(2 * pp) for r in range(pp)
                                                               for c in range(2) if place(r, c) == s]), fix[1])
        fix[2] = jax.tree.map(lambda a: a.sum(0), fix[2])  # shared grads: each rank has its stages' share
    jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6), ref[1:], zb[1:])
    assert np.any(np.asarray(ref[2]["emb"]) != 0)


@pytest.mark.parametrize("pp,m", [(2, 2), (2, 4), (2, 5), (4, 4), (4, 8), (4, 9), (4, 16), (8, 16)])
def test_live_buffers_and_bubble(pp, m):
    timeline = build_zb_v_timeline(m, pp)
    stages = v_stages(pp)
    # The executor holds a (microbatch, chunk)'s input from its arrival (up to a slot or two before
    # its F) to its W: at most two more than the table's F-to-W count, 2pp half-stage activations
    # (1F1B's pp full-stage ones); at most interleaved 1F1B's F-to-B count where that schedule runs.
    bound, peak = live_activation_bound(timeline, stages), timeline.peak_live_activations()
    assert np.all(peak <= bound) and np.all(bound <= peak + 2) and peak.max() <= 2 * pp
    if m % pp == 0:
        assert bound.max() <= interleaved_1f1b_peak_live(m, pp).max()
    sizes = zb_buffer_sizes(timeline, stages)
    assert sizes.residuals <= pp and sizes.output_grads <= pp and sizes.inputs <= 2 * pp
    if m >= 2 * pp - 1:
        assert timeline.bubble_fraction() == pytest.approx((pp - 1) / (6 * m + pp - 1))
        # The least idle time any schedule can have with equal F, B, W: pp - 1 chunk units per rank;
        # in Megatron's bubble time fraction a sixth of 1F1B's (p-1)/m.
        assert np.all(timeline.idle_slots() == pp - 1)
        assert timeline.bubble_time_fraction() == pytest.approx((pp - 1) / m / 6)


def test_plan_routes_the_v():
    # Chunk 0's activations and chunk 1's input gradients flow to rank + 1, the others to rank - 1;
    # on rank pp - 1 chunk 0's output and chunk 1's input gradient stay on the rank.
    pp, m = 4, 8
    plan = build_plan(build_zb_v_timeline(m, pp), v_stages(pp))
    tl = plan.timeline
    for t in range(tl.num_slots):
        for r in range(pp):
            f, b = tl.forward[t, r], tl.backward[t, r]
            chunk = (f if f >= 0 else b) % 2 if max(f, b) >= 0 else None
            down = chunk is not None and r < pp - 1 and (chunk == 0) == (f >= 0)
            up = chunk is not None and r > 0 and (chunk == 1) == (f >= 0)
            assert plan.to_next[t, r] == down and plan.to_prev[t, r] == up
            local = plan.arrivals[2, t, r]
            assert local < 0 or (r == pp - 1 and local // 2 % 2 == 1 - chunk)
    assert [virtual_stage(V_PLACEMENT, pp, r, c) for r in range(pp) for c in range(2)] == \
        [v_stage(pp, r, c) for r in range(pp) for c in range(2)]


# ---- GPT pretraining through launch/pretrain.py's path ---------------------------------------------------------

ITERS = 5
ZBV = ("--pipeline-schedule", "zb-v", "--virtual-pipeline-model-parallel-size", "2")
MOE = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--moe-aux-loss-coeff", "0.01",
       "--moe-token-dispatcher-type", "alltoall", "--moe-router-dtype", "fp32", "--moe-router-enable-expert-bias",
       "--moe-router-score-function", "sigmoid")
FP8 = ("--fp8-format", "hybrid", "--fp8-recipe", "delayed")
DEEP = ("--num-layers", "8")  # pp4 x 2 chunks


def _layer_order(trainer) -> list[np.ndarray]:
    """The parameters (host arrays, stacked layers in layer order) and the model state's."""
    placement = (trainer.model.placement, trainer.layout.pipeline_model_parallel_size)
    params = dict(trainer.params, layers=jax.tree.map(lambda x: to_layer_order(x, *placement),
                                                      trainer.params["layers"]))
    state = jax.tree.map(lambda x: to_layer_order(x, *placement), trainer.model_state or {})
    return [np.asarray(x) for x in jax.tree.leaves((params, state))]


def _run(tp: int, pp: int, devices: list, flags: tuple) -> tuple[list[float], list[np.ndarray]]:
    """Losses of ``ITERS`` steps and the parameters (and model state) after them, in layer order."""
    trainer = layout_trainer(tp, pp, devices, ITERS, flags)
    losses = [trainer.step()["loss"] for _ in range(ITERS)]
    return losses, _layer_order(trainer)


@pytest.fixture(scope="module")
def references():
    """One-device runs by flags (computed on first use)."""
    return cached_by_flags(lambda flags: _run(1, 1, [jax.local_devices()[0]], flags))


def _assert_matches(actual, expected, rtol: float, params_atol: float = 6e-5) -> None:
    """Losses within ``rtol``; parameters within ``rtol`` plus ``params_atol`` (2% of one step's
    update at lr 3e-3: Adam's first steps move weights with near-zero gradients by float noise)."""
    (losses, params), (ref_losses, ref_params) = actual, expected
    assert ref_losses[-1] < ref_losses[0]  # it learns
    np.testing.assert_allclose(losses, ref_losses, rtol=rtol)
    for a, e in zip(params, ref_params, strict=True):
        n = min(a.shape[0], e.shape[0])  # vocabulary padding differs by tp: compare the real rows
        np.testing.assert_allclose(a[:n], e[:n], rtol=rtol, atol=params_atol)


# (tp, pp, model flags, layout flags, rtol): microbatches m = global batch / (micro batch 2 x dp).
CASES = {
    # pp2, m = 5 (odd; dp2): tp2 with SP and the distributed optimizer.
    "tp2_pp2_dp2_sp_distopt_m5": (2, 2, ("--global-batch-size", "20"), ("--sequence-parallel",
                                                                       "--use-distributed-optimizer")),
    # pp4, m = 5 (odd; dp2): MoE with expert parallelism, sigmoid scores and the expert bias.
    "pp4_dp2_ep2_moe_bias_m5": (1, 4, DEEP + MOE + ("--global-batch-size", "20"), ("--expert-model-parallel-size",
                                                                                   "2")),
    # pp4, m = 2pp = 8 (dp1): tp2 with SP.
    "tp2_pp4_sp_m8": (2, 4, DEEP, ("--sequence-parallel",)),
    # pp4, m = pp = 4 (dp2): the distributed optimizer, W recomputing the forward.
    "pp4_dp2_distopt_w_recompute_m4": (1, 4, DEEP, ("--use-distributed-optimizer", "--zero-bubble-w-recompute")),
    # pp2, m = 2pp = 4 (cp2, dp2): context parallelism with full recompute.
    "pp2_cp2_dp2_recompute_m4": (1, 2, (), ("--context-parallel-size", "2", "--recompute-activations")),
    # pp2, m = 4 (tp2, dp2): Megatron-FSDP ZeRO-3 with SP, W recomputing the forward (each layer
    # gathered for its F, B and W's forward).
    "tp2_pp2_dp2_zero3_sp_w_recompute_m4": (2, 2, (), ("--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                                                       "optim_grads_params", "--sequence-parallel",
                                                       "--zero-bubble-w-recompute")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_zb_v_pretraining_equals_one_device(references, case):
    tp, pp, model, layout = CASES[case]
    _assert_matches(_run(tp, pp, jax.devices(), model + layout + ZBV), references(model), rtol=1e-4)


def test_w_recompute_keeps_interleaved_activation_memory():
    # pp4 x 2 chunks, m 8: with W recomputing the forward the step holds stage inputs and output
    # gradients and needs no more temp memory than interleaved 1F1B (within 1.05x); B's residuals far more.
    interleaved, residuals, recompute = (
        train_step_temp_kib(4, (*DEEP, "--seq-length", "64", "--virtual-pipeline-model-parallel-size", "2", *f))
        for f in ((), ZBV, ZBV + ("--zero-bubble-w-recompute",)))
    assert recompute <= 1.05 * interleaved < residuals


def test_zb_v_bf16_trains_close_to_fp32(references):
    # pp2, m = 2pp = 4 (tp2, dp2) with SP: bf16 activations, fp32 params.
    losses, _ = _run(2, 2, jax.devices(), ("--bf16", "--sequence-parallel") + ZBV)
    assert np.all(np.isfinite(losses))
    np.testing.assert_allclose(losses, references(())[0], rtol=3e-2)


def test_zb_v_fp8_delayed_equals_one_device_and_interleaved(references):
    # pp2, m = 2pp = 4 (tp2, dp2): the FP8 amaxes reach the scales through the "max" combine of
    # W's cotangents. The losses equal one device's at FP8's tolerance; a weight whose quantisation
    # rounds the other way in this layout moves by up to a step, so the parameters (and the FP8
    # state, in layer order) are compared with interleaved 1F1B's in the same layout.
    losses, params = _run(2, 2, jax.devices(), FP8 + ZBV)
    np.testing.assert_allclose(losses, references(FP8)[0], rtol=1e-3)
    interleaved = _run(2, 2, jax.devices(), FP8 + ("--virtual-pipeline-model-parallel-size", "2"))
    np.testing.assert_allclose(losses, interleaved[0], rtol=1e-6)
    for a, e in zip(params, interleaved[1], strict=True):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6)


LATER = 3


def test_checkpoints_move_between_the_v_and_other_placements(tmp_path):
    # pp2, m = pp = 2 (tp2 with SP, dp2), MoE with the expert bias (model state stacked like the layers):
    # a ZB-V save resumes under interleaved 1F1B (pp2 vpp2) and one stage, and an interleaved save
    # under ZB-V, with the same next losses (and evaluation losses).
    flags = MOE + ("--global-batch-size", "8", "--sequence-parallel")
    a = layout_trainer(2, 2, jax.devices(), 8, flags + ZBV)
    for _ in range(3):
        a.step()
    a.save(str(tmp_path / "v"))
    later = [a.step()["loss"] for _ in range(LATER)]
    a.finish_saving()
    interleaved = layout_trainer(2, 2, jax.devices(), 8, flags + ("--virtual-pipeline-model-parallel-size", "2"))
    assert interleaved.load(str(tmp_path / "v")) and interleaved.iteration == 3
    interleaved.save(str(tmp_path / "interleaved"))
    interleaved.finish_saving()
    evaluated = interleaved.evaluate()  # forward only, before the next steps
    np.testing.assert_allclose([interleaved.step()["loss"] for _ in range(LATER)], later, rtol=1e-5)
    one = layout_trainer(2, 1, jax.devices()[:2], 8, flags)
    assert one.load(str(tmp_path / "v"))
    np.testing.assert_allclose([one.step()["loss"] for _ in range(LATER)], later, rtol=1e-5)
    back = layout_trainer(2, 2, jax.devices(), 8, flags + ZBV)
    assert back.load(str(tmp_path / "interleaved")) and back.iteration == 3
    np.testing.assert_allclose(back.evaluate(), evaluated, rtol=1e-5)  # ZB-V's forward-only table
    np.testing.assert_allclose([back.step()["loss"] for _ in range(LATER)], later, rtol=1e-5)


def test_layer_order_of_the_v_placement():
    # Chunk 1's row blocks in reverse rank order: layer order is chunk 0's rows, then chunk 1's flipped.
    pp, n = 4, 2
    state = ps.build_parallel_state(pipeline_model_parallel_size=pp, devices=jax.devices()[:pp])
    sharding = jax.sharding.NamedSharding(state.mesh, P(None, "pp"))
    layer = np.array([[virtual_stage(V_PLACEMENT, pp, i // n, c) * n + i % n for i in range(pp * n)]
                      for c in range(2)], np.float32)
    x = jax.device_put(layer, sharding)
    flat = to_layer_order(x, V_PLACEMENT, pp)
    np.testing.assert_array_equal(np.asarray(flat), np.arange(2 * pp * n, dtype=np.float32)[None])
    assert flat.sharding.spec == sharding.spec
    np.testing.assert_array_equal(np.asarray(from_layer_order(flat, 2, V_PLACEMENT, pp)), layer)


# ---- selection -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("vpp", [None, "3"])
def test_zb_v_flag_needs_two_chunks(vpp):
    extra = () if vpp is None else ("--virtual-pipeline-model-parallel-size", vpp)
    args = parse_args([*TINY, "--num-layers", "12", "--tensor-model-parallel-size", "2",
                       "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-v", *extra])
    with pytest.raises(ArgumentError) as err:
        validate_args(args, 8)
    assert str(err.value) == ("--pipeline-schedule zb-v runs two model chunks per stage in a V: it needs "
                              f"--virtual-pipeline-model-parallel-size 2, got {vpp or 1}")


def test_flag_reaches_the_model_config():
    assert model_config(parse_args([*TINY, *ZBV])).pipeline_schedule == "zb-v"


def test_get_forward_backward_func_picks_zb_v():
    vpp2 = ps.build_parallel_state(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                                   devices=jax.devices()[:2])
    pp2 = ps.build_parallel_state(pipeline_model_parallel_size=2, devices=jax.devices()[:2])
    one = ps.build_parallel_state(devices=jax.devices()[:1])
    assert get_forward_backward_func(vpp2, schedule="zb-v") is forward_backward_pipelining_zero_bubble_v
    assert get_forward_backward_func(vpp2) is forward_backward_pipelining_with_interleaving
    assert get_forward_backward_func(one, schedule="zb-v") is forward_backward_no_pipelining
    with pytest.raises(ValueError, match="does not fit virtual_pipeline_model_parallel_size 1"):
        get_forward_backward_func(pp2, schedule="zb-v")


def test_megatron_contract_equals_interleaved():
    # forward_backward_pipelining_zero_bubble_v on Megatron's contract (a list of two chunks in the
    # V placement) gives interleaved 1F1B's losses and, per virtual stage, its grads.
    pp, m = 2, 4
    state = ps.build_parallel_state(pipeline_model_parallel_size=pp, devices=jax.devices()[:pp])
    rng = np.random.default_rng(0)
    w = rng.normal(size=(2 * pp, H, H)).astype(np.float32) / 2
    x = rng.normal(size=(m, MB, H)).astype(np.float32)
    stage_fn = lambda p, x: jnp.tanh(x @ p["w"])

    def forward_step_func(d, model):
        y = model(d)
        return y, lambda y: (jnp.mean(y ** 2), {"loss": jnp.mean(y ** 2)})

    def program(schedule):
        def body(p, x):
            chunks = [(stage_fn, {"w": p[0, c]}) for c in range(2)]
            losses, g, _ = schedule(forward_step_func=forward_step_func, data_iterator=iter(x), model=chunks,
                                    num_microbatches=m)
            return jnp.stack([d["loss"] for d in losses])[None], jnp.stack([gc["w"] for gc in g])[None]
        return jax.jit(jax.shard_map(body, mesh=state.mesh, in_specs=(P("pp"), P()), out_specs=P("pp"),
                                     check_vma=False))

    ref_l, ref_g = program(forward_backward_pipelining_with_interleaving)(_by_rank(w, lambda r, c: c * pp + r), x)
    zb_l, zb_g = program(forward_backward_pipelining_zero_bubble_v)(_by_rank(w, lambda r, c: v_stage(pp, r, c)), x)
    np.testing.assert_allclose(np.asarray(zb_l)[0], np.asarray(ref_l)[pp - 1], rtol=1e-6)
    for r in range(pp):
        for c in range(2):
            s = v_stage(pp, r, c)
            np.testing.assert_allclose(np.asarray(zb_g)[r, c], np.asarray(ref_g)[s % pp, s // pp], rtol=1e-5,
                                       atol=1e-6)
