"""Megatron-FSDP's ``optim_grads_params`` (ZeRO-3): parameters sharded over data parallelism at
rest (:mod:`~core.distributed.fsdp.param_sharding`) and gathered unit by unit by the model
(:mod:`~core.distributed.fsdp.unit_gather`). Megatron-FSDP's Python entry points
(``fully_shard_model``, ``fully_shard_optimizer``, ``fully_shard``) are in :mod:`core.megatron_fsdp`."""

from core.distributed.fsdp.param_sharding import shard_over_data_parallel
from core.distributed.fsdp.unit_gather import ParamGather, gather_shard

__all__ = ["ParamGather", "gather_shard", "shard_over_data_parallel"]
