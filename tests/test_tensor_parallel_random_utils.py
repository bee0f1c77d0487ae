"""RNG streams across tp/dp ranks, and the small tensor-parallel utilities."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tp_harness import run_per_rank

from core import parallel_state as ps
from core.tensor_parallel.random import data_parallel_rng, model_parallel_rng
from core.tensor_parallel.utils import VocabUtility, divide, split_tensor_along_last_dim


def test_model_parallel_stream_differs_across_tp_only():
    state = ps.build_parallel_state(4)
    keys = np.zeros((8, 1), np.float32)
    mp, dp = run_per_rank(state, lambda _: (jax.random.uniform(model_parallel_rng(jax.random.key(7)), (3,)),
                                            jax.random.uniform(data_parallel_rng(jax.random.key(7)), (3,))), keys)
    for r in range(8):
        for q in range(8):
            same_tp = state.group_rank(r, ("tp",)) == state.group_rank(q, ("tp",))
            assert np.array_equal(mp[r], mp[q]) == same_tp  # dp replicas agree, tp ranks differ
            assert np.array_equal(dp[r], dp[q])


def test_utils():
    assert divide(12, 4) == 3
    with pytest.raises(ValueError, match="10 is not divisible by 4"):
        divide(10, 4)
    parts = split_tensor_along_last_dim(jnp.arange(12.0).reshape(2, 6), 3)
    assert [p.shape for p in parts] == [(2, 2)] * 3 and float(parts[2][1, 1]) == 11.0
    assert VocabUtility.vocab_range_from_global_vocab_size(32, 2, 4) == (16, 24)
    assert VocabUtility.vocab_range_from_per_partition_vocab_size(8, 3, 4) == (24, 32)
