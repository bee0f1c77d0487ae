"""1F1B across 8 processes (pp x tp x dp) equals the non-pipelined model."""

import numpy as np
import pytest
from pipeline_tp_harness import run_and_compare

pytestmark = pytest.mark.mpi(min_size=8)


@pytest.mark.parametrize("pp,tp,mult,executor", [(2, 2, 2, "slot_grid"), (4, 2, 1, "slot_grid"), (4, 1, 4, "slot_grid"),
                                                 (2, 2, 2, "table_driven")])
def test_1f1b_processes_equal_reference(pp, tp, mult, executor):
    loss, want_loss, g, want_g = run_and_compare(pp, tp, pp * mult, seed=pp * 10 + tp + mult, executor=executor)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
    for k in g:
        np.testing.assert_allclose(g[k], want_g[k], rtol=1e-5, atol=1e-6)
