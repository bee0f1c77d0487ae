"""Text pretraining data: tokenizer, corpus loading, datasets, sampler and a unigram baseline.

* :class:`ByteTokenizer` maps text to UTF-8 bytes (vocabulary of 256).
* :func:`load_corpus` reads a file or directory, or by default the Python language reference
  shipped with CPython (``pydoc_data.topics``, PSF licence), so training works offline.
* :class:`TextDataset` cuts a token stream into non-overlapping windows of ``seq_length + 1``
  tokens (inputs and next-token labels); :func:`build_train_valid_datasets` splits the stream.
* :class:`DataParallelSampler` is the analogue of Megatron's ``MegatronPretrainingSampler``
  with per-epoch shuffling: the global sample order is the chain of per-epoch permutations,
  global batches are contiguous slices of it and each data-parallel rank takes a contiguous
  share, so every sample is seen exactly once per epoch across ranks, and resuming from
  ``consumed_samples`` reproduces an uninterrupted run.
* :func:`unigram_entropy` is the loss (in nats) of the best context-free predictor, a baseline
  the model must beat.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np


class ByteTokenizer:
    """Byte-level tokenizer: token ids are the bytes of the UTF-8 encoding."""

    vocab_size: int = 256
    """Number of distinct token ids (one per byte value)."""

    def encode(self, text: str) -> np.ndarray:
        """The UTF-8 bytes of ``text`` as an int32 array."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids: Any) -> str:
        """The text whose UTF-8 bytes are ``ids``; invalid sequences become U+FFFD."""
        arr = np.asarray(ids).reshape(-1)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}), got [{arr.min()}, {arr.max()}]")
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def _default_corpus() -> tuple[str, str]:
    """The Python language reference text shipped with CPython's stdlib."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))
    return text, f"pydoc_data.topics (Python language reference, PSF licence, {len(topics)} topics)"


def _read_text_file(path: Path) -> str | None:
    """The UTF-8 text of ``path``, or None if it looks binary (contains a NUL byte)."""
    data = path.read_bytes()
    if b"\0" in data:
        return None
    return data.decode("utf-8", errors="replace")


def _directory_corpus(root: Path) -> tuple[str, str]:
    """All text files under ``root`` (recursively, sorted by path) joined by blank lines."""
    texts = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        text = _read_text_file(path)
        if text is not None:
            texts.append(text)
    return "\n\n".join(texts), f"directory {root} ({len(texts)} text files)"


def load_corpus(data_path: str | None) -> tuple[str, str]:
    """Load the training text and describe where it came from.

    ``None`` gives the default offline corpus (``pydoc_data.topics``); a file gives its text; a
    directory gives its text files concatenated. Raises ``FileNotFoundError`` for a missing
    path and ``ValueError`` if the resulting corpus is empty.
    """
    if data_path is None:
        text, description = _default_corpus()
    else:
        path = Path(data_path)
        if path.is_dir():
            text, description = _directory_corpus(path)
        elif path.is_file():
            text = path.read_bytes().decode("utf-8", errors="replace")
            description = f"file {path}"
        else:
            raise FileNotFoundError(f"--data-path {data_path}: no such file or directory")
    if not text:
        raise ValueError(f"empty corpus: {description} contains no text")
    return text, description


@dataclasses.dataclass(frozen=True)
class TextDataset:
    """Non-overlapping next-token windows over a token stream.

    Sample ``i`` is ``tokens[i * seq_length : i * seq_length + seq_length + 1]``; its inputs are
    the first ``seq_length`` tokens and its labels the last ``seq_length`` (shifted by one).
    Consecutive windows share one boundary token (the last label of one is the first input of
    the next), so every token but the first is predicted exactly once per epoch.
    """

    tokens: np.ndarray
    """The 1-D int32 token stream."""
    seq_length: int
    """Number of input (and label) tokens per sample."""

    def __post_init__(self) -> None:
        """Validate and normalise the token array."""
        if self.seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {self.seq_length}")
        object.__setattr__(self, "tokens", np.asarray(self.tokens, dtype=np.int32).reshape(-1))

    def __len__(self) -> int:
        """Number of complete windows of ``seq_length + 1`` tokens."""
        return max(0, (len(self.tokens) - 1) // self.seq_length)

    def windows(self, indices: Any) -> np.ndarray:
        """The ``[len(indices), seq_length + 1]`` token windows of the given samples."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"sample indices must lie in [0, {len(self)}), got [{idx.min()}, {idx.max()}]")
        offsets = idx[:, None] * self.seq_length + np.arange(self.seq_length + 1)[None, :]
        return self.tokens[offsets]

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """``(tokens, labels)`` of sample ``i``, each int32 of length ``seq_length``."""
        if i < 0:
            i += len(self)
        window = self.windows([i])[0]
        return window[:-1], window[1:]


def build_train_valid_datasets(
    tokens: np.ndarray, seq_length: int, valid_fraction: float = 0.05
) -> tuple[TextDataset, TextDataset]:
    """Split a token stream into a training and a validation dataset.

    The validation set is the last ``valid_fraction`` of the samples (at least one, rounded),
    the training set everything before. Raises ``ValueError`` if the stream is too short for
    one sample of each.
    """
    if not 0.0 < valid_fraction < 1.0:
        raise ValueError(f"valid_fraction must lie in (0, 1), got {valid_fraction}")
    tokens = np.asarray(tokens, dtype=np.int32).reshape(-1)
    total = len(TextDataset(tokens, seq_length))
    if total < 2:
        raise ValueError(
            f"corpus too small: {len(tokens)} tokens give {total} samples of {seq_length} + 1 tokens; "
            f"need at least 2 (one train, one valid), i.e. {2 * seq_length + 1} tokens"
        )
    num_valid = min(max(1, round(valid_fraction * total)), total - 1)
    boundary = (total - num_valid) * seq_length
    return TextDataset(tokens[: boundary + 1], seq_length), TextDataset(tokens[boundary:], seq_length)


@dataclasses.dataclass
class DataParallelSampler:
    """Deterministic, resumable, per-epoch shuffled sample order split over data-parallel ranks.

    The global order is the concatenation of the permutations of ``range(num_samples)`` drawn
    from ``np.random.default_rng([seed, epoch])`` for epoch 0, 1, ... (of ``range(num_samples)``
    itself with ``shuffle=False``). Global batch ``step`` is
    the slice ``[step * global_batch_size, (step + 1) * global_batch_size)`` of that order
    (it may span an epoch boundary); rank ``r`` takes the ``r``-th contiguous share of it.
    """

    num_samples: int
    """Number of samples in the dataset."""
    micro_batch_size: int
    """Samples per micro-batch on one data-parallel rank."""
    data_parallel_rank: int
    """This rank's index in the data-parallel group."""
    data_parallel_size: int
    """Number of data-parallel ranks."""
    seed: int = 0
    """Seed of the per-epoch shuffles."""
    consumed_samples: int = 0
    """Resume position: global samples already consumed (advanced by ``next_*_batch``)."""
    shuffle: bool = True
    """Permute every epoch; False takes the samples in order (Megatron's ``MegatronPretrainingSampler``,
    for datasets such as ``GPTDataset`` that are shuffled already)."""
    _perm_cache: dict[int, np.ndarray] = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)
    """Per-epoch permutations already drawn."""

    def __post_init__(self) -> None:
        """Validate the configuration."""
        if self.num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {self.num_samples}")
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(f"data_parallel_rank {self.data_parallel_rank} not in [0, {self.data_parallel_size})")
        if self.consumed_samples < 0:
            raise ValueError(f"consumed_samples must be >= 0, got {self.consumed_samples}")

    def epoch_permutation(self, epoch: int) -> np.ndarray:
        """The sample order of ``epoch``: a permutation of ``range(num_samples)``."""
        if not self.shuffle:
            return np.arange(self.num_samples)
        if epoch not in self._perm_cache:
            if len(self._perm_cache) > 4:
                self._perm_cache.clear()
            rng = np.random.default_rng([self.seed, epoch])
            self._perm_cache[epoch] = rng.permutation(self.num_samples)
        return self._perm_cache[epoch]

    def _order_slice(self, start: int, count: int) -> np.ndarray:
        """Entries ``[start, start + count)`` of the chained per-epoch order."""
        parts = []
        pos, end = start, start + count
        while pos < end:
            epoch, offset = divmod(pos, self.num_samples)
            take = min(end - pos, self.num_samples - offset)
            parts.append(self.epoch_permutation(epoch)[offset : offset + take])
            pos += take
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def _check_global_batch(self, global_batch_size: int) -> None:
        """Raise ``ValueError`` unless the global batch splits into whole micro-batches per rank."""
        per_rank = self.micro_batch_size * self.data_parallel_size
        if global_batch_size < 1 or global_batch_size % per_rank:
            raise ValueError(
                f"global_batch_size {global_batch_size} is not a positive multiple of micro_batch_size "
                f"{self.micro_batch_size} x data_parallel_size {self.data_parallel_size} = {per_rank}"
            )

    def global_batch_indices(self, step: int, global_batch_size: int) -> np.ndarray:
        """Sample indices of global batch ``step`` (counted from ``consumed_samples = 0``)."""
        self._check_global_batch(global_batch_size)
        return self._order_slice(step * global_batch_size, global_batch_size)

    def _local_share(self, global_indices: np.ndarray) -> np.ndarray:
        """This rank's contiguous share of a global batch."""
        return global_indices.reshape(self.data_parallel_size, -1)[self.data_parallel_rank]

    def local_batch_indices(self, step: int, global_batch_size: int) -> np.ndarray:
        """This rank's sample indices of global batch ``step`` (``global_batch_size / dp`` of them)."""
        return self._local_share(self.global_batch_indices(step, global_batch_size))

    def next_global_batch(self, global_batch_size: int) -> np.ndarray:
        """The global batch starting at ``consumed_samples``; advances ``consumed_samples``."""
        self._check_global_batch(global_batch_size)
        indices = self._order_slice(self.consumed_samples, global_batch_size)
        self.consumed_samples += global_batch_size
        return indices

    def next_local_batch(self, global_batch_size: int) -> np.ndarray:
        """This rank's share of :meth:`next_global_batch`; advances ``consumed_samples``."""
        return self._local_share(self.next_global_batch(global_batch_size))

    def epoch_of(self, step: int, global_batch_size: int) -> int:
        """The epoch of the first sample of global batch ``step``."""
        return (step * global_batch_size) // self.num_samples

    def state_dict(self) -> dict[str, int]:
        """Checkpointable state: the resume position and the seed."""
        return {"consumed_samples": self.consumed_samples, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore the state saved by :meth:`state_dict`."""
        self.consumed_samples = int(state["consumed_samples"])
        self.seed = int(state["seed"])
        self._perm_cache.clear()


def get_batch(dataset: TextDataset, indices: Any) -> dict[str, np.ndarray]:
    """Inputs and next-token labels of the given samples, each int32 ``[len(indices), seq_length]``."""
    windows = dataset.windows(indices)
    return {"tokens": windows[:, :-1], "labels": windows[:, 1:]}


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy in nats of the empirical token distribution (the loss of a unigram predictor)."""
    arr = np.asarray(tokens).reshape(-1)
    if arr.size == 0:
        raise ValueError("unigram_entropy of an empty token stream")
    counts = np.bincount(arr, minlength=vocab_size)
    probs = counts[counts > 0] / arr.size
    return max(0.0, float(-(probs * np.log(probs)).sum()))
