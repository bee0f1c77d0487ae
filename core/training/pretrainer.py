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
import functools
import itertools
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

from core.checkpointing.checkpointer import Checkpointer, TrainingState, first_line
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
    checkpoint_config,
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


class TrainingError(RuntimeError):
    """Training cannot go on (NaN loss, unusable checkpoint); reported as one line."""


def describe_error(error: BaseException) -> str:
    """An unexpected exception as one line: its type and the first line of its message."""
    return f"{type(error).__name__}: {first_line(error)}" if str(error).strip() else type(error).__name__


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
        self._logger = logger
        self._peak = None
        self.iteration = 0
        signal_name = args.exit_signal if getattr(args, "exit_signal_handler", False) else None
        minutes = getattr(args, "exit_duration_in_mins", None)
        self.exit_conditions = ExitConditions(state.mesh, signal_name, None if minutes is None else minutes * 60) \
            if signal_name is not None or minutes is not None else None
        """Megatron's ``--exit-signal-handler`` and ``--exit-duration-in-mins`` (None without
        either): checked every iteration by :meth:`train`, which saves and stops where every
        process agrees; its ``reason`` says why a run stopped early (0: it did not). The signal
        is caught and the time budget counted from here."""
        self.params = self.ddp.init(jax.random.key(args.seed),
                                    jnp.zeros((args.micro_batch_size, args.seq_length), jnp.int32))
        self.optimizer = get_megatron_optimizer(self.optimizer_config, [self.ddp], self.schedule)
        self.opt_state = self.optimizer.init_state(self.params)
        self.checkpointer = Checkpointer(checkpoint_config(args), self.config, layout, self.ddp, self.optimizer,
                                         args.seed, logger)
        """The run's checkpoints (:class:`~core.checkpointing.checkpointer.Checkpointer`)."""
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
    @property
    def logger(self) -> TrainingLogger | None:
        """Rank 0's logger (None elsewhere); the checkpointer's save lines go to it too."""
        return self._logger

    @logger.setter
    def logger(self, logger: TrainingLogger | None) -> None:
        self._logger = self.checkpointer.logger = logger

    def training_state(self) -> TrainingState:
        """The run's state as a checkpoint stores it."""
        return TrainingState(self.iteration, self.data.sampler.consumed_samples, self.params, self.opt_state,
                             self.moe_state)

    def save(self, directory: str | None = None) -> None:
        """Checkpoint this iteration to ``directory`` (default ``--save``): :meth:`Checkpointer.save
        <core.checkpointing.checkpointer.Checkpointer.save>`."""
        self.checkpointer.save(directory or self.args.save, self.training_state())

    def load(self, directory: str, load_optimizer: bool = True, step: int | None = None,
             finetune: bool = False) -> bool:
        """Resume from ``directory`` (:meth:`Checkpointer.load
        <core.checkpointing.checkpointer.Checkpointer.load>`); False if it holds no checkpoint yet."""
        restored = self.checkpointer.load(directory, self.training_state(), load_optimizer, step, finetune)
        if restored is None:
            return False
        self.params, self.opt_state, self.moe_state = restored.params, restored.opt_state, restored.moe_state
        if not finetune:
            self.iteration = restored.iteration
            self.data.sampler.load_state_dict({"consumed_samples": restored.consumed_samples, "seed": self.args.seed})
        return True

    def check_save_directory(self) -> None:
        """Refuse a ``--save`` directory this run must not write to, before the first step."""
        self.checkpointer.check_save_directory(self.iteration)

    def finish_saving(self, close: bool = True) -> None:
        """Wait for an asynchronous save in flight to be committed; with ``close``, stop the writer."""
        self.checkpointer.finish(close)

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
        self.checkpointer.poll()
        if args.eval_interval and i % args.eval_interval == 0 and self.data.num_valid_samples:
            record["valid_loss"] = self.evaluate()
        if log:
            log.set_loss(record["loss"])
            if i % args.log_interval == 0 or i == 1 or "valid_loss" in record:
                log.log_iteration(record, args.train_iters)
            if "valid_loss" in record:
                self._log_validation(record["valid_loss"])
        if self.checkpointer.due(i, stop):
            self.save()

    def _log_validation(self, loss: float) -> None:
        self.logger.print(f" validation loss at iteration {self.iteration} | lm loss value: {loss:.6E} | "
                          f"lm loss PPL: {math.exp(min(loss, 50)):.4E} | unigram entropy of the corpus: "
                          f"{self.data.unigram_entropy:.4f}")
