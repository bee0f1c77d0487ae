"""Tests of core.data.text_dataset: tokenizer, corpus loading, datasets, sampler, entropy."""

import math

import numpy as np
import pytest

from core.data import (
    ByteTokenizer,
    DataParallelSampler,
    TextDataset,
    build_train_valid_datasets,
    get_batch,
    load_corpus,
    unigram_entropy,
)


def test_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "Hello, wörld! ∑ 日本語 🚀"
    ids = tok.encode(text)
    assert ids.dtype == np.int32
    assert len(ids) == len(text.encode("utf-8"))
    assert ids.min() >= 0 and ids.max() < tok.vocab_size == 256
    assert tok.decode(ids) == text
    assert tok.decode(ids.tolist()) == text
    assert tok.decode(ids[:-1]).endswith("\ufffd")  # truncated multibyte char is replaced
    with pytest.raises(ValueError):
        tok.decode([256])


def test_default_corpus():
    text, desc = load_corpus(None)
    assert len(text.encode("utf-8")) > 100_000
    assert "pydoc_data" in desc
    assert text == load_corpus(None)[0]  # deterministic


def test_file_corpus(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes("café\n".encode() + b"\xff")
    text, desc = load_corpus(str(path))
    assert text == "café\n\ufffd"
    assert str(path) in desc


def test_directory_corpus(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "sub" / "c.md").write_text("third")
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01binary")
    text, desc = load_corpus(str(tmp_path))
    assert text == "first\n\nsecond\n\nthird"
    assert "3 text files" in desc


def test_missing_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=f"--data-path {missing}: no such file or directory"):
        load_corpus(str(missing))


def test_empty_corpus(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="empty corpus"):
        load_corpus(str(tmp_path / "empty.txt"))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.bin").write_bytes(b"\x00")
    with pytest.raises(ValueError, match="empty corpus"):
        load_corpus(str(tmp_path / "d"))


def test_dataset_windows():
    tokens = np.arange(23, dtype=np.int32)
    ds = TextDataset(tokens, seq_length=5)
    assert len(ds) == 4  # windows need 6 tokens: starts 0, 5, 10, 15 (15..20 fits in 23)
    for i in range(len(ds)):
        x, y = ds[i]
        assert x.dtype == y.dtype == np.int32
        np.testing.assert_array_equal(x, tokens[i * 5 : i * 5 + 5])
        np.testing.assert_array_equal(y, tokens[i * 5 + 1 : i * 5 + 6])
    np.testing.assert_array_equal(ds[-1][0], ds[3][0])
    with pytest.raises(IndexError):
        ds[4]
    assert len(TextDataset(np.arange(21), 5)) == 4
    assert len(TextDataset(np.arange(20), 5)) == 3


def test_get_batch():
    ds = TextDataset(np.arange(100) % 7, seq_length=4)
    batch = get_batch(ds, np.array([3, 0, 3]))
    assert batch["tokens"].shape == batch["labels"].shape == (3, 4)
    assert batch["tokens"].dtype == batch["labels"].dtype == np.int32
    for row, i in enumerate([3, 0, 3]):
        np.testing.assert_array_equal(batch["tokens"][row], ds[i][0])
        np.testing.assert_array_equal(batch["labels"][row], ds[i][1])


def test_split_sizes():
    seq = 8
    tokens = np.arange(100 * seq + 1, dtype=np.int32)
    train, valid = build_train_valid_datasets(tokens, seq, valid_fraction=0.05)
    assert (len(train), len(valid)) == (95, 5)
    # The split is a boundary in the stream: the samples are those of the whole stream.
    whole = TextDataset(tokens, seq)
    np.testing.assert_array_equal(train[94][1], whole[94][1])
    np.testing.assert_array_equal(valid[0][0], whole[95][0])
    np.testing.assert_array_equal(valid[4][1], whole[99][1])
    # At least one valid sample.
    train, valid = build_train_valid_datasets(np.arange(3 * seq + 1), seq, valid_fraction=0.01)
    assert (len(train), len(valid)) == (2, 1)
    train, valid = build_train_valid_datasets(np.arange(2 * seq + 1), seq, valid_fraction=0.9)
    assert (len(train), len(valid)) == (1, 1)


def test_split_too_small():
    with pytest.raises(ValueError, match=r"16 tokens give 1 samples of 8 \+ 1 tokens.*17 tokens"):
        build_train_valid_datasets(np.arange(16), 8)


def _sampler(rank=0, dp=4, n=48, mbs=2, seed=0, consumed=0):
    return DataParallelSampler(
        num_samples=n,
        micro_batch_size=mbs,
        data_parallel_rank=rank,
        data_parallel_size=dp,
        seed=seed,
        consumed_samples=consumed,
    )


def test_sampler_each_sample_once_per_epoch():
    n, dp, gbs = 48, 4, 16
    samplers = [_sampler(rank=r, dp=dp, n=n) for r in range(dp)]
    steps_per_epoch = n // gbs
    for epoch in range(3):
        seen = []
        for step in range(epoch * steps_per_epoch, (epoch + 1) * steps_per_epoch):
            assert samplers[0].epoch_of(step, gbs) == epoch
            locals_ = [s.local_batch_indices(step, gbs) for s in samplers]
            assert all(len(x) == gbs // dp for x in locals_)
            np.testing.assert_array_equal(np.concatenate(locals_), samplers[0].global_batch_indices(step, gbs))
            seen.extend(np.concatenate(locals_).tolist())
        assert sorted(seen) == list(range(n))
        np.testing.assert_array_equal(seen, samplers[0].epoch_permutation(epoch))


def test_sampler_batches_span_epoch_boundary():
    n, gbs = 10, 4  # batches straddle epochs
    s = _sampler(dp=2, n=n, mbs=1)
    order = np.concatenate([s.global_batch_indices(step, gbs) for step in range(5)])
    np.testing.assert_array_equal(order, np.concatenate([s.epoch_permutation(0), s.epoch_permutation(1)]))
    assert [s.epoch_of(step, gbs) for step in range(5)] == [0, 0, 0, 1, 1]


def test_sampler_shuffle_determinism():
    a, b = _sampler(seed=7), _sampler(seed=7)
    for e in range(3):
        np.testing.assert_array_equal(a.epoch_permutation(e), b.epoch_permutation(e))
        assert sorted(a.epoch_permutation(e).tolist()) == list(range(48))
    assert not np.array_equal(a.epoch_permutation(0), a.epoch_permutation(1))
    assert not np.array_equal(a.epoch_permutation(0), _sampler(seed=8).epoch_permutation(0))
    assert not np.array_equal(a.global_batch_indices(0, 16), _sampler(seed=8).global_batch_indices(0, 16))


@pytest.mark.parametrize("resume_step", [0, 2, 3, 7])
def test_sampler_resume(resume_step):
    gbs, total = 16, 10  # 48 samples: 3 steps per epoch, so the run crosses epochs
    for rank in range(4):
        full = _sampler(rank=rank, seed=3)
        uninterrupted = [full.next_local_batch(gbs) for _ in range(total)]
        for step, batch in enumerate(uninterrupted):
            np.testing.assert_array_equal(batch, full.local_batch_indices(step, gbs))

        first = _sampler(rank=rank, seed=3)
        for _ in range(resume_step):
            first.next_local_batch(gbs)
        state = first.state_dict()
        assert state == {"consumed_samples": resume_step * gbs, "seed": 3}

        resumed = _sampler(rank=rank, seed=0)
        resumed.load_state_dict(state)
        rest = [resumed.next_local_batch(gbs) for _ in range(total - resume_step)]
        for got, want in zip(rest, uninterrupted[resume_step:]):
            np.testing.assert_array_equal(got, want)
        direct = _sampler(rank=rank, seed=3, consumed=resume_step * gbs)
        np.testing.assert_array_equal(direct.next_local_batch(gbs), uninterrupted[resume_step])


def test_sampler_indivisible_global_batch():
    s = _sampler(dp=4, mbs=1)
    with pytest.raises(ValueError, match="global_batch_size 6"):
        s.local_batch_indices(0, 6)
    with pytest.raises(ValueError):
        _sampler(dp=4, mbs=2).global_batch_indices(0, 12)
    with pytest.raises(ValueError):
        _sampler(rank=4, dp=4)


def test_unigram_entropy():
    rng = np.random.default_rng(0)
    uniform = np.tile(np.arange(256), 100)
    assert unigram_entropy(uniform, 256) == pytest.approx(math.log(256))
    random = rng.integers(0, 256, size=200_000)
    assert unigram_entropy(random, 256) == pytest.approx(math.log(256), abs=2e-3)
    assert unigram_entropy(np.full(1000, 65), 256) == 0.0
    assert unigram_entropy(np.array([0, 1] * 50), 256) == pytest.approx(math.log(2))
    text, _ = load_corpus(None)
    h = unigram_entropy(ByteTokenizer().encode(text), 256)
    assert 2.0 < h < math.log(256)
