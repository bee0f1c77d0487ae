"""Mixture of experts in GPT pretraining (one process, 8 simulated devices, fp32): with experts
split over ``"ep"`` (and tp + SP, or pp) the loss and the grad norm of every iteration equal the
single-device run's (relative 1e-4), also with context parallelism (ep 1, and ep 2 x cp 2). The
model is tiny (2 MoE layers of 8 experts, top-2, aux and z losses on, dropless all-to-all with
grouped GEMM: on the CPU the expert MLP over row windows). The grad norm checks that the aux
losses' gradient enters with the same scale on every path (stop-gradient zero at pp=1, the ``attach_aux_loss`` identity across pipeline stages) and that
expert grads are reduced over the expert-data-parallel group only."""

import math

import jax
import numpy as np
import pytest
from pretrain_harness import layout_records, layout_trainer

ITERS = 10
MOE = ("--num-layers", "2", "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
       "--moe-layer-freq", "1", "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001",
       "--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm", "--moe-router-dtype", "fp32")


@pytest.fixture(scope="module")
def reference():
    return layout_records(1, 1, [jax.local_devices()[0]], ITERS, MOE)


def _assert_matches(records: list[dict], reference: list[dict]) -> None:
    assert reference[-1]["loss"] < reference[0]["loss"] - 0.5  # it learns
    np.testing.assert_allclose([r["loss"] for r in records], [r["loss"] for r in reference], rtol=1e-4)
    np.testing.assert_allclose([r["grad_norm"] for r in records], [r["grad_norm"] for r in reference], rtol=1e-4)


def test_ep2_dp4_matches_single_device(reference):
    records = layout_records(1, 1, jax.devices(), ITERS, MOE + ("--expert-model-parallel-size", "2"))
    _assert_matches(records, reference)
    # The MoE values are logged separately ("loss" stays the LM loss) and are layout-invariant too.
    for key in ("moe_aux_loss", "moe_z_loss"):
        np.testing.assert_allclose([r[key] for r in records], [r[key] for r in reference], rtol=1e-4)
    np.testing.assert_allclose([r["moe_expert_load"] for r in records], [r["moe_expert_load"] for r in reference],
                               rtol=1e-4)
    first = reference[0]
    assert len(first["moe_expert_load"]) == 2 and all(1.0 <= v <= 4.0 for v in first["moe_expert_load"])
    # Switch loss >= coeff (equality when balanced); z-loss > 0.
    assert first["moe_aux_loss"] >= 2 * 0.01 * (1 - 1e-6) and first["moe_z_loss"] > 0 and math.isfinite(first["loss"])


def test_tp2_sp_ep2_dp2_matches_single_device(reference):
    records = layout_records(2, 1, jax.devices(), ITERS, MOE + ("--expert-model-parallel-size", "2",
                                                                "--sequence-parallel"))
    _assert_matches(records, reference)


def test_ep2_pp2_dp2_matches_single_device(reference):
    # The aux losses of each stage's MoE layers enter the backward through the stage's output.
    records = layout_records(1, 2, jax.devices(), ITERS, MOE + ("--expert-model-parallel-size", "2"))
    _assert_matches(records, reference)
    # Logged with pipelining too: every virtual stage's MoE layers, summed over the stages.
    _assert_moe_metrics_match(records, reference)


def test_ep2_pp2_dp2_recompute_matches_single_device(reference):
    # --recompute-activations reruns each layer (router, dispatch, experts' windows) in the backward.
    records = layout_records(1, 2, jax.devices(), ITERS, MOE + ("--expert-model-parallel-size", "2",
                                                                "--recompute-activations"))
    _assert_matches(records, reference)


def test_ep2_dp4_bf16_tracks_fp32(reference):
    # bf16 parameters' compute copies and activations (fp32 master weights and router): the losses
    # learn and stay within bf16's reach of the fp32 run.
    records = layout_records(1, 1, jax.devices(), ITERS, MOE + ("--expert-model-parallel-size", "2", "--bf16"))
    losses = np.array([r["loss"] for r in records])
    assert np.isfinite(losses).all() and losses[-1] < losses[0] - 0.5
    np.testing.assert_allclose(losses, [r["loss"] for r in reference], rtol=5e-3)  # 9e-4 measured


def _assert_moe_metrics_match(records: list[dict], reference: list[dict]) -> None:
    for key in ("moe_aux_loss", "moe_z_loss"):
        np.testing.assert_allclose([r[key] for r in records], [r[key] for r in reference], rtol=1e-4)
    np.testing.assert_allclose([r["moe_expert_load"] for r in records], [r["moe_expert_load"] for r in reference],
                               rtol=1e-4)


def test_ep2_pp2_vpp2_logs_the_moe_metrics_of_every_virtual_stage():
    # 4 MoE layers, one per virtual stage (vs = chunk * pp + rank): each layer's expert load lands in
    # its own row, in layer order, and the aux / z losses sum over all four. With sigmoid scores and
    # the aux-loss-free expert bias, each virtual stage also moves its own layer's bias
    # (``moe_state["expert_bias"]``, ``[vpp, pp, E]``: layer order row-major).
    four = MOE + ("--num-layers", "4", "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                  "--moe-router-bias-update-rate", "0.01")
    iters = 3
    runs = []
    for tp, pp, devices, extra in ((1, 1, [jax.local_devices()[0]], ()),
                                   (1, 2, jax.devices(), ("--expert-model-parallel-size", "2",
                                                          "--virtual-pipeline-model-parallel-size", "2"))):
        trainer = layout_trainer(tp, pp, devices, iters, four + extra)
        runs.append(([trainer.step() for _ in range(iters)], np.asarray(trainer.model_state["expert_bias"])))
    (reference, ref_bias), (records, bias) = runs
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in records], [r[key] for r in reference], rtol=1e-4)
    _assert_moe_metrics_match(records, reference)
    assert len(reference[0]["moe_expert_load"]) == 4
    np.testing.assert_allclose(bias.reshape(4, -1), ref_bias.reshape(4, -1), atol=1e-7)
    assert np.abs(ref_bias).max() > 0  # it moved


def test_flops_per_token_counts_active_experts():
    # A MoE layer counts its router (2 h E), its k routed experts and the shared expert instead of the MLP.
    import dataclasses

    from core.models.gpt import GPTConfig
    from core.transformer.moe import MoEConfig

    h, layers = 128, 4
    dense = GPTConfig(hidden_size=h, num_layers=layers, ffn_hidden_size=512)
    moe = dataclasses.replace(dense, moe=MoEConfig(num_experts=8, moe_ffn_hidden_size=256, moe_router_topk=2,
                                                   moe_shared_expert_intermediate_size=128), moe_layer_freq=2)
    per_moe_layer = 2 * h * 8 + 4 * h * 256 * 2 + 4 * h * 128 - 4 * h * 512
    assert moe.flops_per_token() - dense.flops_per_token() == 3 * 2 * per_moe_layer


def test_checkpoint_resumes_in_another_ep_and_cp(tmp_path):
    # A dense layer then a MoE layer ('[0,1]'); saved at ep2 x cp2 (experts with dp / ep x cp = 4
    # copies) after 2 steps, resumed at ep4, cp1: the next 2 losses equal the uninterrupted ep2 x cp2
    # run (experts are saved at their global [E, ...] shape).
    from pretrain_harness import TINY

    from core import parallel_state as ps
    from core.training.arguments import parse_args, validate_args
    from core.training.pretrainer import Pretrainer
    from core.training.run_config import pretrain_config

    flags = ["--num-layers", "2", "--num-experts", "4", "--moe-ffn-hidden-size", "32", "--moe-layer-freq", "[0,1]",
             "--moe-token-dispatcher-type", "alltoall", "--moe-aux-loss-coeff", "0.01"]

    def trainer(ep, cp):
        args = parse_args(TINY + ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
                                  "--train-iters", "4", "--save", str(tmp_path), *flags,
                                  "--expert-model-parallel-size", str(ep), "--context-parallel-size", str(cp)])
        state = ps.build_parallel_state(1, 1, context_parallel_size=cp, expert_model_parallel_size=ep,
                                        devices=jax.devices())
        layout = validate_args(args, 8)
        return Pretrainer(pretrain_config(args), layout, state)

    first = trainer(2, 2)
    assert set(first.params["layers"]) == {"dense", "moe"}
    assert first.params["layers"]["moe"]["mlp"]["moe"]["experts"]["weight1"].shape == (1, 1, 4, 64, 32)
    for _ in range(2):
        first.step()
    first.save(str(tmp_path))
    first.finish_saving()
    expected = [first.step()["loss"] for _ in range(2)]
    second = trainer(4, 1)
    assert second.load(str(tmp_path))
    np.testing.assert_allclose([second.step()["loss"] for _ in range(2)], expected, rtol=1e-4)


def test_cp2_dp4_matches_single_device(reference):
    # MoE with context parallelism (ep 1): each cp rank routes its load-balanced chunks, the router's
    # counts are summed over cp, and expert grads are reduced over dp x cp (Megatron's expert-data-
    # parallel group includes cp).
    # The aux and z shares enter the objective times cp, as the LM loss's share does.
    records = layout_records(1, 1, jax.devices(), ITERS, MOE + ("--context-parallel-size", "2"))
    _assert_matches(records, reference)
    for key in ("moe_aux_loss", "moe_z_loss", "moe_expert_load"):
        np.testing.assert_allclose([r[key] for r in records], [r[key] for r in reference], rtol=1e-4)


# Expert parallelism with context parallelism: an ep group is the ranks of one cp index (and one
# dp / ep index), expert grads are reduced over dp / ep x cp. Megatron's ep groups may span cp ranks
# instead; with dropless routing each token meets the same experts either way, so the losses agree.
EP2_CP2 = MOE + ("--expert-model-parallel-size", "2", "--context-parallel-size", "2",
                 "--moe-router-load-balancing-type", "aux_loss")


def test_ep2_cp2_dp4_distributed_optimizer_matches_single_device(reference):
    # Ring (p2p) attention; the distributed optimizer shards expert state over dp / ep x cp = 4 ranks.
    records = layout_records(1, 1, jax.devices(), ITERS, EP2_CP2 + ("--cp-comm-type", "p2p",
                                                                    "--use-distributed-optimizer"))
    _assert_matches(records, reference)
    _assert_moe_metrics_match(records, reference)


def test_tp2_sp_ep2_cp2_dp2_all_gather_matches_single_device(reference):
    # All-gather attention and the all-gather token dispatcher (dropless: the same sums as all-to-all).
    records = layout_records(2, 1, jax.devices(), ITERS, EP2_CP2 + ("--cp-comm-type", "all_gather",
                                                                    "--sequence-parallel",
                                                                    "--moe-token-dispatcher-type", "allgather"))
    _assert_matches(records, reference)
    _assert_moe_metrics_match(records, reference)
