"""FP8 scales: Transformer Engine's current (tensorwise) scaling and its delayed-scaling update.

Scales follow TE's convention: a tensor is quantized as ``sat_cast(x * scale)`` and a GEMM's
result is dequantized by multiplying with ``1 / scale`` of each operand.

Delayed-scaling state of one linear layer (or a stack of them: any leading dims) is
``{"amax_history": f32[..., L, 3], "scale": f32[..., 3]}``, slots :data:`~core.fp8.config.X`,
:data:`~core.fp8.config.W`, :data:`~core.fp8.config.DY` along the last dim (TE's
``amax_history [len, n]`` and ``scale [n]``). The amaxes a step saw come from the FP8 linear
(:mod:`core.fp8.linear`), are reduced with MAX over the mesh axes that share a tensor
(:func:`reduce_amax`) and then enter :func:`delayed_update`, which is TE's
``amax_and_scale_update_after_reduction`` kernel element for element.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from core.fp8.config import NUM_SLOTS, FP8Config

FLT_MAX = float(np.finfo(np.float32).max)
"""The scale an overflowing ``fp8_max / amax`` becomes (TE: ``std::numeric_limits<float>::max()``)."""


def current_scale(amax: jax.Array, fp8_max: float) -> jax.Array:
    """Tensorwise (current) scaling: ``fp8_max / amax`` (TE's ``compute_scale_from_amax`` with
    epsilon 0 and no power-of-2 rounding). An amax of 0 or a non-finite one gives 1 (nothing to
    scale; a NaN tensor fails the step's NaN check anyway); an overflowing scale gives FLT_MAX."""
    amax = amax.astype(jnp.float32)
    usable = jnp.isfinite(amax) & (amax > 0)
    scale = jnp.float32(fp8_max) / jnp.where(usable, amax, 1.0)
    scale = jnp.where(jnp.isinf(scale), FLT_MAX, scale)
    return jnp.where(usable, scale, 1.0)


def init_delayed_state(config: FP8Config, lead_shape: Sequence[int] = ()) -> dict[str, jax.Array]:
    """A fresh delayed-scaling state (TE's: zero histories, unit scales) for ``lead_shape``
    linear layers (e.g. ``(num_layers,)`` for a stack)."""
    lead = tuple(lead_shape)
    return {"amax_history": jnp.zeros(lead + (config.fp8_amax_history_len, NUM_SLOTS), jnp.float32),
            "scale": jnp.ones(lead + (NUM_SLOTS,), jnp.float32)}


def delayed_state_shape(config: FP8Config, lead_shape: Sequence[int] = ()) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes of :func:`init_delayed_state`'s arrays; empty unless the recipe is delayed
    (tensorwise scaling keeps no state)."""
    if not config.delayed:
        return {}
    return jax.eval_shape(lambda: init_delayed_state(config, lead_shape))


def reduce_amax(amax: jax.Array, axes: str | Sequence[str] | None) -> jax.Array:
    """``amax`` reduced with MAX over the mesh ``axes`` that share the quantized tensors (inside
    ``shard_map``): TE's ``fp8_group``, tp x dp x cp (tp for split weights and activations,
    dp/cp for activations and gradients); pipeline stages hold different layers and share nothing."""
    if not axes:
        return amax
    return lax.pmax(amax, axes)


def delayed_update(state: dict[str, jax.Array], amax: jax.Array, config: FP8Config) -> dict[str, jax.Array]:
    """The delayed-scaling state after a step whose (reduced) amaxes were ``amax [..., 3]``.

    Transformer Engine's update (``amax_and_scale_update_after_reduction``), per slot:

    * ``last`` is the step's amax, or the history's slot 0 when the step saw none (amax 0);
    * if ``last != 0`` the history rolls: slot ``i`` takes old slot ``i + 1``, the last slot
      takes ``last``, then slot 0 is zeroed; if ``last == 0`` the history is left as it is;
    * the amax used is ``last`` (``most_recent``) or the maximum of the rolled window
      (``max``: old slots ``1..L-1`` and ``last``; 0 when nothing rolled);
    * ``scale = (fp8_max / amax) / 2**margin`` (fp8_max of the slot's format) when that amax is
      finite and positive, else the previous scale; an infinite result becomes FLT_MAX.
    """
    history, old_scale = state["amax_history"], state["scale"]
    amax = amax.astype(jnp.float32)
    last = jnp.where(amax != 0, amax, history[..., 0, :])
    rolled = jnp.concatenate([history[..., 1:, :], last[..., None, :]], axis=-2)
    # TE takes the window's maximum with fmaxf from 0, which skips NaNs.
    window_max = jnp.max(jnp.where(jnp.isnan(rolled), 0.0, rolled), axis=-2)
    rolled = rolled.at[..., 0, :].set(0.0)
    did_roll = (last != 0)[..., None, :]
    new_history = jnp.where(did_roll, rolled, history)
    if config.fp8_amax_compute_algo == "most_recent":
        use = last
    else:
        use = jnp.where(last != 0, window_max, 0.0)
    scaled_max = jnp.asarray(config.slot_maxes(), jnp.float32) * jnp.float32(2.0 ** -config.fp8_margin)
    usable = jnp.isfinite(use) & (use > 0)
    scale = jnp.where(usable, scaled_max / jnp.where(usable, use, 1.0), old_scale)
    scale = jnp.where(jnp.isinf(scale), FLT_MAX, scale)
    return {"amax_history": new_history, "scale": scale}
