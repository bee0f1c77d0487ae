"""Megatron's blending (core.data.blended_dataset, core.data.dataset_builder): the greedy blending
index against a literal port of helpers.cpp, ratios, the 0.5% margin, ``--data-path`` parsing and
an end-to-end blend of two indexed datasets. numpy only."""

import math

import numpy as np
import pytest

from core.data.blended_dataset import (
    BlendedDataset,
    build_blending_indices,
    get_size_per_split_per_dataset,
    parse_data_path,
)
from core.data.dataset_builder import build_gpt_datasets
from core.data.gpt_dataset import GPTDataset, GPTDatasetConfig
from core.data.indexed_dataset import IndexedDatasetBuilder


def helpers_cpp_build_blending_indices(weights, size):
    """Line-by-line port of Megatron's helpers.cpp build_blending_indices."""
    dataset_index = np.zeros(size, dtype=np.int16)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    current = [0] * len(weights)
    for sample_idx in range(size):
        sample_idx_double = max(float(sample_idx), 1.0)
        max_error_index = 0
        max_error = weights[0] * sample_idx_double - float(current[0])
        for dataset_idx in range(1, len(weights)):
            error = weights[dataset_idx] * sample_idx_double - float(current[dataset_idx])
            if error > max_error:
                max_error = error
                max_error_index = dataset_idx
        dataset_index[sample_idx] = max_error_index
        dataset_sample_index[sample_idx] = current[max_error_index]
        current[max_error_index] += 1
    return dataset_index, dataset_sample_index


@pytest.mark.parametrize("weights", [[0.3, 0.7], [0.5, 0.25, 0.25], [0.01, 0.09, 0.9], [1.0]])
def test_blending_indices_match_helpers_cpp_and_ratios(weights):
    size = 10_000
    dataset_index, sample_index = build_blending_indices(weights, size)
    expected_d, expected_s = helpers_cpp_build_blending_indices(weights, size)
    np.testing.assert_array_equal(dataset_index, expected_d)
    np.testing.assert_array_equal(sample_index, expected_s)
    assert dataset_index.dtype == np.int16 and sample_index.dtype == np.int64
    counts = np.bincount(dataset_index, minlength=len(weights))
    for k, w in enumerate(weights):
        assert abs(counts[k] / size - w) <= 0.01 * w
        # each dataset's samples are taken in order 0, 1, 2, ...
        np.testing.assert_array_equal(sample_index[dataset_index == k], np.arange(counts[k]))
    # Every prefix of the blend follows the weights within two samples (helpers.cpp's max(i, 1) shifts one).
    running = np.cumsum(np.eye(len(weights), dtype=np.int64)[dataset_index], axis=0)
    targets = np.arange(1, size + 1)[:, None] * np.asarray(weights)[None, :]
    assert np.abs(running - targets).max() <= 2.0


def test_sizes_with_megatrons_margin():
    weights = [0.3, 0.7]
    sizes = get_size_per_split_per_dataset(weights, [1000, 100, None])
    assert sizes == [[int(math.ceil(1000 * 0.3 * 1.005)), int(math.ceil(100 * 0.3 * 1.005)), None], [704, 71, None]]
    assert sizes[0][:2] == [302, 31]
    with pytest.raises(ValueError, match="normalised"):
        get_size_per_split_per_dataset([0.3, 0.3], [10])


def test_parse_data_path():
    assert parse_data_path(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])
    prefixes, weights = parse_data_path("30 /data/a_text_document 10 /data/b_text_document")
    assert prefixes == ["/data/a_text_document", "/data/b_text_document"] and weights == [0.75, 0.25]
    assert parse_data_path(["only"]) == (["only"], [1.0])
    assert parse_data_path("1e-1 x 3e-1 y")[1] == pytest.approx([0.25, 0.75])


@pytest.mark.parametrize(
    "bad, message",
    [
        (["a", "b", "c"], "has 3 entries"),
        (["0.3", "a", "0.7"], "has 3 entries"),
        (["x", "a", "0.7", "b"], "weight 'x' (before 'a') is not a number"),
        (["a", "0.5", "b", "0.5"], "weight 'a' (before '0.5') is not a number"),
        (["0", "a", "1", "b"], "must be a positive number"),
        (["-1", "a", "1", "b"], "must be a positive number"),
        (["nan", "a", "1", "b"], "must be a positive number"),
        ([], "empty"),
    ],
)
def test_parse_data_path_errors(bad, message):
    with pytest.raises(ValueError) as excinfo:
        parse_data_path(bad)
    assert message in str(excinfo.value) and "\n" not in str(excinfo.value)


class Numbers:
    def __init__(self, tag, n):
        self.tag, self.n = tag, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        return {"value": (self.tag, i)}


def test_blended_dataset_items_and_short_dataset_error():
    a, b = Numbers("a", 400), Numbers("b", 800)
    blend = BlendedDataset([a, b], [1, 2], 1000)
    assert len(blend) == 1000 and blend.weights == pytest.approx([1 / 3, 2 / 3])
    items = [blend[i] for i in range(len(blend))]
    assert all(item["value"][0] == "ab"[item["dataset_id"]] for item in items)
    for tag in "ab":
        taken = [item["value"][1] for item in items if item["value"][0] == tag]
        assert taken == list(range(len(taken)))
    with pytest.raises(IndexError):
        blend[1000]
    with pytest.raises(ValueError, match="dataset 0 of the blend has 300 samples but the blend of 1000"):
        BlendedDataset([Numbers("a", 300), b], [1, 2], 1000)
    assert BlendedDataset([[7, 8]], [1.0], 2)[1] == {"dataset_id": 0, "sample": 8}


def write_corpus(prefix, num_docs, base, seed):
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for d in range(num_docs):
        builder.add_item(base + 100 * d + np.arange(int(rng.integers(1, 40))))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def test_build_gpt_datasets_blend_end_to_end(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_corpus(a, 1000, 1_000_000, 0)
    write_corpus(b, 1500, 2_000_000, 1)
    config = GPTDatasetConfig(sequence_length=16, random_seed=3, path_to_cache=str(tmp_path / "cache"))
    train, valid, test = build_gpt_datasets(["0.3", a, "0.7", b], "969,30,1", [2000, 50, 10], config)
    assert isinstance(train, BlendedDataset) and (len(train), len(valid), len(test)) == (2000, 50, 10)
    ids = np.array([train[i]["dataset_id"] for i in range(len(train))])
    assert abs((ids == 0).mean() - 0.3) < 0.01
    for i in range(0, 2000, 97):
        item = train[i]
        first = int(item["tokens"][0])
        assert first // 1_000_000 == item["dataset_id"] + 1 and item["tokens"].shape == (16,)
    # Each prefix's GPTDataset covers its share plus the margin; valid documents are valid-split ones.
    assert len(train.datasets[0]) >= math.ceil(2000 * 0.3 * 1.005)
    assert valid.datasets[1].document_ids.tolist() == list(range(round(0.969 * 1500), round(0.999 * 1500)))
    # One prefix: plain GPTDatasets.
    train1, valid1, test1 = build_gpt_datasets(a, "969,30,1", [100, None, 5], config)
    assert isinstance(train1, GPTDataset) and train1.document_ids.tolist() == list(range(969))
    assert valid1.num_samples is None and len(valid1) > 0
    with pytest.raises(ValueError, match="needs a sample count for valid"):
        build_gpt_datasets(["1", a, "1", b], "969,30,1", [100, None, 5], config)
    assert build_gpt_datasets(["1", a, "1", b], "99,1,0", [100, 5, None], config)[2] is None
