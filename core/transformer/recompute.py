"""Activation recompute (Megatron's ``--recompute-granularity``) as ``jax.checkpoint`` policies.

- ``"full"``: the layer keeps only its input; the backward reruns the whole layer.
- ``"selective"``: the layer keeps the outputs of its matmuls without batch dimensions (the
  linear layers: QKV, attention projection, MLP fc1/fc2) and reruns the rest: core attention
  (its scores are a batched matmul or a fused kernel), the experts' grouped GEMMs (batched over
  experts), norms, activations, dropout and the residual adds. Like Megatron's selective
  recompute of core attention, it reruns a small share of the layer's FLOPs
  (``bench/results/2026-11-gpu.md``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import jax

F = TypeVar("F", bound=Callable)

RECOMPUTE_POLICIES = {"full": None, "selective": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}
"""``jax.checkpoint`` policy per granularity (None: save nothing but the inputs)."""


def with_recompute(fn: F, granularity: str | None) -> F:
    """``fn`` wrapped for recompute at ``granularity`` (None: ``fn`` unchanged)."""
    if granularity is None:
        return fn
    if granularity not in RECOMPUTE_POLICIES:
        raise ValueError(f"recompute granularity must be None, 'full' or 'selective', got {granularity!r}")
    return jax.checkpoint(fn, policy=RECOMPUTE_POLICIES[granularity])
