"""The Megatron-style loop example across 8 real processes equals one device."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

pytestmark = pytest.mark.mpi(min_size=8)


def test_megatron_loop_example_8_processes_equals_one_device():
    """tp=2 x dp=4 over processes: ColumnParallel/RowParallelLinear, DDP with the distributed
    optimizer, get_forward_backward_func, finalize_model_grads([model], num_tokens)."""
    import megatron_style_loop

    assert megatron_style_loop.check(tp=2, steps=3) < 1e-5
