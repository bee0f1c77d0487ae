"""``Checkpointer``: a training run's checkpoints, one call per event.

The trainer calls :meth:`Checkpointer.save` at a save iteration, :meth:`~Checkpointer.load` to
resume, :meth:`~Checkpointer.poll` where it reads back step values, :meth:`~Checkpointer.finish`
at the end and :meth:`~Checkpointer.check_save_directory` before the first step. Everything else
is decided here: what a checkpoint holds (the parameters, the optimizer state in its
layout-independent form, the MoE state, all in layer order; iteration, data position, seed, run
id, layout and model records), whether a checkpoint fits this run (same model, seed and run;
the optimizer state saved), which directory entries are checkpoints, and the asynchronous
saves' bookkeeping (:class:`~core.checkpointing.saver.CheckpointSaver`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from core import checkpointing
from core.checkpointing.layer_order import from_layer_order, layer_order_target, map_layer_leaves, merge_chunks
from core.pipeline_parallel.utils import chunk_placement

OPTIMIZER_FORMAT = "global-v1"
"""The marker of checkpoints whose optimizer state is the layout-independent form
(parameter-shaped Adam moments and masters of global shape); checkpoints without it hold the
per-device state."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or used by this run; reported as one line."""


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Where and how a run saves and resumes (Megatron's checkpoint flags)."""

    save: str | None = None
    """``--save``: the directory checkpoints are written to (None: no checkpoints)."""
    load: str | None = None
    """``--load``: the directory a run resumes from."""
    save_interval: int | None = None
    """``--save-interval``: save every this many iterations (and at the end)."""
    async_save: bool = False
    """``--async-save``: write in the background; the step loop only dispatches a copy."""
    async_save_writer: str | None = None
    """``--async-save-writer``: ``process`` or ``thread`` (None: the platform's default)."""
    save_optim: bool = True
    """Checkpoints hold the optimizer state (``--no-save-optim`` turns it off)."""
    load_optim: bool = True
    """A resume loads the optimizer state (``--no-load-optim`` turns it off)."""
    ckpt_step: int | None = None
    """``--ckpt-step``: resume from this checkpoint, not the newest."""
    finetune: bool = False
    """``--finetune``: load the parameters only and start a new run at iteration 0."""


@dataclasses.dataclass(frozen=True)
class TrainingState:
    """What a checkpoint stores of a run, as the trainer holds it."""

    iteration: int
    """Iterations done."""
    consumed_samples: int
    """Training samples consumed (the data position)."""
    params: Any
    """The parameters (global arrays)."""
    opt_state: Any
    """The optimizer state in this run's layout."""
    model_state: Any = None
    """The model's non-trainable state (``GPTModel.model_state_shape``: MoE expert biases, FP8
    delayed-scaling state), None without any."""


EXECUTION_FIELDS = ("bf16", "sequence_parallel", "recompute_granularity", "unroll_layers", "attention_dropout",
                    "hidden_dropout", "context_parallel_size", "cp_comm_type", "hierarchical_context_parallel_sizes",
                    "fp8", "fp8_recipe", "fp8_margin", "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_wgrad",
                    "pipeline_schedule", "zero_bubble_w_recompute")
"""Model config fields a run may change on resume: numerics and execution choices."""


def model_record(model_config: Any) -> dict[str, Any]:
    """The model fields a checkpoint must match, as its metadata stores them: the model config's
    fields but :data:`EXECUTION_FIELDS` (and the MoE grouped-GEMM implementation), and but
    ``seq_length`` with rotary positions (it shapes no parameter there: a run may train an
    imported model at its own sequence length)."""
    record = dataclasses.asdict(model_config)
    for field in EXECUTION_FIELDS:
        record.pop(field)
    if record.get("position_embedding_type") == "rope":
        record.pop("seq_length", None)
    if record.get("moe") is not None:  # an execution choice, as the ones above
        record["moe"].pop("moe_grouped_gemm_implementation")
    if isinstance(record.get("moe_layer_freq"), tuple):  # as the JSON metadata reads back
        record["moe_layer_freq"] = list(record["moe_layer_freq"])
    return record


def _model_state_entries(model_state: dict | None) -> dict[str, Any]:
    """The model state as checkpoint entries: ``{"moe_state": {"expert_bias": ...}}`` (the format
    of checkpoints before the FP8 state existed) and ``{"fp8_state": {"scale", "amax_history"}}``."""
    model_state = model_state or {}
    entries = {}
    if "expert_bias" in model_state:
        entries["moe_state"] = {"expert_bias": model_state["expert_bias"]}
    if "fp8" in model_state:
        entries["fp8_state"] = model_state["fp8"]
    return entries


def _model_state_from_entries(entries: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`_model_state_entries` (for the entries present)."""
    state = {}
    if "moe_state" in entries:
        state["expert_bias"] = entries["moe_state"]["expert_bias"]
    if "fp8_state" in entries:
        state["fp8"] = entries["fp8_state"]
    return state


def first_line(error: BaseException, limit: int = 400) -> str:
    """An exception's message as one line of at most ``limit`` characters: its start and its end,
    where orbax puts the reason (``... No space left on device``)."""
    line = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return line if len(line) <= limit else f"{line[:limit // 3]} ... {line[-(limit - limit // 3 - 5):]}"


_OS_REASONS = ("No space left on device", "Permission denied", "Read-only file system", "Disk quota exceeded")
"""Reasons a checkpoint write fails that the message must name even when the error's text is long."""


def write_error_line(error: BaseException) -> str:
    """A failed checkpoint write as one line: the OS reason first when the error's text holds
    one (tensorstore may put it mid-message, before a long spec that :func:`first_line` cuts),
    then the error's first line."""
    text = str(error)
    reason = next((r for r in _OS_REASONS if r in text), None)
    return f"{reason}: {first_line(error)}" if reason else first_line(error)


class Checkpointer:
    """The checkpoints of one training run (see the module docstring).

    ``model_config``: the model's config (its parameter-shaping fields must match a checkpoint's);
    ``layout``: the run's parallel layout; ``ddp`` and ``optimizer``: the model's data-parallel
    wrapper and optimizer (checkpoint shardings, the optimizer state's global form); ``seed``:
    the run's seed (a resume must keep it); ``logger``: prints the save lines (rank 0), or None.
    """

    def __init__(self, config: CheckpointConfig, model_config: Any, layout: Any, ddp: Any, optimizer: Any,
                 seed: int, logger: Any = None):
        self.config, self.model_config, self.layout = config, model_config, layout
        self.ddp, self.optimizer, self.seed, self.logger = ddp, optimizer, seed, logger
        self.skipped_checkpoints: list[str] = []
        """Newer checkpoints the last :meth:`load` skipped as damaged (one phrase each)."""
        self.run_id = checkpointing.new_run_id()
        """This run's identifier, recorded in its checkpoints; a resume takes the checkpoint's
        (``--finetune`` starts a new run), so a run's checkpoints share one across restarts."""
        self.saving: int | None = None
        """The iteration whose checkpoint :meth:`save` is writing (synchronous) or dispatching, else None."""
        self._saver: checkpointing.CheckpointSaver | None = None
        self._save_in_flight: int | None = None  # the iteration of an asynchronous save not yet committed
        self._checkpoint_copy: Callable | None = None
        self._checkpoint_records: str | None = None  # the layout and model records, as JSON (constant)

    def due(self, iteration: int, last: int) -> bool:
        """Whether iteration ``iteration`` saves: every ``--save-interval`` and at the run's
        ``last`` iteration, with ``--save``."""
        if not self.config.save:
            return False
        return bool(self.config.save_interval) and iteration % self.config.save_interval == 0 or iteration == last

    @property
    def _placement(self) -> tuple[str, int]:
        """``(chunk placement, pipeline size)`` of this run's stacked layers, for the conversions
        to and from layer order (:mod:`~core.checkpointing.layer_order`)."""
        return (chunk_placement(getattr(self.model_config, "pipeline_schedule", None)),
                self.layout.pipeline_model_parallel_size)

    def model_record(self) -> dict[str, Any]:
        """:func:`model_record` of this run's model."""
        return model_record(self.model_config)

    def layout_record(self) -> dict[str, Any]:
        """The layout a checkpoint was written in (informational: any layout loads it)."""
        return {"tensor_model_parallel_size": self.layout.tensor_model_parallel_size,
                "pipeline_model_parallel_size": self.layout.pipeline_model_parallel_size,
                "virtual_pipeline_model_parallel_size": self.layout.virtual_pipeline_model_parallel_size,
                "data_parallel_size": self.layout.data_parallel_size,
                "context_parallel_size": self.layout.context_parallel_size,
                "use_distributed_optimizer": bool(self.ddp.ddp_config.shards_optimizer_state),
                "num_devices": int(self.ddp.mesh.devices.size)}

    def checkpoint_state(self, state: TrainingState) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(state, metadata)`` as a checkpoint stores them: params, the optimizer state in the
        layout-independent form
        (:meth:`~core.optimizer.MegatronOptimizer.state_to_global`; not with
        ``--no-save-optim``) and the model state (``"moe_state"``: the MoE expert biases, with
        ``--moe-router-enable-expert-bias``; ``"fp8_state"``: the FP8 scales and amax histories,
        with ``--fp8-recipe delayed``), in layer order; iteration,
        data position, seed, layout and model shape. The arrays are new ones, computed by one
        jitted program (dispatched, not waited for): the next training step may update or donate
        the trainer's own."""
        if self._checkpoint_records is None:  # built once: an async save's blocking part is on the step loop
            self._checkpoint_records = json.dumps({"layout": self.layout_record(), "model": self.model_record()})
        meta = {"iteration": state.iteration, "consumed_samples": state.consumed_samples,
                "seed": self.seed, "run_id": self.run_id, **json.loads(self._checkpoint_records),
                "optimizer_format": OPTIMIZER_FORMAT,
                "optimizer_saved": self._saves_optimizer}
        if self._checkpoint_copy is None:
            self._checkpoint_copy = self._make_checkpoint_copy(state)
        arrays = self._checkpoint_copy(state.params, state.opt_state, state.model_state)
        arrays.update(_model_state_entries(arrays.pop("model_state")))
        return arrays, meta

    def _make_checkpoint_copy(self, example: TrainingState) -> Callable:
        """The jitted program of :meth:`checkpoint_state`'s arrays, layers in checkpoint order
        (vpp-independent; the MoE state is stacked per MoE layer like the layers)."""
        # The params' copy split over the data-parallel ranks too, as the optimizer state's global
        # form is: a save holds 1/dp of params + Adam state per device (orbax writes any sharding).
        split = jax.tree.map(self.ddp.checkpoint_sharding, example.params)

        def gather(params: Any, opt_state: Any, model_state: Any) -> dict[str, Any]:
            state = {"params": jax.tree.map(jax.lax.with_sharding_constraint, params, split),
                     "model_state": model_state}
            if self._saves_optimizer:
                state["opt_state"] = self.optimizer.state_to_global(opt_state)
            return state

        def copy(params: Any, opt_state: Any, model_state: Any) -> dict[str, Any]:
            # A real copy of the inputs; XLA elides it for what the program computes (the
            # optimizer state's global form), so that is not copied a second time.
            state = jax.tree.map(jnp.copy, gather(params, opt_state, model_state))
            merge = lambda x: merge_chunks(x, *self._placement)
            state["model_state"] = jax.tree.map(merge, state["model_state"])
            return map_layer_leaves(merge, state, self.ddp.param_paths)

        if (self.layout.virtual_pipeline_model_parallel_size or 1) == 1:
            return jax.jit(copy)  # merge_chunks is the identity
        # Each array keeps its sharding through the reshape (dim 1 over pp), as a load expects.
        shardings = {"params": split, "model_state": jax.tree.map(lambda x: x.sharding, example.model_state)}
        if self._saves_optimizer:
            shardings["opt_state"] = jax.tree.map(lambda x: x.sharding, self.optimizer.global_state_abstract())
        return jax.jit(copy, out_shardings=shardings)

    @property
    def _saves_optimizer(self) -> bool:
        """Whether checkpoints hold the optimizer state (not with ``--no-save-optim``)."""
        return self.config.save_optim

    def save(self, directory: str, state: TrainingState) -> None:
        """Checkpoint :meth:`checkpoint_state` as this iteration (atomic). With ``--async-save``
        this returns once an on-device copy of the values is dispatched (the previous save, if
        still in flight, is waited for first, and its error raised); the writer process (or
        thread, ``--async-save-writer``) writes and commits; :meth:`finish` waits for the
        last one. Raises :class:`CheckpointError` naming the iteration whose checkpoint could not
        be written (earlier checkpoints stay intact). A checkpoint is logged as saved only once
        it is committed."""
        self.saving = state.iteration
        writer = self.config.async_save_writer
        if self._saver is None or self._saver.directory != os.path.abspath(directory) or (
                writer is not None and self._saver.writer != writer):
            self.finish()
            self._saver = checkpointing.CheckpointSaver(directory, writer=writer)
        self._saver.async_save = bool(self.config.async_save)
        self._wait_for_save()  # the previous save's copy is freed before this one is made
        try:
            arrays, meta = self.checkpoint_state(state)
            self._saver.save(state.iteration, arrays, meta, copy=False)  # the arrays are a copy already
        except (OSError, ValueError) as e:  # orbax reports a full disk as ValueError(RESOURCE_EXHAUSTED)
            self._saver, self.saving = None, None
            raise CheckpointError(f"cannot write checkpoint {state.iteration} to {directory}: {write_error_line(e)}; "
                                "the earlier checkpoints are intact") from None
        self.saving = None  # (still set when a KeyboardInterrupt leaves mid-save: the error line says so)
        if self._saver.async_save:
            self._save_in_flight = state.iteration
            self._log(f" started an asynchronous save of checkpoint {state.iteration} to {directory}")
        else:
            self._log_saved(state.iteration, directory)

    def _log(self, line: str) -> None:
        if self.logger:
            self.logger.print(line)

    def _log_saved(self, iteration: int, directory: str) -> None:
        self._log(f" saved checkpoint at iteration {iteration:8d} to {directory}")

    def _wait_for_save(self, close: bool = False) -> None:
        """Wait for the asynchronous save in flight (if any) and log it as saved once committed;
        :class:`CheckpointError` naming its iteration if it failed. With ``close``, also stop the
        saver's writer process."""
        if self._saver is None:
            return
        step, directory = self._save_in_flight, self._saver.directory
        try:
            self._saver.close() if close else self._saver.wait()
        except (OSError, ValueError) as e:
            self._saver, self._save_in_flight = None, None
            what = f"checkpoint {step}" if step is not None else "a checkpoint"
            raise CheckpointError(f"cannot write {what} to {directory}: {write_error_line(e)}; "
                                "the earlier checkpoints are intact") from None
        self._save_in_flight = None
        if step is not None:
            self._log_saved(step, directory)

    def poll(self) -> None:
        """Log (or raise the error of) an asynchronous save that has finished, without waiting
        for one that has not (called where the loop reads back its values)."""
        if self._save_in_flight is not None and self._saver is not None and self._saver.finished():
            self._wait_for_save()

    def finish(self, close: bool = True) -> None:
        """Wait for an asynchronous save in flight to be committed (a no-op otherwise); with
        ``close``, also stop the checkpoint writer process (a later save starts a new one)."""
        self._wait_for_save(close=close)
        if close:
            self._saver = None

    def load(self, directory: str, state: TrainingState, load_optimizer: bool = True, step: int | None = None,
             finetune: bool = False) -> TrainingState | None:
        """The run's state resumed from the newest intact checkpoint in ``directory``, in this run's
        layout whatever the layout it was saved in (``state``: the current one, the restore's
        target); None if there is none yet. Newer checkpoints with a damaged file are skipped and
        listed in :attr:`skipped_checkpoints`; if every one is damaged, :class:`CheckpointError`
        names the files. The run adopts the checkpoint's :attr:`run_id`.

        ``step`` (``--ckpt-step``): load that checkpoint, not the newest; :class:`CheckpointError`
        if it is missing, incomplete or damaged. ``finetune`` (``--finetune``): the parameters
        only (no optimizer state), and the run keeps ``state``'s iteration and data position (a
        new run from these weights)."""
        load_optimizer = load_optimizer and not finetune
        if step is None:
            step, self.skipped_checkpoints = checkpointing.latest_valid_step(directory)
            if step is None and self.skipped_checkpoints:
                skipped = "; ".join(self.skipped_checkpoints)
                raise CheckpointError(f"--load {directory}: no intact checkpoint ({skipped})")
            if step is None:
                return None
        else:
            problem = checkpointing.step_problem(directory, step)
            if problem is not None:
                raise CheckpointError(f"--load {directory} --ckpt-step {step}: {problem}")
        meta = checkpointing.load_metadata(directory, step)
        self._check_compatible(directory, meta, load_optimizer, finetune)
        restored = self._restore(directory, step, state, load_optimizer,
                                 meta.get("optimizer_format") == OPTIMIZER_FORMAT)
        if finetune:  # Megatron's --finetune: a new run from these weights
            return restored
        self.run_id = meta.get("run_id", self.run_id)  # a checkpoint without a run id: this run adopts it
        return dataclasses.replace(restored, iteration=int(meta["iteration"]),
                                   consumed_samples=int(meta["consumed_samples"]))

    def _restore(self, directory: str, step: int, state: TrainingState, load_optimizer: bool,
                 global_format: bool) -> TrainingState:
        """``state`` with the arrays of checkpoint ``step`` (the optimizer state only with
        ``load_optimizer``)."""
        if not global_format:  # the per-device format: the optimizer state only into its own layout
            target = {"params": state.params, **({"opt_state": state.opt_state} if load_optimizer else {})}
            restored, _ = checkpointing.restore_checkpoint(directory, step, target, partial=not load_optimizer)
            return dataclasses.replace(state, params=restored["params"],
                                       opt_state=restored["opt_state"] if load_optimizer else state.opt_state)
        target = {"params": state.params}  # any layout, any vpp
        if load_optimizer:
            target["opt_state"] = self.optimizer.global_state_abstract()
        target = map_layer_leaves(layer_order_target, target, self.ddp.param_paths)
        saved = checkpointing.saved_tree(directory, step)
        entries = self._model_state_target(directory, step, state.model_state, saved)
        target.update(entries)
        # Model state this run does not keep (a bf16 run resuming a delayed-FP8 one) stays on disk.
        partial = not load_optimizer or any(k not in target for k in saved)
        restored, _ = checkpointing.restore_checkpoint(directory, step, target, partial=partial)
        vpp = self.layout.virtual_pipeline_model_parallel_size or 1
        split = lambda x: from_layer_order(x, vpp, *self._placement)
        restored = map_layer_leaves(split, restored, self.ddp.param_paths)
        model_state = state.model_state
        if model_state is not None:
            loaded = {k: jax.tree.map(split, restored[k]) for k in entries}
            model_state = {**model_state, **_model_state_from_entries(loaded)}
        opt_state = self.optimizer.state_from_global(restored["opt_state"]) if load_optimizer else state.opt_state
        return dataclasses.replace(state, params=restored["params"], opt_state=opt_state, model_state=model_state)

    def _model_state_target(self, directory: str, step: int, model_state: dict | None, saved: Any) -> dict:
        """The restore targets of the run's model state, by checkpoint entry. The expert biases
        must be in the checkpoint; the FP8 state is restored when the checkpoint holds one of the
        same shape, else this run starts its own (a run that turns FP8 on, or changes
        ``--fp8-amax-history-len``), with a line saying so."""
        targets = {k: jax.tree.map(layer_order_target, v) for k, v in _model_state_entries(model_state).items()}
        if "fp8_state" in targets:
            try:
                checkpointing.check_against_saved(targets["fp8_state"], saved.get("fp8_state"))
            except (ValueError, TypeError) as e:
                del targets["fp8_state"]
                if self.logger:
                    self.logger.print(f"--load {directory}: checkpoint {step} holds no usable FP8 scaling state "
                                      f"({first_line(e)}); FP8 scales start afresh")
        return targets

    def check_save_directory(self, iteration: int) -> None:
        """Raise :class:`CheckpointError` if ``--save`` holds a checkpoint of another model, one
        newer than this run's current iteration (a save would then not be newer, and would fail
        only when the run reaches it: a new run pointed at an old run's directory, or
        ``--finetune`` writing where a run saved), or one of another run of this model: this
        run's keep-last rotation would delete another model's or run's checkpoints
        (:meth:`foreign_checkpoint`)."""
        if not self.config.save:
            return
        other_model, other_run = self._foreign_checkpoints(self.config.save)  # one read of each step's metadata
        self._refuse_foreign(other_model)
        latest = checkpointing.latest_step(self.config.save)
        if latest is not None and latest > iteration:
            if self.skipped_checkpoints and self.config.load and os.path.abspath(self.config.load) == os.path.abspath(
                    self.config.save):
                raise CheckpointError(
                    f"--save {self.config.save} holds checkpoint {latest}, newer than iteration {iteration} this "
                    f"run resumed from, but damaged (skipped at --load): move it out of {self.config.save} to save "
                    "there again")
            raise CheckpointError(
                f"--save {self.config.save} already holds checkpoint {latest}, newer than this run's start "
                f"(iteration {iteration}): its saves would not be newer. Resume from it with --load "
                f"{self.config.save} (without --finetune), or save elsewhere")
        self._refuse_foreign(other_run)

    def _refuse_foreign(self, foreign: str | None) -> None:
        if foreign is not None:
            raise CheckpointError(
                f"--save {self.config.save} holds {foreign}: this run's saves would rotate it away "
                f"(the newest {checkpointing.DEFAULT_MAX_TO_KEEP} are kept). Save to another directory, or move "
                "those checkpoints out")

    def foreign_checkpoint(self, directory: str, other_runs: bool = True) -> str | None:
        """None when every complete checkpoint in ``directory`` is this run's, else one phrase
        naming one that is not: the newest of another model (the fields of :meth:`model_record`,
        saved then this run's) or whose metadata cannot be read; else, with ``other_runs``, the
        newest of another run of this model (another :attr:`run_id`; checkpoints without a run
        id are checked by their model only)."""
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
                return f"checkpoint {step}, whose metadata cannot be read ({first_line(e)})", other_run
            if diff:
                return f"checkpoint {step} of a different model: {diff}", other_run
            if other_run is None and meta.get("run_id", self.run_id) != self.run_id:
                other_run = (f"checkpoint {step} of another run of this model (run {meta['run_id']}, this run "
                             f"{self.run_id})")
        return None, other_run

    def _model_differences(self, saved: dict) -> str:
        """The fields of :meth:`model_record` where ``saved`` differs, as ``name=saved (now
        this run's)``; empty when none do. A field an older checkpoint's record lacks (an option
        added since) is its default, which that checkpoint's model had."""
        defaults = {f.name: f.default for f in dataclasses.fields(self.model_config)}
        saved = {**{k: defaults.get(k) for k in self.model_record() if k not in saved}, **saved}
        return ", ".join(f"{k}={saved.get(k)!r} (now {v!r})" for k, v in self.model_record().items()
                         if saved.get(k) != v)

    def _check_compatible(self, directory: str, meta: dict, load_optimizer: bool, finetune: bool) -> None:
        diff = self._model_differences(meta["model"])
        if diff:
            raise CheckpointError(f"checkpoint {directory} holds a different model: {diff}")
        if not finetune and int(meta["seed"]) != self.seed:
            raise CheckpointError(
                f"--seed {self.seed} differs from the seed of checkpoint {meta['iteration']} in {directory} "
                f"({meta['seed']}): a resumed run's data order and dropout follow the seed it started with. Pass "
                f"--seed {meta['seed']} to resume, or --finetune to start a new run from these weights")
        if load_optimizer and meta.get("optimizer_saved") is False:
            raise CheckpointError(f"checkpoint {meta['iteration']} in {directory} was saved without its optimizer "
                                "state (--no-save-optim): pass --no-load-optim (or --finetune) to load its parameters")
        # A layout record without a context-parallel size is a cp=1 checkpoint's.
        old, new = {"context_parallel_size": 1, **meta["layout"]}, self.layout_record()
        global_format = meta.get("optimizer_format") == OPTIMIZER_FORMAT
        vpp_key = "virtual_pipeline_model_parallel_size"
        if not global_format and old[vpp_key] != new[vpp_key]:
            raise CheckpointError(
                f"checkpoint {directory} was saved with virtual-pipeline-model-parallel-size "
                f"{old['virtual_pipeline_model_parallel_size']}, now {new['virtual_pipeline_model_parallel_size']}: "
                "the stacked layer arrays differ; resume with the same --virtual-pipeline-model-parallel-size")
        if load_optimizer and not global_format and old != new:
            describe = lambda r: ", ".join(f"{k}={v}" for k, v in r.items())
            raise CheckpointError(
                f"checkpoint {directory} stores its optimizer state per device (the format before "
                f"'{OPTIMIZER_FORMAT}'), saved with layout ({describe(old)}), now ({describe(new)}): it loads only "
                "into its own layout; pass --no-load-optim to load only the parameters (resharded) with a "
                "fresh optimizer state")
