"""Optimizer configuration (Megatron's ``OptimizerConfig`` names) and its optax transformation."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """What optimizer to build; the learning-rate schedule is passed separately."""

    optimizer: str = "adam"
    """"adam" (decoupled weight decay, i.e. AdamW, as Megatron) or "sgd"."""
    lr: float = 1e-3
    """Peak learning rate (used when no schedule is given)."""
    weight_decay: float = 0.01
    """Decoupled weight decay; applied to params with more than one dimension only (Megatron's rule)."""
    adam_beta1: float = 0.9
    """Adam first-moment decay."""
    adam_beta2: float = 0.999
    """Adam second-moment decay."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    sgd_momentum: float = 0.9
    """SGD momentum (0 disables it)."""
    clip_grad: float = 0.0
    """Clip gradients to this global L2 norm across all ranks (0 disables clipping)."""

    def __post_init__(self) -> None:
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer must be 'adam' or 'sgd', got {self.optimizer!r}")
        if self.clip_grad < 0 or self.weight_decay < 0:
            raise ValueError(f"clip_grad ({self.clip_grad}) and weight_decay ({self.weight_decay}) must be >= 0")


class MaskedDecayState(optax.EmptyState):
    """No state: the decay mask is a constant of the transformation."""


def add_decayed_weights_elementwise(weight_decay: float, mask: Any = None) -> optax.GradientTransformation:
    """``updates + weight_decay * mask * params``, with ``mask`` a tree of arrays or scalars.

    Unlike ``optax.add_decayed_weights`` the mask may vary *within* a leaf, which the
    distributed optimizer needs: a shard of a flat buffer mixes decayed and undecayed params.
    """

    def init(params):
        del params
        return MaskedDecayState()

    def update(updates, state, params=None):
        if weight_decay == 0.0:
            return updates, state
        m = mask if mask is not None else jax.tree.map(lambda _: 1.0, params)
        updates = jax.tree.map(lambda u, p, k: u + weight_decay * jnp.asarray(k, u.dtype) * p, updates, params, m)
        return updates, state

    return optax.GradientTransformation(init, update)


def get_optax_transformation(
    config: OptimizerConfig, learning_rate: float | optax.Schedule | None = None, decay_mask: Any = None
) -> optax.GradientTransformation:
    """The optax transformation for ``config`` (without clipping, which is done globally)."""
    lr = config.lr if learning_rate is None else learning_rate
    if config.optimizer == "adam":
        core = optax.scale_by_adam(b1=config.adam_beta1, b2=config.adam_beta2, eps=config.adam_eps)
    else:
        core = optax.trace(decay=config.sgd_momentum) if config.sgd_momentum else optax.identity()
    return optax.chain(core, add_decayed_weights_elementwise(config.weight_decay, decay_mask),
                       optax.scale_by_learning_rate(lr))
