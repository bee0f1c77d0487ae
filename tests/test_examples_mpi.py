"""examples/xlstm_style_fsdp.py across 8 real processes (one device each): FSDP over dp=2,
TPDense over tp=2, GPipe over pp=2, and the run equals one device (fp32 rtol=atol=1e-5)."""

import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.experimental import multihost_utils

pytestmark = pytest.mark.mpi(min_size=8)

ROOT = Path(__file__).resolve().parents[1]


sys.path.insert(0, str(ROOT / "examples"))  # examples/ is not a package


def _load_example():
    """examples/xlstm_style_fsdp.py as a module."""
    import xlstm_style_fsdp

    return xlstm_style_fsdp


def test_xlstm_style_example_equals_single_device():
    """Every process trains the sharded model and sees the same loss trajectory; process 0
    trains the single-device reference and ``check`` asserts losses and final parameters match."""
    ex = _load_example()
    sharded, single = ex.check(2, 2, steps=3)
    losses = np.asarray(multihost_utils.process_allgather(sharded.losses))
    assert losses.shape == (jax.process_count(), 3)
    np.testing.assert_array_equal(losses, np.broadcast_to(losses[0], losses.shape))
    assert (single is not None) == (jax.process_index() == 0)
    assert sharded.losses[-1] < sharded.losses[0]
