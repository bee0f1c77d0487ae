"""Megatron-LM's ``GPTDataset``: fixed-length samples over the documents of an indexed dataset.

Three index arrays (Megatron's names) turn sample ``i`` into tokens:

* **document index** (int32): the split's document ids repeated over the epochs needed for the
  requested number of samples and shuffled with ``numpy.random.RandomState(seed)`` (all epochs
  together; with Megatron's *separate last epoch* rule the last epoch is shuffled on its own
  when it would contribute fewer than 80% of an epoch's samples).
* **sample index** (``[num_samples + 1, 2]``, Megatron's ``helpers.build_sample_idx``): entry
  ``k`` is ``(position in the document index, token offset)`` of token ``k * seq_length`` of
  the concatenated documents. Sample ``k`` is the ``seq_length + 1`` tokens from entry ``k``
  through entry ``k + 1`` inclusive, so it crosses document boundaries and consecutive samples
  share one token (the last label of one is the first input of the next).
* **shuffle index**: a permutation of the samples (the last epoch's separately when separated).

The arrays are built once and cached as ``.npy`` files named by the MD5 of a JSON description
of the configuration (Megatron's ``unique_description_hash``), by default in
``{path_prefix}/cache/GPTDataset_indices``; :func:`build_on_rank0_then_share` lets rank 0 build
them while the other ranks wait at a barrier and then load them.

``dataset[i]`` is Megatron's dict: ``tokens``, ``labels`` (int64 ``[seq_length]``),
``loss_mask`` (float32), ``position_ids`` (int64) and, when ``create_attention_mask``, a bool
``attention_mask`` ``[1, seq_length, seq_length]`` (True = masked), with Megatron's
``reset_position_ids``, ``reset_attention_mask`` and ``eod_mask_loss``. :meth:`GPTDataset.get_text`
is the raw int64 ``[seq_length + 1]`` window.

:func:`get_split_document_ids` is Megatron's ``--split 969,30,1`` document-range split.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from core.atomic_files import write_atomically
from core.data.indexed_dataset import IndexedDataset

T = TypeVar("T")

SPLIT_NAMES = ("train", "valid", "test")
"""Megatron's ``Split`` enum, in order."""

_PAD_TOKEN_ID = -1
"""Megatron's pad id of partial (undropped) validation samples; masked out of the loss, then set to 0."""


def parse_and_normalize_split(split: str) -> list[float]:
    """Megatron's ``parse_and_normalize_split``: ``"969,30,1"`` (or ``/``-separated) as 3 weights summing to 1.

    Missing trailing weights are 0. ``ValueError`` for more than 3 weights, a negative weight
    or an all-zero split.
    """
    weights = [float(w) for w in re.findall(r"[.0-9]+", split)]
    if "-" in split or not weights or len(weights) > len(SPLIT_NAMES):
        raise ValueError(f"--split {split!r}: expected 1 to 3 non-negative weights such as '969,30,1'")
    weights += [0.0] * (len(SPLIT_NAMES) - len(weights))
    total = float(np.sum(np.array(weights, dtype=np.float64)))
    if total <= 0.0:
        raise ValueError(f"--split {split!r}: the weights sum to 0")
    return (np.array(weights, dtype=np.float64) / total).tolist()


def convert_split_vector_to_split_matrix(vector: list[float]) -> list[tuple[float, float] | None]:
    """Megatron's bookends: ``[.9, .09, .01]`` -> ``[(0, .9), (.9, .99), (.99, 1)]``; an empty range is None."""
    expansion = functools.reduce(lambda a, b: a + [a[len(a) - 1] + b], [[0], *vector])
    matrix: list[tuple[float, float] | None] = []
    for begin, end in zip(expansion[:-1], expansion[1:]):
        matrix.append(None if end <= begin else (begin, end))
    return matrix


def get_split_document_ids(split: str, num_documents: int) -> list[np.ndarray | None]:
    """The int32 document ids of train, valid and test for ``--split split`` (None: a zero weight).

    Megatron's ``BlendedMegatronDatasetBuilder``: normalised weights, cumulative bookends,
    ``range(round(begin * n), round(end * n))`` per split (Python's ``round``).
    """
    ids: list[np.ndarray | None] = []
    for bookends in convert_split_vector_to_split_matrix(parse_and_normalize_split(split)):
        if bookends is None:
            ids.append(None)
            continue
        begin = int(round(bookends[0] * float(num_documents)))
        end = int(round(bookends[1] * float(num_documents)))
        ids.append(np.arange(begin, end, dtype=np.int32))
    return ids


@dataclasses.dataclass(frozen=True)
class GPTDatasetConfig:
    """What a :class:`GPTDataset` needs beyond its documents (Megatron's ``GPTDatasetConfig``)."""

    sequence_length: int
    """Input tokens per sample (``--seq-length``); a sample holds one more token for the labels."""
    random_seed: int = 1234
    """Seed of the document and shuffle permutations (``--seed``, Megatron's default 1234)."""
    eod_token: int | None = None
    """End-of-document id (the tokenizer's ``eod``); needed by the three options below."""
    reset_position_ids: bool = False
    """Restart position ids after every EOD (``--reset-position-ids``)."""
    reset_attention_mask: bool = False
    """Document-causal attention mask: no attention across an EOD (``--reset-attention-mask``)."""
    eod_mask_loss: bool = False
    """Loss mask 0 where the input token is an EOD (``--eod-mask-loss``)."""
    create_attention_mask: bool = False
    """Return ``attention_mask`` (Megatron creates it unless ``--no-create-attention-mask-in-dataloader``)."""
    add_extra_token_to_sequence: bool = True
    """Samples hold ``seq_length + 1`` tokens (labels are the inputs shifted by one)."""
    drop_last_partial_validation_sequence: bool = True
    """Drop the last partial sample of the valid split (else pad it and mask the padding)."""
    path_to_cache: str | None = None
    """Directory of the cached index arrays; None: ``{path_prefix}/cache/GPTDataset_indices``."""

    def __post_init__(self) -> None:
        """Validate the configuration."""
        if self.sequence_length < 2:
            raise ValueError(f"sequence_length must be >= 2 (Megatron's build_sample_idx), got {self.sequence_length}")
        needs_eod = [
            name for name in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss") if getattr(self, name)
        ]
        if needs_eod and self.eod_token is None:
            raise ValueError(f"{', '.join(needs_eod)} need eod_token (the tokenizer's end-of-document id)")


def _num_epochs(tokens_per_epoch: int, num_samples: int | None, sequence_length: int, extra: int) -> int:
    """Megatron's ``_get_num_epochs``: epochs needed for ``num_samples * seq_length + extra`` tokens."""
    if num_samples is None:
        return 1
    needed = num_samples * sequence_length + extra
    return max(1, -(-needed // tokens_per_epoch))


def build_document_index(
    documents: np.ndarray, num_epochs: int, random_state: np.random.RandomState, separate_final_epoch: bool
) -> np.ndarray:
    """Megatron's ``_build_document_index``: ``documents`` repeated ``num_epochs`` times, shuffled (int32)."""
    if not separate_final_epoch or num_epochs == 1:
        document_index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
        random_state.shuffle(document_index)
        return document_index
    first = build_document_index(documents, num_epochs - 1, random_state, False)
    last = build_document_index(documents, 1, random_state, False)
    return np.concatenate((first, last))


def build_sample_index(
    sequence_lengths: np.ndarray,
    document_index: np.ndarray,
    sequence_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last_partial_sequence: bool = True,
    add_extra_token_to_sequence: bool = True,
) -> np.ndarray:
    """Megatron's ``helpers.build_sample_idx``, vectorised: ``[num_samples + 1, 2]`` (doc position, offset).

    Entry ``k`` locates token ``k * sequence_length`` of the concatenated documents. With the
    extra token it is the document containing that token; without it, the first document
    ending at or after it (offset may equal the document length); past the end (an undropped
    partial last sample) it is ``(last, length_of_last - extra)``, as in helpers.cpp.
    int32 when the values fit (Megatron's choice), else int64.
    """
    extra = int(add_extra_token_to_sequence)
    total = num_epochs * tokens_per_epoch
    if drop_last_partial_sequence:
        num_samples = (total - extra) // sequence_length
    else:  # helpers.cpp: ceil(float(...) / seq_length), in single precision
        num_samples = int(np.ceil(np.float32(total - extra) / np.float32(sequence_length)))
    sizes = np.asarray(sequence_lengths)[np.asarray(document_index)].astype(np.int64)
    starts = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=starts[1:])
    positions = np.arange(num_samples + 1, dtype=np.int64) * sequence_length
    if extra:
        doc = np.searchsorted(starts, positions, side="right") - 1
    else:
        doc = np.searchsorted(starts[1:], positions, side="left")
    beyond = positions > total - extra
    doc = np.minimum(doc, len(sizes) - 1)
    offset = positions - starts[doc]
    offset[beyond] = sizes[-1] - extra
    offset[0] = 0
    doc[0] = 0
    result = np.stack([doc, offset], axis=1)
    if max(len(document_index), int(np.max(sequence_lengths))) <= np.iinfo(np.int32).max:
        return result.astype(np.int32)
    return result


def build_shuffle_index(num_samples: int, total_size: int, random_state: np.random.RandomState) -> np.ndarray:
    """Megatron's ``_build_shuffle_index``: ``[0, num_samples)`` shuffled, then ``[num_samples, total_size)``."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    random_state.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    random_state.shuffle(last)
    return np.concatenate((first, last))


def get_ltor_masks_and_position_ids(
    tokens: np.ndarray,
    eod_token: int | None,
    reset_position_ids: bool,
    reset_attention_mask: bool,
    eod_mask_loss: bool,
    create_attention_mask: bool,
) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    """Megatron's ``_get_ltor_masks_and_position_ids`` for one sample: (attention_mask, loss_mask, position_ids).

    The attention mask is bool ``[1, s, s]``, True where attention is masked: causal, and with
    ``reset_attention_mask`` no token after an EOD attends to the EOD or anything before it.
    ``reset_position_ids`` restarts positions at 0 after every EOD; ``eod_mask_loss`` zeroes the
    loss mask where the input token is the EOD.
    """
    seq_length = len(tokens)
    causal = np.tril(np.ones((seq_length, seq_length), dtype=bool)) if create_attention_mask else None
    loss_mask = np.ones(seq_length, dtype=np.float32)
    if eod_mask_loss:
        loss_mask[tokens == eod_token] = 0.0
    position_ids = np.arange(seq_length, dtype=np.int64)
    if reset_position_ids or reset_attention_mask:
        previous = 0
        for i in np.flatnonzero(tokens == eod_token):
            if reset_attention_mask and causal is not None:
                causal[i + 1 :, : i + 1] = False
            if reset_position_ids:
                position_ids[i + 1 :] -= i + 1 - previous
                previous = i + 1
    attention_mask = None if causal is None else ~causal[None]
    return attention_mask, loss_mask, position_ids


def get_segment_ids(tokens: np.ndarray, eod_token: int) -> np.ndarray:
    """Document ids within each sample: int32, same shape as ``tokens`` (``[s]`` or ``[b, s]``).

    ``segment_ids[..., j]`` is the number of EOD tokens strictly before position ``j``, so an
    EOD belongs to the document it ends. Attention restricted to equal segment ids (and causal)
    is exactly Megatron's ``reset_attention_mask``: a token after an EOD sees neither the EOD
    nor anything before it. It is the ``[s]`` form of that ``[s, s]`` mask, which the model
    rebuilds on the device instead of receiving ``s * s`` values per sample.
    """
    tokens = np.asarray(tokens)
    is_eod = (tokens == eod_token).astype(np.int32)
    segment_ids = np.zeros(tokens.shape, dtype=np.int32)
    np.cumsum(is_eod[..., :-1], axis=-1, dtype=np.int32, out=segment_ids[..., 1:])
    return segment_ids


class IndexCacheError(OSError):
    """The sample-index cache cannot be written (read-only filesystem, no permission, full disk)."""


class GPTDataset:
    """Megatron's ``GPTDataset`` over the documents ``document_ids`` of an :class:`IndexedDataset`.

    ``num_samples`` None means one epoch. Loads the three index arrays from the cache when all
    its files exist, else builds and saves them (``built_anew_on_cache_miss`` tells which).
    ``len(dataset)`` can exceed ``num_samples`` (the rest of the last epoch), as in Megatron.
    """

    def __init__(
        self,
        indexed_dataset: IndexedDataset,
        document_ids: Any,
        num_samples: int | None,
        config: GPTDatasetConfig,
        index_split: str = "train",
    ) -> None:
        """Index the samples of ``document_ids`` (sequence ids of ``indexed_dataset``) for ``index_split``."""
        if index_split not in SPLIT_NAMES:
            raise ValueError(f"index_split must be one of {SPLIT_NAMES}, got {index_split!r}")
        self.dataset = indexed_dataset
        """The indexed dataset the samples are cut from."""
        self.document_ids = np.asarray(document_ids, dtype=np.int32).reshape(-1)
        """The split's document (sequence) ids."""
        self.num_samples = num_samples
        """Requested number of samples (None: one epoch)."""
        self.config = config
        """The dataset configuration."""
        self.index_split = index_split
        """``train``, ``valid`` or ``test``."""
        if self.document_ids.size and (self.document_ids.min() < 0 or self.document_ids.max() >= len(indexed_dataset)):
            raise ValueError(f"document ids must lie in [0, {len(indexed_dataset)}) for {indexed_dataset.path_prefix}")
        if num_samples is not None and num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        self.unique_identifiers: dict[str, Any] = {
            "class": type(self).__name__,
            "dataset_path": indexed_dataset.path_prefix,
            "num_samples": num_samples,
            "index_split": index_split,
            "documents_md5": hashlib.md5(self.document_ids.tobytes(), usedforsecurity=False).hexdigest(),
            "num_documents": int(self.document_ids.size),
            "random_seed": config.random_seed,
            "sequence_length": config.sequence_length,
            "add_extra_token_to_sequence": config.add_extra_token_to_sequence,
            "drop_last_partial_sequence": self._drop_last_partial_sequence(),
        }
        """What identifies the index arrays (Megatron's ``unique_identifiers``)."""
        self.unique_description = json.dumps(self.unique_identifiers, indent=4)
        """The JSON of :attr:`unique_identifiers`, written beside the cache files."""
        self.unique_description_hash = hashlib.md5(
            self.unique_description.encode("utf-8"), usedforsecurity=False
        ).hexdigest()
        """MD5 of :attr:`unique_description`: the cache files' name prefix."""
        self.built_anew_on_cache_miss = False
        """Whether this instance built the index arrays (False: loaded from the cache)."""
        self.build_seconds = 0.0
        """Seconds spent building the index arrays (0 when loaded from the cache)."""
        self.document_index, self.sample_index, self.shuffle_index = self._build_document_sample_shuffle_indices()

    def _drop_last_partial_sequence(self) -> bool:
        """Megatron: always drop for train and test; the config decides for valid."""
        return self.index_split != "valid" or self.config.drop_last_partial_validation_sequence

    @property
    def cache_dir(self) -> str:
        """Directory of the cached index arrays."""
        if self.config.path_to_cache is not None:
            return self.config.path_to_cache
        return os.path.join(self.dataset.path_prefix, "cache", f"{type(self).__name__}_indices")

    def cache_path(self, affix: str) -> str:
        """Megatron's cache file name: ``{hash}-GPTDataset-{split}-{affix}``."""
        base = f"{self.unique_description_hash}-{type(self).__name__}-{self.index_split}"
        return os.path.join(self.cache_dir, f"{base}-{affix}")

    def _build_document_sample_shuffle_indices(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Load the three arrays from the cache, or build (Megatron's algorithm) and save them."""
        affixes = ("document_index.npy", "sample_index.npy", "shuffle_index.npy")
        paths = [self.cache_path(affix) for affix in affixes]
        description_path = self.cache_path("description.txt")
        if all(os.path.isfile(p) for p in [*paths, description_path]):
            return tuple(np.load(p, allow_pickle=False, mmap_mode="r") for p in paths)  # type: ignore[return-value]

        self.built_anew_on_cache_miss = True
        start = time.perf_counter()
        config = self.config
        seq_length, extra = config.sequence_length, int(config.add_extra_token_to_sequence)
        tokens_per_epoch = int(np.sum(self.dataset.sequence_lengths[self.document_ids], dtype=np.int64))
        if tokens_per_epoch <= extra:
            raise ValueError(
                f"{self.index_split} split of {self.dataset.path_prefix}: {self.document_ids.size} documents with "
                f"{tokens_per_epoch} tokens, too few for a sample of {seq_length} + {extra} tokens"
            )
        num_epochs = _num_epochs(tokens_per_epoch, self.num_samples, seq_length, extra)
        separate_final_epoch = False
        num_samples_sans_final_epoch = 0
        if num_epochs > 1:
            assert self.num_samples is not None
            num_samples_sans_final_epoch = ((num_epochs - 1) * tokens_per_epoch - extra) // seq_length
            num_samples_from_final_epoch = self.num_samples - num_samples_sans_final_epoch
            num_samples_per_epoch = (tokens_per_epoch - extra) // seq_length
            assert 0 <= num_samples_from_final_epoch <= num_samples_per_epoch + 1
            separate_final_epoch = num_samples_from_final_epoch < int(0.80 * num_samples_per_epoch)

        random_state = np.random.RandomState(config.random_seed)
        document_index = build_document_index(self.document_ids, num_epochs, random_state, separate_final_epoch)
        sample_index = build_sample_index(
            self.dataset.sequence_lengths,
            document_index,
            seq_length,
            num_epochs,
            tokens_per_epoch,
            self._drop_last_partial_sequence(),
            config.add_extra_token_to_sequence,
        )
        total = sample_index.shape[0] - 1
        first = num_samples_sans_final_epoch if separate_final_epoch else total
        shuffle_index = build_shuffle_index(first, total, random_state)

        try:  # each file under a temporary name, renamed into place: a failure leaves no half file
            os.makedirs(self.cache_dir, exist_ok=True)
            for path, array in zip(paths, (document_index, sample_index, shuffle_index)):
                write_atomically(path, lambda stream, a=array: np.save(stream, a, allow_pickle=False))
            write_atomically(description_path, lambda stream: stream.write(self.unique_description), mode="w")
        except OSError as e:
            raise IndexCacheError(f"cannot write the sample-index cache in {self.cache_dir}: {e.strerror or e}") \
                from None
        self.build_seconds = time.perf_counter() - start
        return document_index, sample_index, shuffle_index

    def __len__(self) -> int:
        """Number of samples indexed (at least ``num_samples``)."""
        return self.sample_index.shape[0] - 1

    def _query(self, idx: int) -> np.ndarray:
        """Megatron's ``_query_document_sample_shuffle_indices``: the int64 tokens of sample ``idx``."""
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"sample {idx} out of range for {n} samples")
        sample = int(self.shuffle_index[idx % n])
        doc_begin, offset_begin = (int(v) for v in self.sample_index[sample])
        doc_end, offset_end = (int(v) for v in self.sample_index[sample + 1])
        extra = int(self.config.add_extra_token_to_sequence)
        if doc_begin == doc_end:
            parts = [
                self.dataset.get(int(self.document_index[doc_begin]), offset_begin, offset_end - offset_begin + extra)
            ]
        else:
            parts = []
            for i in range(doc_begin, doc_end + 1):
                offset = offset_begin if i == doc_begin else 0
                length = offset_end + extra if i == doc_end else None
                parts.append(self.dataset.get(int(self.document_index[i]), offset, length))
        size = sum(len(p) for p in parts)
        wanted = self.config.sequence_length + extra
        if size < wanted:
            parts.append(np.full(wanted - size, _PAD_TOKEN_ID, dtype=np.int64))
        return np.concatenate(parts, dtype=np.int64)

    def get_text(self, idx: int) -> np.ndarray:
        """The raw int64 window of sample ``idx``: ``seq_length + 1`` tokens (pad -1 only in an undropped partial)."""
        return self._query(idx)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        """Megatron's sample dict: tokens, labels, loss_mask, position_ids (and attention_mask if configured)."""
        text = self._query(int(idx))
        config = self.config
        if config.add_extra_token_to_sequence:
            tokens, labels = text[:-1].copy(), text[1:].copy()
        else:
            tokens = text
            labels = np.roll(text, -1)
            labels[-1] = _PAD_TOKEN_ID
        attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
            tokens,
            config.eod_token,
            config.reset_position_ids,
            config.reset_attention_mask,
            config.eod_mask_loss,
            config.create_attention_mask,
        )
        loss_mask[labels == _PAD_TOKEN_ID] = 0.0
        tokens[tokens == _PAD_TOKEN_ID] = 0
        labels[labels == _PAD_TOKEN_ID] = 0
        sample = {"tokens": tokens, "labels": labels}
        if attention_mask is not None:
            sample["attention_mask"] = attention_mask
        sample.update(loss_mask=loss_mask, position_ids=position_ids)
        return sample


def build_on_rank0_then_share(build: Callable[[], T], *, rank: int = 0, barrier: Callable[[], None] | None = None) -> T:
    """Megatron's ``build_generic_dataset`` order: rank 0 builds, everyone meets at ``barrier``, then the rest.

    ``build`` is typically ``lambda: GPTDataset(...)``: rank 0 builds and caches the index
    arrays, the other ranks construct after the barrier and load them (a miss, e.g. on a
    node-local cache directory, rebuilds the same arrays: the build is deterministic and the
    cache files are written atomically). ``barrier`` None: no synchronisation (one process).
    """
    result = build() if rank == 0 else None
    if barrier is not None:
        barrier()
    if rank != 0:
        result = build()
    return result  # type: ignore[return-value]
