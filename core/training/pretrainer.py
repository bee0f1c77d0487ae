"""``Pretrainer``: the GPT pretraining loop of ``launch/pretrain.py`` as a reusable object.

One training iteration is one jitted ``shard_map`` program (DDP's fused step): the pipeline
schedule or the microbatch loop, ``finalize_model_grads``, global-norm clipping and the
(distributed) optimizer. The data order is a pure function of ``--seed`` and the number of
consumed samples, parameters and optimizer state live in the checkpoint, and the only other
randomness, dropout, is seeded per sample from ``--seed`` and the sample's position in that
order (``pretraining_data.dropout_seeds``), so resuming reproduces the uninterrupted run. The MoE expert
biases and the FP8 delayed-scaling state (:attr:`Pretrainer.model_state`) are model state outside
the optimizer, updated after each step and checkpointed with the parameters.

The run is configured by a :class:`~core.training.config.PretrainConfig` (``launch/pretrain.py``
builds it from the flags: ``core.training.run_config.pretrain_config``); the data is
:class:`~core.training.pretraining_data.PretrainingData`, the checkpoints
:class:`~core.checkpointing.checkpointer.Checkpointer`'s.

The loop does not wait for a step's loss before starting the next: JAX dispatches steps
asynchronously, so the host builds batch ``i + 1`` while the device runs step ``i``, and
losses and grad norms are read back (one transfer) only when a line is logged, before an
evaluation or a checkpoint, and at the end. At most two steps are in flight. A non-finite
loss or grad norm found then stops the run naming its first iteration; nothing after it is
saved.

Around what the host does in each iteration (building the batch, dispatching the step, waiting
for the device, evaluating, saving) :attr:`Pretrainer.timers` measures per-rank phase times
(``--timing-log-level``), gathered over the ranks at each log line; the records read back go to
:attr:`Pretrainer.tracker`'s TensorBoard and W&B writers as they are (no extra read-back).
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from core.checkpointing.checkpointer import Checkpointer, TrainingState, first_line
from core.distributed.distributed_data_parallel import DistributedDataParallel
from core.models.gpt import GPTModel
from core.optimizer import get_megatron_optimizer
from core.optimizer.optimizer_param_scheduler import learning_rate_schedule
from core.parallel_state import CP_AXIS, ParallelState
from core.training.arguments import ParallelLayout
from core.training.config import PretrainConfig
from core.training.device_peak import device_peak
from core.training.exit_conditions import ExitConditions
from core.training.experiment_tracking import ExperimentTracker
from core.training.pretraining_data import PretrainingData
from core.training.profiling import StepProfiler
from core.training.timers import Timers
from core.training.train_logging import TrainingLogger, memory_per_device_bytes
from core.training.train_step import make_train_step


class TrainingError(RuntimeError):
    """Training cannot go on (NaN loss, unusable checkpoint); reported as one line."""


def describe_error(error: BaseException) -> str:
    """An unexpected exception as one line: its type and the first line of its message."""
    return f"{type(error).__name__}: {first_line(error)}" if str(error).strip() else type(error).__name__


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

    def __init__(self, config: PretrainConfig, layout: ParallelLayout, state: ParallelState,
                 logger: TrainingLogger | None = None):
        self.run_config, self.layout, self.state = config, layout, state
        """The run's typed configuration (:class:`~core.training.config.PretrainConfig`)."""
        self.training = training = config.training
        save = config.checkpoint.save
        if save:  # fail now, not at the first checkpoint
            try:
                os.makedirs(save, exist_ok=True)
                if not os.access(save, os.W_OK):
                    raise PermissionError("permission denied")
            except OSError as e:
                raise ValueError(f"--save {save}: cannot create or write the directory ({e})") from None
        self.data = PretrainingData(config.data, training, state)
        self.config = config.model
        """The model's config (Megatron's ``config``)."""
        self.data.with_dropout_seed = self.config.attention_dropout > 0 or self.config.hidden_dropout > 0
        self.model = GPTModel(self.config, state)
        self.schedule = learning_rate_schedule(config.scheduler)
        # The learning rate of every iteration, on the host: evaluating the (jnp) schedule per step
        # would queue a device op behind the running step and wait for it (a host sync per step).
        self.learning_rates = np.asarray(jax.jit(jax.vmap(self.schedule))(jnp.arange(max(1, training.train_iters))))
        self.ddp = DistributedDataParallel(state, config.ddp, self.model)
        self._logger = logger
        self.tracker: ExperimentTracker | None = None
        """Rank 0's TensorBoard / W&B writers (:class:`~core.training.experiment_tracking.ExperimentTracker`),
        None when nothing is tracked; set by the launcher like :attr:`logger`."""
        logging = config.logging
        self.timers = Timers(logging.timing_log_level, logging.timing_log_option)
        """This process's host-side phase timers (``--timing-log-level``), gathered over the ranks
        at each log line (:mod:`core.training.timers`)."""
        self._timed_from = 0
        self._peak = None
        self.iteration = 0
        signal_name, minutes = training.exit_signal, training.exit_duration_in_mins
        self.exit_conditions = ExitConditions(state.mesh, signal_name, None if minutes is None else minutes * 60) \
            if signal_name is not None or minutes is not None else None
        """Megatron's ``--exit-signal-handler`` and ``--exit-duration-in-mins`` (None without
        either): checked every iteration by :meth:`train`, which saves and stops where every
        process agrees; its ``reason`` says why a run stopped early (0: it did not). The signal
        is caught and the time budget counted from here."""
        self.params = self.ddp.init(jax.random.key(training.seed),
                                    jnp.zeros((training.micro_batch_size, training.seq_length), jnp.int32))
        self.optimizer = get_megatron_optimizer(config.optimizer, [self.ddp], self.schedule)
        self.opt_state = self.optimizer.init_state(self.params)
        self.checkpointer = Checkpointer(config.checkpoint, self.config, layout, self.ddp, self.optimizer,
                                         training.seed, logger)
        """The run's checkpoints (:class:`~core.checkpointing.checkpointer.Checkpointer`)."""
        self.model_state = self.model.init_model_state()
        """The model's non-trainable state (:meth:`GPTModel.model_state_shape
        <core.models.gpt.GPTModel.model_state_shape>`: ``"expert_bias"`` with
        ``--moe-router-enable-expert-bias``, ``"fp8"`` with ``--fp8-recipe delayed``), None without
        either: updated after every optimizer step, checkpointed."""
        m = layout.num_microbatches
        sequence_axis = CP_AXIS if state.context_parallel_size > 1 else None
        loss_fn, fb = self.model.loss_fn, None
        if layout.pipeline_model_parallel_size > 1:
            loss_fn, fb = None, functools.partial(self.model.forward_backward, num_microbatches=m)
        state_args = {}
        if self.model_state is not None:
            state_args = {"model_state_specs": self.model.model_state_spec(),
                          "update_model_state": lambda s, report, observed: self.model.update_model_state(
                              s, report, observed, m)}
        self.train_step = make_train_step(self.ddp, self.optimizer, loss_fn, m, forward_backward=fb,
                                          sequence_axis=sequence_axis, **state_args)
        self.eval_step = self._make_eval_step()

    # -- steps -----------------------------------------------------------------------------
    def _make_eval_step(self):
        m, dp_axes = self.layout.num_microbatches, self.state.data_parallel_axis_name
        sequence_axis = CP_AXIS if self.state.context_parallel_size > 1 else None
        # Every cp rank's loss is already the whole sequence's (eval_loss sums over "cp").
        fn = lambda p, b, s: lax.pmean(self.model.eval_loss(p, b, m, s), dp_axes)
        state_spec = self.model.model_state_spec()
        programs: dict[Any, Callable] = {}

        def eval_step(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
            key = tuple(sorted((k, v.ndim) for k, v in batch.items()))
            if key not in programs:
                specs = self.ddp.batch_specs(batch, sequence_axis)
                programs[key] = jax.jit(jax.shard_map(fn, mesh=self.state.mesh,
                                                      in_specs=(self.ddp.param_specs, specs, state_spec),
                                                      out_specs=P(), check_vma=False))
            return programs[key](params, batch, self.model_state)

        return eval_step

    def evaluate(self) -> float:
        """Mean validation loss over ``--eval-iters`` batches (NaN without validation data)."""
        if not self.data.num_valid_samples:
            return math.nan
        return float(np.mean([float(self.eval_step(self.params, self.data.valid_batch(i)))
                              for i in range(self.training.eval_iters)]))

    def dispatch_step(self) -> dict[str, Any]:
        """Start one training iteration without waiting for it; returns its pending record, whose
        ``loss`` and ``grad_norm`` are device arrays until :meth:`collect` reads them."""
        with self.timers("batch-generator"):
            batch = self.data.next_train_batch()
        with self.timers("step-dispatch"):  # returns once queued: the device's time shows in device-wait
            if self.model_state is None:
                self.params, self.opt_state, metrics = self.train_step(self.params, self.opt_state, batch)
            else:
                self.params, self.opt_state, metrics, self.model_state = self.train_step(
                    self.params, self.opt_state, batch, self.model_state)
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
        tokens = self.training.global_batch_size * self.training.seq_length
        records = []
        for record, (loss, grad_norm, spiky, recent_max, model_metrics) in zip(pending, values):
            loss, grad_norm = float(loss), float(grad_norm)
            metrics = record.pop("_metrics")
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                where = ""
                if self.training.check_for_nan_in_loss_and_grad:
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
                    factor = self.training.spiky_loss_factor
                    self.logger.print(f"WARNING: iteration {record['iteration']}: loss {loss:.4f} is above "
                                      f"{factor:g} x the recent maximum {float(recent_max):.4f} "
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
                             self.model_state)

    def save(self, directory: str | None = None) -> None:
        """Checkpoint this iteration to ``directory`` (default ``--save``): :meth:`Checkpointer.save
        <core.checkpointing.checkpointer.Checkpointer.save>`."""
        self.checkpointer.save(directory or self.run_config.checkpoint.save, self.training_state())

    def load(self, directory: str, load_optimizer: bool = True, step: int | None = None,
             finetune: bool = False) -> bool:
        """Resume from ``directory`` (:meth:`Checkpointer.load
        <core.checkpointing.checkpointer.Checkpointer.load>`); False if it holds no checkpoint yet."""
        restored = self.checkpointer.load(directory, self.training_state(), load_optimizer, step, finetune)
        if restored is None:
            return False
        self.params, self.opt_state, self.model_state = restored.params, restored.opt_state, restored.model_state
        if not finetune:
            self.iteration = restored.iteration
            position = {"consumed_samples": restored.consumed_samples, "seed": self.training.seed}
            self.data.sampler.load_state_dict(position)
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
        training, i = self.training, self.iteration
        evaluate = bool(training.eval_interval) and i % training.eval_interval == 0
        log_interval = self.run_config.logging.log_interval
        return i == 1 or i == stop or i % log_interval == 0 or evaluate or self.checkpointer.due(i, stop)

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
        training = self.training
        records, pending = [], []
        stop = training.train_iters
        if training.exit_interval:  # Megatron's: the next iteration divisible by it
            stop = min(stop, (self.iteration // training.exit_interval + 1) * training.exit_interval)
        profiler = StepProfiler(self.run_config.profile, jax.process_index())
        self._timed_from = self.iteration
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
            with self.timers("device-wait"):
                jax.block_until_ready(pending[-2]["loss"])
        if not self._must_collect(stop):
            return pending, start
        with self.timers("device-wait"):
            # Wait for the last step (its loss and the updated state) before reading the clock:
            # dispatch returns at once on a GPU, and collect's read-back waits only after the clock.
            jax.block_until_ready((pending[-1]["loss"], self.params, self.opt_state))
            done = self.collect(pending, time.perf_counter() - start)
        for record in done:
            self._add_throughput(record)
        records += done
        if self.tracker is not None and self.tracker.active:
            memory = self.run_config.logging.log_memory_to_tensorboard
            self.tracker.log_training(done, jax.local_devices()[0].memory_stats() if memory else None)
        self._after_collect(done[-1], stop)
        return [], time.perf_counter()  # evaluation and checkpoint time is not step time

    def _after_collect(self, record: dict[str, Any], stop: int) -> None:
        """Evaluate, log and save at an iteration whose values were just read back."""
        training, log, i = self.training, self.logger, self.iteration
        self.checkpointer.poll()
        if training.eval_interval and i % training.eval_interval == 0 and self.data.num_valid_samples:
            with self.timers("evaluate"):
                record["valid_loss"] = self.evaluate()
        logged = i % self.run_config.logging.log_interval == 0 or i == 1 or "valid_loss" in record
        if log:
            log.set_loss(record["loss"])
            if logged:
                log.log_iteration(record, training.train_iters)
        if logged:
            self._log_timers()  # every process: the timers are gathered over the ranks
        if "valid_loss" in record:
            if log:
                self._log_validation(record["valid_loss"])
            if self.tracker is not None:
                self.tracker.log_validation(i, record["consumed_samples"], record["valid_loss"])
        if self.checkpointer.due(i, stop):
            with self.timers("save-checkpoint"):
                self.save()

    def _log_timers(self) -> None:
        """Gather the timers over the ranks (every process, at the same iteration), print them on
        rank 0 and write their ``<name>-time`` tags."""
        report = self.timers.gather(self.iteration - self._timed_from)
        self._timed_from = self.iteration
        if report is None:
            return
        text = report.describe()
        if self.logger and text:
            self.logger.print(text)
        if self.tracker is not None:
            self.tracker.log_timers(self.iteration, report.max_seconds())

    def _log_validation(self, loss: float) -> None:
        self.logger.print(f" validation loss at iteration {self.iteration} | lm loss value: {loss:.6E} | "
                          f"lm loss PPL: {math.exp(min(loss, 50)):.4E} | unigram entropy of the corpus: "
                          f"{self.data.unigram_entropy:.4f}")
