"""Pipeline schedule tables: Megatron's examples and the order properties."""

import pytest

from core.pipeline_parallel.schedule_table import Step, get_pipeline_parallel_order, get_schedule_table


def test_megatron_interleaved_example_table():
    table = get_schedule_table(5, 2, 3)
    assert [mb for mb, _ in table] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [c for _, c in table] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]


def test_1f1b_warmup_steady_cooldown():
    order = get_pipeline_parallel_order(8, 4, 1)
    kinds = "".join(s.kind for s in order)
    assert kinds == "FF" + "FB" * 6 + "BB"
    assert order[:3] == [Step("F", 0), Step("F", 1), Step("F", 2)]
    last = get_pipeline_parallel_order(8, 4, 3)
    assert "".join(s.kind for s in last) == "FB" * 8


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("mult", [1, 2, 4])
@pytest.mark.parametrize("vpp", [None, 2])
def test_order_properties(pp, mult, vpp):
    m = pp * mult
    for rank in range(pp):
        order = get_pipeline_parallel_order(m, pp, rank, vpp)
        v = vpp or 1
        assert sorted((s.kind, s.microbatch, s.chunk) for s in order) == sorted(
            (k, mb, c) for k in "FB" for mb in range(m) for c in range(v))
        done, in_flight = set(), 0
        for s in order:
            if s.kind == "F":
                done.add((s.microbatch, s.chunk))
                in_flight += 1
            else:
                assert (s.microbatch, s.chunk) in done  # every forward before its backward
                in_flight -= 1
            assert in_flight >= 0
        if vpp is None:  # 1F1B keeps at most pp - rank microbatches in flight
            peak = max(sum(1 if s.kind == "F" else -1 for s in order[:i + 1]) for i in range(len(order)))
            assert peak == min(pp - rank, m)


def test_forward_only():
    assert all(s.kind == "F" for s in get_pipeline_parallel_order(4, 2, 0, forward_only=True))


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(num_microbatches=5, pipeline_parallel_size=1, rank=0, virtual_size=2), "needs pipeline_model_parallel_size >= 2"),
    (dict(num_microbatches=5, pipeline_parallel_size=4, rank=0, virtual_size=2), r"modulo .* is 1"),
    (dict(num_microbatches=3, pipeline_parallel_size=4, rank=0, virtual_size=2), r"must lie in \[pipeline_model_parallel_size \(4\), num_microbatches \(3\)\]"),
    (dict(num_microbatches=0, pipeline_parallel_size=2, rank=0), "num_microbatches must be >= 1"),
])
def test_bad_configurations(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        get_pipeline_parallel_order(**kwargs)
