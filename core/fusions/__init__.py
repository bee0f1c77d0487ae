"""Fused CPU kernels for hot ops XLA's CPU code generation runs slowly (Megatron's ``fusions``)."""

from core.fusions.fused_layer_norm import FusedLayerNorm, fused_layer_norm_available

__all__ = ["FusedLayerNorm", "fused_layer_norm_available"]
