"""Spiky-loss check of the fused step (``check_for_spiky_loss``): a loss far above the recent
ones skips the update, as Megatron's ``--check-for-spiky-loss`` flags a loss that is
"unexpectedly large".

The tracker is part of the optimizer state: the last :data:`WINDOW` finite, accepted losses in
a ring buffer. Once :data:`MIN_COUNT` losses are in, a loss above ``factor`` times the largest
of them is *spiky*: the step's update is skipped (parameters and optimizer state unchanged) and
the loss is not added. The loss is the global mean (the same on every rank), so every rank
decides alike without a collective.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

WINDOW = 100
"""Losses the recent maximum is taken over."""
MIN_COUNT = 10
"""Losses seen before the check starts (the first steps' losses fall fast)."""


def init_spiky_loss_tracker() -> dict[str, jax.Array]:
    """An empty tracker: ``losses`` (ring buffer) and ``count`` (losses added so far)."""
    return {"losses": jnp.zeros(WINDOW, jnp.float32), "count": jnp.zeros((), jnp.int32)}


def check_spiky_loss(tracker: dict[str, jax.Array], loss: jax.Array, factor: float
                     ) -> tuple[dict[str, jax.Array], jax.Array, jax.Array]:
    """``(new tracker, spiky, recent max)`` for this step's ``loss`` (see the module docstring)."""
    count = tracker["count"]
    valid = jnp.arange(WINDOW) < jnp.minimum(count, WINDOW)
    recent_max = jnp.max(jnp.where(valid, tracker["losses"], -jnp.inf))
    loss = loss.astype(jnp.float32)
    spiky = (count >= MIN_COUNT) & (loss > factor * recent_max)
    accept = jnp.isfinite(loss) & ~spiky
    losses = jnp.where(accept, tracker["losses"].at[count % WINDOW].set(loss), tracker["losses"])
    return {"losses": losses, "count": count + accept.astype(jnp.int32)}, spiky, recent_max
