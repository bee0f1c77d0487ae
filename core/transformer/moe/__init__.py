"""Mixture of experts with expert parallelism: Megatron-core's MoE layer inside ``shard_map``
(``docs/moe.md``): config, router, token dispatchers, experts, shared expert, the layer."""

from core.transformer.moe.experts import GroupedMLP, SequentialMLP
from core.transformer.moe.moe_config import MoEConfig
from core.transformer.moe.moe_layer import MoEBlock, MoELayer
from core.transformer.moe.moe_utils import get_updated_expert_bias
from core.transformer.moe.router import MOE_STATE, RouterOutput, TopKRouter
from core.transformer.moe.shared_experts import SharedExpertMLP
from core.transformer.moe.token_dispatcher import (
    MoEAllGatherTokenDispatcher,
    MoEAlltoAllTokenDispatcher,
    build_token_dispatcher,
)

__all__ = [
    "MOE_STATE", "GroupedMLP", "MoEAllGatherTokenDispatcher", "MoEAlltoAllTokenDispatcher", "MoEBlock", "MoEConfig",
    "MoELayer", "RouterOutput", "SequentialMLP", "SharedExpertMLP", "TopKRouter", "build_token_dispatcher",
    "get_updated_expert_bias",
]
