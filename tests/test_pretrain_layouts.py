"""Layout invariance of GPT pretraining (one process, 8 simulated devices): the loss trajectory
of 10 iterations equals the single-device run (relative 1e-4, fp32) for every layout."""

import jax
import numpy as np
import pytest
from pretrain_harness import LAYOUTS, LLAMA, layout_losses, reference_losses


@pytest.fixture(scope="module")
def reference():
    return reference_losses()


# Every layout but three whose flags other entries cover at the same tp x pp: plain (2, 2) (the
# Llama-class test runs it), (2, 1) with the distributed optimizer and plain (1, 4).
@pytest.mark.parametrize("tp,pp,extra", [LAYOUTS[i] for i in (0, 1, 3, 4, 7, 8, 9)],
                         ids=lambda v: "-".join(v) if isinstance(v, tuple) else str(v))
def test_loss_trajectory_matches_single_device(reference, tp, pp, extra):
    losses = layout_losses(tp, pp, jax.devices(), extra=extra)
    assert reference[-1] < reference[0] - 0.5  # it learns
    np.testing.assert_allclose(losses, reference, rtol=1e-4)


@pytest.fixture(scope="module")
def llama_reference():
    return reference_losses(extra=LLAMA)


@pytest.mark.parametrize("extra", [(), ("--use-distributed-optimizer", "--sequence-parallel")], ids=["plain", "do-sp"])
def test_llama_loss_trajectory_matches_single_device(llama_reference, extra):
    reference = llama_reference
    losses = layout_losses(2, 2, jax.devices(), extra=LLAMA + extra)
    assert reference[-1] < reference[0] - 0.5  # it learns
    np.testing.assert_allclose(losses, reference, rtol=1e-4)


def test_dropout_is_layout_invariant(llama_reference):
    # Masks come from each sample's dropout_seed (seed and position in the run), the global layer
    # index and the site, drawn at the global shape: the same whatever tp, SP, pp or dp.
    dropout = LLAMA + ("--attention-dropout", "0.1", "--hidden-dropout", "0.1")
    reference = reference_losses(iters=4, extra=dropout)
    losses = layout_losses(2, 2, jax.devices(), iters=4,
                           extra=dropout + ("--sequence-parallel", "--recompute-activations"))
    np.testing.assert_allclose(losses, reference, rtol=1e-4)
    assert not np.allclose(reference, llama_reference[:4], rtol=1e-3)  # dropout ran


def test_llama_bf16_trains_close_to_fp32(llama_reference):
    # tp2 pp2 cp2 with SP: bf16 through every sharded path, the context-parallel ring included.
    losses = layout_losses(2, 2, jax.devices(), extra=LLAMA + ("--bf16", "--sequence-parallel",
                                                               "--context-parallel-size", "2"))
    assert np.all(np.isfinite(losses))
    np.testing.assert_allclose(losses, llama_reference, rtol=3e-2)  # bf16 activations, fp32 params
