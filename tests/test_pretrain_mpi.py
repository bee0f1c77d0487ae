"""Layout invariance of GPT pretraining in 8 real processes (one device each): the loss
trajectory of 10 iterations equals the one-device run (relative 1e-4, fp32)."""

import jax
import numpy as np
import pytest
from pretrain_harness import LAYOUTS, LLAMA, layout_losses, reference_losses

pytestmark = pytest.mark.mpi(min_size=8)


@pytest.fixture(scope="module")
def reference():
    # Each process runs the one-device reference on its own device (no communication).
    return reference_losses()


@pytest.mark.parametrize("tp,pp,extra", [LAYOUTS[i] for i in (1, 3, 4, 6)],
                         ids=lambda v: "-".join(v) if isinstance(v, tuple) else str(v))
def test_loss_trajectory_matches_single_device(reference, tp, pp, extra):
    losses = layout_losses(tp, pp, jax.devices(), extra=extra)
    np.testing.assert_allclose(losses, reference, rtol=1e-4)


def test_llama_loss_trajectory_matches_single_device():
    reference = reference_losses(extra=LLAMA)
    losses = layout_losses(2, 2, jax.devices(), extra=LLAMA + ("--sequence-parallel",))
    np.testing.assert_allclose(losses, reference, rtol=1e-4)

