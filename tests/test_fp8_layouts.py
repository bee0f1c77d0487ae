"""FP8 delayed scaling through the training step (one process, 8 simulated devices): the scaling
state follows Transformer Engine's rules on the amaxes the GEMMs saw, is the same in every layout,
is checkpointed and resumes bit-identically, and FP8 runs in any layout equal one device within
the stated tolerance."""

import jax
import numpy as np
import pytest
from pretrain_harness import LLAMA, layout_records, layout_trainer

from core.fp8 import DY, W, X

DELAYED = ("--fp8-format", "hybrid", "--fp8-recipe", "delayed")
ITERS = 6
LINEARS = {("self_attention", "linear_qkv"), ("self_attention", "linear_proj"), ("mlp", "fc1"), ("mlp", "fc2")}


def _layer_order(tree):
    """Host arrays, ``[vpp, pp * n, ...]`` leaves as ``[L, ...]`` (one row per layer, in layer order)."""
    return jax.tree.map(lambda x: np.asarray(x).reshape((-1,) + x.shape[2:]), tree)


def _fp8_state(trainer):
    return _layer_order(trainer.model_state["fp8"])


def _weights(trainer):
    """``{(block, linear): [L, out, in]}`` of the trainer's current layer weights, in layer order."""
    layers = _layer_order(trainer.params["layers"])
    return {key: layers[key[0]][key[1]]["weight"] for key in LINEARS}


def _per_linear(tree):
    """``{(block, linear): leaf}`` of an FP8 state tree (``scale`` or ``amax_history``)."""
    return {key: tree[key[0]][key[1]]["scale"] for key in LINEARS}


def _run(tp, pp, devices, extra=(), iters=ITERS):
    """Losses of ``iters`` steps and the FP8 state after the first one."""
    trainer = layout_trainer(tp, pp, devices, iters, DELAYED + LLAMA + extra)
    first = trainer.step()
    state = _fp8_state(trainer)
    return [first["loss"]] + [trainer.step()["loss"] for _ in range(iters - 1)], state


@pytest.fixture(scope="module")
def reference():
    return _run(1, 1, jax.devices()[:1])


def test_the_state_follows_transformer_engines_rules():
    """Two steps on one device with a history of 4, the ``max`` algorithm and margin 1: each
    linear's weight slot holds the amax of the weights its GEMMs read (before each update), the
    history rolls as TE's kernel does (newest last, slot 0 zeroed), and the scale is
    ``448 / 2**margin / max(history window)``."""
    trainer = layout_trainer(1, 1, jax.devices()[:1], ITERS, DELAYED + (
        "--fp8-amax-history-len", "4", "--fp8-amax-compute-algo", "max", "--fp8-margin", "1"))
    initial = _per_linear(_fp8_state(trainer)["scale"])
    assert all(np.all(s == 1.0) for s in initial.values())  # TE's initial scales
    amax_w = []
    for _ in range(2):
        amax_w.append({k: np.abs(w).max(axis=(1, 2)) for k, w in _weights(trainer).items()})
        trainer.step()
    state = _fp8_state(trainer)
    history, scale = _per_linear(state["amax_history"]), _per_linear(state["scale"])
    for key in LINEARS:
        h = history[key]  # [L, 4, 3]
        np.testing.assert_array_equal(h[:, :2], 0.0)
        np.testing.assert_allclose(h[:, 2, W], amax_w[0][key], rtol=1e-6)
        np.testing.assert_allclose(h[:, 3, W], amax_w[1][key], rtol=1e-6)
        assert np.all(h[:, 2:, X] > 0) and np.all(h[:, 2:, DY] > 0)
        window_max = h[:, 2:].max(axis=1)
        maxes = np.array([448.0, 448.0, 57344.0])  # hybrid: E4M3 forward, E5M2 gradients
        np.testing.assert_allclose(scale[key], maxes / 2 / window_max, rtol=1e-6)


def test_fp8_state_is_model_state_outside_the_optimizer():
    trainer = layout_trainer(1, 1, jax.devices()[:1], ITERS, ("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"))
    assert trainer.model_state is None  # tensorwise scaling keeps no state
    trainer = layout_trainer(1, 1, jax.devices()[:1], ITERS, DELAYED)
    assert set(trainer.model_state) == {"fp8"} and set(trainer.model_state["fp8"]) == {"scale", "amax_history"}
    assert "fp8" not in str(jax.tree_util.tree_structure(trainer.opt_state))


# (tp, pp, devices, flags): tensor parallelism with SP (weights and activations split over tp),
# data parallelism (activations and gradients split over dp), context parallelism (activations
# split over cp), pipelining (no sharing), all of them with interleaving and the distributed
# optimizer, and Megatron-FSDP's ZeRO-3 (each layer's parameters gathered for it) with recompute.
LAYOUTS = [(2, 1, 2, ("--sequence-parallel",)), (1, 1, 2, ()), (1, 1, 2, ("--context-parallel-size", "2")),
           (1, 2, 2, ()), (2, 2, 8, ("--virtual-pipeline-model-parallel-size", "2", "--use-distributed-optimizer")),
           (2, 1, 8, ("--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
                      "--sequence-parallel", "--recompute-activations"))]


@pytest.mark.parametrize("tp,pp,devices,extra", LAYOUTS,
                         ids=["tp2-sp", "dp2", "cp2", "pp2", "tp2-pp2-vpp2-dp2-do", "tp2-dp4-zero3-sp-recompute"])
def test_every_layout_equals_one_device(reference, tp, pp, devices, extra):
    """The inputs' and weights' amaxes are reduced with MAX over tp and dp, so after the first step
    their scales equal one device's (rtol 1e-6). The losses of 6 steps stay within 1e-3 of one
    device's (measured: at most 6.7e-4). They cannot be bit-equal: the first step quantizes with
    TE's unit scales, and the output gradients' magnitude, hence what underflows E5M2, depends on
    the microbatches per rank (each microbatch's loss is divided by their number; dp averages
    after the backward); later steps scale every tensor to its range, and the curves stay together."""
    ref_losses, ref_state = reference
    losses, state = _run(tp, pp, jax.devices()[:devices], extra)
    got, want = _per_linear(state["scale"]), _per_linear(ref_state["scale"])
    for key in LINEARS:
        np.testing.assert_allclose(got[key][:, [X, W]], want[key][:, [X, W]], rtol=1e-6, err_msg=str(key))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-3)
    assert ref_losses[-1] < ref_losses[0] - 0.5  # it learns


def test_moe_layers_with_expert_parallelism_equal_one_device():
    """MoE layers: the experts' grouped GEMMs keep a scale per layer for all its experts, their
    weight amax reduced over the expert-parallel ranks; with the expert bias (the other model
    state) and tp2 x pp2 x ep2 with SP, 6 steps within 1e-3 of one device (measured 1.1e-4)."""
    from test_pretrain_moe import MOE

    flags = DELAYED + MOE + ("--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid")
    ref = layout_trainer(1, 1, jax.devices()[:1], ITERS, flags)
    assert set(ref.model_state) == {"expert_bias", "fp8"}
    experts = ref.model_state["fp8"]["scale"]["moe"]["mlp"]["moe"]["experts"]
    assert set(experts) == {"fc1_scale", "fc2_scale"}
    want = [ref.step()["loss"] for _ in range(ITERS)]
    got = [r["loss"] for r in layout_records(2, 2, jax.devices(), ITERS, flags + (
        "--expert-model-parallel-size", "2", "--sequence-parallel"))]
    np.testing.assert_allclose(got, want, rtol=1e-3)


def test_tensorwise_layouts_equal_one_device():
    """Tensorwise scales come from each rank's own tensors (a tp rank's weight shard has its own
    amax), so tp changes the quantization slightly: within 1e-3 over 6 steps at tp2 x dp2 with SP."""
    flags = ("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise") + LLAMA
    ref = [r["loss"] for r in layout_records(1, 1, jax.devices()[:1], ITERS, flags)]
    got = [r["loss"] for r in layout_records(2, 1, jax.devices()[:4], ITERS, flags + ("--sequence-parallel",))]
    np.testing.assert_allclose(got, ref, rtol=1e-3)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tp2 x pp2 x dp2 delayed-FP8 run saved after 3 steps, and its next 3 losses and state."""
    directory = str(tmp_path_factory.mktemp("fp8ckpt"))
    a = layout_trainer(2, 2, jax.devices(), ITERS, DELAYED + ("--use-distributed-optimizer",))
    for _ in range(3):
        a.step()
    saved_state = _fp8_state(a)
    a.save(directory)
    later = [a.step()["loss"] for _ in range(3)]
    a.finish_saving()
    return directory, saved_state, later, _fp8_state(a)


def test_same_layout_resumes_bit_identically(saved):
    directory, saved_state, later, final_state = saved
    b = layout_trainer(2, 2, jax.devices(), ITERS, DELAYED + ("--use-distributed-optimizer",))
    assert b.load(directory)
    jax.tree.map(np.testing.assert_array_equal, _fp8_state(b), saved_state)
    assert [b.step()["loss"] for _ in range(3)] == later
    jax.tree.map(np.testing.assert_array_equal, _fp8_state(b), final_state)


def test_another_layout_restores_the_state(saved):
    directory, saved_state, later, _ = saved
    b = layout_trainer(1, 4, jax.devices()[:4], ITERS, DELAYED + ("--virtual-pipeline-model-parallel-size", "1"))
    assert b.load(directory)
    jax.tree.map(np.testing.assert_array_equal, _fp8_state(b), saved_state)
    np.testing.assert_allclose([b.step()["loss"] for _ in range(3)], later, rtol=1e-4)


def test_a_checkpoint_without_fp8_state_starts_it_afresh_and_one_with_it_loads_without_fp8(saved, tmp_path):
    directory, _, later, _ = saved
    plain = layout_trainer(2, 2, jax.devices(), ITERS, ("--use-distributed-optimizer",))
    assert plain.load(directory)  # the FP8 state stays on disk
    assert np.isfinite(plain.step()["loss"])
    plain.save(str(tmp_path))
    plain.finish_saving()
    lines = []
    fp8 = layout_trainer(2, 2, jax.devices(), ITERS, DELAYED + ("--use-distributed-optimizer",))
    fp8.checkpointer.logger = type("Log", (), {"print": staticmethod(lines.append)})()
    assert fp8.load(str(tmp_path))
    assert any("no usable FP8 scaling state" in line and "start afresh" in line for line in lines), lines
    assert all(np.all(s == 1.0) for s in _per_linear(_fp8_state(fp8)["scale"]).values())
    assert np.isfinite(fp8.step()["loss"])
