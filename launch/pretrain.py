"""Pretrain a GPT with tensor, pipeline and data parallelism: ``mpirun -n 8 python launch/pretrain.py``.

Megatron's flags (``--help``); the defaults train a small byte-level GPT on the Python reference
manual shipped with CPython, with tp=2, pp=2, dp=2 on 8 processes and tp=pp=1 in one process.
Data preprocessed for Megatron-LM trains as it does there: ``--data-path 0.3 PREFIX_A 0.7
PREFIX_B --split 969,30,1 --tokenizer-type ... [--reset-position-ids --reset-attention-mask
--eod-mask-loss]`` (docs/data.md).
Any failure, on any rank, ends the whole job with one ``error:`` line (``--debug`` adds the
traceback) and exit code 2 for bad input (flags, data, an unusable checkpoint), 3 when training
fails (a NaN loss, a checkpoint that cannot be written; the last checkpoint is kept), 130 when
interrupted, 1 for anything unexpected (docs/pretraining-and-checkpoints.md).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

EXIT_UNEXPECTED, EXIT_BAD_INPUT, EXIT_TRAINING_FAILED, EXIT_INTERRUPTED = 1, 2, 3, 130


class _Progress:
    """Where the run is, for the error line of a failure."""

    def __init__(self):
        self.trainer = None
        """The :class:`~core.training.pretrainer.Pretrainer`, once built."""
        self.training = False
        """Whether the training loop has started (a failure there exits with code 3, before it with 2)."""

    def where(self) -> str:
        """`` in iteration N`` (the one running) or `` while saving checkpoint N`` once training has
        started, else empty."""
        if not self.training or self.trainer is None:
            return ""
        if self.trainer.checkpointer.saving is not None:
            return f" while saving checkpoint {self.trainer.checkpointer.saving}"
        return f" in iteration {self.trainer.iteration + 1}"


def _report(failure, progress: _Progress, args, error: BaseException):
    """End the job for ``error`` with one line and the exit code of its kind (never returns)."""
    from core.checkpointing.checkpointer import CheckpointError
    from core.runtime.cluster import ClusterError
    from core.training.arguments import ArgumentError
    from core.training.pretrainer import TrainingError, describe_error

    if isinstance(error, KeyboardInterrupt):
        saved = f"; the checkpoints in --save {args.save} are intact" if args.save else ""
        failure.fail(EXIT_INTERRUPTED, f"interrupted{progress.where()}{saved}", error)
    if isinstance(error, (TrainingError, CheckpointError)):
        failure.fail(EXIT_TRAINING_FAILED if progress.training else EXIT_BAD_INPUT, str(error), error)
    if isinstance(error, (ArgumentError, ClusterError)) or (
            not progress.training and isinstance(error, (ValueError, FileNotFoundError))):
        failure.fail(EXIT_BAD_INPUT, str(error), error)
    hint = "" if failure.debug else " (--debug prints the traceback)"
    failure.fail(EXIT_UNEXPECTED, f"{describe_error(error)}{progress.where()}{hint}", error)


def _configure_cpu(args, processes: int, reexec: bool) -> None:
    """CPU backend only, before JAX starts: malloc settings (re-executes the script), devices per
    process (one per core of the process's share, as many as the layout divides) and threads."""
    from core.runtime.cpu_devices import ENV_VAR, configure_cpu_devices, cpu_devices_per_process
    from core.runtime.cpu_malloc import CACHEABLE_RUN_ITERS, reexec_with_malloc_settings
    from core.runtime.cpu_threads import configure_cpu_threads
    from core.training.arguments import fill_defaults, layout_fits

    # tp/pp defaults follow what was launched; the devices chosen for the cores only add dp.
    fill_defaults(args, processes * int(os.environ.get(ENV_VAR) or 1))
    if reexec:  # run as a script: glibc reads its malloc settings at start-up only
        # A short run with the compilation cache keeps its programs cacheable (no heap split).
        reexec_with_malloc_settings(split_heaps=args.no_compilation_cache or args.train_iters > CACHEABLE_RUN_ITERS)
    fits = lambda n: layout_fits(args, processes * n)  # noqa: E731
    devices = cpu_devices_per_process(fits)
    if not fits(devices):  # refused at any count: at the most devices the error names the flag, not a world of 1
        devices = cpu_devices_per_process()
    configure_cpu_devices(devices)
    # Pipeline stages lend their cores to each other in the bubbles, so only the other layouts
    # get a thread pool of their share's size.
    configure_cpu_threads(share_pool=args.pipeline_model_parallel_size == 1)


def main(argv: list[str] | None = None) -> int:
    """Parse, apply the CPU settings (CPU backend only), start ``jax.distributed``, validate the
    flags against the devices the job really has, set up the mesh, train; returns the exit code.
    Any failure on any rank ends the whole job with one ``error:`` line (:mod:`core.training.job_failure`)."""
    from core.runtime.cluster import mpi_rank_and_world_from_env
    from core.training.arguments import parse_args
    from core.training.flags import parse_on_rank_0
    from core.training.job_failure import JobFailure

    rank, processes = mpi_rank_and_world_from_env()
    args = parse_on_rank_0(parse_args, argv, rank)
    failure, progress = JobFailure(rank, debug=args.debug), _Progress()
    try:
        return _start(args, rank, processes, failure, progress, reexec=argv is None)
    except (Exception, KeyboardInterrupt) as error:  # every failure becomes one line; --debug adds the traceback
        _report(failure, progress, args, error)


def _start(args, rank: int, processes: int, failure, progress: _Progress, reexec: bool) -> int:
    from core.runtime.cluster import initialize_distributed
    from core.runtime.jax_backend import jax_runs_on_cpu
    from core.training.arguments import fill_defaults, validate_args
    from core.training.checkpoint_args import apply_checkpoint_args

    apply_checkpoint_args(args)  # the model flags from --load's checkpoint, before anything sizes the model
    if jax_runs_on_cpu():
        _configure_cpu(args, processes, reexec=reexec)
    if rank != 0:
        # Logs are rank 0's job (native output too, such as gloo's connection lines). stderr
        # stays, so a crash on any rank is still reported.
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    elif args.debug:  # gloo's connection lines too (core/runtime/gloo_chatter.py)
        os.environ.setdefault("MCJ_GLOO_LOGS", "1")
    initialize_distributed()
    failure.start_watcher()  # from here on a failure on any one rank ends every rank
    import jax

    world = _device_count(jax)  # processes x devices each: one host with 8 GPUs, 8 ranks of 1, ...
    fill_defaults(args, world)  # accelerators: the defaults follow the devices (a no-op when set above)
    layout = validate_args(args, world)
    return _run(args, layout, rank, progress)


def _device_count(jax) -> int:
    """``jax.device_count()``, or one line naming ``JAX_PLATFORMS`` when JAX cannot start the
    backend it names (JAX raises a bare ``AssertionError`` for a platform whose plugin is absent)."""
    from core.runtime.cluster import ClusterError

    try:
        return jax.device_count()
    except (RuntimeError, AssertionError) as e:
        platforms = os.environ.get("JAX_PLATFORMS") or os.environ.get("JAX_PLATFORM_NAME")
        reason = str(e).strip().splitlines()[0] if str(e).strip() else "its plugin is not installed"
        if platforms:
            raise ClusterError(f"JAX_PLATFORMS={platforms}: JAX cannot start that backend here ({reason}); install "
                               "its plugin (e.g. jax[cuda12]) on a machine with the devices, or unset "
                               "JAX_PLATFORMS") from None
        raise ClusterError(f"JAX cannot start a backend: {reason}") from None


def _run(args, layout, rank: int, progress: _Progress) -> int:
    import jax

    from core import checkpointing
    from core import parallel_state as ps
    from core.runtime.cpu_threads import release_cpu_affinity
    from core.training.compilation_cache import default_cache_dir, enable_compilation_cache
    from core.training.pretrainer import Pretrainer, TrainingError
    from core.training.run_config import pretrain_config
    from core.training.train_logging import TrainingLogger

    if not args.no_compilation_cache:
        enable_compilation_cache(args.compilation_cache_dir or default_cache_dir(), share_between_processes=True)
    state = ps.initialize_model_parallel(layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size,
                                         layout.virtual_pipeline_model_parallel_size,
                                         context_parallel_size=layout.context_parallel_size,
                                         expert_model_parallel_size=layout.expert_model_parallel_size,
                                         num_distributed_optimizer_instances=layout.num_distributed_optimizer_instances)
    release_cpu_affinity()  # the backend has sized its thread pool
    trainer = progress.trainer = Pretrainer(pretrain_config(args), layout, state)
    resumed = bool(args.load) and trainer.load(args.load, load_optimizer=not args.no_load_optim,
                                               step=args.ckpt_step, finetune=args.finetune)
    if args.load and not resumed and args.exit_on_missing_checkpoint:
        raise TrainingError(f"--load {args.load}: {checkpointing.why_nothing_to_load(args.load)} "
                            "(--exit-on-missing-checkpoint)")
    trainer.check_save_directory()
    logging = trainer.run_config.logging
    logger = TrainingLogger(args.train_iters, trainer.iteration, logging.metrics_file, logging.progress_bar)
    trainer.logger = logger
    trainer.tracker = _open_tracker(args, trainer, logger)
    n_params = sum(x.size for x in jax.tree.leaves(trainer.params))
    logger.print(f"> {jax.process_count()} processes, {jax.device_count()} {jax.devices()[0].platform} devices, "
                 f"layout {layout.describe()}, {layout.num_microbatches} microbatches of {args.micro_batch_size}")
    logger.print(f"> MFU against a peak of {trainer.peak.describe()} per device")
    data = trainer.data
    logger.print(f"> GPT: {trainer.config.describe()}, {n_params / 1e6:.2f}M parameters; "
                 f"data: {data.corpus_description}, "
                 f"{len(data.train_data)} train / {data.num_valid_samples} valid samples, unigram entropy "
                 f"{data.unigram_entropy:.4f} nats")
    _print_checkpoint_notes(args, trainer, resumed, logger)
    if resumed and trainer.iteration >= args.train_iters:
        logger.print(f"> nothing to train: the checkpoint in --load {args.load} is at iteration {trainer.iteration}, "
                     f"--train-iters is {args.train_iters}; raise --train-iters to train further")
        logger.close()
        trainer.tracker.close()
        return 0
    progress.training = True
    try:
        records = trainer.train()
    finally:
        logger.close()
        trainer.tracker.close()
    exits = trainer.exit_conditions
    if exits is not None and exits.reason:  # Megatron's early exits: no final evaluation, the time is short
        saved = f"checkpoint {trainer.iteration} saved to {args.save}" if args.save else "nothing saved (no --save)"
        logger.print(f"> exiting at iteration {trainer.iteration}: {exits.describe()}; {saved}")
        return 0
    if records:
        last = records[-1]
        logger.print(f"> done: iteration {trainer.iteration}, loss {last['loss']:.4f}, "
                     f"validation loss {trainer.evaluate():.4f}, unigram entropy {trainer.data.unigram_entropy:.4f}")
    return 0


def _open_tracker(args, trainer, logger):
    """Rank 0's TensorBoard and W&B writers (:mod:`core.training.experiment_tracking`), with a line
    saying where they write; W&B's run config is the flags."""
    from core.training.experiment_tracking import ExperimentTracker

    logging = trainer.run_config.logging
    flags = {k: list(v) if isinstance(v, tuple) else v for k, v in vars(args).items()
             if isinstance(v, (str, int, float, bool, list, tuple, type(None)))}
    tracker = ExperimentTracker.open(logging, args.global_batch_size, logger.is_writer, flags, args.save)
    if logging.tensorboard_dir:
        logger.print(f"> TensorBoard: event files in {logging.tensorboard_dir}")
    if logging.wandb_project:
        logger.print(f"> W&B: project {logging.wandb_project}"
                     + (f", run {logging.wandb_exp_name}" if logging.wandb_exp_name else ""))
    return tracker


def _print_checkpoint_notes(args, trainer, resumed: bool, logger) -> None:
    """What ``--load`` and ``--save`` hold that the user should know: damaged checkpoints skipped,
    step directories without a commit marker (an unfinished save: skipped, and removed by the
    first save), what was resumed, or why nothing was."""
    from core import checkpointing

    for skipped in trainer.checkpointer.skipped_checkpoints:
        logger.print(f"WARNING: --load {args.load}: {skipped}")
    flags_of: dict[str, tuple[str, list[str]]] = {}  # the same directory under both flags: one warning
    for flag, directory in (("--load", args.load), ("--save", args.save)):
        if directory:
            flags_of.setdefault(os.path.abspath(directory), (directory, []))[1].append(flag)
    for directory, flags in flags_of.values():
        removed = ", and removed at the first save" if "--save" in flags else ""
        for step in checkpointing.incomplete_steps(directory):
            logger.print(f"WARNING: {'/'.join(flags)} {directory}: step directory {step} has no commit marker (a save "
                         f"that did not finish): skipped{removed}")
    if resumed and args.finetune:
        logger.print(f"> finetuning from the parameters in {args.load}: iteration 0, a fresh optimizer state")
    elif resumed:
        logger.print(f"> resumed from {args.load} at iteration {trainer.iteration}")
    elif args.load:  # as Megatron: say so, then train from random (a first run's --load DIR is normal)
        logger.print(f"WARNING: --load {args.load}: {checkpointing.why_nothing_to_load(args.load)}; "
                     "starting from random initialization")


if __name__ == "__main__":
    sys.exit(main())
