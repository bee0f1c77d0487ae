"""The trainer's typed configs from the validated flags, in one place: each function maps one group
of flags into its config (:mod:`core.training.config`, ``GPTConfig``, ``OptimizerConfig``,
``DistributedDataParallelConfig``, ``CheckpointConfig``, ``SchedulerConfig``)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from core.training.arguments import ddp_config, lr_decay_iters, lr_warmup_iters, min_lr, model_config

if TYPE_CHECKING:
    from core.checkpointing.checkpointer import CheckpointConfig
    from core.training.config import DataConfig, LoggingConfig, PretrainConfig, TrainingConfig


def checkpoint_config(args: argparse.Namespace) -> CheckpointConfig:
    """The checkpoint flags as a :class:`~core.checkpointing.checkpointer.CheckpointConfig`."""
    from core.checkpointing.checkpointer import CheckpointConfig

    return CheckpointConfig(
        save=args.save, load=args.load, save_interval=args.save_interval, async_save=bool(args.async_save),
        async_save_writer=args.async_save_writer, save_optim=not args.no_save_optim,
        load_optim=not args.no_load_optim, ckpt_step=args.ckpt_step, finetune=bool(args.finetune))


def pretrain_config(args: argparse.Namespace) -> PretrainConfig:
    """The validated flags (``validate_args``, which checks them once, naming flags) as the
    trainer's typed configs, the model with the tokenizer's vocabulary."""
    from core.optimizer.optimizer_config import OptimizerConfig
    from core.optimizer.optimizer_param_scheduler import SchedulerConfig
    from core.training.config import PretrainConfig, ProfileConfig
    from core.training.pretraining_data import data_vocab_size

    # The padded vocabulary is a multiple of tp for any tokenizer, so validate_args's check of the
    # model (with the flags' vocabulary) holds for this one too.
    data, training = data_config(args), training_config(args)
    from core.training.checkpoint_args import check_tokenizer_fits

    check_tokenizer_fits(args, data_vocab_size(data))
    model = model_config(args, data_vocab_size(data))
    ddp = ddp_config(args)
    return PretrainConfig(
        model=model, training=training, ddp=ddp, data=data, checkpoint=checkpoint_config(args),
        logging=logging_config(args),
        optimizer=OptimizerConfig(optimizer="adam", lr=args.lr, weight_decay=args.weight_decay,
                                  adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, clip_grad=args.clip_grad),
        scheduler=SchedulerConfig(lr=args.lr, min_lr=min_lr(args), lr_decay_style=args.lr_decay_style,
                                  lr_warmup_iters=lr_warmup_iters(args), lr_decay_iters=lr_decay_iters(args)),
        profile=ProfileConfig(profile=bool(args.profile), profile_ranks=tuple(args.profile_ranks),
                              profile_step_start=args.profile_step_start, profile_step_end=args.profile_step_end,
                              profile_dir=args.profile_dir))


def training_config(args: argparse.Namespace) -> TrainingConfig:
    """The loop's flags as a :class:`~core.training.config.TrainingConfig`."""
    from core.training.config import TrainingConfig

    return TrainingConfig(
        micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size, seq_length=args.seq_length,
        train_iters=args.train_iters, seed=args.seed, eval_interval=args.eval_interval,
        eval_iters=args.eval_iters, exit_interval=args.exit_interval,
        exit_signal=args.exit_signal if args.exit_signal_handler else None,
        exit_duration_in_mins=args.exit_duration_in_mins,
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
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss, sft=args.sft,
        sft_tokenizer_prompt_format=args.sft_tokenizer_prompt_format or "default")


def logging_config(args: argparse.Namespace) -> LoggingConfig:
    """The log, metrics-file, TensorBoard, W&B and timer flags as a :class:`~core.training.config.LoggingConfig`."""
    from core.training.config import LoggingConfig

    return LoggingConfig(
        log_interval=args.log_interval, metrics_file=args.metrics_file, progress_bar=not args.no_progress_bar,
        tensorboard_dir=args.tensorboard_dir, tensorboard_log_interval=args.tensorboard_log_interval,
        tensorboard_queue_size=args.tensorboard_queue_size, log_timers_to_tensorboard=args.log_timers_to_tensorboard,
        log_memory_to_tensorboard=args.log_memory_to_tensorboard,
        log_validation_ppl_to_tensorboard=args.log_validation_ppl_to_tensorboard,
        log_learning_rate_to_tensorboard=args.log_learning_rate_to_tensorboard,
        log_loss_scale_to_tensorboard=args.log_loss_scale_to_tensorboard, wandb_project=args.wandb_project,
        wandb_exp_name=args.wandb_exp_name, wandb_save_dir=args.wandb_save_dir,
        timing_log_level=args.timing_log_level, timing_log_option=args.timing_log_option)
