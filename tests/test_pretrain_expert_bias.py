"""Aux-loss-free expert bias (``--moe-router-enable-expert-bias``) in GPT pretraining (one
process, 8 simulated devices, fp32): the bias is non-trainable model state, moved after every
optimizer step by ``rate * sign(mean - tpe)`` with ``tpe`` the step's global tokens per expert of
its layer. With experts over ``"ep"`` (and pp) the losses and the biases of every iteration equal
the single-device run's; a checkpoint stores the bias and a resume continues bit-identically."""

import jax
import numpy as np
import pytest
from pretrain_harness import layout_trainer

ITERS = 4
RATE = 0.01  # large enough to change the top-k choice of this tiny model within a few steps
EXPERTS = 8
BIAS = ("--num-layers", "2", "--num-experts", str(EXPERTS), "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
        "--moe-layer-freq", "1", "--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm",
        "--moe-router-dtype", "fp32", "--moe-router-score-function", "sigmoid",
        "--moe-router-load-balancing-type", "none", "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate", str(RATE))


def _bias(trainer) -> np.ndarray:
    """``[n_moe_layers, E]`` in layer order (row-major ``[vpp, pp * n_chunk]`` is layer order)."""
    return np.asarray(trainer.model_state["expert_bias"]).reshape(-1, EXPERTS)


def _run(trainer, iters: int, save_to: str | None = None, save_at: int = 0) -> list[dict]:
    """Each step's record plus the step's logged tokens per expert (``tpe``) and the bias after it."""
    out = []
    for _ in range(iters):
        pending = trainer.dispatch_step()
        tpe = np.asarray(pending["_metrics"]["report"]["moe_tokens_per_expert"])
        record = trainer.collect([pending], 1.0)[0]
        out.append({**record, "tpe": tpe, "bias": _bias(trainer)})
        if save_to and trainer.iteration == save_at:
            trainer.save(save_to)
            trainer.finish_saving()
    return out


@pytest.fixture(scope="module")
def reference():
    return _run(layout_trainer(1, 1, [jax.local_devices()[0]], ITERS, BIAS), ITERS)


def _assert_matches(records: list[dict], reference: list[dict]) -> None:
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in records], [r[key] for r in reference], rtol=1e-4)
    np.testing.assert_allclose([r["bias"] for r in records], [r["bias"] for r in reference], atol=1e-7)


def test_bias_follows_the_logged_load(reference):
    before = np.zeros((2, EXPERTS), np.float32)
    for record in reference:
        tpe = record["tpe"]  # averaged over microbatches and dp: the sign of mean - tpe is the global count's
        expected = before + RATE * np.sign(tpe.mean(axis=-1, keepdims=True) - tpe)
        np.testing.assert_allclose(record["bias"], expected, atol=1e-7)
        before = record["bias"]
    assert np.abs(reference[-1]["bias"]).max() > RATE  # it moves (and not just once)
    assert not np.array_equal(reference[0]["bias"], reference[-1]["bias"])


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory):
    """The ep2 pp2 dp2 run, its trainer, and the checkpoint it saved after iteration 2."""
    directory = str(tmp_path_factory.mktemp("bias_ckpt"))
    trainer = layout_trainer(1, 2, jax.devices(), ITERS, BIAS + ("--expert-model-parallel-size", "2"))
    return _run(trainer, ITERS, save_to=directory, save_at=2), trainer, directory


def test_ep2_pp2_dp2_matches_single_device(reference, pipelined):
    # Each pipeline stage updates the biases of its own MoE layer.
    _assert_matches(pipelined[0], reference)


def test_resume_restores_the_bias(pipelined):
    # The same trainer (its compiled step) rewinds to the checkpoint: the bias comes from the file.
    records, trainer, directory = pipelined
    assert not np.array_equal(_bias(trainer), records[1]["bias"])
    assert trainer.load(directory) and trainer.iteration == 2
    np.testing.assert_array_equal(_bias(trainer), records[1]["bias"])
    resumed = _run(trainer, ITERS - 2)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in records[2:]]
    for r, expected in zip(resumed, records[2:]):
        np.testing.assert_array_equal(r["bias"], expected["bias"])


def test_ep2_dp4_matches_single_device(reference, pipelined):
    # Each dp rank routes its own rows: only the global counts give every rank the same bias.
    trainer = layout_trainer(1, 1, jax.devices(), ITERS, BIAS + ("--expert-model-parallel-size", "2"))
    _assert_matches(_run(trainer, ITERS), reference)
    # The pp2 checkpoint loads here too (the biases are stored per layer, in layer order).
    records, _, directory = pipelined
    assert trainer.load(directory)
    np.testing.assert_array_equal(_bias(trainer), records[1]["bias"])
    _assert_matches(_run(trainer, ITERS - 2), records[2:])


def test_tp2_sp_cp2_ep2_matches_single_device(reference):
    # tp2 with SP, cp2 (the load-balanced ring) and ep2 over dp2: every rank routes its own part of
    # the sequence, and the bias moves by the counts summed over all of them.
    trainer = layout_trainer(2, 1, jax.devices(), ITERS, BIAS + ("--expert-model-parallel-size", "2",
                                                                  "--context-parallel-size", "2", "--sequence-parallel"))
    _assert_matches(_run(trainer, ITERS), reference)
