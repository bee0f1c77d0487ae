"""The nine Megatron mappings: forward and backward against the table, tp=4 x pp=2 (one process)."""

import numpy as np
import pytest
from tp_harness import run_per_rank, value_and_input_grad

from core import parallel_state as ps
from core.tensor_parallel import mappings as m

TP = 4


def _groups(state):
    return {r: state.group_of(r, ("tp",)) for r in range(state.world_size)}


def _expect(kind, per_rank, state, dim):
    """Numpy version of a collective on every rank's tp group."""
    out = []
    for r in range(state.world_size):
        group = _groups(state)[r]
        i = group.index(r)
        vals = [per_rank[g] for g in group]
        if kind == "identity":
            out.append(per_rank[r])
        elif kind == "reduce":
            out.append(sum(vals))
        elif kind == "gather":
            out.append(np.concatenate(vals, axis=dim))
        elif kind == "split":
            out.append(np.split(per_rank[r], TP, axis=dim)[i])
        elif kind == "reduce_scatter":
            out.append(np.split(sum(vals), TP, axis=dim)[i])
    return np.stack(out)


TABLE = [
    (m.copy_to_tensor_model_parallel_region, "identity", "reduce", -1),
    (m.reduce_from_tensor_model_parallel_region, "reduce", "identity", -1),
    (m.scatter_to_tensor_model_parallel_region, "split", "gather", -1),
    (m.gather_from_tensor_model_parallel_region, "gather", "split", -1),
    (m.scatter_to_sequence_parallel_region, "split", "gather", 0),
    (m.gather_from_sequence_parallel_region, "gather", "reduce_scatter", 0),
    (lambda x: m.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False), "gather", "split", 0),
    (m.reduce_scatter_to_sequence_parallel_region, "reduce_scatter", "gather", 0),
    (m.all_gather_last_dim_from_tensor_parallel_region, "gather", "reduce_scatter", -1),
    (m.reduce_scatter_last_dim_to_tensor_parallel_region, "reduce_scatter", "gather", -1),
]


@pytest.mark.parametrize("fn,forward,backward,dim", TABLE)
def test_mapping_forward_and_backward(fn, forward, backward, dim):
    state = ps.initialize_model_parallel(TP, 2)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 8, 3, 8)).astype(np.float32)
    out_shape = _expect(forward, x, state, dim).shape[1:]
    cot = rng.normal(size=(8, *out_shape)).astype(np.float32)
    out, grad = run_per_rank(state, lambda a, c: value_and_input_grad(fn, a, c), x, cot)
    np.testing.assert_allclose(out, _expect(forward, x, state, dim), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(grad, _expect(backward, cot, state, dim), rtol=1e-6, atol=1e-6)


def test_all_reduce_of_ones_times_rank_gives_6_and_22():
    state = ps.initialize_model_parallel(TP, 2)
    x = np.stack([np.full((2, 4), r, np.float32) for r in range(8)])
    (out,) = run_per_rank(state, lambda a: (m.reduce_from_tensor_model_parallel_region(a),), x)
    assert [float(out[r, 0, 0]) for r in range(8)] == [6.0] * 4 + [22.0] * 4


def test_identity_when_tp_is_one():
    state = ps.initialize_model_parallel(1, 2)
    x = np.random.default_rng(1).normal(size=(8, 4, 4)).astype(np.float32)
    for fn, *_ in TABLE:
        out, grad = run_per_rank(state, lambda a, c, fn=fn: value_and_input_grad(fn, a, c), x, x)
        np.testing.assert_array_equal(out, x)
        np.testing.assert_array_equal(grad, x)
