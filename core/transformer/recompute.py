"""Activation recompute (Megatron's ``--recompute-granularity``) as ``jax.checkpoint`` policies.

- ``"full"``: the layer keeps only its input; the backward reruns the whole layer.
- ``"selective"``: the layer keeps the outputs of its matmuls without batch dimensions (the
  linear layers: QKV, attention projection, MLP fc1/fc2) and reruns the rest: core attention
  (its scores are a batched matmul or a fused kernel), the experts' grouped GEMMs (batched over
  experts), norms, activations, dropout and the residual adds. Like Megatron's selective
  recompute of core attention, it reruns a small share of the layer's FLOPs
  (``bench/results/2026-11-gpu.md``).

Under Megatron-FSDP ``optim_grads_params`` a layer's gathered parameters are tagged
:data:`GATHERED_PARAMS`; no policy above keeps them (they are neither inputs nor matmul
outputs), so the backward gathers them again, and without recompute ``regather_params`` wraps
the layer in a policy that keeps everything else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import jax

from core.distributed.fsdp.unit_gather import GATHERED_PARAMS

F = TypeVar("F", bound=Callable)

RECOMPUTE_POLICIES = {"full": None, "selective": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}
"""``jax.checkpoint`` policy per granularity (None: save nothing but the inputs)."""


def with_recompute(fn: F, granularity: str | None, regather_params: bool = False) -> F:
    """``fn`` wrapped for recompute at ``granularity`` (None: ``fn`` unchanged, or with
    ``regather_params`` wrapped to recompute only its :data:`GATHERED_PARAMS`)."""
    if granularity is None:
        if regather_params:
            return jax.checkpoint(fn, policy=jax.checkpoint_policies.save_anything_except_these_names(GATHERED_PARAMS))
        return fn
    if granularity not in RECOMPUTE_POLICIES:
        raise ValueError(f"recompute granularity must be None, 'full' or 'selective', got {granularity!r}")
    return jax.checkpoint(fn, policy=RECOMPUTE_POLICIES[granularity])
