"""Layer partitioning over stages and its errors."""

import pytest

from core.pipeline_parallel.utils import get_layer_offset, get_num_layers_to_build


def test_layers_per_chunk_and_offsets():
    assert get_num_layers_to_build(8, 2) == 4
    assert get_num_layers_to_build(8, 2, 2) == 2
    # Interleaved: rank 0 holds layers 0-1 and 4-5, rank 1 holds 2-3 and 6-7.
    assert [get_layer_offset(8, r, 2, c, 2) for r in (0, 1) for c in (0, 1)] == [0, 4, 2, 6]


def test_errors_name_the_numbers():
    with pytest.raises(ValueError, match="num_layers 6 is not divisible .* 4"):
        get_num_layers_to_build(6, 4)
    with pytest.raises(ValueError, match="needs pipeline_model_parallel_size >= 2, got 1"):
        get_num_layers_to_build(8, 1, 2)
