"""The learning-rate schedule of Megatron's ``OptimizerParamScheduler``, as an optax schedule:
linear warm-up to ``lr``, then constant, linear or cosine decay to ``min_lr``."""

from __future__ import annotations

import dataclasses

import optax


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """The learning-rate schedule (Megatron's ``OptimizerParamScheduler`` flags), resolved."""

    lr: float = 3e-4
    """``--lr``: the peak learning rate."""
    min_lr: float = 3e-5
    """``--min-lr``: the rate the decay ends at."""
    lr_decay_style: str = "cosine"
    """``--lr-decay-style``: ``constant``, ``linear`` or ``cosine``."""
    lr_warmup_iters: int = 0
    """``--lr-warmup-iters``: linear warm-up from 0 over this many iterations."""
    lr_decay_iters: int = 100
    """``--lr-decay-iters`` (default ``--train-iters``): the iteration the decay ends at."""


def learning_rate_schedule(config: SchedulerConfig) -> optax.Schedule:
    """Megatron's schedule: linear warm-up to ``lr``, then constant/linear/cosine decay to ``min_lr``
    at ``lr_decay_iters``."""
    lr, warmup_iters = config.lr, config.lr_warmup_iters
    decay_iters = max(1, config.lr_decay_iters - warmup_iters)
    if config.lr_decay_style == "constant":
        decay = optax.constant_schedule(lr)
    elif config.lr_decay_style == "linear":
        decay = optax.linear_schedule(lr, config.min_lr, decay_iters)
    else:
        decay = optax.cosine_decay_schedule(lr, decay_iters, alpha=config.min_lr / lr if lr else 0.0)
    if warmup_iters <= 0:
        return decay
    warmup = optax.linear_schedule(lr / warmup_iters, lr, warmup_iters - 1)
    return optax.join_schedules([warmup, decay], [warmup_iters])
