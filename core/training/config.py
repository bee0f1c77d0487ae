"""The typed configuration of a pretraining run: what :class:`~core.training.pretrainer.Pretrainer`
reads, grouped as Megatron groups its flags. ``core.training.run_config.pretrain_config`` maps the
flags into them in one place; the trainer never sees the flags' namespace."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from core.checkpointing.checkpointer import CheckpointConfig
    from core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
    from core.models.gpt import GPTConfig
    from core.optimizer.optimizer_config import OptimizerConfig
    from core.optimizer.optimizer_param_scheduler import SchedulerConfig


@dataclasses.dataclass(frozen=True)
class TrainingConfig:
    """The loop: batch sizes, length, evaluation, stops and checks."""

    micro_batch_size: int = 4
    """``--micro-batch-size``: samples per microbatch per data-parallel rank."""
    global_batch_size: int = 16
    """``--global-batch-size``: samples per iteration over all data-parallel ranks."""
    seq_length: int = 128
    """``--seq-length``: tokens per sample."""
    train_iters: int = 100
    """``--train-iters``: the iteration the run ends at."""
    seed: int = 1234
    """``--seed``: initialisation, data order and dropout."""
    eval_interval: int | None = None
    """``--eval-interval``: a validation pass every this many iterations (None: never)."""
    eval_iters: int = 10
    """``--eval-iters``: batches per validation pass."""
    exit_interval: int | None = None
    """``--exit-interval``: stop at the next multiple of this many iterations."""
    exit_signal: str | None = None
    """The signal that saves and stops the run (``--exit-signal-handler``'s ``--exit-signal``), None without."""
    exit_duration_in_mins: float | None = None
    """``--exit-duration-in-mins``: save and stop once the run has taken this long."""
    check_for_nan_in_loss_and_grad: bool = True
    """``--check-for-nan-in-loss-and-grad``: stop at a non-finite loss or gradient, naming params and ranks."""
    check_for_spiky_loss: bool = False
    """``--check-for-spiky-loss``: skip the update of a loss far above the recent maximum."""
    spiky_loss_factor: float = 10.0
    """``--spiky-loss-factor``: how far above the recent maximum a loss is spiky."""


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The training data: where it is, how it is tokenized, split and batched."""

    data_path: tuple[str, ...] | None = None
    """``--data-path``: a text file or directory, or Megatron dataset prefixes with optional weights."""
    split: str = "969,30,1"
    """``--split``: train/valid/test weights of indexed datasets."""
    valid_fraction: float = 0.1
    """The share of a text corpus held out for validation."""
    tokenizer_type: str = "ByteLevel"
    """``--tokenizer-type``."""
    tokenizer_model: str | None = None
    """``--tokenizer-model``: a Hugging Face ``tokenizer.json`` or directory."""
    vocab_file: str | None = None
    """``--vocab-file`` (GPT-2 BPE)."""
    merge_file: str | None = None
    """``--merge-file`` (GPT-2 BPE)."""
    vocab_size: int | None = None
    """``--vocab-size`` (``NullTokenizer``)."""
    data_cache_path: str | None = None
    """``--data-cache-path``: where the dataset index caches go (default: beside the data)."""
    reset_position_ids: bool = False
    """``--reset-position-ids``: positions restart after every end-of-document token."""
    reset_attention_mask: bool = False
    """``--reset-attention-mask``: attention stays inside each document."""
    eod_mask_loss: bool = False
    """``--eod-mask-loss``: no loss on end-of-document tokens."""
    sft: bool = False
    """``--sft``: ``data_path`` is a JSONL of chat conversations, packed, the loss on the assistant's tokens."""
    sft_tokenizer_prompt_format: str = "default"
    """``--sft-tokenizer-prompt-format``: the tokenizer's chat template, or one of Megatron's fixed ones."""


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """What the run prints and writes (rank 0)."""

    log_interval: int = 10
    """``--log-interval``: a log line every this many iterations."""
    metrics_file: str | None = None
    """``--metrics-file``: one JSON line per logged iteration."""
    progress_bar: bool = True
    """A progress bar on a terminal (``--no-progress-bar`` turns it off)."""
    tensorboard_dir: str | None = None
    """``--tensorboard-dir``: write TensorBoard event files here (rank 0; needs tensorboardX)."""
    tensorboard_log_interval: int = 1
    """``--tensorboard-log-interval``: TensorBoard and W&B get every this-many-th iteration's scalars."""
    tensorboard_queue_size: int = 1000
    """``--tensorboard-queue-size``: events queued before the writer flushes them to disk."""
    log_timers_to_tensorboard: bool = False
    """``--log-timers-to-tensorboard``: iteration time, throughput and the timers' ``<name>-time``."""
    log_memory_to_tensorboard: bool = False
    """``--log-memory-to-tensorboard``: the ``mem-*`` tags."""
    log_validation_ppl_to_tensorboard: bool = False
    """``--log-validation-ppl-to-tensorboard``: ``lm loss validation ppl`` besides the loss."""
    log_learning_rate_to_tensorboard: bool = True
    """``--log-learning-rate-to-tensorboard`` (``--no-...`` turns it off): the ``learning-rate`` tags."""
    log_loss_scale_to_tensorboard: bool = True
    """``--log-loss-scale-to-tensorboard``: accepted for Megatron's scripts; no run here scales its loss."""
    wandb_project: str | None = None
    """``--wandb-project``: log to this Weights & Biases project (rank 0; needs wandb)."""
    wandb_exp_name: str | None = None
    """``--wandb-exp-name``: the W&B run's name (default: W&B chooses one)."""
    wandb_save_dir: str | None = None
    """``--wandb-save-dir``: W&B's local directory (default ``<--save>/wandb``, else ``./wandb``)."""
    timing_log_level: int = 0
    """``--timing-log-level``: host-side phases timed per rank and logged at each log line (0: none)."""
    timing_log_option: str = "minmax"
    """``--timing-log-option``: report the ``max`` over ranks, ``minmax``, or ``all`` ranks' times."""


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
    """``--profile``: a JAX trace of a few iterations."""

    profile: bool = False
    """``--profile``: write a trace."""
    profile_ranks: tuple[int, ...] = (0,)
    """``--profile-ranks``: the processes that trace."""
    profile_step_start: int = 10
    """``--profile-step-start``: the trace starts after this iteration."""
    profile_step_end: int = 12
    """``--profile-step-end``: the trace stops after this iteration."""
    profile_dir: str = "profile"
    """``--profile-dir``: where the trace goes."""


@dataclasses.dataclass(frozen=True)
class PretrainConfig:
    """Everything a pretraining run is configured with."""

    model: GPTConfig
    """The model (its vocabulary the tokenizer's)."""
    training: TrainingConfig
    """The loop."""
    optimizer: OptimizerConfig
    """Adam, weight decay and clipping."""
    scheduler: SchedulerConfig
    """The learning-rate schedule."""
    ddp: DistributedDataParallelConfig
    """Data parallelism and the distributed optimizer."""
    data: DataConfig
    """The data."""
    checkpoint: CheckpointConfig
    """Saving and resuming."""
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    """Log lines, metrics file, progress bar."""
    profile: ProfileConfig = dataclasses.field(default_factory=ProfileConfig)
    """Tracing."""
