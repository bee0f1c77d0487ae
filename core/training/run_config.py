"""The trainer's typed configs from the validated flags, in one place: each function maps one group
of flags into its config (:mod:`core.training.config`, ``GPTConfig``, ``OptimizerConfig``,
``DistributedDataParallelConfig``, ``CheckpointConfig``, ``SchedulerConfig``)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from core.training.arguments import (
    data_source,
    lr_decay_iters,
    lr_warmup_iters,
    min_lr,
    model_config,
    tokenizer_from_args,
)

if TYPE_CHECKING:
    from core.checkpointing.checkpointer import CheckpointConfig
    from core.training.config import DataConfig, PretrainConfig, TrainingConfig


def checkpoint_config(args: argparse.Namespace) -> CheckpointConfig:
    """The checkpoint flags as a :class:`~core.checkpointing.checkpointer.CheckpointConfig`."""
    from core.checkpointing.checkpointer import CheckpointConfig

    return CheckpointConfig(
        save=args.save, load=getattr(args, "load", None), save_interval=getattr(args, "save_interval", None),
        async_save=bool(getattr(args, "async_save", False)),
        async_save_writer=getattr(args, "async_save_writer", None),
        save_optim=not getattr(args, "no_save_optim", False), load_optim=not getattr(args, "no_load_optim", False),
        ckpt_step=getattr(args, "ckpt_step", None), finetune=bool(getattr(args, "finetune", False)))


def data_vocab_size(args: argparse.Namespace) -> int:
    """The vocabulary the data's tokens come from: the byte vocabulary for a text corpus with
    ``--tokenizer-type ByteLevel``, else the tokenizer's."""
    from core.data import ByteTokenizer

    if args.tokenizer_type == "ByteLevel" and data_source(args.data_path).kind != "indexed":
        return ByteTokenizer.vocab_size
    return tokenizer_from_args(args).vocab_size


def pretrain_config(args: argparse.Namespace) -> PretrainConfig:
    """The validated flags (``validate_args``, which checks them once, naming flags) as the
    trainer's typed configs, the model with the tokenizer's vocabulary."""
    from core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
    from core.optimizer.optimizer_config import OptimizerConfig
    from core.optimizer.optimizer_param_scheduler import SchedulerConfig
    from core.training.config import LoggingConfig, PretrainConfig, ProfileConfig

    # The padded vocabulary is a multiple of tp for any tokenizer, so validate_args's check of the
    # model (with the flags' vocabulary) holds for this one too.
    model = model_config(args, data_vocab_size(args))
    data, training = data_config(args), training_config(args)
    # No in-step NaN skip unless asked (check_for_nan_in_grad): the loop stops at the first
    # non-finite loss or grad norm and saves nothing after it (Megatron's
    # --check-for-nan-in-loss-and-grad), so parameters left unchanged would never be used.
    ddp = DistributedDataParallelConfig(
        use_distributed_optimizer=args.use_distributed_optimizer, overlap_grad_reduce=args.overlap_grad_reduce,
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances, grad_reduce_in_fp32=True,
        check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad, check_for_spiky_loss=args.check_for_spiky_loss,
        spiky_loss_factor=args.spiky_loss_factor)
    get = lambda name, default=None: getattr(args, name, default)
    return PretrainConfig(
        model=model, training=training, ddp=ddp, data=data, checkpoint=checkpoint_config(args),
        logging=LoggingConfig(log_interval=args.log_interval, metrics_file=get("metrics_file"),
                              progress_bar=not get("no_progress_bar", False)),
        optimizer=OptimizerConfig(optimizer="adam", lr=args.lr, weight_decay=args.weight_decay,
                                  adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, clip_grad=args.clip_grad),
        scheduler=SchedulerConfig(lr=args.lr, min_lr=min_lr(args), lr_decay_style=args.lr_decay_style,
                                  lr_warmup_iters=lr_warmup_iters(args), lr_decay_iters=lr_decay_iters(args)),
        profile=ProfileConfig(profile=bool(get("profile", False)), profile_ranks=tuple(get("profile_ranks", (0,))),
                              profile_step_start=get("profile_step_start", 10),
                              profile_step_end=get("profile_step_end", 12), profile_dir=get("profile_dir", "profile")))


def training_config(args: argparse.Namespace) -> TrainingConfig:
    """The loop's flags as a :class:`~core.training.config.TrainingConfig`."""
    from core.training.config import TrainingConfig

    return TrainingConfig(
        micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size, seq_length=args.seq_length,
        train_iters=args.train_iters, seed=args.seed, eval_interval=args.eval_interval,
        eval_iters=args.eval_iters, exit_interval=args.exit_interval,
        exit_signal=args.exit_signal if getattr(args, "exit_signal_handler", False) else None,
        exit_duration_in_mins=getattr(args, "exit_duration_in_mins", None),
        check_for_nan_in_loss_and_grad=args.check_for_nan_in_loss_and_grad,
        check_for_spiky_loss=args.check_for_spiky_loss, spiky_loss_factor=args.spiky_loss_factor)


def data_config(args: argparse.Namespace) -> DataConfig:
    """The data flags as a :class:`~core.training.config.DataConfig`."""
    from core.training.config import DataConfig

    return DataConfig(
        data_path=None if args.data_path is None else tuple(args.data_path), split=args.split,
        valid_fraction=args.valid_fraction, tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model,
        vocab_file=args.vocab_file, merge_file=args.merge_file, vocab_size=args.vocab_size,
        data_cache_path=args.data_cache_path, reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss)
