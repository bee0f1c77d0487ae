"""``Pretrainer``: the GPT pretraining loop of ``launch/pretrain.py`` as a reusable object.

One training iteration is one jitted ``shard_map`` program (DDP's fused step): the pipeline
schedule or the microbatch loop, ``finalize_model_grads``, global-norm clipping and the
(distributed) optimizer. The data order is a pure function of ``--seed`` and the number of
consumed samples, parameters and optimizer state live in the checkpoint, and the only other
randomness, dropout, is seeded per sample from ``--seed`` and the sample's position in that
order (:func:`dropout_seeds`), so resuming reproduces the uninterrupted run. The MoE expert
biases (:attr:`Pretrainer.moe_state`) are model state outside the optimizer, updated after each
step and checkpointed with the parameters.

The data (:class:`PretrainingData`) is the built-in corpus, a text file or directory, or
Megatron's indexed datasets (``--data-path [w] PREFIX ...``, ``--split``, ``--tokenizer-type``),
whose batches carry Megatron's fields (:data:`BATCH_FIELDS`).

The loop does not wait for a step's loss before starting the next: JAX dispatches steps
asynchronously, so the host builds batch ``i + 1`` while the device runs step ``i``, and
losses and grad norms are read back (one transfer) only when a line is logged, before an
evaluation or a checkpoint, and at the end. At most two steps are in flight. A non-finite
loss or grad norm found then stops the run naming its first iteration; nothing after it is
saved.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from core import checkpointing
from core.checkpointing.layer_order import from_layer_order, layer_order_target, map_layer_leaves, merge_chunks
from core.context_parallel import reorder_for_cp
from core.data import (
    ByteTokenizer,
    DataParallelSampler,
    GPTDatasetConfig,
    IndexedDataset,
    build_gpt_datasets,
    build_train_valid_datasets,
    get_batch,
    get_segment_ids,
    load_corpus,
)
from core.data.gpt_dataset import IndexCacheError
from core.data.text_dataset import unigram_entropy
from core.distributed.distributed_data_parallel import DistributedDataParallel
from core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from core.models.gpt import GPTModel
from core.optimizer import get_megatron_optimizer
from core.optimizer.optimizer_config import OptimizerConfig
from core.parallel_state import CP_AXIS, ParallelState
from core.training.arguments import (
    ParallelLayout,
    data_source,
    lr_decay_iters,
    lr_warmup_iters,
    min_lr,
    model_config,
    tokenizer_from_args,
)
from core.training.device_peak import device_peak
from core.training.exit_conditions import ExitConditions
from core.training.profiling import StepProfiler
from core.training.train_logging import TrainingLogger, memory_per_device_bytes
from core.training.train_step import make_train_step

# The checkpoint's optimizer state is the layout-independent form (parameter-shaped Adam moments
# and masters of global shape); checkpoints without this marker hold the per-device state.
OPTIMIZER_FORMAT = "global-v1"


class TrainingError(RuntimeError):
    """Training cannot go on (NaN loss, unusable checkpoint); reported as one line."""


def _first_line(error: BaseException, limit: int = 400) -> str:
    """An exception's message as one line of at most ``limit`` characters: its start and its end,
    where orbax puts the reason (``... No space left on device``)."""
    line = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return line if len(line) <= limit else f"{line[:limit // 3]} ... {line[-(limit - limit // 3 - 5):]}"


def describe_error(error: BaseException) -> str:
    """An unexpected exception as one line: its type and the first line of its message."""
    return f"{type(error).__name__}: {_first_line(error)}" if str(error).strip() else type(error).__name__


_OS_REASONS = ("No space left on device", "Permission denied", "Read-only file system", "Disk quota exceeded")
"""Reasons a checkpoint write fails that the message must name even when the error's text is long."""


def _write_error(error: BaseException) -> str:
    """A failed checkpoint write as one line: the OS reason first when the error's text holds
    one (tensorstore may put it mid-message, before a long spec that :func:`_first_line` cuts),
    then the error's first line."""
    text = str(error)
    reason = next((r for r in _OS_REASONS if r in text), None)
    return f"{reason}: {_first_line(error)}" if reason else _first_line(error)


def learning_rate_schedule(args: argparse.Namespace) -> optax.Schedule:
    """Megatron's schedule: linear warm-up to ``--lr``, then constant/linear/cosine decay to ``--min-lr``."""
    warmup_iters = lr_warmup_iters(args)
    decay_iters = max(1, lr_decay_iters(args) - warmup_iters)
    if args.lr_decay_style == "constant":
        decay = optax.constant_schedule(args.lr)
    elif args.lr_decay_style == "linear":
        decay = optax.linear_schedule(args.lr, min_lr(args), decay_iters)
    else:
        decay = optax.cosine_decay_schedule(args.lr, decay_iters, alpha=min_lr(args) / args.lr if args.lr else 0.0)
    if warmup_iters <= 0:
        return decay
    warmup = optax.linear_schedule(args.lr / warmup_iters, args.lr, warmup_iters - 1)
    return optax.join_schedules([warmup, decay], [warmup_iters])


BATCH_FIELDS = {
    "tokens": "int32 [b, s]: input ids",
    "labels": "int32 [b, s]: next-token ids",
    "loss_mask": "float32 [b, s]: 0 where a token carries no loss (--eod-mask-loss); indexed data only",
    "position_ids": "int32 [b, s]: positions restarting after every EOD; with --reset-position-ids only",
    "segment_ids": "int32 [b, s]: EODs strictly before each position (attend within equal ids); "
                   "with --reset-attention-mask only",
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
    return lambda: multihost_utils.sync_global_devices(f"core.training.pretrainer:data:{next(counter)}")


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

    With ``with_dropout_seed`` training batches (never validation ones) also carry ``dropout_seed``.
    """

    def __init__(self, args: argparse.Namespace, state: ParallelState, with_dropout_seed: bool = False):
        """Load or index the data the flags name (``args`` already validated)."""
        self.args = args
        self.with_dropout_seed = with_dropout_seed
        """Whether training batches carry ``dropout_seed`` (the model has dropout)."""
        self.source = data_source(args.data_path)
        """What ``--data-path`` names."""
        self.tokenizer = tokenizer_from_args(args)
        """The ``--tokenizer-type`` tokenizer."""
        self.indexed = self.source.kind == "indexed"
        """Whether the data are Megatron indexed datasets."""
        if self.indexed:
            self._init_indexed(args)
        else:
            self._init_text(args)
        self.context_parallel_size = state.context_parallel_size
        """cp: with more than 1, :meth:`to_global` reorders and splits every sample's sequence."""
        dp = state.data_parallel_axis_name
        self.batch_sharding = NamedSharding(state.mesh, P(dp))
        """Sharding of per-sample fields (and of every field without context parallelism)."""
        self.sequence_sharding = NamedSharding(state.mesh, P(dp, CP_AXIS) if self.context_parallel_size > 1 else P(dp))
        """Sharding of the ``[b, s]`` fields: rows over data parallelism, the sequence over ``"cp"``."""

    def _init_text(self, args: argparse.Namespace) -> None:
        text, self.corpus_description = load_corpus(self.source.text_path)
        if args.tokenizer_type == "ByteLevel":
            tokens, self.vocab_size = ByteTokenizer().encode(text), ByteTokenizer.vocab_size
        else:
            tokens = np.asarray(self.tokenizer.tokenize(text), dtype=np.int32)
            self.vocab_size = self.tokenizer.vocab_size
            self.corpus_description += f", {args.tokenizer_type} vocabulary {self.vocab_size}"
        self.unigram_entropy = unigram_entropy(tokens, self.vocab_size)
        self.train_data, self.valid_data = build_train_valid_datasets(tokens, args.seq_length, args.valid_fraction)
        self.sampler = DataParallelSampler(num_samples=len(self.train_data), micro_batch_size=args.micro_batch_size,
                                           data_parallel_rank=0, data_parallel_size=1, seed=args.seed)

    def _init_indexed(self, args: argparse.Namespace) -> None:
        self.vocab_size = self.tokenizer.vocab_size
        config = GPTDatasetConfig(
            sequence_length=args.seq_length, random_seed=args.seed, eod_token=self.tokenizer.eod,
            reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
            eod_mask_loss=args.eod_mask_loss, create_attention_mask=False, path_to_cache=args.data_cache_path)
        g = args.global_batch_size
        items = [str(x) for pair in zip(self.source.weights, self.source.prefixes) for x in pair]
        # Test split: 0 samples, not indexed (training never reads it).
        try:
            self.train_data, self.valid_data, _ = build_gpt_datasets(
                items, args.split, [args.train_iters * g, args.eval_iters * g, 0], config,
                rank=jax.process_index(), barrier=_process_barrier())
        except IndexCacheError as e:
            where = f"--data-cache-path {args.data_cache_path}" if args.data_cache_path else \
                "the dataset's directory (no --data-cache-path)"
            raise ValueError(f"{where}: {e}; pass --data-cache-path DIR on a writable filesystem") from None
        if self.train_data is None:
            raise ValueError(f"--split {args.split} gives the training split no documents")
        self.unigram_entropy = _sampled_unigram_entropy(self.source.prefixes, self.source.weights, self.vocab_size)
        self.corpus_description = (f"Megatron datasets {self.source.describe()} (--split {args.split}, "
                                   f"{args.tokenizer_type} vocabulary {self.vocab_size})")
        self.sampler = DataParallelSampler(num_samples=len(self.train_data), micro_batch_size=args.micro_batch_size,
                                           data_parallel_rank=0, data_parallel_size=1, seed=args.seed, shuffle=False)

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
        if self.args.reset_position_ids:
            batch["position_ids"] = stack("position_ids", np.int32)
        if self.args.reset_attention_mask:
            batch["segment_ids"] = get_segment_ids(batch["tokens"], self.tokenizer.eod)
        return batch

    def _host_batch(self, dataset: Any, indices: np.ndarray) -> dict[str, np.ndarray]:
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
        g = self.args.global_batch_size
        first = self.sampler.consumed_samples
        batch = self._host_batch(self.train_data, self.sampler.next_global_batch(g))
        if self.with_dropout_seed:
            batch["dropout_seed"] = dropout_seeds(self.args.seed, first, g)
        return batch

    def next_train_batch(self) -> dict[str, jax.Array]:
        """The next global batch (advances the sampler's consumed samples)."""
        return self.to_global(self.next_train_host_batch())

    def valid_host_batch(self, i: int) -> dict[str, np.ndarray]:
        """Validation batch ``i`` as numpy arrays (a fixed set, the same at every evaluation; no dropout)."""
        if self.valid_data is None:
            raise ValueError(f"--split {self.args.split} gives validation no documents")
        g = self.args.global_batch_size
        return self._host_batch(self.valid_data, np.arange(i * g, (i + 1) * g) % len(self.valid_data))

    def valid_batch(self, i: int) -> dict[str, jax.Array]:
        """Validation batch ``i`` (a fixed set, the same at every evaluation)."""
        return self.to_global(self.valid_host_batch(i))


def moe_record(metrics: dict | None) -> dict[str, Any]:
    """The logged MoE values of a step's model metrics (empty without them): ``moe_aux_loss`` and
    ``moe_z_loss`` (summed over the MoE layers, as they enter the objective) and
    ``moe_expert_load`` (per MoE layer, max / mean of the tokens routed to each expert: 1 is balanced)."""
    if not metrics or "moe_tokens_per_expert" not in metrics:
        return {}
    tpe = np.asarray(metrics["moe_tokens_per_expert"], np.float64)
    load = tpe.max(axis=-1) / np.maximum(tpe.mean(axis=-1), 1e-30)
    return {"moe_aux_loss": float(metrics["moe_aux_loss"]), "moe_z_loss": float(metrics["moe_z_loss"]),
            "moe_expert_load": [round(float(v), 6) for v in load]}


class Pretrainer:
    """Model, DDP, optimizer, data and checkpoints of one GPT pretraining run."""

    def __init__(self, args: argparse.Namespace, layout: ParallelLayout, state: ParallelState,
                 logger: TrainingLogger | None = None):
        self.args, self.layout, self.state = args, layout, state
        if args.save:  # fail now, not at the first checkpoint
            try:
                os.makedirs(args.save, exist_ok=True)
                if not os.access(args.save, os.W_OK):
                    raise PermissionError("permission denied")
            except OSError as e:
                raise ValueError(f"--save {args.save}: cannot create or write the directory ({e})") from None
        self.data = PretrainingData(args, state)
        self.config = model_config(args, self.data.vocab_size)  # the tokenizer decides the vocabulary
        try:  # again, with the tokenizer's vocabulary (validate_args checked the flags' model)
            self.config.validate(layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size
                                 * (layout.virtual_pipeline_model_parallel_size or 1))
        except ValueError as e:
            raise ValueError(str(e).replace("_", "-")) from None
        self.data.with_dropout_seed = self.config.attention_dropout > 0 or self.config.hidden_dropout > 0
        self.model = GPTModel(self.config, state)
        self.schedule = learning_rate_schedule(args)
        # The learning rate of every iteration, on the host: evaluating the (jnp) schedule per step
        # would queue a device op behind the running step and wait for it (a host sync per step).
        self.learning_rates = np.asarray(jax.jit(jax.vmap(self.schedule))(jnp.arange(max(1, args.train_iters))))
        # No in-step NaN skip (check_for_nan_in_grad): the loop stops at the first non-finite loss
        # or grad norm and saves nothing after it (Megatron's --check-for-nan-in-loss-and-grad), so
        # parameters left unchanged would never be used; the skip's conditional costs ~1% of a CPU step.
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=args.use_distributed_optimizer, overlap_grad_reduce=args.overlap_grad_reduce,
            num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
            grad_reduce_in_fp32=True, check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad,
            check_for_spiky_loss=args.check_for_spiky_loss, spiky_loss_factor=args.spiky_loss_factor)
        self.optimizer_config = OptimizerConfig(optimizer="adam", lr=args.lr, weight_decay=args.weight_decay,
                                    adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, clip_grad=args.clip_grad)
        self.ddp = DistributedDataParallel(state, ddp_config, self.model)
        self.logger = logger
        self._peak = None
        self.iteration = 0
        self.skipped_checkpoints: list[str] = []
        self.run_id = checkpointing.new_run_id()
        """This run's identifier, recorded in its checkpoints; a resume takes the checkpoint's
        (``--finetune`` starts a new run), so a run's checkpoints share one across restarts."""
        signal_name = args.exit_signal if getattr(args, "exit_signal_handler", False) else None
        minutes = getattr(args, "exit_duration_in_mins", None)
        self.exit_conditions = ExitConditions(state.mesh, signal_name, None if minutes is None else minutes * 60) \
            if signal_name is not None or minutes is not None else None
        """Megatron's ``--exit-signal-handler`` and ``--exit-duration-in-mins`` (None without
        either): checked every iteration by :meth:`train`, which saves and stops where every
        process agrees; its ``reason`` says why a run stopped early (0: it did not). The signal
        is caught and the time budget counted from here."""
        self._saver: checkpointing.CheckpointSaver | None = None
        self._save_in_flight: int | None = None  # the iteration of an asynchronous save not yet committed
        self.saving: int | None = None
        """The iteration whose checkpoint :meth:`save` is writing (synchronous) or dispatching, else None."""
        self._checkpoint_copy: Callable | None = None
        self._checkpoint_records: str | None = None  # the layout and model records, as JSON (constant)
        self.params = self.ddp.init(jax.random.key(args.seed),
                                    jnp.zeros((args.micro_batch_size, args.seq_length), jnp.int32))
        self.optimizer = get_megatron_optimizer(self.optimizer_config, [self.ddp], self.schedule)
        self.opt_state = self.optimizer.init_state(self.params)
        self.moe_state = self._init_moe_state()
        """The model's non-trainable MoE state (``{"expert_bias": [vpp, pp * n_moe, E]}``), None
        without ``--moe-router-enable-expert-bias``: updated after every optimizer step, checkpointed."""
        m = layout.num_microbatches
        sequence_axis = CP_AXIS if state.context_parallel_size > 1 else None
        loss_fn, fb = self.model.loss_fn, None
        if layout.pipeline_model_parallel_size > 1:
            loss_fn, fb = None, functools.partial(self.model.forward_backward, num_microbatches=m)
        state_args = {}
        if self.moe_state is not None:
            state_args = {"model_state_specs": self.model.moe_state_spec(),
                          "update_model_state": lambda s, report: self.model.update_moe_state(s, report, m)}
        self.train_step = make_train_step(self.ddp, self.optimizer, loss_fn, m, forward_backward=fb,
                                          sequence_axis=sequence_axis, **state_args)
        self.eval_step = self._make_eval_step()

    def _init_moe_state(self) -> dict[str, jax.Array] | None:
        """Zero expert biases (Megatron's initial value), split over ``"pp"`` like the MoE layers."""
        if not self.model.has_expert_bias:
            return None
        specs = self.model.moe_state_spec()
        return {k: jnp.zeros(v.shape, v.dtype, device=NamedSharding(self.state.mesh, specs[k]))
                for k, v in self.model.moe_state_shape().items()}

    # -- steps -----------------------------------------------------------------------------
    def _make_eval_step(self):
        m, dp_axes = self.layout.num_microbatches, self.state.data_parallel_axis_name
        sequence_axis = CP_AXIS if self.state.context_parallel_size > 1 else None
        # Every cp rank's loss is already the whole sequence's (eval_loss sums over "cp").
        fn = lambda p, b, s: lax.pmean(self.model.eval_loss(p, b, m, s), dp_axes)
        state_spec = None if self.moe_state is None else self.model.moe_state_spec()
        programs: dict[Any, Callable] = {}

        def eval_step(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
            key = tuple(sorted((k, v.ndim) for k, v in batch.items()))
            if key not in programs:
                specs = self.ddp.batch_specs(batch, sequence_axis)
                programs[key] = jax.jit(jax.shard_map(fn, mesh=self.state.mesh,
                                                      in_specs=(self.ddp.param_specs, specs, state_spec),
                                                      out_specs=P(), check_vma=False))
            return programs[key](params, batch, self.moe_state)

        return eval_step

    def evaluate(self) -> float:
        """Mean validation loss over ``--eval-iters`` batches (NaN without validation data)."""
        if not self.data.num_valid_samples:
            return math.nan
        return float(np.mean([float(self.eval_step(self.params, self.data.valid_batch(i)))
                              for i in range(self.args.eval_iters)]))

    def dispatch_step(self) -> dict[str, Any]:
        """Start one training iteration without waiting for it; returns its pending record, whose
        ``loss`` and ``grad_norm`` are device arrays until :meth:`collect` reads them."""
        batch = self.data.next_train_batch()
        if self.moe_state is None:
            self.params, self.opt_state, metrics = self.train_step(self.params, self.opt_state, batch)
        else:
            self.params, self.opt_state, metrics, self.moe_state = self.train_step(self.params, self.opt_state,
                                                                                   batch, self.moe_state)
        self.iteration += 1
        lr = float(self.learning_rates[min(self.iteration, len(self.learning_rates)) - 1])
        return {"iteration": self.iteration, "consumed_samples": self.data.sampler.consumed_samples,
                "loss": metrics["loss"], "lr": lr, "grad_norm": metrics["grad_norm"], "_metrics": metrics}

    def collect(self, pending: list[dict[str, Any]], elapsed: float) -> list[dict[str, Any]]:
        """Read back the pending records' losses and grad norms (one transfer; waits for the last
        step) and add timing over the ``elapsed`` seconds they took together. Raises
        :class:`TrainingError` at the first non-finite value."""
        values = jax.device_get([(r["loss"], r["grad_norm"], r["_metrics"].get("spiky_loss", False),
                                  r["_metrics"].get("recent_max_loss", 0.0), r["_metrics"]["report"])
                                 for r in pending])
        per_step = elapsed / max(1, len(pending))
        tokens = self.args.global_batch_size * self.args.seq_length
        records = []
        for record, (loss, grad_norm, spiky, recent_max, model_metrics) in zip(pending, values):
            loss, grad_norm = float(loss), float(grad_norm)
            metrics = record.pop("_metrics")
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                where = ""
                if self.args.check_for_nan_in_loss_and_grad:
                    try:
                        self.optimizer.check_nonfinite(metrics)
                    except FloatingPointError as e:
                        where = f" {e}"
                raise TrainingError(f"iteration {record['iteration']}: loss is {loss}, grad norm is {grad_norm} "
                                    f"(NaN/Inf in the loss or gradients);{where} stopping, the last checkpoint "
                                    "is kept")
            record = {**record, "loss": loss, "grad_norm": grad_norm, "tokens_per_sec": tokens / per_step,
                      "step_time_s": per_step, **moe_record(model_metrics)}
            if bool(spiky):
                record["skipped"] = True
                if self.logger:
                    self.logger.print(f"WARNING: iteration {record['iteration']}: loss {loss:.4f} is above "
                                      f"{self.args.spiky_loss_factor:g} x the recent maximum {float(recent_max):.4f} "
                                      "(spiky); the update was skipped")
            records.append(record)
        return records

    def step(self) -> dict[str, Any]:
        """One training iteration, waited for; returns its metrics record (host values)."""
        t = time.perf_counter()
        pending = self.dispatch_step()
        jax.block_until_ready(pending["loss"])
        return self.collect([pending], time.perf_counter() - t)[0]

    # -- checkpoints -----------------------------------------------------------------------
    def model_record(self) -> dict[str, Any]:
        """The model fields a checkpoint must match: those that shape the parameters (numerics
        and execution choices such as bf16, SP, recompute or dropout may change on resume)."""
        record = dataclasses.asdict(self.config)
        for field in ("bf16", "sequence_parallel", "recompute_granularity", "unroll_layers", "attention_dropout",
                      "hidden_dropout", "context_parallel_size", "cp_comm_type"):
            record.pop(field)
        if record["moe"] is not None:  # an execution choice, as the ones above
            record["moe"].pop("moe_grouped_gemm_implementation")
        if isinstance(record["moe_layer_freq"], tuple):  # as the JSON metadata reads back
            record["moe_layer_freq"] = list(record["moe_layer_freq"])
        return record

    def layout_record(self) -> dict[str, Any]:
        """The layout a checkpoint was written in (informational: any layout loads it)."""
        return {"tensor_model_parallel_size": self.layout.tensor_model_parallel_size,
                "pipeline_model_parallel_size": self.layout.pipeline_model_parallel_size,
                "virtual_pipeline_model_parallel_size": self.layout.virtual_pipeline_model_parallel_size,
                "data_parallel_size": self.layout.data_parallel_size,
                "context_parallel_size": self.layout.context_parallel_size,
                "use_distributed_optimizer": bool(self.args.use_distributed_optimizer),
                "num_devices": int(self.state.mesh.devices.size)}

    def checkpoint_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(state, metadata)`` as a checkpoint stores them: params, the optimizer state in the
        layout-independent form
        (:meth:`~core.optimizer.MegatronOptimizer.state_to_global`; not with
        ``--no-save-optim``) and the
        MoE expert biases (with ``--moe-router-enable-expert-bias``), in layer order; iteration,
        data position, seed, layout and model shape. The arrays are new ones, computed by one
        jitted program (dispatched, not waited for): the next training step may update or donate
        the trainer's own."""
        if self._checkpoint_records is None:  # built once: an async save's blocking part is on the step loop
            self._checkpoint_records = json.dumps({"layout": self.layout_record(), "model": self.model_record()})
        meta = {"iteration": self.iteration, "consumed_samples": self.data.sampler.consumed_samples,
                "seed": self.args.seed, "run_id": self.run_id, **json.loads(self._checkpoint_records),
                "optimizer_format": OPTIMIZER_FORMAT,
                "optimizer_saved": self._saves_optimizer}
        if self._checkpoint_copy is None:
            self._checkpoint_copy = self._make_checkpoint_copy()
        state = self._checkpoint_copy(self.params, self.opt_state, self.moe_state)
        if self.moe_state is None:
            del state["moe_state"]
        return state, meta

    def _make_checkpoint_copy(self) -> Callable:
        """The jitted program of :meth:`checkpoint_state`'s arrays, layers in checkpoint order
        (vpp-independent; the MoE state is stacked per MoE layer like the layers)."""
        # The params' copy split over the data-parallel ranks too, as the optimizer state's global
        # form is: a save holds 1/dp of params + Adam state per device (orbax writes any sharding).
        split = jax.tree.map(self.ddp.checkpoint_sharding, self.params)

        def gather(params: Any, opt_state: Any, moe_state: Any) -> dict[str, Any]:
            state = {"params": jax.tree.map(jax.lax.with_sharding_constraint, params, split), "moe_state": moe_state}
            if self._saves_optimizer:
                state["opt_state"] = self.optimizer.state_to_global(opt_state)
            return state

        def copy(params: Any, opt_state: Any, moe_state: Any) -> dict[str, Any]:
            # A real copy of the inputs; XLA elides it for what the program computes (the
            # optimizer state's global form), so that is not copied a second time.
            state = jax.tree.map(jnp.copy, gather(params, opt_state, moe_state))
            state["moe_state"] = jax.tree.map(merge_chunks, state["moe_state"])
            return map_layer_leaves(merge_chunks, state, self.ddp.param_paths)

        if (self.layout.virtual_pipeline_model_parallel_size or 1) == 1:
            return jax.jit(copy)  # merge_chunks is the identity
        # Each array keeps its sharding through the reshape (dim 1 over pp), as a load expects.
        shardings = {"params": split, "moe_state": jax.tree.map(lambda x: x.sharding, self.moe_state)}
        if self._saves_optimizer:
            shardings["opt_state"] = jax.tree.map(lambda x: x.sharding, self.optimizer.global_state_abstract())
        return jax.jit(copy, out_shardings=shardings)

    @property
    def _saves_optimizer(self) -> bool:
        """Whether checkpoints hold the optimizer state (not with ``--no-save-optim``)."""
        return not getattr(self.args, "no_save_optim", False)

    def save(self, directory: str) -> None:
        """Checkpoint :meth:`checkpoint_state` as this iteration (atomic). With ``--async-save``
        this returns once an on-device copy of the values is dispatched (the previous save, if
        still in flight, is waited for first, and its error raised); the writer process (or
        thread, ``--async-save-writer``) writes and commits; :meth:`finish_saving` waits for the
        last one. Raises :class:`TrainingError` naming the iteration whose checkpoint could not
        be written (earlier checkpoints stay intact). A checkpoint is logged as saved only once
        it is committed."""
        self.saving = self.iteration
        writer = self.args.async_save_writer
        if self._saver is None or self._saver.directory != os.path.abspath(directory) or (
                writer is not None and self._saver.writer != writer):
            self.finish_saving()
            self._saver = checkpointing.CheckpointSaver(directory, writer=writer)
        self._saver.async_save = bool(self.args.async_save)
        self._wait_for_save()  # the previous save's copy is freed before this one is made
        try:
            state, meta = self.checkpoint_state()
            self._saver.save(self.iteration, state, meta, copy=False)  # the state is a copy already
        except (OSError, ValueError) as e:  # orbax reports a full disk as ValueError(RESOURCE_EXHAUSTED)
            self._saver, self.saving = None, None
            raise TrainingError(f"cannot write checkpoint {self.iteration} to {directory}: {_write_error(e)}; "
                                "the earlier checkpoints are intact") from None
        self.saving = None  # (still set when a KeyboardInterrupt leaves mid-save: the error line says so)
        if self._saver.async_save:
            self._save_in_flight = self.iteration
            self._log(f" started an asynchronous save of checkpoint {self.iteration} to {directory}")
        else:
            self._log_saved(self.iteration, directory)

    def _log(self, line: str) -> None:
        if self.logger:
            self.logger.print(line)

    def _log_saved(self, iteration: int, directory: str) -> None:
        self._log(f" saved checkpoint at iteration {iteration:8d} to {directory}")

    def _wait_for_save(self, close: bool = False) -> None:
        """Wait for the asynchronous save in flight (if any) and log it as saved once committed;
        :class:`TrainingError` naming its iteration if it failed. With ``close``, also stop the
        saver's writer process."""
        if self._saver is None:
            return
        step, directory = self._save_in_flight, self._saver.directory
        try:
            self._saver.close() if close else self._saver.wait()
        except (OSError, ValueError) as e:
            self._saver, self._save_in_flight = None, None
            what = f"checkpoint {step}" if step is not None else "a checkpoint"
            raise TrainingError(f"cannot write {what} to {directory}: {_write_error(e)}; "
                                "the earlier checkpoints are intact") from None
        self._save_in_flight = None
        if step is not None:
            self._log_saved(step, directory)

    def poll_saving(self) -> None:
        """Log (or raise the error of) an asynchronous save that has finished, without waiting
        for one that has not (called where the loop reads back its values)."""
        if self._save_in_flight is not None and self._saver is not None and self._saver.finished():
            self._wait_for_save()

    def finish_saving(self, close: bool = True) -> None:
        """Wait for an asynchronous save in flight to be committed (a no-op otherwise); with
        ``close``, also stop the checkpoint writer process (a later save starts a new one)."""
        self._wait_for_save(close=close)
        if close:
            self._saver = None

    def load(self, directory: str, load_optimizer: bool = True, step: int | None = None,
             finetune: bool = False) -> bool:
        """Resume from the newest intact checkpoint in ``directory`` in this run's layout, whatever
        the layout it was saved in; False if there is none yet. Newer checkpoints with a damaged
        file are skipped and listed in ``skipped_checkpoints``; if every one is damaged,
        :class:`TrainingError` names the files.

        ``step`` (``--ckpt-step``): load that checkpoint, not the newest; :class:`TrainingError`
        if it is missing, incomplete or damaged. ``finetune`` (``--finetune``): the parameters
        only (no optimizer state), and the run starts at iteration 0 at the start of the data."""
        load_optimizer = load_optimizer and not finetune
        if step is None:
            step, self.skipped_checkpoints = checkpointing.latest_valid_step(directory)
            if step is None and self.skipped_checkpoints:
                raise TrainingError(f"--load {directory}: no intact checkpoint ({'; '.join(self.skipped_checkpoints)})")
            if step is None:
                return False
        else:
            problem = checkpointing.step_problem(directory, step)
            if problem is not None:
                raise TrainingError(f"--load {directory} --ckpt-step {step}: {problem}")
        meta = checkpointing.load_metadata(directory, step)
        self._check_compatible(directory, meta, load_optimizer, finetune)
        if meta.get("optimizer_format") == OPTIMIZER_FORMAT:  # any layout, any vpp
            target = {"params": self.params}
            if load_optimizer:
                target["opt_state"] = self.optimizer.global_state_abstract()
            target = map_layer_leaves(layer_order_target, target, self.ddp.param_paths)
            if self.moe_state is not None:
                target["moe_state"] = jax.tree.map(layer_order_target, self.moe_state)
            restored, _ = checkpointing.restore_checkpoint(directory, step, target, partial=not load_optimizer)
            vpp = self.layout.virtual_pipeline_model_parallel_size or 1
            restored = map_layer_leaves(lambda x: from_layer_order(x, vpp), restored, self.ddp.param_paths)
            self.params = restored["params"]
            if self.moe_state is not None:
                self.moe_state = jax.tree.map(lambda x: from_layer_order(x, vpp), restored["moe_state"])
            if load_optimizer:
                self.opt_state = self.optimizer.state_from_global(restored["opt_state"])
        else:  # the per-device format: the optimizer state only into its own layout
            target = {"params": self.params, **({"opt_state": self.opt_state} if load_optimizer else {})}
            restored, _ = checkpointing.restore_checkpoint(directory, step, target, partial=not load_optimizer)
            self.params = restored["params"]
            if load_optimizer:
                self.opt_state = restored["opt_state"]
        if finetune:  # Megatron's --finetune: a new run from these weights
            return True
        self.run_id = meta.get("run_id", self.run_id)  # checkpoints from before run ids: this run adopts them
        self.iteration = int(meta["iteration"])
        position = {"consumed_samples": int(meta["consumed_samples"]), "seed": int(meta["seed"])}
        self.data.sampler.load_state_dict(position)
        return True

    def check_save_directory(self) -> None:
        """Raise :class:`TrainingError` if ``--save`` holds a checkpoint of another model, one
        newer than this run's current iteration (a save would then not be newer, and would fail
        only when the run reaches it: a new run pointed at an old run's directory, or
        ``--finetune`` writing where a run saved), or one of another run of this model: this
        run's keep-last rotation would delete another model's or run's checkpoints
        (:meth:`foreign_checkpoint`)."""
        if not self.args.save:
            return
        other_model, other_run = self._foreign_checkpoints(self.args.save)  # one read of each step's metadata
        self._refuse_foreign(other_model)
        latest = checkpointing.latest_step(self.args.save)
        if latest is not None and latest > self.iteration:
            if self.skipped_checkpoints and self.args.load and os.path.abspath(self.args.load) == os.path.abspath(
                    self.args.save):
                raise TrainingError(
                    f"--save {self.args.save} holds checkpoint {latest}, newer than iteration {self.iteration} this "
                    f"run resumed from, but damaged (skipped at --load): move it out of {self.args.save} to save "
                    "there again")
            raise TrainingError(
                f"--save {self.args.save} already holds checkpoint {latest}, newer than this run's start "
                f"(iteration {self.iteration}): its saves would not be newer. Resume from it with --load "
                f"{self.args.save} (without --finetune), or save elsewhere")
        self._refuse_foreign(other_run)

    def _refuse_foreign(self, foreign: str | None) -> None:
        if foreign is not None:
            raise TrainingError(
                f"--save {self.args.save} holds {foreign}: this run's saves would rotate it away "
                f"(the newest {checkpointing.DEFAULT_MAX_TO_KEEP} are kept). Save to another directory, or move "
                "those checkpoints out")

    def foreign_checkpoint(self, directory: str, other_runs: bool = True) -> str | None:
        """None when every complete checkpoint in ``directory`` is this run's, else one phrase
        naming one that is not: the newest of another model (the fields of :meth:`model_record`,
        saved then this run's) or whose metadata cannot be read; else, with ``other_runs``, the
        newest of another run of this model (another :attr:`run_id`; checkpoints written before
        run ids are checked by their model only)."""
        other_model, other_run = self._foreign_checkpoints(directory)
        return other_model or (other_run if other_runs else None)

    def _foreign_checkpoints(self, directory: str) -> tuple[str | None, str | None]:
        """The phrases of :meth:`foreign_checkpoint`, (another model or unreadable, another run),
        from one read of each step's metadata, newest first."""
        other_run = None
        for step in reversed(checkpointing.complete_steps(directory)):
            try:
                meta = checkpointing.load_metadata(directory, step)
                diff = self._model_differences(meta["model"])
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                return f"checkpoint {step}, whose metadata cannot be read ({_first_line(e)})", other_run
            if diff:
                return f"checkpoint {step} of a different model: {diff}", other_run
            if other_run is None and meta.get("run_id", self.run_id) != self.run_id:
                other_run = (f"checkpoint {step} of another run of this model (run {meta['run_id']}, this run "
                             f"{self.run_id})")
        return None, other_run

    def _model_differences(self, saved: dict) -> str:
        """The fields of :meth:`model_record` where ``saved`` differs, as ``name=saved (now
        this run's)``; empty when none do."""
        return ", ".join(f"{k}={saved.get(k)!r} (now {v!r})" for k, v in self.model_record().items()
                         if saved.get(k) != v)

    def _check_compatible(self, directory: str, meta: dict, load_optimizer: bool, finetune: bool) -> None:
        diff = self._model_differences(meta["model"])
        if diff:
            raise TrainingError(f"checkpoint {directory} holds a different model: {diff}")
        if not finetune and int(meta["seed"]) != self.args.seed:
            raise TrainingError(
                f"--seed {self.args.seed} differs from the seed of checkpoint {meta['iteration']} in {directory} "
                f"({meta['seed']}): a resumed run's data order and dropout follow the seed it started with. Pass "
                f"--seed {meta['seed']} to resume, or --finetune to start a new run from these weights")
        if load_optimizer and meta.get("optimizer_saved") is False:
            raise TrainingError(f"checkpoint {meta['iteration']} in {directory} was saved without its optimizer "
                                "state (--no-save-optim): pass --no-load-optim (or --finetune) to load its parameters")
        # Checkpoints written before context parallelism existed were all cp=1.
        old, new = {"context_parallel_size": 1, **meta["layout"]}, self.layout_record()
        global_format = meta.get("optimizer_format") == OPTIMIZER_FORMAT
        vpp_key = "virtual_pipeline_model_parallel_size"
        if not global_format and old[vpp_key] != new[vpp_key]:
            raise TrainingError(
                f"checkpoint {directory} was saved with virtual-pipeline-model-parallel-size "
                f"{old['virtual_pipeline_model_parallel_size']}, now {new['virtual_pipeline_model_parallel_size']}: "
                "the stacked layer arrays differ; resume with the same --virtual-pipeline-model-parallel-size")
        if load_optimizer and not global_format and old != new:
            describe = lambda r: ", ".join(f"{k}={v}" for k, v in r.items())
            raise TrainingError(
                f"checkpoint {directory} stores its optimizer state per device (the format before "
                f"'{OPTIMIZER_FORMAT}'), saved with layout ({describe(old)}), now ({describe(new)}): it loads only "
                "into its own layout; pass --no-load-optim to load only the parameters (resharded) with a "
                "fresh optimizer state")

    # -- the loop ----------------------------------------------------------------------------
    @property
    def peak(self):
        """The device peak MFU is taken against (:mod:`core.training.device_peak`), found once."""
        if self._peak is None:
            self._peak = device_peak(self.config.compute_dtype)
        return self._peak

    def _add_throughput(self, record: dict[str, Any]) -> None:
        # A process's CPU devices share its cores, and a CPU peak is measured with all of them.
        devices_per_peak = jax.local_device_count() if jax.devices()[0].platform == "cpu" else 1
        per_device = record["tokens_per_sec"] / self.state.mesh.devices.size
        record["tflops_per_device"] = self.config.flops_per_token() * per_device / 1e12
        record["mfu"] = record["tflops_per_device"] * devices_per_peak * 1e12 / self.peak.flops
        record["memory_per_device_bytes"] = memory_per_device_bytes()

    def _must_collect(self, stop: int) -> bool:
        """Whether this iteration's values are needed now: a log line, an evaluation, a checkpoint or the end."""
        args, i = self.args, self.iteration
        evaluate = bool(args.eval_interval) and i % args.eval_interval == 0
        save = bool(args.save and args.save_interval) and i % args.save_interval == 0
        return i == 1 or i == stop or i % args.log_interval == 0 or evaluate or save

    def train(self) -> list[dict[str, Any]]:
        """Run to ``--train-iters`` (or the next multiple of ``--exit-interval``, or until an
        :attr:`exit_conditions` stop, saving there); returns every iteration's record.
        Returns (or raises) only once the last checkpoint is committed; raises
        :class:`TrainingError` before the first step if ``--save`` holds a newer checkpoint
        (:meth:`check_save_directory`)."""
        self.check_save_directory()
        exits = self.exit_conditions
        if exits is not None:
            exits.install()  # again after a previous train(); given back once the last checkpoint is committed
        try:
            try:
                return self._train_loop()
            finally:
                self.finish_saving()
        finally:
            if exits is not None:
                exits.uninstall()

    def _train_loop(self) -> list[dict[str, Any]]:
        args = self.args
        records, pending = [], []
        stop = args.train_iters
        if args.exit_interval:  # Megatron's: the next iteration divisible by it
            stop = min(stop, (self.iteration // args.exit_interval + 1) * args.exit_interval)
        profiler = StepProfiler(args, jax.process_index())
        start = time.perf_counter()
        try:
            while self.iteration < stop:
                profiler.before_step(self.iteration, [r["loss"] for r in pending])
                pending.append(self.dispatch_step())
                profiler.after_step(self.iteration, pending[-1]["loss"])
                if self.exit_conditions is not None and self.exit_conditions.poll(self.iteration):
                    stop = self.iteration  # every process agreed: collect, save and stop here
                pending, start = self._after_dispatch(records, pending, stop, start)
        finally:
            profiler.close()
        return records

    def _after_dispatch(self, records: list, pending: list, stop: int, start: float) -> tuple[list, float]:
        """Bound the steps in flight; at a collect point read them back, log, evaluate and save.
        Returns the steps still pending and the start time of the current timing window."""
        log = self.logger
        if log:
            log.advance()
        if len(pending) >= 2:  # at most two steps in flight: the device stays busy with the newest
            jax.block_until_ready(pending[-2]["loss"])
        if not self._must_collect(stop):
            return pending, start
        # Wait for the last step (its loss and the updated state) before reading the clock:
        # dispatch returns at once on a GPU, and collect's read-back waits only after the clock.
        jax.block_until_ready((pending[-1]["loss"], self.params, self.opt_state))
        done = self.collect(pending, time.perf_counter() - start)
        for record in done:
            self._add_throughput(record)
        records += done
        self._after_collect(done[-1], stop)
        return [], time.perf_counter()  # evaluation and checkpoint time is not step time

    def _after_collect(self, record: dict[str, Any], stop: int) -> None:
        """Evaluate, log and save at an iteration whose values were just read back."""
        args, log, i = self.args, self.logger, self.iteration
        self.poll_saving()
        if args.eval_interval and i % args.eval_interval == 0 and self.data.num_valid_samples:
            record["valid_loss"] = self.evaluate()
        if log:
            log.set_loss(record["loss"])
            if i % args.log_interval == 0 or i == 1 or "valid_loss" in record:
                log.log_iteration(record, args.train_iters)
            if "valid_loss" in record:
                self._log_validation(record["valid_loss"])
        if args.save and args.save_interval and i % args.save_interval == 0:
            self.save(args.save)
        elif args.save and i == stop:
            self.save(args.save)  # the final state

    def _log_validation(self, loss: float) -> None:
        self.logger.print(f" validation loss at iteration {self.iteration} | lm loss value: {loss:.6E} | "
                          f"lm loss PPL: {math.exp(min(loss, 50)):.4E} | unigram entropy of the corpus: "
                          f"{self.data.unigram_entropy:.4f}")
