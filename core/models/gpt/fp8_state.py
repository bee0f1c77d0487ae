"""The GPT's FP8 delayed-scaling state: one ``{"scale", "amax_history"}`` per FP8 GEMM of every
layer, stacked like the layers.

Layout (global arrays): ``{"scale": S, "amax_history": H}`` where ``S`` mirrors one layer's
``"fp8_scale"`` collection (:mod:`core.fp8.module_state`: a leaf ``f32[3]`` per FP8 GEMM, e.g.
``self_attention/linear_qkv/scale``) with every leaf stacked ``[vpp, pp * n, 3]`` as
``params["layers"]`` is (dim 1 split over ``"pp"``; a MoE model has ``{"dense": ..., "moe":
...}`` per kind), and ``H`` the same with ``[vpp, pp * n, amax_history_len, 3]`` leaves.

A training step feeds each layer its scales; the loss's cotangent with respect to them is the
amaxes every GEMM saw (:mod:`core.fp8.linear`), combined over the step's microbatches with
``max``; :func:`update_fp8_state` reduces them with MAX over every mesh axis but ``"pp"``
(tensor-parallel shards, data-parallel and context-parallel replicas, expert-parallel ranks: the
groups that share a tensor; pipeline stages hold different layers) and applies Transformer
Engine's update (:func:`core.fp8.delayed_update`) once per step. The reduced amaxes are the
one-device amaxes, so the scales, and hence the quantized values, do not depend on the layout.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from core.fp8 import FP8_SCALE, NUM_SLOTS, FP8Config, delayed_update, reduce_amax
from core.parallel_state import PP_AXIS


def layer_scale_shapes(model: Any, layer: Any) -> Any:
    """One layer's :data:`~core.fp8.FP8_SCALE` collection as its init creates it (``f32[3]``
    leaves), from an abstract init inside the model's mesh (nothing is computed)."""
    shape = model.activation_shape(1)

    def scales():
        return layer.init(jax.random.key(0), jnp.zeros(shape, model.config.compute_dtype)).get(FP8_SCALE, {})

    return jax.eval_shape(jax.shard_map(scales, mesh=model.state.mesh, in_specs=(), out_specs=P(), check_vma=False))


def fp8_state_shape(model: Any) -> dict[str, Any]:
    """Global shapes of ``model``'s FP8 state (module docstring), float32."""
    config: FP8Config = model.config.fp8_config
    per_kind = {}
    for kind, layer, n in model.layer_kinds():
        lead = (model.vpp, model.pp * n)
        scales = layer_scale_shapes(model, layer)
        per_kind[kind] = (jax.tree.map(lambda _, lead=lead: jax.ShapeDtypeStruct(lead + (NUM_SLOTS,), jnp.float32),
                                       scales),
                          jax.tree.map(lambda _, lead=lead: jax.ShapeDtypeStruct(
                              lead + (config.fp8_amax_history_len, NUM_SLOTS), jnp.float32), scales))
    if model.moe_layer is None:
        scale, history = per_kind["dense"]
    else:
        scale = {kind: v[0] for kind, v in per_kind.items()}
        history = {kind: v[1] for kind, v in per_kind.items()}
    return {"scale": scale, "amax_history": history}


def fp8_state_spec(shapes: dict[str, Any]) -> dict[str, Any]:
    """The ``shard_map`` specs of :func:`fp8_state_shape`'s arrays: dim 1 over ``"pp"``."""
    return jax.tree.map(lambda _: P(None, PP_AXIS), shapes)


def init_fp8_state(shapes: dict[str, Any]) -> dict[str, Any]:
    """Transformer Engine's initial state of :func:`fp8_state_shape`'s arrays: unit scales, zero
    amax histories (local arrays; build them under ``jax.jit`` with the specs' shardings)."""
    return {"scale": jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), shapes["scale"]),
            "amax_history": jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["amax_history"])}


def update_fp8_state(state: dict[str, Any], amaxes: Any, config: FP8Config, axes: tuple[str, ...]) -> dict[str, Any]:
    """The FP8 state after a step whose GEMMs saw ``amaxes`` (this rank's, the scales'
    cotangents combined over the microbatches; inside ``shard_map``): reduced with MAX over
    ``axes``, then Transformer Engine's update per GEMM."""
    amaxes = reduce_amax(amaxes, axes)
    scales, treedef = jax.tree.flatten(state["scale"])
    new = [delayed_update({"amax_history": h, "scale": s}, a, config)
           for s, h, a in zip(scales, jax.tree.leaves(state["amax_history"]), jax.tree.leaves(amaxes), strict=True)]
    return {"scale": jax.tree.unflatten(treedef, [n["scale"] for n in new]),
            "amax_history": jax.tree.unflatten(treedef, [n["amax_history"] for n in new])}


def amax_axes(mesh: Any) -> tuple[str, ...]:
    """The mesh axes FP8 amaxes are reduced over: all but ``"pp"``."""
    return tuple(a for a in mesh.axis_names if a != PP_AXIS)


def chunk_scales(fp8_state: dict | None) -> Any:
    """The scales of a model chunk's state slice (None without FP8 state)."""
    return None if fp8_state is None else fp8_state["scale"]


def scale_variables(scales: Any) -> dict[str, Any]:
    """A layer's variables entry for its scales (empty without them)."""
    return {} if scales is None else {FP8_SCALE: scales}


__all__ = ["amax_axes", "chunk_scales", "fp8_state_shape", "fp8_state_spec", "init_fp8_state",
           "layer_scale_shapes", "scale_variables", "update_fp8_state"]
