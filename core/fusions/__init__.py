"""Fused CPU kernels for hot ops XLA's CPU code generation runs slowly (Megatron's ``fusions``)."""

from core.fusions.fused_attention import fused_attention_available, fused_causal_attention
from core.fusions.fused_layer_norm import (
    FusedLayerNorm,
    FusedRMSNorm,
    fused_layer_norm_available,
    fused_rms_norm_available,
)

__all__ = ["FusedLayerNorm", "FusedRMSNorm", "fused_attention_available", "fused_causal_attention",
           "fused_layer_norm_available", "fused_rms_norm_available"]
