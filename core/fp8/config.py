"""``FP8Config``: which FP8 formats and scaling recipe the transformer's linear layers use, with
Megatron's ``TransformerConfig`` field names and defaults (``--fp8-format``, ``--fp8-recipe``,
``--fp8-margin``, ``--fp8-amax-history-len``, ``--fp8-amax-compute-algo``, ``--no-fp8-wgrad``).

Formats (Transformer Engine's ``Format``): ``"e4m3"`` quantizes every tensor to E4M3 (max 448);
``"hybrid"`` quantizes the forward's tensors (activations, weights) to E4M3 and the gradients to
E5M2 (max 57344: gradients need range more than precision). Pure E5M2 is rejected, as Megatron does.

Recipes: ``"delayed"`` (TE's ``DelayedScaling``) quantizes with a scale derived from a history
of past amaxes (:mod:`core.fp8.scaling`); ``"tensorwise"`` (TE's ``Float8CurrentScaling``)
derives the scale from the tensor being quantized and keeps no state.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

FP8_FORMATS = ("e4m3", "hybrid")
"""Values of ``--fp8-format`` (``FP8Config.fp8``)."""
FP8_RECIPES = ("delayed", "tensorwise")
"""Values of ``--fp8-recipe``."""
AMAX_COMPUTE_ALGOS = ("most_recent", "max")
"""Values of ``--fp8-amax-compute-algo``."""

X, W, DY = 0, 1, 2
"""Slots of a linear layer's scaling state: its input, its weight, its output gradient."""
NUM_SLOTS = 3
"""Quantized tensors per linear layer (TE's fprop input and weight, dgrad/wgrad grad_output)."""


@dataclasses.dataclass(frozen=True)
class FP8Config:
    """FP8 settings of the transformer's linear layers (Megatron's ``TransformerConfig`` names).

    Frozen and hashable: the FP8 linear takes it as a static argument of its ``custom_vjp``.
    """

    fp8: str | None = None
    """Format: None (FP8 off), ``"e4m3"`` or ``"hybrid"`` (E4M3 forward, E5M2 gradients)."""
    fp8_recipe: str = "delayed"
    """``"delayed"`` (scale from an amax history) or ``"tensorwise"`` (scale from the current tensor)."""
    fp8_margin: int = 0
    """Delayed only: the scale is divided by ``2**fp8_margin`` (headroom against amax growth)."""
    fp8_amax_history_len: int = 1
    """Delayed only: amaxes kept per tensor (Megatron's default 1; TE's own default is 1024)."""
    fp8_amax_compute_algo: str = "most_recent"
    """Delayed only: the amax a scale comes from, ``"most_recent"`` or ``"max"`` over the history."""
    fp8_wgrad: bool = True
    """Run the weight-gradient GEMM in FP8 (False: Megatron's ``--no-fp8-wgrad``, high precision)."""

    def __post_init__(self) -> None:
        if self.fp8 is not None and self.fp8 not in FP8_FORMATS:
            raise ValueError(f"fp8 format must be one of {FP8_FORMATS} or None, got {self.fp8!r}")
        if self.fp8_recipe not in FP8_RECIPES:
            raise ValueError(f"fp8_recipe must be one of {FP8_RECIPES}, got {self.fp8_recipe!r}")
        if self.fp8_amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(f"fp8_amax_compute_algo must be one of {AMAX_COMPUTE_ALGOS}, "
                             f"got {self.fp8_amax_compute_algo!r}")
        if self.fp8_amax_history_len < 1:
            raise ValueError(f"fp8_amax_history_len must be at least 1, got {self.fp8_amax_history_len}")

    @classmethod
    def from_config(cls, config: Any) -> FP8Config:
        """The FP8 fields of a config that carries them under the same names (``TransformerConfig``)."""
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})

    @property
    def enabled(self) -> bool:
        """Whether FP8 is on."""
        return self.fp8 is not None

    @property
    def delayed(self) -> bool:
        """Whether the layers keep delayed-scaling state (FP8 on with the ``delayed`` recipe)."""
        return self.enabled and self.fp8_recipe == "delayed"

    @property
    def forward_dtype(self) -> Any:
        """The FP8 dtype of activations and weights."""
        return jnp.float8_e4m3fn

    @property
    def backward_dtype(self) -> Any:
        """The FP8 dtype of output gradients: E5M2 under ``hybrid``, else E4M3."""
        return jnp.float8_e5m2 if self.fp8 == "hybrid" else jnp.float8_e4m3fn

    def slot_dtypes(self) -> tuple[Any, Any, Any]:
        """The FP8 dtype of each slot (:data:`X`, :data:`W`, :data:`DY`)."""
        return self.forward_dtype, self.forward_dtype, self.backward_dtype

    def slot_maxes(self) -> tuple[float, float, float]:
        """The largest finite value of each slot's FP8 dtype (448 for E4M3, 57344 for E5M2)."""
        return tuple(float(jnp.finfo(d).max) for d in self.slot_dtypes())
