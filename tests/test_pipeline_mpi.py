"""Table-driven 1F1B with tensor-parallel stages across 8 processes (pp x tp x dp) equals the non-pipelined model."""

import numpy as np
import pytest
from pipeline_tp_harness import run_and_compare

pytestmark = pytest.mark.mpi(min_size=8)


@pytest.mark.parametrize("pp,tp,mult", [(2, 2, 2), (4, 2, 1), (4, 1, 4)])
def test_1f1b_processes_equal_reference(pp, tp, mult):
    loss, want_loss, g, want_g = run_and_compare(pp, tp, pp * mult, seed=pp * 10 + tp + mult)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
    for k in g:
        np.testing.assert_allclose(g[k], want_g[k], rtol=1e-5, atol=1e-6)
