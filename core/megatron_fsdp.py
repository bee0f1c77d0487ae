"""Megatron-FSDP's Python entry points (Megatron's ``megatron_fsdp`` package) for users who write
their own loop:
:func:`fully_shard_model`, :func:`fully_shard_optimizer` and :func:`fully_shard`.

They build the package's :class:`~core.distributed.DistributedDataParallel` and
:class:`~core.optimizer.MegatronOptimizer` with Megatron-FSDP's configuration, so everything
else (the fused step :func:`~core.training.train_step.make_train_step`, Megatron's loop,
checkpoints) is the same as for any strategy::

    model = fully_shard_model(GPTModel(config, state), state=state)   # ZeRO-3
    params = model.init(jax.random.key(0), sample_tokens)             # created in their shards
    optimizer = fully_shard_optimizer(model, OptimizerConfig(lr=3e-4))
    opt_state = optimizer.init_state(params)
    step = make_train_step(model, optimizer, model.module.loss_fn, num_microbatches=4)

Megatron's ``fsdp_unit_modules`` has no counterpart: the units are the module's own (for
:class:`~core.models.gpt.GPTModel` the embedding, every transformer layer and the output head),
and a module used with ``optim_grads_params`` must gather them itself (a ``param_gather``
attribute, :class:`~core.distributed.fsdp.unit_gather.ParamGather`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import optax

from core import parallel_state
from core.distributed.distributed_data_parallel import DistributedDataParallel
from core.distributed.distributed_data_parallel_config import SHARDING_STRATEGIES, DistributedDataParallelConfig
from core.optimizer.optimizer import MegatronOptimizer, get_megatron_optimizer
from core.optimizer.optimizer_config import OptimizerConfig


def _strategy(zero_dp_strategy: int | str) -> str:
    """Megatron-FSDP's ``zero_dp_strategy``: a strategy name or its ZeRO level 0-3."""
    if isinstance(zero_dp_strategy, int) and not isinstance(zero_dp_strategy, bool):
        if not 0 <= zero_dp_strategy < len(SHARDING_STRATEGIES):
            raise ValueError(f"zero_dp_strategy must be 0-3 or one of {', '.join(SHARDING_STRATEGIES)}, "
                             f"got {zero_dp_strategy}")
        return SHARDING_STRATEGIES[zero_dp_strategy]
    if zero_dp_strategy not in SHARDING_STRATEGIES:
        raise ValueError(f"zero_dp_strategy must be 0-3 or one of {', '.join(SHARDING_STRATEGIES)}, "
                         f"got {zero_dp_strategy!r}")
    return zero_dp_strategy


def fully_shard_model(module: Any, *, state: parallel_state.ParallelState | None = None,
                      zero_dp_strategy: int | str = 3,
                      ddp_config: DistributedDataParallelConfig | None = None) -> DistributedDataParallel:
    """Megatron-FSDP's ``fully_shard_model(module, zero_dp_strategy=3)``: ``module`` wrapped for
    data parallelism with ``use_megatron_fsdp=True`` and ``zero_dp_strategy`` (``3`` or
    ``"optim_grads_params"``: parameters, gradients and optimizer state sharded; ``2`` /
    ``"optim_grads"``; ``1`` / ``"optim"``; ``0`` / ``"no_shard"``). ``state``: the parallel state
    (default: the initialised one); ``ddp_config``: the other DDP options (its
    ``use_megatron_fsdp`` and strategy are replaced). Call ``init(rng, *sample_inputs)`` on the
    result: the parameters are created directly in their shards."""
    config = dataclasses.replace(ddp_config or DistributedDataParallelConfig(), use_megatron_fsdp=True,
                                 data_parallel_sharding_strategy=_strategy(zero_dp_strategy))
    return DistributedDataParallel(state, config, module)


def fully_shard_optimizer(model: DistributedDataParallel, config: OptimizerConfig | optax.GradientTransformation,
                          learning_rate: float | optax.Schedule | None = None) -> MegatronOptimizer:
    """Megatron-FSDP's ``fully_shard_optimizer``: the optimizer of a model from
    :func:`fully_shard_model`, its state sharded as the model's strategy says (split like the
    sharded parameters under ``optim_grads_params``, bucket shards under ``optim`` /
    ``optim_grads``). ``model`` must be initialised (``model.init``) before ``init_state``."""
    if not model.ddp_config.use_megatron_fsdp:
        raise ValueError("fully_shard_optimizer needs a model from fully_shard_model (use_megatron_fsdp=True)")
    return get_megatron_optimizer(config, [model], learning_rate)


def fully_shard(module: Any, config: OptimizerConfig | optax.GradientTransformation, *,
                state: parallel_state.ParallelState | None = None, zero_dp_strategy: int | str = 3,
                ddp_config: DistributedDataParallelConfig | None = None,
                learning_rate: float | optax.Schedule | None = None
                ) -> tuple[DistributedDataParallel, MegatronOptimizer]:
    """Megatron-FSDP's ``fully_shard(module, optimizer)``: :func:`fully_shard_model` and
    :func:`fully_shard_optimizer` in one call, ``(model, optimizer)``."""
    model = fully_shard_model(module, state=state, zero_dp_strategy=zero_dp_strategy, ddp_config=ddp_config)
    return model, fully_shard_optimizer(model, config, learning_rate)
