"""Megatron's bucket-layout rules: the test_bucket_sizes grid and alignment checks, ported."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from core.distributed import param_and_grad_buffer
from core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from core.distributed.param_and_grad_buffer import (
    MAX_BUCKET_ELEMENTS,
    bucket_element_masks,
    bucket_flag_changes,
    bucket_shard_ranges,
    build_buffer_specs,
    build_param_layout,
    flatten_bucket_shard,
    flatten_to_buckets,
    unflatten_from_buckets,
)
from core.param_metadata import ParamInfo

INPUT_DIM = OUTPUT_DIM = 95
NUM_LAYERS = 10


def model_numels(bias: bool) -> list[int]:
    """Megatron's TestModel: 10 Linear(95, 95) layers, model (forward) order."""
    sizes = []
    for _ in range(NUM_LAYERS):
        sizes.append(INPUT_DIM * OUTPUT_DIM)
        if bias:
            sizes.append(OUTPUT_DIM)
    return sizes


@pytest.mark.parametrize("bucket_size", [None, 9000, 9025, 9050, 18000, 18050, 20000])
@pytest.mark.parametrize("use_distributed_optimizer", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shared_embedding", [False, True])
@pytest.mark.parametrize("dp", [1, 8])
def test_bucket_sizes(bucket_size, use_distributed_optimizer, bias, shared_embedding, dp):
    param_sizes = model_numels(bias)
    shared = len(param_sizes) - 1 if shared_embedding else None  # the last (output) param
    layout = build_param_layout(param_sizes, bucket_size=bucket_size, data_parallel_size=dp,
                                use_distributed_optimizer=use_distributed_optimizer, shared_embedding=shared)
    actual_unpadded = list(layout.per_bucket_numel_unpadded)
    actual_padded = [end - start for start, end in layout.bucket_indices]

    def pad_if_needed(n, divisor):
        return math.ceil(n / divisor) * divisor if use_distributed_optimizer else n

    def pad_bucket(n):
        return pad_if_needed(n, math.lcm(dp, 128))

    def pad_param(n):
        return pad_if_needed(n, 64)

    if bucket_size is None:
        assert len(actual_padded) == (2 if shared_embedding and use_distributed_optimizer else 1)
    want_unpadded, want_padded = [], []
    sizes = list(param_sizes)
    if shared_embedding and use_distributed_optimizer:
        want_unpadded.append(sizes[-1])
        want_padded.append(pad_bucket(sizes[-1]))
        sizes = sizes[:-1]
    in_last = 0
    for size in sizes[::-1]:
        in_last = pad_param(in_last) + size
        if bucket_size is not None and in_last >= bucket_size:
            want_unpadded.append(in_last)
            want_padded.append(pad_bucket(in_last))
            in_last = 0
    if in_last:
        want_unpadded.append(in_last)
        want_padded.append(pad_bucket(in_last))
    assert actual_unpadded == want_unpadded
    assert actual_padded == want_padded


@pytest.mark.parametrize("dp", [1, 2, 8, 12])
@pytest.mark.parametrize("high_busbw", [False, True])
def test_param_to_index_alignment_with_padding(dp, high_busbw):
    numels = [7, 1000, 64, 3, 4096, 129, 1]
    layout = build_param_layout(numels, bucket_size=2000, data_parallel_size=dp, use_distributed_optimizer=True,
                                pad_buckets_for_high_nccl_busbw=high_busbw)
    divisor = math.lcm(dp, 128, 2**16) if high_busbw else math.lcm(dp, 128)
    for start, end in layout.bucket_indices:
        assert start % divisor == 0 and end % divisor == 0
    spans = sorted(layout.param_index_map)
    for (start, end, bucket), numel in zip(layout.param_index_map, numels):
        assert start % 64 == 0 and end - start == numel
        b_start, b_end = layout.bucket_indices[bucket]
        assert b_start <= start < end <= b_end
    for (_, end, _), (start, _, _) in zip(spans, spans[1:]):
        assert end <= start
    # Reverse order: the last param sits at the start of the buffer.
    assert layout.param_index_map[-1][0] == 0


def test_no_padding_without_distributed_optimizer():
    numels = [7, 1000, 64, 3]
    layout = build_param_layout(numels, bucket_size=None, data_parallel_size=8, use_distributed_optimizer=False)
    assert layout.param_index_map == ((1067, 1074, 0), (67, 1067, 0), (3, 67, 0), (0, 3, 0))
    assert layout.bucket_indices == ((0, 1074),)


@pytest.mark.parametrize("use_distributed_optimizer", [False, True])
def test_buckets_stay_within_int32_indexing(use_distributed_optimizer):
    # A ~3.6B-parameter buffer (no arrays: the layout is arithmetic) with one bucket asked for
    # (no bucket_size, as without overlap_grad_reduce): int32 offsets inside one bucket would
    # wrap (rank 3 of 4's shard of a 3.6e9-element bucket starts at 2.7e9), so it is cut.
    numels = [3, *[300_000_007] * 12, 129]
    layout = build_param_layout(numels, bucket_size=None, data_parallel_size=4,
                                use_distributed_optimizer=use_distributed_optimizer)
    sizes = [end - start for start, end in layout.bucket_indices]
    assert len(sizes) == 2 and max(sizes) <= MAX_BUCKET_ELEMENTS < 2**31, sizes
    assert sum(sizes) >= sum(numels)
    for start, end, b in layout.param_index_map:  # every parameter whole inside its bucket
        assert layout.bucket_indices[b][0] <= start < end <= layout.bucket_indices[b][1]
    if use_distributed_optimizer:
        assert all(n % 128 == 0 for n in sizes)
    # The cap changes nothing below it: the same parameters in one bucket when they fit.
    small = build_param_layout([n // 1000 for n in numels], bucket_size=None, data_parallel_size=4,
                               use_distributed_optimizer=use_distributed_optimizer)
    assert len(small.bucket_indices) == 1


def test_a_parameter_beyond_int32_indexing_is_a_clear_error():
    with pytest.raises(ValueError, match=r"a parameter of 2200000000 elements \(on each device\) does not fit in a "
                                         r"gradient bucket: buckets are indexed with int32, at most \d+ elements"):
        build_param_layout([10, 2_200_000_000], bucket_size=None, data_parallel_size=8, use_distributed_optimizer=True)


def test_shard_ranges_cover_each_bucket_once():
    layout = build_param_layout([300, 5000, 77], bucket_size=1000, data_parallel_size=4, use_distributed_optimizer=True)
    for b, (start, end) in enumerate(layout.bucket_indices):
        pieces = [bucket_shard_ranges(layout, 4, r)[b] for r in range(4)]
        assert pieces[0][0] == start and pieces[-1][1] == end
        assert all(a[1] == c[0] for a, c in zip(pieces, pieces[1:]))
        assert len({e - s for s, e in pieces}) == 1


def test_flatten_unflatten_roundtrip_and_masks():
    rng = np.random.default_rng(0)
    shapes = [(3, 5), (7,), (2, 2, 2), (130,)]
    leaves = [jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes]
    infos = [ParamInfo(P()), ParamInfo(P(), expert=True), ParamInfo(P()), ParamInfo(P(), shared_embedding=True)]
    specs = build_buffer_specs(shapes, [jnp.float32] * 4, infos, data_parallel_size=4, bucket_size=20,
                               use_distributed_optimizer=True, grad_reduce_in_fp32=False)
    assert [s.key.is_expert_parallel for s in specs] == [False, True]
    dense = specs[0]
    assert dense.leaves == (0, 2, 3)
    buckets = flatten_to_buckets(leaves, dense)
    assert [b.shape[0] for b in buckets] == dense.bucket_sizes()
    back = unflatten_from_buckets(buckets, dense)
    for i in dense.leaves:
        np.testing.assert_array_equal(back[i], leaves[i])
    # Padding is zero; masks mark exactly the flagged params' elements.
    total = sum(int(np.prod(shapes[i])) for i in dense.leaves)
    assert sum(float(jnp.sum(b != 0)) for b in buckets) == total
    masks = bucket_element_masks(dense, [False, False, True])
    assert sum(int(m.sum()) for m in masks) == 130


@pytest.mark.parametrize("segments", [True, False])
@pytest.mark.parametrize("shards", [1, 2, 8])
def test_a_bucket_shard_is_that_ranks_slice_of_the_whole_bucket(shards, segments, monkeypatch):
    """Built from the params that overlap it (never the whole bucket), for every rank, with shard
    edges inside params, alignment gaps and end padding; in the params' dtype or cast; by
    segments, and by whole candidate shards (the path for many shards)."""
    if not segments:
        monkeypatch.setattr(param_and_grad_buffer, "SHARD_SEGMENT_MAX_SLICES", 0)
    rng = np.random.default_rng(2)
    shapes = [tuple(int(d) for d in rng.integers(1, 40, size=rng.integers(1, 3))) for _ in range(12)]
    leaves = [jnp.asarray(rng.normal(size=s), jnp.bfloat16) for s in shapes]
    spec = build_buffer_specs(shapes, [jnp.bfloat16] * len(shapes), [ParamInfo(P())] * len(shapes),
                              data_parallel_size=shards, bucket_size=300, use_distributed_optimizer=True,
                              grad_reduce_in_fp32=False)[0]
    assert len(spec.layout.bucket_indices) > 1
    # a function of this test's own: jit's cache would hand another parametrization's trace back
    shard_of = jax.jit(lambda leaves, b, rank: flatten_bucket_shard(leaves, spec, b, shards, rank, jnp.float32),
                       static_argnums=1)
    for b, whole in enumerate(flatten_to_buckets(leaves, spec, jnp.float32)):
        size = whole.shape[0] // shards
        for rank in range(shards):
            got = shard_of(leaves, b, jnp.int32(rank))
            assert got.dtype == jnp.float32
            np.testing.assert_array_equal(got, whole[rank * size:(rank + 1) * size])


@pytest.mark.parametrize("use_distributed_optimizer", [False, True])
@pytest.mark.parametrize("bucket_size", [None, 400])
def test_flag_changes_give_every_parameter_its_flag(use_distributed_optimizer, bucket_size):
    rng = np.random.default_rng(1)
    shapes = [tuple(int(d) for d in rng.integers(1, 40, size=rng.integers(1, 3))) for _ in range(30)]
    infos = [ParamInfo(P())] * len(shapes)
    spec = build_buffer_specs(shapes, [jnp.float32] * len(shapes), infos, data_parallel_size=8, bucket_size=bucket_size,
                              use_distributed_optimizer=use_distributed_optimizer, grad_reduce_in_fp32=False)[0]
    flags = [bool(f) for f in rng.integers(0, 2, len(shapes))]
    for b, mask in enumerate(bucket_element_masks(spec, flags)):
        first, flips = bucket_flag_changes(spec, b, flags)
        at = np.arange(mask.size)
        from_runs = ((at[:, None] >= np.asarray(flips, int)[None, :]).sum(1) % 2 == 1) != first
        members = spec.layout.bucket_params(b)
        for j in members:  # every parameter's elements carry its flag (gaps and padding: any)
            start, end, _ = spec.layout.param_index_map[j]
            offset = spec.layout.bucket_indices[b][0]
            np.testing.assert_array_equal(from_runs[start - offset:end - offset], mask[start - offset:end - offset])
        assert len(flips) == sum(flags[i] != flags[j] for i, j in zip(members, members[1:]))  # no flip in a gap


def test_default_bucket_size_follows_megatron():
    assert DistributedDataParallelConfig().effective_bucket_size(8) is None
    assert DistributedDataParallelConfig(overlap_grad_reduce=True).effective_bucket_size(8) == 40_000_000
    assert DistributedDataParallelConfig(overlap_grad_reduce=True).effective_bucket_size(64) == 64_000_000
    assert DistributedDataParallelConfig(bucket_size=1000).effective_bucket_size(8) == 1000
    with pytest.raises(ValueError, match="bucket_size must be a positive int"):
        DistributedDataParallelConfig(bucket_size=0)
