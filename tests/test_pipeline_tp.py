"""Table-driven 1F1B / interleaved 1F1B with tensor-parallel stages and data parallelism equals the
non-pipelined model (8 simulated devices)."""

import numpy as np
import pytest
from pipeline_tp_harness import run_and_compare


@pytest.mark.parametrize("pp,tp,mult", [(2, 2, 1), (2, 2, 4), (4, 2, 2), (4, 1, 4), (2, 1, 2)])
def test_1f1b_tp_dp_equals_reference(pp, tp, mult):
    loss, want_loss, g, want_g = run_and_compare(pp, tp, pp * mult, seed=pp * 10 + tp + mult)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
    for k in g:
        np.testing.assert_allclose(g[k], want_g[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pp,tp,mult", [(2, 2, 1), (2, 2, 2), (4, 2, 1)])
def test_interleaved_tp_dp_equals_reference(pp, tp, mult):
    loss, want_loss, g, want_g = run_and_compare(pp, tp, pp * mult, seed=pp + tp + mult, vpp=2)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
    for k in g:
        np.testing.assert_allclose(g[k], want_g[k], rtol=1e-5, atol=1e-6)
