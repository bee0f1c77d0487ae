"""FP8 training of the transformer's linear layers, Transformer Engine's recipes in XLA.

``config`` (``FP8Config``: formats ``e4m3`` / ``hybrid``, recipes ``delayed`` / ``tensorwise``,
Megatron's field names), ``scaling`` (tensorwise scales, the delayed-scaling state and its
update, the amax reduction), ``linear`` (``fp8_linear``: the FP8 GEMMs and how the amaxes
they see reach the delayed update), ``grouped`` (``fp8_ragged_dot``: the MoE experts' grouped
GEMMs in FP8, same design) and ``module_state`` (the ``"fp8_scale"`` collection a flax
module reads its delayed-recipe scales from).
"""

from core.fp8.config import AMAX_COMPUTE_ALGOS, DY, FP8_FORMATS, FP8_RECIPES, NUM_SLOTS, FP8Config, W, X
from core.fp8.grouped import RaggedDotGemm, fp8_ragged_dot
from core.fp8.linear import amax, fp8_linear, quantize
from core.fp8.module_state import FP8_SCALE, module_scale
from core.fp8.scaling import (
    FLT_MAX,
    current_scale,
    delayed_state_shape,
    delayed_update,
    init_delayed_state,
    reduce_amax,
)

__all__ = [
    "AMAX_COMPUTE_ALGOS", "DY", "FLT_MAX", "FP8_FORMATS", "FP8_RECIPES", "FP8_SCALE", "NUM_SLOTS", "W", "X",
    "FP8Config", "RaggedDotGemm", "amax", "current_scale", "delayed_state_shape", "delayed_update", "fp8_linear",
    "fp8_ragged_dot", "init_delayed_state", "module_scale", "quantize", "reduce_amax",
]
