"""``PretrainingData``: the datasets, sampler and global batches of a pretraining run.

The data is the built-in corpus, a text file or directory, Megatron's indexed datasets
(``--data-path [w] PREFIX ...``, ``--split``, ``--tokenizer-type``) or, with ``--sft``, a JSONL of
chat conversations; the last two's batches carry Megatron's fields (:data:`BATCH_FIELDS`). The
data order is a pure function of the seed and the number of consumed samples, and dropout is
seeded per sample from the seed and the sample's position in that order (:func:`dropout_seeds`),
so a resumed run reads what the uninterrupted one would.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from core.context_parallel import reorder_for_cp
from core.data import (
    ByteTokenizer,
    DataParallelSampler,
    GPTDatasetConfig,
    IndexedDataset,
    SFTDataset,
    build_gpt_datasets,
    build_train_valid_datasets,
    get_batch,
    get_segment_ids,
    get_split_document_ids,
    load_chat_template,
    load_corpus,
    read_conversations,
)
from core.data.gpt_dataset import IndexCacheError
from core.data.text_dataset import unigram_entropy
from core.parallel_state import CP_AXIS, ParallelState
from core.training.arguments import data_source, tokenizer_from_args
from core.training.config import DataConfig, TrainingConfig

BATCH_FIELDS = {
    "tokens": "int32 [b, s]: input ids",
    "labels": "int32 [b, s]: next-token ids",
    "loss_mask": "float32 [b, s]: 0 where a token carries no loss (--eod-mask-loss; --sft: 1 only where the "
                 "label is an assistant token); indexed data and --sft only",
    "position_ids": "int32 [b, s]: positions restarting after every EOD (--reset-position-ids) or at every "
                    "conversation (--sft)",
    "segment_ids": "int32 [b, s]: EODs strictly before each position (--reset-attention-mask) or the "
                   "conversation's index in the packed sequence (--sft); attend within equal ids",
    "dropout_seed": "int32 [b]: per-sample dropout seed (dropout_seeds); training batches of a model "
                    "with dropout only",
}
"""The batch contract between the data and the model: field -> dtype, shape and when it is sent."""

_DROPOUT_SEED_MULTIPLIER = 2654435761
"""Knuth's multiplicative hash constant: consecutive samples get well-spread seeds."""

_ENTROPY_TOKENS = 1 << 20
"""Tokens per dataset read for the unigram-entropy baseline of indexed data (the print, not training)."""


def dropout_seeds(seed: int, first_sample: int, count: int) -> np.ndarray:
    """int32 ``[count]``: ``(seed * 2654435761 + position) mod 2**31`` for the global sample
    positions ``first_sample .. first_sample + count - 1`` in consumption order.

    A sample's dropout depends only on ``--seed`` and where it is consumed, not on the layout,
    the device that holds its row or whether the run was resumed.
    """
    base = (int(seed) * _DROPOUT_SEED_MULTIPLIER) % (1 << 31)
    return ((base + np.arange(first_sample, first_sample + count, dtype=np.int64)) % (1 << 31)).astype(np.int32)


def _process_barrier() -> Callable[[], None] | None:
    """A barrier over every process (None in one process): rank 0 writes the index caches first."""
    if jax.process_count() == 1:
        return None
    from jax.experimental import multihost_utils

    counter = itertools.count()  # every process builds the same datasets in the same order: same names
    return lambda: multihost_utils.sync_global_devices(f"core.training.pretraining_data:{next(counter)}")


def data_vocab_size(data: DataConfig) -> int:
    """The vocabulary the data's tokens come from: the byte vocabulary for a text corpus with
    ``--tokenizer-type ByteLevel`` (encoded by :class:`ByteTokenizer`), else the tokenizer's."""
    if data.tokenizer_type == "ByteLevel" and data_source(data.data_path).kind != "indexed":
        return ByteTokenizer.vocab_size
    return tokenizer_from_args(data).vocab_size


def _sampled_unigram_entropy(prefixes: tuple[str, ...], weights: tuple[float, ...], vocab_size: int) -> float:
    """Unigram entropy (nats) of a blend: each dataset's token distribution over up to
    :data:`_ENTROPY_TOKENS` of its tokens (``IndexedDataset.sample_tokens``), mixed with the weights."""
    mixture = np.zeros(vocab_size, dtype=np.float64)
    for prefix, weight in zip(prefixes, weights):
        tokens = IndexedDataset(prefix).sample_tokens(_ENTROPY_TOKENS).astype(np.int64)
        if tokens.size:
            mixture += weight * np.bincount(tokens, minlength=vocab_size)[:vocab_size] / tokens.size
    probs = mixture[mixture > 0] / mixture.sum()
    return max(0.0, float(-(probs * np.log(probs)).sum()))


class PretrainingData:
    """Datasets, sampler and global batches of a run (the same on every process; each device keeps
    its data-parallel rows of a global batch).

    * No ``--data-path``, or a text file or directory: the text is tokenized whole (ByteLevel:
      its bytes, a vocabulary of 256, since plain text has no EOD), ``--valid-fraction`` of it is
      held out, and the sampler shuffles every epoch. Batches: ``tokens`` and ``labels``.
    * Megatron prefixes: ``build_gpt_datasets`` over ``--data-path`` and ``--split`` with
      ``--train-iters x --global-batch-size`` training samples and ``--eval-iters x
      --global-batch-size`` validation samples (a fixed set, the same at every evaluation);
      rank 0 builds the index caches while the others wait, then they load them. ``GPTDataset``
      is shuffled already, so the sampler takes its samples in order (Megatron's
      ``MegatronPretrainingSampler``). Batches: ``tokens``, ``labels``, ``loss_mask`` and, as
      the flags ask, ``position_ids`` and ``segment_ids`` (:data:`BATCH_FIELDS`).
    * ``--sft``: the JSONL's chat conversations packed into sequences (:meth:`_init_sft`). Batches:
      all five fields, the loss on the assistant's tokens.

    With ``with_dropout_seed`` training batches (never validation ones) also carry ``dropout_seed``.
    """

    def __init__(self, data: DataConfig, training: TrainingConfig, state: ParallelState,
                 with_dropout_seed: bool = False):
        """Load or index the data ``data`` names, in ``training``'s samples and batches (validated
        flags: ``validate_args``, ``validate_data_args``)."""
        self.data_config, self.training = data, training
        self.with_dropout_seed = with_dropout_seed
        """Whether training batches carry ``dropout_seed`` (the model has dropout)."""
        self.source = data_source(self.data_config.data_path)
        """What ``--data-path`` names."""
        self.tokenizer = tokenizer_from_args(data)
        """The ``--tokenizer-type`` tokenizer."""
        self.indexed = self.source.kind == "indexed"
        """Whether the data are Megatron indexed datasets."""
        self.vocab_size = data_vocab_size(data)
        """The vocabulary of the data's tokens (the model's, :func:`data_vocab_size`)."""
        self.sft = data.sft
        """Whether the data are chat conversations (``--sft``)."""
        if self.sft:
            self._init_sft()
        elif self.indexed:
            self._init_indexed()
        else:
            self._init_text()
        self.context_parallel_size = state.context_parallel_size
        """cp: with more than 1, :meth:`to_global` reorders and splits every sample's sequence."""
        dp = state.data_parallel_axis_name
        self.batch_sharding = NamedSharding(state.mesh, P(dp))
        """Sharding of per-sample fields (and of every field without context parallelism)."""
        self.sequence_sharding = NamedSharding(state.mesh, P(dp, CP_AXIS) if self.context_parallel_size > 1 else P(dp))
        """Sharding of the ``[b, s]`` fields: rows over data parallelism, the sequence over ``"cp"``."""

    def _init_text(self) -> None:
        data, training = self.data_config, self.training
        text, self.corpus_description = load_corpus(self.source.text_path)
        if data.tokenizer_type == "ByteLevel":
            tokens = ByteTokenizer().encode(text)
        else:
            tokens = np.asarray(self.tokenizer.tokenize(text), dtype=np.int32)
            self.corpus_description += f", {data.tokenizer_type} vocabulary {self.vocab_size}"
        self.unigram_entropy = unigram_entropy(tokens, self.vocab_size)
        self.train_data, self.valid_data = build_train_valid_datasets(tokens, training.seq_length, data.valid_fraction)
        self.sampler = DataParallelSampler(num_samples=len(self.train_data), micro_batch_size=training.micro_batch_size,
                                           data_parallel_rank=0, data_parallel_size=1, seed=training.seed)

    def _init_indexed(self) -> None:
        data, training = self.data_config, self.training
        config = GPTDatasetConfig(
            sequence_length=training.seq_length, random_seed=training.seed, eod_token=self.tokenizer.eod,
            reset_position_ids=data.reset_position_ids, reset_attention_mask=data.reset_attention_mask,
            eod_mask_loss=data.eod_mask_loss, create_attention_mask=False, path_to_cache=data.data_cache_path)
        g = training.global_batch_size
        items = [str(x) for pair in zip(self.source.weights, self.source.prefixes) for x in pair]
        # Test split: 0 samples, not indexed (training never reads it).
        try:
            self.train_data, self.valid_data, _ = build_gpt_datasets(
                items, data.split, [training.train_iters * g, training.eval_iters * g, 0], config,
                rank=jax.process_index(), barrier=_process_barrier())
        except IndexCacheError as e:
            where = f"--data-cache-path {data.data_cache_path}" if data.data_cache_path else \
                "the dataset's directory (no --data-cache-path)"
            raise ValueError(f"{where}: {e}; pass --data-cache-path DIR on a writable filesystem") from None
        if self.train_data is None:
            raise ValueError(f"--split {data.split} gives the training split no documents")
        self.unigram_entropy = _sampled_unigram_entropy(self.source.prefixes, self.source.weights, self.vocab_size)
        self.corpus_description = (f"Megatron datasets {self.source.describe()} (--split {data.split}, "
                                   f"{data.tokenizer_type} vocabulary {self.vocab_size})")
        self.sampler = DataParallelSampler(num_samples=len(self.train_data), micro_batch_size=training.micro_batch_size,
                                           data_parallel_rank=0, data_parallel_size=1, seed=training.seed,
                                           shuffle=False)

    def _init_sft(self) -> None:
        """``--sft``: the JSONL's conversations tokenized with the chat template, split by ``--split``
        and packed (:meth:`_sft_splits`). Packed sequences have no order of their own, so the sampler
        shuffles them every epoch (seeded by ``--seed``, resumable from the consumed samples)."""
        data, training = self.data_config, self.training
        template = load_chat_template(data.tokenizer_model, data.sft_tokenizer_prompt_format)
        conversations = read_conversations(self.source.text_path, template, self.tokenizer)
        self.train_data, self.valid_data = self._sft_splits(conversations)
        train = self.train_data
        self.unigram_entropy = unigram_entropy(train.target_tokens(), self.vocab_size)
        valid = 0 if self.valid_data is None else len(self.valid_data.conversations) + self.valid_data.num_dropped
        self.corpus_description = (
            f"SFT conversations {self.source.text_path} ({len(conversations)}: "
            f"{len(train.conversations) + train.num_dropped} train, {valid} valid; chat template {template.origin}; "
            f"packed {train.fill:.0%} full; {train.num_truncated} truncated to --seq-length, {train.num_dropped} "
            f"dropped; {data.tokenizer_type} vocabulary {self.vocab_size})")
        self.sampler = DataParallelSampler(num_samples=len(train), micro_batch_size=training.micro_batch_size,
                                           data_parallel_rank=0, data_parallel_size=1, seed=training.seed)

    def _sft_splits(self, conversations: list) -> tuple[SFTDataset, SFTDataset | None]:
        """The training and validation conversations of ``--split`` packed (the test share is not
        used); ``ValueError`` when training gets none that fits."""
        split, seq_length, path = self.data_config.split, self.training.seq_length, self.source.text_path
        train_ids, valid_ids, _ = get_split_document_ids(split, len(conversations))
        pack = lambda ids: SFTDataset([conversations[i] for i in ids], seq_length, self.training.seed,
                                      self.tokenizer.eod)
        train = pack(train_ids) if train_ids is not None else None
        if train is None or not len(train):
            raise ValueError(f"--split {split} leaves no training conversation of {path} with an assistant token "
                             f"within --seq-length {seq_length}")
        valid = pack(valid_ids) if valid_ids is not None else None
        return train, valid if valid is not None and len(valid) else None

    @property
    def num_valid_samples(self) -> int:
        """Validation samples available (0 when ``--split`` gives validation no documents)."""
        return 0 if self.valid_data is None else len(self.valid_data)

    def _indexed_batch(self, dataset: Any, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Megatron's fields of the samples ``indices`` of a ``GPTDataset`` or ``BlendedDataset``."""
        samples = [dataset[int(i)] for i in indices]
        stack = lambda key, dtype: np.stack([sample[key] for sample in samples]).astype(dtype)
        batch = {"tokens": stack("tokens", np.int32), "labels": stack("labels", np.int32),
                 "loss_mask": stack("loss_mask", np.float32)}
        if self.data_config.reset_position_ids:
            batch["position_ids"] = stack("position_ids", np.int32)
        if self.data_config.reset_attention_mask:
            batch["segment_ids"] = get_segment_ids(batch["tokens"], self.tokenizer.eod)
        return batch

    def _host_batch(self, dataset: Any, indices: np.ndarray) -> dict[str, np.ndarray]:
        if self.sft:
            return dataset.batch(indices)
        return self._indexed_batch(dataset, indices) if self.indexed else get_batch(dataset, indices)

    def for_context_parallel(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The host batch as context parallelism reads it (unchanged when cp is 1): ``position_ids``
        added (``arange(s)`` per sample) when absent, then every ``[b, s]`` field reordered once into
        the load-balanced chunk order (:func:`core.context_parallel.reorder_for_cp`), so that the
        contiguous split of the sequence over ``"cp"`` hands rank ``r`` chunks ``r`` and ``2cp-1-r``."""
        cp = self.context_parallel_size
        if cp == 1:
            return batch
        batch = dict(batch)
        if "position_ids" not in batch:  # positions are not implied by the local index any more
            b, s = batch["tokens"].shape
            batch["position_ids"] = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)).copy()
        return {k: reorder_for_cp(v, cp, seq_axis=1) if v.ndim >= 2 else v for k, v in batch.items()}

    def to_global(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """A host batch as global arrays: rows over data parallelism (each device its rows) and,
        with context parallelism, the reordered sequence over ``"cp"`` (:meth:`for_context_parallel`)."""
        batch = self.for_context_parallel(batch)
        sharding = lambda v: self.sequence_sharding if v.ndim >= 2 else self.batch_sharding
        return {k: jax.make_array_from_callback(v.shape, sharding(v), lambda idx, v=v: v[idx])
                for k, v in batch.items()}

    def next_train_host_batch(self) -> dict[str, np.ndarray]:
        """The next global batch as numpy arrays (advances the sampler's consumed samples)."""
        g = self.training.global_batch_size
        first = self.sampler.consumed_samples
        batch = self._host_batch(self.train_data, self.sampler.next_global_batch(g))
        if self.with_dropout_seed:
            batch["dropout_seed"] = dropout_seeds(self.training.seed, first, g)
        return batch

    def next_train_batch(self) -> dict[str, jax.Array]:
        """The next global batch (advances the sampler's consumed samples)."""
        return self.to_global(self.next_train_host_batch())

    def valid_host_batch(self, i: int) -> dict[str, np.ndarray]:
        """Validation batch ``i`` as numpy arrays (a fixed set, the same at every evaluation; no dropout)."""
        if self.valid_data is None:
            raise ValueError(f"--split {self.data_config.split} gives validation no documents")
        g = self.training.global_batch_size
        return self._host_batch(self.valid_data, np.arange(i * g, (i + 1) * g) % len(self.valid_data))

    def valid_batch(self, i: int) -> dict[str, jax.Array]:
        """Validation batch ``i`` (a fixed set, the same at every evaluation)."""
        return self.to_global(self.valid_host_batch(i))
