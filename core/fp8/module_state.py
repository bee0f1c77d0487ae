"""Where a flax module's delayed-scaling scales live: the ``"fp8_scale"`` variable collection.

A module with an FP8 GEMM under the ``delayed`` recipe reads its scales ``f32[3]`` (slots x, w,
dy) from the collection :data:`FP8_SCALE` (:func:`module_scale`); ``init`` creates them as ones
(TE's initial scale). The model passes them in with the parameters (``{"params": p,
"fp8_scale": s}``) and differentiates the loss with respect to them, which yields the amaxes
each GEMM saw (:mod:`core.fp8.linear`). The amax histories are not needed by the forward and
stay with the training step's model state (:mod:`core.fp8.scaling`).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from core.fp8.config import NUM_SLOTS, FP8Config

FP8_SCALE = "fp8_scale"
"""The flax variable collection of the delayed-scaling scales."""


def module_scale(module: nn.Module, config: FP8Config | None, name: str = "scale") -> jax.Array | None:
    """The scales ``f32[3]`` of ``module``'s FP8 GEMM called ``name`` under the delayed recipe
    (None otherwise: FP8 off or tensorwise), from the :data:`FP8_SCALE` collection; ``init``
    creates them as ones. Raises ``ValueError`` when a delayed-recipe module is applied without
    the collection."""
    if config is None or not config.delayed:
        return None
    if not (module.is_initializing() or module.has_variable(FP8_SCALE, name)):
        raise ValueError(f"{type(module).__name__} {module.name!r}: the delayed FP8 recipe needs its scales; apply "
                         f"the module with the {FP8_SCALE!r} collection (init creates it)")
    return module.variable(FP8_SCALE, name, lambda: jnp.ones((NUM_SLOTS,), jnp.float32)).value
