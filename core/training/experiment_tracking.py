"""A run's scalars under Megatron-LM's TensorBoard and W&B tag names (``training_log`` and
``evaluate_and_print_results`` of ``megatron/training/training.py``), written by rank 0.

Per iteration (every ``--tensorboard-log-interval``-th), at the iteration and, for TensorBoard,
``... vs samples`` at the consumed samples: ``lm loss``, ``learning-rate`` (unless
``--no-log-learning-rate-to-tensorboard``), ``batch-size``, ``grad-norm``; MoE runs add
Megatron's ``load_balancing_loss`` and ``z_loss`` (means over the MoE layers) and
``moe/expert_load_layer_<i>``. ``tokens-per-sec`` and ``mfu`` (this package's; Megatron has no
such tags). With ``--log-timers-to-tensorboard``: ``iteration-time`` (s), ``throughput``
(TFLOP/s per device) and the timers' ``<name>-time`` (s per iteration, max over ranks); with
``--log-memory-to-tensorboard``: ``mem-max-allocated-bytes`` and, where the device reports them,
``mem-allocated-bytes``, ``mem-reserved-bytes``, ``mem-allocated-count``. At each evaluation:
``lm loss validation`` (and ``... vs samples``), with ``--log-validation-ppl-to-tensorboard``
``lm loss validation ppl``. W&B gets the per-iteration tags and ``samples vs steps``.

The values are the metrics records' (read back where the loop reads them anyway), so the
writers add no device sync; they are written when the loop collects, in iteration order.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

from core.training.metric_writers import MetricWriter, TensorBoardWriter, WandbWriter

if TYPE_CHECKING:
    from core.training.config import LoggingConfig


def memory_scalars(record: dict[str, Any], stats: dict[str, Any] | None) -> dict[str, float]:
    """Megatron's ``mem-*`` tags: the record's peak per device, and the current allocator figures
    of ``stats`` (a device's ``memory_stats()``; a CPU device has none)."""
    scalars = {"mem-max-allocated-bytes": float(record["memory_per_device_bytes"])}
    for tag, key in (("mem-allocated-bytes", "bytes_in_use"), ("mem-reserved-bytes", "bytes_reserved"),
                     ("mem-allocated-count", "num_allocs")):
        if stats and key in stats:
            scalars[tag] = float(stats[key])
    return scalars


class ExperimentTracker:
    """The TensorBoard and W&B writers of a run (none on ranks other than 0) and the tags it writes."""

    def __init__(self, config: LoggingConfig, global_batch_size: int, tensorboard: MetricWriter | None = None,
                 wandb: MetricWriter | None = None):
        self.config = config
        """The logging flags (:class:`~core.training.config.LoggingConfig`)."""
        self.global_batch_size = global_batch_size
        """Megatron's ``batch-size`` tag."""
        self.tensorboard = tensorboard
        """The ``--tensorboard-dir`` writer, or None."""
        self.wandb = wandb
        """The ``--wandb-project`` writer, or None."""

    @classmethod
    def open(cls, config: LoggingConfig, global_batch_size: int, is_writer: bool,
             run_config: dict[str, Any] | None = None, save: str | None = None) -> ExperimentTracker:
        """The run's writers, opened on the writing process only (``is_writer``); W&B's directory is
        ``--wandb-save-dir``, else Megatron's ``<--save>/wandb``, else ``./wandb``."""
        tensorboard = wandb = None
        if is_writer and config.tensorboard_dir:
            tensorboard = TensorBoardWriter(config.tensorboard_dir, config.tensorboard_queue_size)
        if is_writer and config.wandb_project:
            save_dir = config.wandb_save_dir or (os.path.join(save, "wandb") if save else "wandb")
            wandb = WandbWriter(config.wandb_project, config.wandb_exp_name, save_dir, run_config)
        return cls(config, global_batch_size, tensorboard, wandb)

    @property
    def active(self) -> bool:
        """Whether this process writes anything."""
        return self.tensorboard is not None or self.wandb is not None

    def _write(self, scalars: dict[str, float], iteration: int, samples: int, vs_samples: bool = True) -> None:
        if self.tensorboard is not None:
            self.tensorboard.add_scalars(scalars, iteration)
            if vs_samples:
                self.tensorboard.add_scalars({f"{tag} vs samples": v for tag, v in scalars.items()}, samples)
        if self.wandb is not None:
            self.wandb.add_scalars(scalars, iteration)

    def log_training(self, records: list[dict[str, Any]], memory_stats: dict[str, Any] | None = None) -> None:
        """The scalars of each record (one per iteration, in order) on the ``--tensorboard-log-interval``."""
        if not self.active:
            return
        cfg = self.config
        for r in records:
            i, samples = r["iteration"], r["consumed_samples"]
            if i % cfg.tensorboard_log_interval:
                continue
            if self.wandb is not None:
                self.wandb.add_scalars({"samples vs steps": samples}, i)
            scalars = {}
            if cfg.log_learning_rate_to_tensorboard:
                scalars["learning-rate"] = r["lr"]
            scalars["batch-size"] = self.global_batch_size
            scalars["lm loss"] = r["loss"]
            if "moe_aux_loss" in r:  # Megatron's MoE tracker: means over the MoE layers
                n = max(1, len(r["moe_expert_load"]))
                scalars["load_balancing_loss"] = r["moe_aux_loss"] / n
                scalars["z_loss"] = r["moe_z_loss"] / n
            scalars["grad-norm"] = r["grad_norm"]
            self._write(scalars, i, samples)
            extra = {"tokens-per-sec": r["tokens_per_sec"], "mfu": r["mfu"]}
            extra.update({f"moe/expert_load_layer_{k}": v for k, v in enumerate(r.get("moe_expert_load", ()))})
            if cfg.log_timers_to_tensorboard:
                extra.update({"iteration-time": r["step_time_s"], "throughput": r["tflops_per_device"]})
            if cfg.log_memory_to_tensorboard:
                extra.update(memory_scalars(r, memory_stats))
            self._write(extra, i, samples, vs_samples=False)

    def log_timers(self, iteration: int, max_seconds: dict[str, float]) -> None:
        """The timers' ``<name>-time`` (seconds per iteration, max over ranks), with ``--log-timers-to-tensorboard``."""
        if self.active and self.config.log_timers_to_tensorboard and max_seconds:
            self._write({f"{name}-time": t for name, t in max_seconds.items()}, iteration, 0, vs_samples=False)

    def log_validation(self, iteration: int, samples: int, loss: float) -> None:
        """``lm loss validation`` (and its perplexity with ``--log-validation-ppl-to-tensorboard``;
        Megatron's ``exp(min(20, loss))``)."""
        if not self.active:
            return
        if self.tensorboard is not None:
            scalars = {"lm loss validation": loss}
            if self.config.log_validation_ppl_to_tensorboard:
                scalars["lm loss validation ppl"] = math.exp(min(20.0, loss))
            self.tensorboard.add_scalars(scalars, iteration)
            self.tensorboard.add_scalars({f"{tag} vs samples": v for tag, v in scalars.items()}, samples)
        if self.wandb is not None:  # Megatron sends W&B the loss only
            self.wandb.add_scalars({"lm loss validation": loss}, iteration)

    def close(self) -> None:
        """Flush and close the writers."""
        for writer in (self.tensorboard, self.wandb):
            if writer is not None:
                writer.close()
        self.tensorboard = self.wandb = None
