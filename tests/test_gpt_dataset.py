"""Megatron's GPTDataset (core.data.gpt_dataset): the document/sample/shuffle indices against literal
ports of Megatron's code, token coverage, the on-disk cache, rank-0-then-share, the masks and the
``--split`` document ranges. numpy only."""

import functools
import os
import threading

import numpy as np
import pytest

from core.data.gpt_dataset import (
    GPTDataset,
    GPTDatasetConfig,
    IndexCacheError,
    build_on_rank0_then_share,
    build_sample_index,
    get_ltor_masks_and_position_ids,
    get_split_document_ids,
)
from core.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

EOD = 0


def helpers_cpp_build_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch, drop_last, extra):
    """A line-by-line port of Megatron's helpers.cpp build_sample_idx."""
    if drop_last:
        num_samples = (num_epochs * tokens_per_epoch - extra) // seq_length
    else:
        num_samples = int(np.ceil(np.float32(num_epochs * tokens_per_epoch - extra) / np.float32(seq_length)))
    sample_idx = np.zeros((num_samples + 1, 2), dtype=np.int64)
    sample_idx_index = 0
    doc_idx_index = 0
    doc_offset = 0
    sample_idx[0] = (0, 0)
    sample_idx_index += 1
    while sample_idx_index <= num_samples:
        remaining = seq_length + extra
        while remaining != 0:
            document_length = sizes[doc_idx[doc_idx_index]] - doc_offset
            remaining -= document_length
            if remaining <= 0:
                doc_offset += remaining + document_length - extra
                remaining = 0
            else:
                if doc_idx_index == len(doc_idx) - 1:
                    assert sample_idx_index == num_samples
                    doc_offset = sizes[doc_idx[doc_idx_index]] - extra
                    break
                doc_idx_index += 1
                doc_offset = 0
        sample_idx[sample_idx_index] = (doc_idx_index, doc_offset)
        sample_idx_index += 1
    return sample_idx


def megatron_document_index(documents, num_epochs, rs, separate_final_epoch):
    """Megatron's _build_document_index, written as Megatron writes it (numpy.mgrid)."""
    if not separate_final_epoch or num_epochs == 1:
        document_index = np.mgrid[0:num_epochs, 0 : len(documents)][1]
        document_index[:] = documents
        document_index = document_index.reshape(-1).astype(np.int32)
        rs.shuffle(document_index)
        return document_index
    first = megatron_document_index(documents, num_epochs - 1, rs, False)
    last = megatron_document_index(documents, 1, rs, False)
    return np.concatenate((first, last))


def write_dataset(prefix, documents, dtype=np.uint16):
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in documents:
        builder.add_item(doc)
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return IndexedDataset(prefix)


@pytest.fixture
def corpus(tmp_path):
    """40 documents of 1..30 tokens; token value = 1000 * (doc + 1) + position (unique), EOD-terminated."""
    rng = np.random.default_rng(0)
    docs = []
    for d in range(40):
        n = int(rng.integers(1, 30))
        docs.append(np.array([1000 * (d + 1) + i for i in range(n)] + [EOD], dtype=np.int64))
    return write_dataset(str(tmp_path / "corpus"), docs, dtype=np.int32), docs


@pytest.mark.parametrize("extra", [1, 0])
@pytest.mark.parametrize("drop_last", [True, False])
def test_sample_index_equals_helpers_cpp(extra, drop_last):
    rng = np.random.default_rng(3)
    for trial in range(30):
        sizes = rng.integers(0, 12, size=int(rng.integers(2, 15))).astype(np.int32)
        sizes[rng.integers(0, len(sizes))] += 1  # not all empty
        docs = np.arange(len(sizes), dtype=np.int32)
        num_epochs = int(rng.integers(1, 4))
        doc_idx = np.tile(docs, num_epochs)
        rng.shuffle(doc_idx)
        if sizes[doc_idx[-1]] == 0:  # helpers.cpp's partial-sample rule reads the last document's length
            sizes[doc_idx[-1]] = 3
        tokens_per_epoch = int(sizes.sum())
        seq_length = int(rng.integers(2, 9))
        if num_epochs * tokens_per_epoch - extra < 1:
            continue
        expected = helpers_cpp_build_sample_idx(
            sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch, drop_last, extra
        )
        got = build_sample_index(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch, drop_last, bool(extra))
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, expected, err_msg=f"trial {trial}")


def test_indices_match_megatron_and_every_token_appears(corpus, tmp_path):
    indexed, docs = corpus
    ids = np.arange(5, 35, dtype=np.int32)  # a split
    seq = 16
    config = GPTDatasetConfig(sequence_length=seq, random_seed=7, path_to_cache=str(tmp_path / "cache"))
    ds = GPTDataset(indexed, ids, None, config)
    # Megatron's arrays, from its own code and one RandomState.
    rs = np.random.RandomState(7)
    doc_index = megatron_document_index(ids, 1, rs, False)
    np.testing.assert_array_equal(ds.document_index, doc_index)
    tokens_per_epoch = int(indexed.sequence_lengths[ids].sum())
    sample_idx = helpers_cpp_build_sample_idx(indexed.sequence_lengths, doc_index, seq, 1, tokens_per_epoch, True, 1)
    np.testing.assert_array_equal(ds.sample_index, sample_idx)
    shuffle = np.arange(len(sample_idx) - 1, dtype=np.uint32)
    rs.shuffle(shuffle)
    np.testing.assert_array_equal(ds.shuffle_index, shuffle)
    assert len(ds) == (tokens_per_epoch - 1) // seq
    # Samples in sample order: seq+1 tokens, consecutive ones share one token, together the stream.
    order = np.argsort(ds.shuffle_index)
    texts = [ds.get_text(int(i)) for i in order]
    assert all(len(t) == seq + 1 and t.dtype == np.int64 for t in texts)
    assert all(a[-1] == b[0] for a, b in zip(texts, texts[1:]))
    stream = np.concatenate([docs[d] for d in doc_index])
    joined = np.concatenate([texts[0]] + [t[1:] for t in texts[1:]])
    np.testing.assert_array_equal(joined, stream[: len(joined)])
    assert len(stream) - len(joined) < seq  # only the last partial sample is dropped
    # With the partial sample kept (valid split, no drop), every token of the split appears.
    keep = GPTDataset(
        indexed,
        ids,
        None,
        GPTDatasetConfig(seq, 7, drop_last_partial_validation_sequence=False, path_to_cache=str(tmp_path / "c2")),
        "valid",
    )
    seen = np.concatenate([keep.get_text(i) for i in range(len(keep))])
    split_tokens = np.concatenate([docs[d] for d in ids])
    assert set(split_tokens.tolist()) <= set(seen.tolist())
    last = keep[int(np.argmax(keep.shuffle_index))]  # the padded partial sample
    assert last["loss_mask"].sum() < seq and (last["tokens"] >= 0).all()


def test_multi_epoch_and_separate_final_epoch(corpus, tmp_path):
    indexed, _ = corpus
    ids = np.arange(0, 40, dtype=np.int32)
    seq = 8
    tokens_per_epoch = int(indexed.sequence_lengths.sum())
    per_epoch = (tokens_per_epoch - 1) // seq
    for num_samples, separate in [(2 * per_epoch + per_epoch // 10, True), (3 * per_epoch - 1, False)]:
        config = GPTDatasetConfig(seq, random_seed=11, path_to_cache=str(tmp_path / f"c{num_samples}"))
        ds = GPTDataset(indexed, ids, num_samples, config)
        epochs = 3
        assert len(ds) >= num_samples
        assert np.bincount(ds.document_index, minlength=40).tolist() == [epochs] * 40
        rs = np.random.RandomState(11)
        doc_index = megatron_document_index(ids, epochs, rs, separate)
        np.testing.assert_array_equal(ds.document_index, doc_index)
        total = len(ds.sample_index) - 1
        first = (2 * tokens_per_epoch - 1) // seq if separate else total
        a = np.arange(first, dtype=np.uint32)
        rs.shuffle(a)
        b = np.arange(first, total, dtype=np.uint32)
        rs.shuffle(b)
        np.testing.assert_array_equal(ds.shuffle_index, np.concatenate([a, b]) if separate else a)
        if separate:
            assert sorted(ds.document_index[-40:].tolist()) == list(range(40))
            assert ds.shuffle_index[first:].min() >= first


def test_deterministic_per_seed(corpus, tmp_path):
    indexed, _ = corpus
    ids = np.arange(40, dtype=np.int32)
    make = lambda seed, d: GPTDataset(indexed, ids, 100, GPTDatasetConfig(8, seed, path_to_cache=str(tmp_path / d)))
    a, b, c = make(1, "a"), make(1, "b"), make(2, "c")
    for name in ("document_index", "sample_index", "shuffle_index"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(a.shuffle_index, c.shuffle_index)
    np.testing.assert_array_equal(a[5]["tokens"], b[5]["tokens"])


def test_cache_is_built_once_and_reused(corpus, tmp_path):
    indexed, _ = corpus
    ids = np.arange(40, dtype=np.int32)
    config = GPTDatasetConfig(8, 3, path_to_cache=str(tmp_path / "cache"))
    first = GPTDataset(indexed, ids, 50, config)
    assert first.built_anew_on_cache_miss
    files = sorted(os.listdir(tmp_path / "cache"))
    assert files == sorted(
        f"{first.unique_description_hash}-GPTDataset-train-{a}"
        for a in ("description.txt", "document_index.npy", "sample_index.npy", "shuffle_index.npy")
    )
    mtimes = {f: os.stat(tmp_path / "cache" / f).st_mtime_ns for f in files}
    second = GPTDataset(indexed, ids, 50, config)
    assert not second.built_anew_on_cache_miss
    assert {f: os.stat(tmp_path / "cache" / f).st_mtime_ns for f in files} == mtimes
    np.testing.assert_array_equal(second.sample_index, first.sample_index)
    assert isinstance(second.sample_index, np.memmap)
    # Another configuration (samples, seed, documents) is another hash, hence other files.
    third = GPTDataset(indexed, ids[:-1], 50, config)
    assert third.built_anew_on_cache_miss and third.unique_description_hash != first.unique_description_hash


def test_an_unwritable_cache_is_one_error_naming_it(corpus, tmp_path):
    indexed, _ = corpus
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    config = GPTDatasetConfig(8, 3, path_to_cache=str(blocker / "cache"))
    with pytest.raises(IndexCacheError, match=f"^cannot write the sample-index cache in {blocker / 'cache'}: "
                                              "Not a directory$"):
        GPTDataset(indexed, np.arange(40, dtype=np.int32), 50, config)


def test_default_cache_dir_is_megatrons(corpus):
    indexed, _ = corpus
    ds = GPTDataset(indexed, np.arange(40), None, GPTDatasetConfig(8))
    assert ds.cache_dir == os.path.join(indexed.path_prefix, "cache", "GPTDataset_indices")
    assert os.path.isfile(ds.cache_path("sample_index.npy"))


def test_build_on_rank0_then_share_rank0_builds_others_load(corpus, tmp_path):
    indexed, _ = corpus
    config = GPTDatasetConfig(8, 5, path_to_cache=str(tmp_path / "shared"))
    barrier = threading.Barrier(3)
    results = {}

    def rank_main(rank):
        results[rank] = build_on_rank0_then_share(
            lambda: GPTDataset(indexed, np.arange(40), 60, config), rank=rank, barrier=barrier.wait
        )

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in (2, 1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [results[r].built_anew_on_cache_miss for r in (0, 1, 2)] == [True, False, False]
    np.testing.assert_array_equal(results[1].shuffle_index, results[0].shuffle_index)
    assert build_on_rank0_then_share(lambda: 42) == 42


def test_masks_and_position_ids_hand_example():
    tokens = np.array([5, 6, EOD, 7, 8, EOD, 9])
    attention, loss_mask, position_ids = get_ltor_masks_and_position_ids(tokens, EOD, True, True, True, True)
    assert position_ids.tolist() == [0, 1, 2, 0, 1, 2, 0]
    assert loss_mask.tolist() == [1, 1, 0, 1, 1, 0, 1] and loss_mask.dtype == np.float32
    allowed = ~attention[0]
    doc = np.array([0, 0, 0, 1, 1, 1, 2])
    expected = (doc[:, None] == doc[None, :]) & np.tri(7, dtype=bool)
    np.testing.assert_array_equal(allowed, expected)
    # Without the resets: plain causal mask, arange positions, no loss masking.
    attention, loss_mask, position_ids = get_ltor_masks_and_position_ids(tokens, EOD, False, False, False, True)
    np.testing.assert_array_equal(~attention[0], np.tri(7, dtype=bool))
    assert position_ids.tolist() == list(range(7)) and loss_mask.tolist() == [1] * 7
    attention, _, _ = get_ltor_masks_and_position_ids(tokens, EOD, True, True, True, False)
    assert attention is None


def test_getitem_dict(tmp_path):
    docs = [np.array([5, 6, EOD]), np.array([7, 8, 9, EOD]), np.array([3, EOD])]
    indexed = write_dataset(str(tmp_path / "small"), docs)
    config = GPTDatasetConfig(
        sequence_length=8,
        eod_token=EOD,
        reset_position_ids=True,
        reset_attention_mask=True,
        eod_mask_loss=True,
        create_attention_mask=True,
        path_to_cache=str(tmp_path / "cache"),
    )
    ds = GPTDataset(indexed, np.arange(3), 1, config)
    sample = ds[0]
    assert list(sample) == ["tokens", "labels", "attention_mask", "loss_mask", "position_ids"]
    text = np.concatenate([docs[d] for d in ds.document_index])[:9]
    np.testing.assert_array_equal(sample["tokens"], text[:-1])
    np.testing.assert_array_equal(sample["labels"], text[1:])
    assert sample["tokens"].dtype == np.int64 and sample["attention_mask"].shape == (1, 8, 8)
    expected_positions = []
    position = 0
    for t in text[:-1]:
        expected_positions.append(position)
        position = 0 if t == EOD else position + 1
    assert sample["position_ids"].tolist() == expected_positions
    assert sample["loss_mask"].tolist() == [0.0 if t == EOD else 1.0 for t in text[:-1]]
    plain = GPTDataset(indexed, np.arange(3), 1, GPTDatasetConfig(8, path_to_cache=str(tmp_path / "c2")))
    assert list(plain[0]) == ["tokens", "labels", "loss_mask", "position_ids"]


def test_config_and_input_errors(corpus, tmp_path):
    indexed, _ = corpus
    with pytest.raises(ValueError, match="need eod_token"):
        GPTDatasetConfig(8, eod_mask_loss=True)
    with pytest.raises(ValueError, match="sequence_length must be >= 2"):
        GPTDatasetConfig(1)
    with pytest.raises(ValueError, match="too few for a sample"):
        GPTDataset(indexed, np.array([], dtype=np.int32), 10, GPTDatasetConfig(8, path_to_cache=str(tmp_path)))
    with pytest.raises(ValueError, match=r"document ids must lie in \[0, 40\)"):
        GPTDataset(indexed, [40], 10, GPTDatasetConfig(8, path_to_cache=str(tmp_path)))


def megatron_split(split, n):
    """Megatron-core: normalise, cumulative bookends, round(bookend * n) (written independently)."""
    weights = [float(w) for w in split.split(",")]
    weights += [0.0] * (3 - len(weights))
    weights = [w / sum(weights) for w in weights]
    bounds = functools.reduce(lambda acc, w: acc + [acc[-1] + w], weights, [0.0])
    out = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        out.append(None if b <= a else (int(round(a * n)), int(round(b * n))))
    return out


@pytest.mark.parametrize("n", [1, 7, 100, 999, 1000, 12345, 1_000_003])
def test_split_969_30_1_document_ranges(n):
    got = get_split_document_ids("969,30,1", n)
    expected = megatron_split("969,30,1", n)
    for ids, bounds in zip(got, expected):
        assert ids.dtype == np.int32
        assert (int(ids[0]), int(ids[-1]) + 1) == bounds if len(ids) else bounds[0] == bounds[1]
    assert sum(len(ids) for ids in got) == n
    if n == 1000:
        assert [(int(i[0]), int(i[-1]) + 1) for i in got] == [(0, 969), (969, 999), (999, 1000)]


def test_split_zero_weights_and_separators():
    train, valid, test = get_split_document_ids("98,2,0", 100)
    assert len(train) == 98 and len(valid) == 2 and test is None
    train, valid, test = get_split_document_ids("1", 10)
    assert len(train) == 10 and valid is None and test is None
    assert [len(x) for x in get_split_document_ids("90/5/5", 20)] == [18, 1, 1]
    with pytest.raises(ValueError, match="weights sum to 0"):
        get_split_document_ids("0,0,0", 10)
    with pytest.raises(ValueError, match="1 to 3 non-negative weights"):
        get_split_document_ids("1,2,3,4", 10)


def test_every_public_name_and_config_field_has_a_docstring():
    import ast
    import dataclasses
    import inspect

    from core.data import blended_dataset, dataset_builder, gpt_dataset, indexed_dataset, tokenizers

    tree = ast.parse(inspect.getsource(GPTDatasetConfig))
    body = tree.body[0].body
    documented = {
        stmt.target.id
        for stmt, nxt in zip(body, body[1:])
        if isinstance(stmt, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
    }
    assert documented == {f.name for f in dataclasses.fields(GPTDatasetConfig)}
    for module in (indexed_dataset, gpt_dataset, blended_dataset, dataset_builder, tokenizers):
        assert module.__doc__
        for name, obj in vars(module).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isfunction(obj) or inspect.isclass(obj):
                assert obj.__doc__, f"{module.__name__}.{name}"
                for member_name, member in vars(obj).items() if inspect.isclass(obj) else []:
                    if not member_name.startswith("_") and inspect.isfunction(member):
                        assert member.__doc__, f"{module.__name__}.{name}.{member_name}"
