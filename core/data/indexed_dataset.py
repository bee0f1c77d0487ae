"""Megatron-LM's memory-mapped indexed dataset: the ``.bin``/``.idx`` pair, byte-compatible.

A dataset ``prefix`` is two files. ``prefix.bin`` holds the tokens of every sequence, back to
back, in one numpy dtype. ``prefix.idx`` (all integers little-endian) is::

    b"MMIDIDX\\x00\\x00"              9 bytes, magic
    <Q version = 1                    8 bytes
    <B dtype code                     1 byte  (DType: 1 uint8, 2 int8, 3 int16, 4 int32,
                                               5 int64, 6 float64, 7 float32, 8 uint16)
    <Q sequence_count                 8 bytes
    <Q document_count                 8 bytes
    int32[sequence_count]             tokens per sequence
    int64[sequence_count]             byte offset of each sequence in the .bin
    int64[document_count]             document boundaries as sequence indices: 0, ..., sequence_count

``document_count`` counts the boundaries (one more than the number of documents). Megatron's
multimodal variant appends one int8 mode per sequence; the reader accepts and ignores it.
Without ``--split-sentences`` every document is one sequence, so GPT datasets index sequences.

:class:`IndexedDatasetBuilder` writes the pair (Megatron's builder, same calls, same bytes),
:class:`IndexedDataset` reads it through ``numpy.memmap`` (no copy, nothing loaded up front).
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import shutil
import struct
from itertools import accumulate
from typing import Any

import numpy as np

from core.atomic_files import remove_quietly, replace_together, temporary_path, write_atomically

_INDEX_HEADER = b"MMIDIDX\x00\x00"
_INDEX_VERSION = 1
# magic (9) + version (8) + dtype code (1) + sequence count (8) + document count (8)
_INDEX_PREAMBLE_BYTES = 34


class DType(enum.Enum):
    """Megatron's numeric codes of the token dtypes stored in an ``.idx`` header."""

    uint8 = 1
    int8 = 2
    int16 = 3
    int32 = 4
    int64 = 5
    float64 = 6
    float32 = 7
    uint16 = 8

    @classmethod
    def code_from_dtype(cls, dtype: Any) -> int:
        """The header code of a numpy dtype (``ValueError`` for a dtype Megatron cannot store)."""
        name = np.dtype(dtype).name
        if name not in cls.__members__:
            raise ValueError(f"dtype {name} cannot be stored in a Megatron index; use one of {list(cls.__members__)}")
        return cls[name].value

    @classmethod
    def dtype_from_code(cls, code: int) -> type[np.number]:
        """The numpy dtype of a header code."""
        return getattr(np, cls(code).name)

    @staticmethod
    def size(dtype: Any) -> int:
        """Bytes per element of ``dtype``."""
        return np.dtype(dtype).itemsize

    @staticmethod
    def optimal_dtype(cardinality: int | None) -> type[np.number]:
        """Megatron's token dtype for a vocabulary of ``cardinality`` ids: uint16 below 65500, else int32."""
        if cardinality is not None and cardinality < 65500:
            return np.uint16
        return np.int32


def get_idx_path(path_prefix: str) -> str:
    """The index file of a dataset prefix: ``prefix + ".idx"``."""
    return path_prefix + ".idx"


def get_bin_path(path_prefix: str) -> str:
    """The data file of a dataset prefix: ``prefix + ".bin"``."""
    return path_prefix + ".bin"


def _write_index(idx_path: str, dtype: Any, sequence_lengths: Any, document_indices: Any) -> None:
    """Write an ``.idx`` file (Megatron's ``_IndexWriter``): preamble, lengths, pointers, documents."""
    lengths = np.asarray(sequence_lengths, dtype=np.int32).reshape(-1)
    itemsize = DType.size(dtype)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * itemsize, out=pointers[1:])
    documents = np.asarray(document_indices, dtype=np.int64).reshape(-1)
    with open(idx_path, "wb") as stream:
        stream.write(_INDEX_HEADER)
        stream.write(struct.pack("<Q", _INDEX_VERSION))
        stream.write(struct.pack("<B", DType.code_from_dtype(dtype)))
        stream.write(struct.pack("<Q", len(lengths)))
        stream.write(struct.pack("<Q", len(documents)))
        stream.write(lengths.astype("<i4").tobytes(order="C"))
        stream.write(pointers.astype("<i8").tobytes(order="C"))
        stream.write(documents.astype("<i8").tobytes(order="C"))


class IndexedDatasetBuilder:
    """Writer of a Megatron ``.bin``/``.idx`` pair (Megatron's ``IndexedDatasetBuilder``).

    Tokens go to ``bin_path`` as they are added; :meth:`finalize` closes it and writes the index.
    Call :meth:`end_document` after the sequences of each document added with :meth:`add_item`,
    or add a whole document with :meth:`add_document`.
    """

    def __init__(self, bin_path: str, dtype: Any = np.int32) -> None:
        """Start writing tokens of ``dtype`` (Megatron's default: int32) for ``bin_path``: into a
        temporary file next to it, which :meth:`finalize` renames into place (an existing
        dataset at that path stays untouched until then, and after :meth:`abort`)."""
        DType.code_from_dtype(dtype)
        self.dtype = np.dtype(dtype).type
        """Token dtype of the ``.bin``."""
        self.bin_path = bin_path
        """The ``.bin`` being written (its final name)."""
        self.sequence_lengths: list[int] = []
        """Tokens per sequence added so far."""
        self.document_indices: list[int] = [0]
        """Document boundaries (sequence indices) so far; starts with 0."""
        self._tmp_bin_path = temporary_path(bin_path)
        self._data_file = open(self._tmp_bin_path, "wb")  # noqa: SIM115 (closed by finalize or abort)

    def _as_tokens(self, tokens: Any) -> np.ndarray:
        """``tokens`` as a flat array of the builder's dtype; ``ValueError`` if a value does not fit."""
        values = np.asarray(tokens)
        if values.dtype == object:
            raise ValueError(f"tokens must be numbers, got {values.dtype}")
        values = values.reshape(-1)
        if np.issubdtype(self.dtype, np.integer) and values.size:
            if not (np.issubdtype(values.dtype, np.integer) or np.issubdtype(values.dtype, np.bool_)):
                raise ValueError(f"tokens of dtype {values.dtype} cannot be stored as {np.dtype(self.dtype).name}")
            info = np.iinfo(self.dtype)
            low, high = int(values.min()), int(values.max())
            if low < info.min or high > info.max:
                raise ValueError(
                    f"token ids [{low}, {high}] do not fit the dataset dtype {np.dtype(self.dtype).name} "
                    f"[{info.min}, {info.max}]; use a wider dtype (DType.optimal_dtype(vocab_size))"
                )
        return values.astype(self.dtype)

    def add_item(self, tokens: Any) -> None:
        """Append one sequence (not yet closing its document)."""
        array = self._as_tokens(tokens)
        self._data_file.write(array.tobytes(order="C"))
        self.sequence_lengths.append(int(array.size))

    def end_document(self) -> None:
        """Close the current document: its sequences are those added since the last boundary."""
        self.document_indices.append(len(self.sequence_lengths))

    def add_document(self, tokens: Any, lengths: Any) -> None:
        """Append a whole document: ``tokens`` holds its sequences back to back, ``lengths`` their sizes."""
        array = self._as_tokens(tokens)
        lengths = [int(n) for n in np.asarray(lengths, dtype=np.int64).reshape(-1)]
        if sum(lengths) != array.size or any(n < 0 for n in lengths):
            raise ValueError(f"document lengths {lengths} do not partition its {array.size} tokens")
        self._data_file.write(array.tobytes(order="C"))
        self.sequence_lengths.extend(lengths)
        self.document_indices.append(len(self.sequence_lengths))

    def add_index(self, path_prefix: str) -> None:
        """Append every sequence and document of the dataset ``path_prefix`` (same dtype required)."""
        other = IndexedDataset(path_prefix)
        if other.dtype != self.dtype:
            raise ValueError(
                f"cannot merge {path_prefix}: its dtype {np.dtype(other.dtype).name} differs from "
                f"this builder's {np.dtype(self.dtype).name}"
            )
        offset = len(self.sequence_lengths)
        self.sequence_lengths.extend(int(n) for n in other.sequence_lengths)
        self.document_indices.extend(int(d) for d in (offset + other.document_indices)[1:])
        del other
        with open(get_bin_path(path_prefix), "rb") as stream:
            shutil.copyfileobj(stream, self._data_file)

    def abort(self) -> None:
        """Close and delete the partly written temporary ``.bin``; a dataset already at
        :attr:`bin_path` (and its ``.idx``) stays as it was."""
        self._data_file.close()
        remove_quietly(self._tmp_bin_path)

    def finalize(self, idx_path: str) -> None:
        """Close the ``.bin``, write the index, and rename both into place (``.bin`` first, with
        SIGINT/SIGTERM held back between the renames); on a failure neither replaces the old pair."""
        self._data_file.close()
        tmp_idx = temporary_path(idx_path)
        try:
            _write_index(tmp_idx, self.dtype, self.sequence_lengths, self.document_indices)
            replace_together([(self._tmp_bin_path, self.bin_path), (tmp_idx, idx_path)])
        except BaseException:
            remove_quietly(tmp_idx)
            remove_quietly(self._tmp_bin_path)
            raise


class IndexedDataset:
    """Reader of a Megatron ``.bin``/``.idx`` pair through ``numpy.memmap``.

    ``dataset[i]`` is sequence ``i`` (a read-only view of the ``.bin``), ``dataset[a:b]`` a list
    of them, :meth:`get` a part of one. Opening checks the header and that the ``.bin`` has
    exactly the bytes the index describes; each problem is one ``FileNotFoundError`` or
    ``ValueError`` naming the file.
    """

    def __init__(self, path_prefix: str) -> None:
        """Open the dataset ``path_prefix`` (``path_prefix.idx`` and ``path_prefix.bin``)."""
        self.path_prefix = path_prefix
        """The dataset prefix."""
        idx_path, bin_path = get_idx_path(path_prefix), get_bin_path(path_prefix)
        for path, what in ((idx_path, "index"), (bin_path, "data")):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path}: no such file (the {what} file of the Megatron dataset {path_prefix})")
        idx_size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as stream:
            preamble = stream.read(_INDEX_PREAMBLE_BYTES)
        if preamble[:9] != _INDEX_HEADER:
            raise ValueError(f"{idx_path}: not a Megatron MMIDIDX index (starts with {preamble[:9]!r})")
        if len(preamble) < _INDEX_PREAMBLE_BYTES:
            raise ValueError(f"{idx_path}: truncated index ({idx_size} bytes, the header alone has 34)")
        (version,) = struct.unpack("<Q", preamble[9:17])
        if version != _INDEX_VERSION:
            raise ValueError(f"{idx_path}: unsupported MMIDIDX version {version} (only version 1 is known)")
        (code,) = struct.unpack("<B", preamble[17:18])
        try:
            self.dtype: type[np.number] = DType.dtype_from_code(code)
            """Token dtype of the ``.bin``."""
        except ValueError:
            raise ValueError(f"{idx_path}: unknown dtype code {code} (Megatron's codes are 1..8)") from None
        count, documents = struct.unpack("<QQ", preamble[18:34])
        expected = _INDEX_PREAMBLE_BYTES + 12 * count + 8 * documents
        if idx_size not in (expected, expected + count):  # + count: the multimodal variant's int8 modes
            raise ValueError(
                f"{idx_path}: {idx_size} bytes, but its header announces {count} sequences and "
                f"{documents} document boundaries ({expected} bytes); the index is truncated or corrupt"
            )
        self._idx_mmap = np.memmap(idx_path, mode="r", order="C")
        lengths_at = _INDEX_PREAMBLE_BYTES
        pointers_at = lengths_at + 4 * count
        documents_at = pointers_at + 8 * count
        self.sequence_lengths: np.ndarray = np.frombuffer(self._idx_mmap, dtype="<i4", count=count, offset=lengths_at)
        """int32 tokens per sequence."""
        self.sequence_pointers: np.ndarray = np.frombuffer(self._idx_mmap, dtype="<i8", count=count, offset=pointers_at)
        """int64 byte offset of each sequence in the ``.bin``."""
        self.document_indices: np.ndarray = np.frombuffer(
            self._idx_mmap, dtype="<i8", count=documents, offset=documents_at
        )
        """int64 document boundaries as sequence indices (``0, ..., len(self)``)."""
        itemsize = DType.size(self.dtype)
        described = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * itemsize if count else 0
        bin_size = os.path.getsize(bin_path)
        if bin_size != described:
            raise ValueError(
                f"{bin_path}: {bin_size} bytes, but its index {idx_path} describes {described} bytes "
                f"({count} sequences of {np.dtype(self.dtype).name}); the .bin is truncated or from another dataset"
            )
        self._bin_mmap = np.memmap(bin_path, mode="r", order="C") if bin_size else np.zeros(0, dtype=np.uint8)

    @staticmethod
    def exists(path_prefix: str) -> bool:
        """Whether both ``path_prefix.idx`` and ``path_prefix.bin`` exist."""
        return os.path.isfile(get_idx_path(path_prefix)) and os.path.isfile(get_bin_path(path_prefix))

    def __len__(self) -> int:
        """Number of sequences."""
        return len(self.sequence_lengths)

    def _read(self, count: int, byte_offset: int) -> np.ndarray:
        """``count`` tokens starting at ``byte_offset`` of the ``.bin`` (a read-only view)."""
        return np.frombuffer(self._bin_mmap, dtype=self.dtype, count=count, offset=byte_offset)

    def _check_index(self, idx: int) -> int:
        """``idx`` as a non-negative sequence index, or ``IndexError``."""
        n = len(self)
        i = int(idx)
        if not -n <= i < n:
            raise IndexError(f"sequence index {idx} out of range for {n} sequences of {self.path_prefix}")
        return i + n if i < 0 else i

    def __getitem__(self, idx: int | np.integer | slice) -> np.ndarray | list[np.ndarray]:
        """Sequence ``idx``, or the list of sequences of a contiguous slice."""
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError("slices of an IndexedDataset must be contiguous (step 1)")
            if stop <= start:
                return []
            lengths = self.sequence_lengths[start:stop]
            flat = self._read(int(lengths.sum()), int(self.sequence_pointers[start]))
            return np.split(flat, list(accumulate(int(n) for n in lengths[:-1])))
        i = self._check_index(idx)
        return self._read(int(self.sequence_lengths[i]), int(self.sequence_pointers[i]))

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (to its end when ``length`` is None)."""
        i = self._check_index(idx)
        size = int(self.sequence_lengths[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for sequence {i} of {size} tokens")
        return self._read(length, int(self.sequence_pointers[i]) + offset * DType.size(self.dtype))

    def sample_tokens(self, max_tokens: int, runs: int = 16) -> np.ndarray:
        """Up to ``max_tokens`` tokens of the ``.bin``: all of them, or ``runs`` evenly spaced contiguous
        runs (a cheap, deterministic sample of a large dataset, e.g. for token statistics)."""
        total = int(self.sequence_lengths.sum(dtype=np.int64))
        if total <= max_tokens:
            return self._read(total, 0)
        run = max(1, max_tokens // runs)
        starts = np.linspace(0, total - run, runs, dtype=np.int64)
        return np.concatenate([self._read(run, int(start) * DType.size(self.dtype)) for start in starts])

    @property
    def num_documents(self) -> int:
        """Number of documents (boundaries minus one)."""
        return max(0, len(self.document_indices) - 1)


_MAX_TOKEN_ID_CACHE: dict[tuple[str, int, int], int] = {}
"""In-process memo of :func:`max_token_id`, keyed by the ``.bin``'s path, size and mtime."""


def max_token_id(path_prefix: str, cache_dir: str | None = None) -> int:
    """The largest token id in ``path_prefix.bin`` (-1 for an empty dataset), read once and cached.

    Training checks it against the tokenizer's vocabulary before the first step. One pass of
    ``numpy.max`` over the memory-mapped tokens costs a read of the whole ``.bin``, so the result
    is kept in this process and in ``cache_dir`` (default ``{path_prefix}/cache``, next to the
    dataset's index caches) as ``max_token_id-{md5 of the .bin's path}.json``, valid while the
    ``.bin``'s size and modification time are unchanged. An unwritable cache directory only
    loses the file cache. ``ValueError`` for a dataset whose tokens are not integers.
    """
    dataset = IndexedDataset(path_prefix)
    if not np.issubdtype(dataset.dtype, np.integer):
        raise ValueError(f"{get_bin_path(path_prefix)}: tokens of dtype {np.dtype(dataset.dtype).name} are not ids")
    bin_path = os.path.abspath(get_bin_path(path_prefix))
    stat = os.stat(bin_path)
    key = (bin_path, stat.st_size, stat.st_mtime_ns)
    if key in _MAX_TOKEN_ID_CACHE:
        return _MAX_TOKEN_ID_CACHE[key]
    directory = cache_dir if cache_dir is not None else os.path.join(path_prefix, "cache")
    name = hashlib.md5(bin_path.encode("utf-8"), usedforsecurity=False).hexdigest()
    cache_file = os.path.join(directory, f"max_token_id-{name}.json")
    record = {"bin_path": bin_path, "bin_size": stat.st_size, "bin_mtime_ns": stat.st_mtime_ns}
    try:
        with open(cache_file, encoding="utf-8") as stream:
            cached = json.load(stream)
        if all(cached.get(k) == v for k, v in record.items()) and isinstance(cached.get("max_token_id"), int):
            _MAX_TOKEN_ID_CACHE[key] = cached["max_token_id"]
            return cached["max_token_id"]
    except (OSError, ValueError):
        pass  # no cache yet, or an unreadable one: compute
    tokens = dataset._read(stat.st_size // DType.size(dataset.dtype), 0)
    result = int(tokens.max()) if tokens.size else -1
    _MAX_TOKEN_ID_CACHE[key] = result
    try:  # atomically: ranks of one job may compute and write it at the same time
        os.makedirs(directory, exist_ok=True)
        write_atomically(cache_file, lambda stream: json.dump({**record, "max_token_id": result}, stream), mode="w")
    except OSError:
        pass  # a read-only dataset directory: the next run computes it again
    return result
