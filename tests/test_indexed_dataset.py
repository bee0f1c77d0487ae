"""Megatron's mmap indexed dataset (core.data.indexed_dataset): round trips, byte compatibility with
an independent writer of the format, merging, and one clear error per bad input. numpy only."""

import struct

import numpy as np
import pytest

from core.data.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder, get_bin_path, get_idx_path

# Megatron's DType codes and the struct format of each dtype, written out independently of the package.
FORMATS = {
    "uint8": (1, "B"),
    "int8": (2, "b"),
    "int16": (3, "h"),
    "int32": (4, "i"),
    "int64": (5, "q"),
    "float64": (6, "d"),
    "float32": (7, "f"),
    "uint16": (8, "H"),
}


def write_by_hand(prefix, dtype_name, documents):
    """The .bin/.idx of ``documents`` (each a list of sequences) with struct.pack, following the spec."""
    code, fmt = FORMATS[dtype_name]
    itemsize = struct.calcsize("<" + fmt)
    sequences = [s for doc in documents for s in doc]
    with open(prefix + ".bin", "wb") as f:
        for s in sequences:
            f.write(struct.pack(f"<{len(s)}{fmt}", *s))
    lengths = [len(s) for s in sequences]
    pointers, at = [], 0
    for n in lengths:
        pointers.append(at)
        at += n * itemsize
    doc_idx = [0]
    for doc in documents:
        doc_idx.append(doc_idx[-1] + len(doc))
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(sequences)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(struct.pack(f"<{len(lengths)}i", *lengths))
        f.write(struct.pack(f"<{len(pointers)}q", *pointers))
        f.write(struct.pack(f"<{len(doc_idx)}q", *doc_idx))


def random_documents(rng, num_docs=12, max_sentences=3, high=200):
    return [
        [rng.integers(0, high, size=rng.integers(0, 9)).tolist() for _ in range(rng.integers(1, max_sentences + 1))]
        for _ in range(num_docs)
    ]


def write_with_package(prefix, dtype, documents, use_add_item):
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in documents:
        if use_add_item:
            for s in doc:
                builder.add_item(np.array(s))
            builder.end_document()
        else:
            builder.add_document([t for s in doc for t in s], [len(s) for s in doc])
    builder.finalize(prefix + ".idx")


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_package_round_trip_is_exact(tmp_path, dtype):
    rng = np.random.default_rng(0)
    documents = random_documents(rng)
    prefix = str(tmp_path / "ds")
    write_with_package(prefix, dtype, documents, use_add_item=True)
    ds = IndexedDataset(prefix)
    sequences = [s for doc in documents for s in doc]
    assert len(ds) == len(sequences) and ds.dtype == dtype
    for i, s in enumerate(sequences):
        np.testing.assert_array_equal(ds[i], s)
        assert ds[i].dtype == dtype
    assert ds.sequence_lengths.tolist() == [len(s) for s in sequences]
    assert ds.document_indices[0] == 0 and ds.document_indices[-1] == len(sequences)
    assert ds.num_documents == len(documents)
    np.testing.assert_array_equal(ds[-1], sequences[-1])
    assert [a.tolist() for a in ds[2:7]] == sequences[2:7]


@pytest.mark.parametrize("dtype_name", list(FORMATS))
def test_hand_written_index_reads_and_package_writes_identical_bytes(tmp_path, dtype_name):
    rng = np.random.default_rng(1)
    high = 100 if dtype_name == "int8" else 200
    documents = random_documents(rng, high=high)
    hand, pkg, pkg2 = str(tmp_path / "hand"), str(tmp_path / "pkg"), str(tmp_path / "pkg2")
    write_by_hand(hand, dtype_name, documents)
    ds = IndexedDataset(hand)
    assert ds.dtype == getattr(np, dtype_name)
    sequences = [s for doc in documents for s in doc]
    assert [ds[i].tolist() for i in range(len(ds))] == sequences
    doc_idx = np.cumsum([0] + [len(d) for d in documents])
    np.testing.assert_array_equal(ds.document_indices, doc_idx)
    write_with_package(pkg, getattr(np, dtype_name), documents, use_add_item=True)
    write_with_package(pkg2, getattr(np, dtype_name), documents, use_add_item=False)
    for other in (pkg, pkg2):
        for path in (get_idx_path, get_bin_path):
            assert open(path(other), "rb").read() == open(path(hand), "rb").read()


def test_dtype_codes_and_optimal_dtype():
    assert {d.name: d.value for d in DType} == {name: code for name, (code, _) in FORMATS.items()}
    assert DType.optimal_dtype(257) is np.uint16
    assert DType.optimal_dtype(65499) is np.uint16
    assert DType.optimal_dtype(65500) is np.int32
    assert DType.optimal_dtype(None) is np.int32
    assert DType.dtype_from_code(8) is np.uint16 and DType.code_from_dtype(np.int32) == 4


def test_get_offsets_and_exists(tmp_path):
    prefix = str(tmp_path / "ds")
    assert not IndexedDataset.exists(prefix)
    write_with_package(prefix, np.int32, [[[10, 11, 12, 13, 14]], [[20, 21]]], use_add_item=False)
    assert IndexedDataset.exists(prefix)
    ds = IndexedDataset(prefix)
    assert ds.get(0).tolist() == [10, 11, 12, 13, 14]
    assert ds.get(0, offset=2).tolist() == [12, 13, 14]
    assert ds.get(0, offset=1, length=3).tolist() == [11, 12, 13]
    assert ds.get(1, offset=2).tolist() == []
    with pytest.raises(IndexError, match="out of range"):
        ds.get(0, offset=3, length=3)
    with pytest.raises(IndexError, match="out of range"):
        ds[2]


def test_add_index_merges_datasets(tmp_path):
    a, b, merged = str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "m")
    docs_a = [[[1, 2], [3]], [[4]]]
    docs_b = [[[5, 6, 7]], [[8], [9, 10]], [[11]]]
    write_with_package(a, np.uint16, docs_a, use_add_item=False)
    write_with_package(b, np.uint16, docs_b, use_add_item=False)
    builder = IndexedDatasetBuilder(merged + ".bin", dtype=np.uint16)
    builder.add_index(a)
    builder.add_index(b)
    builder.finalize(merged + ".idx")
    write_by_hand(str(tmp_path / "expected"), "uint16", docs_a + docs_b)
    for path in (get_idx_path, get_bin_path):
        assert open(path(merged), "rb").read() == open(path(str(tmp_path / "expected")), "rb").read()
    builder = IndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=np.int32)
    with pytest.raises(ValueError, match="dtype uint16 differs"):
        builder.add_index(a)


def test_empty_dataset(tmp_path):
    prefix = str(tmp_path / "empty")
    IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16).finalize(prefix + ".idx")
    ds = IndexedDataset(prefix)
    assert len(ds) == 0 and ds.document_indices.tolist() == [0] and ds[0:0] == []


def test_builder_rejects_tokens_that_do_not_fit(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=np.uint16)
    with pytest.raises(ValueError, match="do not fit the dataset dtype uint16"):
        builder.add_item([1, 70000])
    with pytest.raises(ValueError, match="do not partition"):
        builder.add_document([1, 2, 3], [1, 1])
    with pytest.raises(ValueError, match="cannot be stored"):
        IndexedDatasetBuilder(str(tmp_path / "y.bin"), dtype=np.uint32)


@pytest.fixture
def good(tmp_path):
    prefix = str(tmp_path / "good")
    write_with_package(prefix, np.uint16, [[[1, 2, 3]], [[4, 5]]], use_add_item=False)
    return prefix


def one_line_error(excinfo, *needles):
    message = str(excinfo.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message


def test_missing_idx_names_the_file(good):
    import os

    os.remove(good + ".idx")
    with pytest.raises(FileNotFoundError) as excinfo:
        IndexedDataset(good)
    one_line_error(excinfo, good + ".idx", "no such file")


def test_missing_bin_names_the_file(good):
    import os

    os.remove(good + ".bin")
    with pytest.raises(FileNotFoundError) as excinfo:
        IndexedDataset(good)
    one_line_error(excinfo, good + ".bin", "no such file")


def test_wrong_magic(good):
    data = bytearray(open(good + ".idx", "rb").read())
    data[:9] = b"TNTIDX\x00\x00\x00"  # Megatron's old (non-mmap) indexed format
    open(good + ".idx", "wb").write(bytes(data))
    with pytest.raises(ValueError) as excinfo:
        IndexedDataset(good)
    one_line_error(excinfo, good + ".idx", "not a Megatron MMIDIDX index")


def test_unsupported_version(good):
    data = bytearray(open(good + ".idx", "rb").read())
    data[9:17] = struct.pack("<Q", 2)
    open(good + ".idx", "wb").write(bytes(data))
    with pytest.raises(ValueError) as excinfo:
        IndexedDataset(good)
    one_line_error(excinfo, good + ".idx", "unsupported MMIDIDX version 2")


def test_unknown_dtype_code(good):
    data = bytearray(open(good + ".idx", "rb").read())
    data[17] = 9
    open(good + ".idx", "wb").write(bytes(data))
    with pytest.raises(ValueError) as excinfo:
        IndexedDataset(good)
    one_line_error(excinfo, good + ".idx", "unknown dtype code 9")


def test_truncated_bin(good):
    data = open(good + ".bin", "rb").read()
    open(good + ".bin", "wb").write(data[:-2])
    with pytest.raises(ValueError) as excinfo:
        IndexedDataset(good)
    one_line_error(excinfo, good + ".bin", "8 bytes", "describes 10 bytes", "truncated")


def test_truncated_idx(good):
    data = open(good + ".idx", "rb").read()
    open(good + ".idx", "wb").write(data[:-8])
    with pytest.raises(ValueError) as excinfo:
        IndexedDataset(good)
    one_line_error(excinfo, good + ".idx", "truncated")
