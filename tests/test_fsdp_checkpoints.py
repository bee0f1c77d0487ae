"""Checkpoints across Megatron-FSDP's sharding strategies (one process, 8 simulated devices): a
checkpoint saved under ``optim_grads_params`` (ZeRO-3: parameters sharded over dp at rest) at dp 8
resumes under tp2 pp2 dp2 ``optim``, and one saved there resumes under ``optim_grads_params`` at
dp 8. The resumed trainer holds exactly the saved parameters and optimizer state (the checkpoint's
global form, compared element for element) and its losses and grad norms equal those of the
uninterrupted run over the remaining iterations (fp32, rtol 1e-5).

Four trainers in all: each layout's uninterrupted run (which also writes the checkpoint, in the
background while it goes on, as ``--async-save`` does) and each layout's resume of the other's."""

import jax
import numpy as np
import pytest
from pretrain_harness import layout_trainer

ITERS = 5


def fsdp_flags(strategy: str) -> tuple[str, ...]:
    return ("--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy)


# name: (tp, pp, extra flags, iteration its uninterrupted run saves at)
LAYOUTS = {
    "zero3_dp8": (1, 1, fsdp_flags("optim_grads_params"), 2),
    "optim_tp2pp2dp2": (2, 2, fsdp_flags("optim"), 3),
}


def _trainer(name: str, *extra: str):
    tp, pp, flags, _ = LAYOUTS[name]
    return layout_trainer(tp, pp, jax.devices(), ITERS, flags + extra)


def _host(tree):
    return jax.tree.map(np.asarray, tree)


def _checkpoint_state(trainer) -> dict:
    """The trainer's params and optimizer state as a checkpoint stores them (global, layout-independent), on the host."""
    return _host(trainer.checkpointer.checkpoint_state(trainer.training_state())[0])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Each layout's run, computed once: name -> (records of ITERS iterations, checkpoint
    directory, the checkpoint's state on the host)."""
    runs = {}

    def run(name: str):
        if name not in runs:
            saved_at = LAYOUTS[name][3]
            directory = str(tmp_path_factory.mktemp(name))
            trainer = _trainer(name, "--async-save")
            records = [trainer.step() for _ in range(saved_at)]
            trainer.save(directory)
            state = _checkpoint_state(trainer)
            records += [trainer.step() for _ in range(ITERS - saved_at)]
            trainer.finish_saving()
            runs[name] = records, directory, state
        return runs[name]

    return run


@pytest.mark.parametrize("saved_in,resumed_in", [("zero3_dp8", "optim_tp2pp2dp2"), ("optim_tp2pp2dp2", "zero3_dp8")],
                         ids=["zero3-to-optim", "optim-to-zero3"])
def test_checkpoint_resumes_under_the_other_strategy_and_layout(uninterrupted, saved_in, resumed_in):
    records, directory, saved_state = uninterrupted(saved_in)
    saved_at = LAYOUTS[saved_in][3]
    resumed = _trainer(resumed_in)
    assert resumed.load(directory)
    assert resumed.iteration == saved_at and resumed.data.sampler.consumed_samples == saved_at * 16
    loaded = _checkpoint_state(resumed)
    assert jax.tree.structure(loaded) == jax.tree.structure(saved_state)
    jax.tree.map(np.testing.assert_array_equal, loaded, saved_state)
    later = [resumed.step() for _ in range(ITERS - saved_at)]
    expected = records[saved_at:]
    np.testing.assert_allclose([r["loss"] for r in later], [r["loss"] for r in expected], rtol=1e-5)
    np.testing.assert_allclose([r["grad_norm"] for r in later], [r["grad_norm"] for r in expected], rtol=1e-5)


def test_both_uninterrupted_runs_agree(uninterrupted):
    """The two layouts train alike (what makes each resume's comparison meaningful in the other's terms)."""
    (zero3, _, _), (optim, _, _) = uninterrupted("zero3_dp8"), uninterrupted("optim_tp2pp2dp2")
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in zero3], [r[key] for r in optim], rtol=1e-5)
