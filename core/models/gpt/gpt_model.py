"""``GPTModel``: the GPT split over tensor, sequence and (virtual) pipeline parallelism.

Parameters (global arrays, sharded as their metadata says)::

    {"embedding": {"word_embeddings": {"weight": [V, h]  split over tp},
                   "position_embeddings": [s, h]},          # learned positions only
     "layers": <TransformerLayer params stacked [vpp, L / vpp, ...], dim 1 split over pp>,
     "head":   {"final_layernorm": ..., "output_layer": [V, h] when untied}}

With MoE (``config.moe``) ``"layers"`` is ``{"dense": [vpp, pp * n_dense, ...], "moe": [vpp,
pp * n_moe, ...]}``: each chunk's dense and MoE layers stacked apart (the MoE pattern is the same
in every chunk), run unrolled in layer order; the MoE aux and z losses enter the gradient
(``docs/moe.md``).

``V`` is ``padded_vocab_size`` (its padding rows start at zero; their logits are masked in the
loss). A microbatch is the dict of ``core/models/gpt/gpt_layers.py``'s docstring (tokens,
labels and the optional loss mask, positions, segments and dropout seeds); every entry point
takes the whole dict so the options reach the layers on both training paths.

Layer ``l`` sits at ``layers[l // (L/vpp), l % (L/vpp)]``, so pipeline rank ``r`` holds, in chunk
``c``, the layers of virtual stage ``c * pp + r`` (Megatron's interleaved assignment) and the
global arrays are the same for every layout with the same ``vpp``. Under ``pipeline_schedule``
``"zb-v"`` (two chunks) rank ``r``'s chunk 1 holds virtual stage ``2 pp - 1 - r`` instead (ZB-V's
V placement, :meth:`GPTModel.virtual_stage`): the arrays keep their shape, chunk 1's row blocks
come in reverse rank order (``core/checkpointing/layer_order.py`` converts). Layer ``l`` is initialised
from ``fold_in(key, l)`` and every weight tensor-parallel-invariantly, so the initial model does
not depend on tp, pp or dp. Embedding and head live on every pipeline stage (used by the first
and last); ``finalize_model_grads`` sums their grads over ``"pp"``, Megatron's embedding group.

Two training paths give the same result: without pipelining :meth:`GPTModel.loss_fn` (Megatron's
loss contract, ``(loss_sum, num_tokens, report)``) is differentiated by the training step's
microbatch loop; with pipelining :meth:`GPTModel.forward_backward` runs Megatron's (interleaved)
1F1B with the table-driven executor.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from core.context_parallel import cp_positions
from core.distributed.fsdp.unit_gather import ParamGather
from core.distributed.loss_normalization import sequence_mean
from core.models.gpt import fp8_state
from core.models.gpt.gpt_config import GPTConfig
from core.models.gpt.gpt_layers import GPTEmbedding, GPTOutputHead, language_model_loss_terms
from core.parallel_state import CP_AXIS, PP_AXIS, TP_AXIS, ParallelState
from core.param_metadata import abstract_boxed_params, param_info_tree, unbox
from core.pipeline_parallel.table_driven import execute_stages
from core.pipeline_parallel.utils import chunk_placement, split_microbatches, virtual_stage
from core.pipeline_parallel.zero_bubble_executor import execute_stages_zb_h1, execute_stages_zb_v
from core.transformer.layer_context import LayerContext
from core.transformer.moe import MOE_STATE, get_updated_expert_bias
from core.transformer.moe.moe_utils import attach_aux_loss, current_moe_aux_loss_scale
from core.transformer.recompute import with_recompute
from core.transformer.transformer_layer import TransformerLayer


def expert_bias_variables(bias: jax.Array) -> dict:
    """The flax variables that give a MoE transformer layer's router its top-k expert bias
    ``[E]`` (the non-trainable ``MOE_STATE`` collection)."""
    return {MOE_STATE: {"mlp": {"moe": {"router": {"expert_bias": bias}}}}}


class GPTModel:
    """Megatron's ``GPTModel`` for one :class:`ParallelState` (pure functions over explicit params)."""

    def __init__(self, config: GPTConfig, state: ParallelState):
        self.config = config
        self.state = state
        self.pp = state.pipeline_model_parallel_size
        self.vpp = state.virtual_pipeline_model_parallel_size or 1
        config.validate(state.tensor_model_parallel_size, self.pp * self.vpp)
        if config.context_parallel_size != state.context_parallel_size:
            raise ValueError(f"config.context_parallel_size {config.context_parallel_size} does not match the "
                             f"parallel state's context_parallel_size {state.context_parallel_size}")
        if config.pipeline_schedule == "zb-h1" and self.vpp > 1:
            raise ValueError(f"pipeline_schedule 'zb-h1' runs one model chunk per stage, got "
                             f"virtual_pipeline_model_parallel_size {self.vpp}")
        if config.pipeline_schedule == "zb-v" and self.vpp != 2:
            raise ValueError(f"pipeline_schedule 'zb-v' runs two model chunks per stage, got "
                             f"virtual_pipeline_model_parallel_size {self.vpp}")
        self.placement = chunk_placement(config.pipeline_schedule)
        """Which virtual stage each rank's chunk is (:meth:`virtual_stage`): Megatron's interleaved
        placement, or ZB-V's V placement under ``pipeline_schedule`` ``"zb-v"``."""
        self.layers_per_chunk = config.num_layers // (self.pp * self.vpp)
        self.embedding = GPTEmbedding(config)
        self.layer = TransformerLayer(config)
        self.moe_layer = TransformerLayer(config, moe=True) if config.moe is not None else None
        self.chunk_moe_pattern = config.chunk_moe_pattern(self.layers_per_chunk)
        """Per position in a model chunk: whether that layer is MoE (the same in every chunk)."""
        self.head = GPTOutputHead(config)
        self.param_gather: ParamGather | None = None
        """Megatron-FSDP ``optim_grads_params``: the parameters are sharded over data parallelism at
        rest and each unit (the embedding, every layer, the head) gathers its own right before
        use (:class:`~core.distributed.fsdp.ParamGather`; set by ``DistributedDataParallel``).
        None: the parameters arrive whole."""

    def virtual_stage(self, chunk: Any, rank: Any) -> Any:
        """Virtual stage of this model's chunk ``chunk`` on pipeline rank ``rank`` (ints or traced
        arrays): ``chunk * pp + rank`` (interleaved), or under ZB-V ``rank`` for chunk 0 and
        ``2 pp - 1 - rank`` for chunk 1. Chunk ``c`` of rank ``r`` holds layers
        ``virtual_stage(c, r) * layers_per_chunk`` onwards, at rows ``r * n ...`` of ``layers[c]``."""
        return virtual_stage(self.placement, self.pp, rank, chunk)

    # -- parameters -----------------------------------------------------------------------
    def init(self, rng: jax.Array, tokens: jax.Array) -> dict:
        """Boxed local parameters (inside ``shard_map``; ``tokens`` a local ``[b, s]`` sample).

        Under FSDP (:attr:`param_gather` set) each unit keeps only this rank's blocks right after
        it is created, the layers one after the other (``lax.map``), so no device holds more than
        one unit whole."""
        k_emb, k_layers, k_head = jax.random.split(rng, 3)
        emb = self.embedding.init(k_emb, tokens)["params"]
        x = self.embedding.apply({"params": unbox(emb)}, tokens)
        first = self.virtual_stage(jnp.arange(self.vpp)[:, None], lax.axis_index(PP_AXIS)) * self.layers_per_chunk
        index = first + jnp.arange(self.layers_per_chunk)[None, :]
        if self.moe_layer is None:
            one = lambda i: self.layer.init(jax.random.fold_in(k_layers, i), x)["params"]
            if self.param_gather is None:
                stacked = jax.vmap(jax.vmap(one))(index)
            else:
                flat = lax.map(lambda i: self._keep_block(one(i), ("layers",), 2), index.reshape(-1))
                stacked = jax.tree.map(lambda b: b.replace_boxed(b.unbox().reshape(index.shape + b.unbox().shape[1:])),
                                       flat, is_leaf=_is_box)
        else:
            stacked = self._init_moe_layers(k_layers, index, x)
        layers = jax.tree.map(lambda b: b.replace(names=(None, PP_AXIS) + tuple(b.names)), stacked, is_leaf=_is_box)
        word = None if not self.config.share_embeddings_and_output_weights else unbox(emb)["word_embeddings"]["weight"]
        head = self.head.init(k_head, x, word)["params"]
        return {"embedding": self._keep_block(emb, ("embedding",)), "layers": layers,
                "head": self._keep_block(head, ("head",))}

    def _keep_block(self, params: Any, path: tuple[str, ...], stacked: int = 0) -> Any:
        """Under FSDP this rank's blocks of one unit's just-created parameters, else the parameters."""
        return params if self.param_gather is None else self.param_gather.keep_block(params, path, stacked)

    def _init_moe_layers(self, key: jax.Array, index: jax.Array, x: jax.Array) -> dict:
        """``{"dense": [vpp, n_dense, ...], "moe": [vpp, n_moe, ...]}`` (kinds without layers left
        out): each chunk's dense and MoE layers stacked apart, layer ``l`` drawn from
        ``fold_in(key, l)``. A Python loop, not a vmap: the MoE layer's init runs its collectives."""
        stacked = {}
        for kind, layer in (("dense", self.layer), ("moe", self.moe_layer)):
            positions = [j for j, m in enumerate(self.chunk_moe_pattern) if m == (kind == "moe")]
            if not positions:
                continue
            chunks = [[self._keep_block(layer.init(jax.random.fold_in(key, index[c, j]), x)["params"],
                                        ("layers", kind), 2) for j in positions] for c in range(self.vpp)]
            stack = lambda *xs: jax.tree.map(lambda *a: a[0].replace_boxed(jnp.stack([b.unbox() for b in a])),
                                             *xs, is_leaf=_is_box)
            stacked[kind] = stack(*[stack(*chunk) for chunk in chunks])
        return stacked

    def chunk_layer_slots(self) -> list[tuple[str, int]]:
        """Each layer of a chunk, in order, as ``(kind, i)``: its params are row ``i`` of the
        chunk's ``kind`` stack (``"dense"`` or ``"moe"``; a dense model's are all ``"dense"``)."""
        pattern = self.chunk_moe_pattern if self.moe_layer is not None else [False] * self.layers_per_chunk
        count = {"dense": 0, "moe": 0}
        slots = []
        for is_moe in pattern:
            kind = "moe" if is_moe else "dense"
            slots.append((kind, count[kind]))
            count[kind] += 1
        return slots

    def layer_kinds(self) -> list[tuple[str, Any, int]]:
        """``(kind, layer module, layers of that kind per chunk)`` of the kinds the model has:
        ``"dense"`` only, or with MoE those of ``"dense"`` and ``"moe"`` that occur."""
        if self.moe_layer is None:
            return [("dense", self.layer, self.layers_per_chunk)]
        counts = {"dense": self.chunk_moe_pattern.count(False), "moe": self.chunk_moe_pattern.count(True)}
        return [(kind, layer, counts[kind]) for kind, layer in (("dense", self.layer), ("moe", self.moe_layer))
                if counts[kind]]

    # -- non-trainable model state: MoE expert biases, FP8 delayed scaling ----------------------
    @property
    def has_fp8_state(self) -> bool:
        """Whether the linear layers keep FP8 delayed-scaling state (``--fp8-recipe delayed``)."""
        fp8 = self.config.fp8_config
        return fp8 is not None and fp8.delayed

    def model_state_shape(self) -> dict[str, Any] | None:
        """Global shapes of the model's non-trainable state, None without any: ``"expert_bias"``
        (:meth:`moe_state_shape`) with the expert bias, ``"fp8"`` (:mod:`core.models.gpt.fp8_state`)
        under FP8 delayed scaling. The training step feeds it to every forward, differentiates the
        loss with respect to it (the FP8 scales' cotangents are the amaxes their GEMMs saw) and
        updates it after the optimizer step (:meth:`update_model_state`)."""
        shapes = {}
        if self.has_expert_bias:
            shapes.update(self.moe_state_shape())
        if self.has_fp8_state:
            shapes["fp8"] = self._fp8_state_shape
        return shapes or None

    @functools.cached_property
    def _fp8_state_shape(self) -> dict[str, Any]:
        return fp8_state.fp8_state_shape(self)

    def model_state_spec(self) -> dict[str, Any] | None:
        """The ``shard_map`` specs of :meth:`model_state_shape`'s arrays (dim 1 over ``"pp"``)."""
        shapes = self.model_state_shape()
        if shapes is None:
            return None
        specs = {"expert_bias": self.moe_state_spec()["expert_bias"]} if self.has_expert_bias else {}
        if "fp8" in shapes:
            specs["fp8"] = fp8_state.fp8_state_spec(shapes["fp8"])
        return specs

    def init_model_state(self) -> dict[str, Any] | None:
        """The initial model state (global arrays): zero expert biases (Megatron's), unit FP8
        scales and zero amax histories (Transformer Engine's); None without state."""
        shapes = self.model_state_shape()
        if shapes is None:
            return None

        def init():
            state = {"expert_bias": jnp.zeros(shapes["expert_bias"].shape, jnp.float32)} if self.has_expert_bias else {}
            if "fp8" in shapes:
                state["fp8"] = fp8_state.init_fp8_state(shapes["fp8"])
            return state

        shardings = jax.tree.map(lambda spec: NamedSharding(self.state.mesh, spec), self.model_state_spec())
        return jax.jit(init, out_shardings=shardings)()

    def update_model_state(self, model_state: dict, local_report: dict, observed: dict | None,
                           num_microbatches: int) -> dict:
        """The model state after an optimizer step (inside ``shard_map``): the expert biases from
        the step's routed tokens (:meth:`update_moe_state`), the FP8 state from the amaxes its
        GEMMs saw (``observed``: the state's cotangents, combined over the microbatches with max;
        :func:`~core.models.gpt.fp8_state.update_fp8_state`)."""
        new = {}
        if "expert_bias" in model_state:
            new.update(self.update_moe_state({"expert_bias": model_state["expert_bias"]}, local_report,
                                             num_microbatches))
        if "fp8" in model_state:
            new["fp8"] = fp8_state.update_fp8_state(model_state["fp8"], observed["fp8"]["scale"],
                                                    self.config.fp8_config, fp8_state.amax_axes(self.state.mesh))
        return new

    @property
    def has_expert_bias(self) -> bool:
        """Whether the MoE routers carry an expert bias (``moe_router_enable_expert_bias``)."""
        return self.config.moe is not None and self.config.moe.moe_router_enable_expert_bias

    def moe_state_shape(self) -> dict[str, jax.ShapeDtypeStruct]:
        """Global shapes of the model's MoE state: ``{"expert_bias": [vpp, pp * n_moe, E]}``
        float32, stacked and split over ``"pp"`` (dim 1) as ``params["layers"]["moe"]`` is."""
        n_moe = sum(self.chunk_moe_pattern) * self.pp
        return {"expert_bias": jax.ShapeDtypeStruct((self.vpp, n_moe, self.config.moe.num_experts), jnp.float32)}

    @staticmethod
    def moe_state_spec() -> dict:
        """The ``shard_map`` spec of :meth:`moe_state_shape`'s arrays (replicated but over ``"pp"``)."""
        return {"expert_bias": P(None, PP_AXIS, None)}

    def update_moe_state(self, moe_state: dict, local_metrics: dict, num_microbatches: int) -> dict:
        """Megatron's ``_update_router_expert_bias`` (inside ``shard_map``, after the optimizer step):
        every MoE layer's bias moves by ``rate * sign(mean - tpe)`` with ``tpe`` the step's global
        tokens per expert of that layer. ``local_metrics`` are this rank's :meth:`moe_metrics`
        averaged over the microbatches (summed over tp and cp); the counts are integers, so
        ``round(x * m)`` undoes the average exactly and the data-parallel sum gives every rank
        the same global counts (hence the same bias)."""
        tpe = jnp.round(local_metrics["moe_tokens_per_expert"] * num_microbatches)
        tpe = lax.psum(tpe, self.state.data_parallel_axis_name)  # [vpp * pp * n_chunk, E], layer order
        bias = moe_state["expert_bias"]  # local [vpp, n_chunk, E]; layer order row = virtual_stage(c, r) * n_chunk + j
        vpp, n_chunk, e = bias.shape
        tpe = tpe.reshape(vpp * self.pp, n_chunk, e)[self.virtual_stage(jnp.arange(vpp), lax.axis_index(PP_AXIS))]
        rate = self.config.moe.moe_router_bias_update_rate
        return {"expert_bias": get_updated_expert_bias(tpe, bias, rate)}

    def _run_unit(self, fn: Any, params: Any, x: Any, path: tuple[str, ...], stacked: int = 0,
                  prefetched: Any = None) -> Any:
        """``fn(params, x)`` of one unit (a layer sliced out of the stack: ``stacked`` 2). Without
        FSDP the caller casts the parameters and applies recompute. Under FSDP
        (:attr:`param_gather`) the parameters are gathered in the compute dtype, here or ahead
        (``prefetched``), and the unit runs with recompute inside its own VJP, which gathers them
        again for the backward (:meth:`~core.distributed.fsdp.ParamGather.call`)."""
        if self.param_gather is None:
            return fn(params, x)
        unit_fn = with_recompute(lambda p, x: fn(self._cast(p), x), self.config.recompute_granularity)
        return self.param_gather.call(unit_fn, params, x, self.param_gather.infos_at(path),
                                      self.config.compute_dtype, stacked, prefetched)

    def _gather_ahead(self, params: Any, path: tuple[str, ...], stacked: int = 0) -> Any:
        """A unit's parameters gathered ahead of its use (see :meth:`_run_unit`)."""
        gather = self.param_gather
        return gather.gather_ahead(params, gather.infos_at(path), self.config.compute_dtype, stacked)

    def _run_dense_layers_fsdp(self, chunk_layers: Any, x: jax.Array, ctx: LayerContext,
                               index: jax.Array, scales: Any = None) -> jax.Array:
        """The chunk's dense layers under FSDP, as a scan whose iteration ``j`` issues the gather of
        layer ``j + 1`` before running layer ``j`` on the copy gathered by iteration ``j - 1``
        (double buffering: two layers' gathered parameters exist at a time, and the collective has
        the whole layer's compute to overlap with). The last iteration gathers its own layer once
        more when the loop is rolled (``--scan-layers``); unrolled, XLA drops that gather."""
        n = self.layers_per_chunk
        layer_at = lambda j: jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, j, keepdims=False), chunk_layers)

        def body(carry, xs):
            h, ahead = carry
            params, layer_index, j, scale = xs
            upcoming = self._gather_ahead(layer_at(jnp.minimum(j + 1, n - 1)), ("layers",), stacked=2)
            # The FP8 scales travel with the activations: the unit's VJP differentiates x only.
            apply = lambda p, hs: self.layer.apply({"params": p, **fp8_state.scale_variables(hs[1])}, hs[0],
                                                   ctx.replace(layer_index=layer_index))
            h = self._run_unit(apply, params, (h, scale), ("layers",), stacked=2, prefetched=ahead)
            return (h, upcoming), None

        first = self._gather_ahead(layer_at(0), ("layers",), stacked=2)
        xs = (chunk_layers, index, jnp.arange(n), scales)
        return lax.scan(body, (x, first), xs, unroll=self.config.unroll_layers)[0][0]

    def _cast(self, tree: Any) -> Any:
        dtype = self.config.compute_dtype
        return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)

    # -- forward pieces (inside shard_map, local shapes) ----------------------------------
    def context(self, microbatch: dict | jax.Array | None) -> LayerContext:
        """The layers' :class:`LayerContext` of a microbatch. Under context parallelism a batch
        without ``position_ids`` gets this cp rank's global positions (its load-balanced chunks):
        rotary and learned positions must see where the local tokens sit in the sequence."""
        ctx = LayerContext.from_batch(microbatch)
        cp = self.config.context_parallel_size
        if cp > 1 and ctx.position_ids is None and microbatch is not None:
            tokens = microbatch["tokens"] if isinstance(microbatch, dict) else microbatch
            positions = cp_positions(lax.axis_index(CP_AXIS), tokens.shape[1] * cp, cp).astype(jnp.int32)
            ctx = ctx.replace(position_ids=jnp.broadcast_to(positions, tokens.shape))
        return ctx

    def embed(self, shared: dict, microbatch: dict | jax.Array) -> jax.Array:
        """First stage: the microbatch's ``[b, s]`` tokens (with its positions and dropout seeds;
        bare tokens also accepted) to ``[s(/tp), b, h]`` activations."""
        tokens = microbatch["tokens"] if isinstance(microbatch, dict) else microbatch
        # The tables are read in the params' dtype and the result cast: the lookup's backward then
        # scatter-adds the tokens' gradients in fp32. A bf16 scatter-add rounds at every add and is
        # slow on GPUs; the fp32 one is exact and fast (bench/results/2026-11-gpu.md).
        # The lookup's backward does not need the table: nothing gathered is kept for it.
        table = shared["embedding"] if self.param_gather is None else self.param_gather.unit(
            shared["embedding"], ("embedding",))
        x = self.embedding.apply({"params": table}, tokens, self.context(microbatch))
        return x.astype(self.config.compute_dtype)

    def run_layers(self, chunk_layers: Any, x: jax.Array, microbatch: dict | None = None,
                   first_layer: int | jax.Array = 0, chunk_bias: jax.Array | None = None,
                   chunk_scales: Any = None) -> tuple[jax.Array, dict]:
        """The layers of one model chunk; ``first_layer`` is the chunk's first global layer index
        (its dropout keys use it); ``chunk_scales``: the chunk's FP8 scales (its slice of the
        ``"fp8"`` model state's ``"scale"``, under delayed scaling). Returns ``(x, stats)``:
        ``stats`` is empty for a dense model; with MoE layers it holds this rank's shares of the
        chunk's MoE losses summed over its layers (``"aux_loss"``, ``"z_loss"``, and ``"total"``,
        cp times their sum, which enters the objective) and ``"tokens_per_expert"`` ``[n_moe, E]``
        (this rank's routed tokens).

        Dense layers (params stacked ``[L/(pp*vpp), ...]``) run as a scan. A MoE model's chunk
        (params ``{"dense", "moe"}`` stacked per kind; ``chunk_bias`` ``[n_moe, E]``: the chunk's
        expert biases, with them) runs unrolled in layer order."""
        ctx = self.context(microbatch)
        if self.param_gather is None:  # in the compute dtype once; FSDP units cast their gathered copy
            chunk_layers = self._cast(chunk_layers)
        if self.moe_layer is None:
            index = first_layer + jnp.arange(self.layers_per_chunk, dtype=jnp.int32)
            if self.param_gather is not None:
                return self._run_dense_layers_fsdp(chunk_layers, x, ctx, index, chunk_scales), {}
            body = lambda h, xs: (self.layer.apply({"params": xs[0], **fp8_state.scale_variables(xs[2])}, h,
                                                   ctx.replace(layer_index=xs[1])), None)
            body = with_recompute(body, self.config.recompute_granularity)
            return lax.scan(body, x, (chunk_layers, index, chunk_scales), unroll=self.config.unroll_layers)[0], {}
        auxes = []
        for j, (kind, i) in enumerate(self.chunk_layer_slots()):
            is_moe = kind == "moe"
            p = jax.tree.map(lambda a, i=i: a[i], chunk_layers[kind])
            scales = None if chunk_scales is None else jax.tree.map(lambda a, i=i: a[i], chunk_scales[kind])
            layer = self.moe_layer if is_moe else self.layer
            variables = {}
            if is_moe and self.has_expert_bias:  # the router's non-trainable top-k bias (no gradient)
                variables = expert_bias_variables(lax.stop_gradient(chunk_bias[i]))

            # The FP8 scales travel with the activations (an FSDP unit's VJP differentiates x only).
            def apply(p, hs, c, layer=layer, v=variables):
                return layer.apply({"params": p, **v, **fp8_state.scale_variables(hs[1])}, hs[0], c)

            if self.param_gather is None:
                fn = with_recompute(apply, self.config.recompute_granularity)
            else:
                def fn(p, hs, c, apply=apply, kind=kind):
                    return self._run_unit(lambda p, hs: apply(p, hs, c), p, hs, ("layers", kind), stacked=2)
            out = fn(p, (x, scales), ctx.replace(layer_index=first_layer + j))
            if is_moe:
                x, aux = out
                auxes.append(aux)
            else:
                x = out
        aux_loss = sum(a["aux_loss"].astype(jnp.float32) for a in auxes)
        z_loss = sum(a["z_loss"].astype(jnp.float32) for a in auxes)
        # The objective gets cp x this rank's share, as the LM loss does (sequence_mean: the
        # data-parallel reduction averages the cp ranks' gradients).
        cp = self.config.context_parallel_size
        stats = {"aux_loss": aux_loss, "z_loss": z_loss, "total": (aux_loss + z_loss) * cp,
                 "tokens_per_expert": jnp.stack([a["tokens_per_expert"].astype(jnp.float32) for a in auxes])}
        return x, stats

    def loss(self, shared: dict, x: jax.Array, microbatch: dict | jax.Array) -> tuple[jax.Array, jax.Array]:
        """Last stage: final norm, output layer, vocabulary-parallel cross entropy of the
        microbatch's labels (bare labels also accepted) as the loss contract's terms: ``(loss
        summed over this rank's tokens, their number)``, weighted by the loss mask."""
        batch = microbatch if isinstance(microbatch, dict) else {"labels": microbatch}
        logits = self._output_logits(shared, x)
        return language_model_loss_terms(logits, batch["labels"], batch.get("loss_mask"), self.config.vocab_size)

    def _output_logits(self, shared: dict, x: jax.Array) -> jax.Array:
        """Final norm and output layer: vocabulary-split ``[s, b, V/tp]`` logits (compute dtype)."""
        word = shared["embedding"]["word_embeddings"]["weight"] if self.config.share_embeddings_and_output_weights \
            else None
        apply = lambda p, x: self.head.apply({"params": p["head"]}, x, p["word"])
        params = {"head": shared["head"], "word": word}
        if self.param_gather is None:
            return apply(self._cast(params), x)
        gather = self.param_gather
        infos = {"head": gather.infos_at(("head",)),
                 "word": None if word is None else gather.infos_at(("embedding", "word_embeddings", "weight"))}
        # The head is a unit of its own (with the tied word embedding): gathered for it, and
        # again for its backward.
        return gather.call(lambda p, x: apply(self._cast(p), x), params, x, infos, self.config.compute_dtype)

    @property
    def sequence_axis(self) -> str | None:
        """The mesh axis that splits a sequence (``"cp"`` under context parallelism), else None."""
        return CP_AXIS if self.config.context_parallel_size > 1 else None

    def activation_shape(self, micro_batch_size: int) -> tuple[int, int, int]:
        """Local shape of the activations sent between pipeline stages."""
        s = self.config.seq_length // self.config.context_parallel_size
        if self.config.sequence_parallel:
            s //= self.state.tensor_model_parallel_size
        return (s, micro_batch_size, self.config.hidden_size)

    # -- whole-model entry points -----------------------------------------------------------
    def loss_fn(self, params: dict, microbatch: dict, model_state: dict | None = None
                ) -> tuple[jax.Array, jax.Array, dict]:
        """One microbatch through the whole model (no pipelining), Megatron's loss contract:
        ``(loss summed over this rank's tokens, their number, report)``. ``report`` holds the MoE
        values of :meth:`moe_metrics` (empty for a dense model); the MoE aux and z losses enter
        the gradient through the hidden states (:func:`~core.transformer.moe.moe_utils.attach_aux_loss`,
        weighted by the training step's ``moe_aux_loss_scale``), not the returned loss.
        ``model_state``: :meth:`model_state_shape`'s local arrays, needed with the expert bias or
        FP8 delayed scaling."""
        if self.pp > 1:
            raise ValueError("loss_fn runs the whole model on one stage; use forward_backward with pipelining")
        x, stats = self._hidden_states(params, microbatch, model_state)
        report = {}
        if self.moe_layer is not None:
            total = sum(st["total"] for st in stats)
            x = attach_aux_loss(x, total, current_moe_aux_loss_scale())
            report = self.moe_metrics(stats)
        loss_sum, num_tokens = self.loss(params, x, microbatch)
        return loss_sum, num_tokens, report

    def _hidden_states(self, params: dict, microbatch: dict, model_state: dict | None) -> tuple[jax.Array, list]:
        """Embedding and every layer on one stage: the last layer's output and each chunk's stats."""
        x = self.embed(params, microbatch)
        stats = []
        for c in range(self.vpp):  # without pipelining chunk c is virtual stage c
            take = lambda tree, c=c: jax.tree.map(lambda a: a[c], tree)
            x, st = self.run_layers(take(params["layers"]), x, microbatch, c * self.layers_per_chunk,
                                    *_chunk_state(take(model_state)))
            stats.append(st)
        return x, stats

    def logits(self, params: dict, tokens: jax.Array, positions: jax.Array | None = None,
               model_state: dict | None = None) -> jax.Array:
        """Megatron's ``GPTModel.forward`` without labels, inside ``shard_map``: float32 logits
        ``[b, s, vocab_size]`` of this rank's local ``[b, s]`` tokens (``positions`` ``[b, s]``,
        default ``0..s-1``), the vocabulary gathered over tp and its padding rows dropped. Works
        with tp, sequence parallelism and data parallelism (each dp rank its local batch);
        raises ``ValueError`` with pipelining or context parallelism (one stage must hold every
        layer and the whole sequence). :meth:`global_logits` wraps it for global arrays::

            model = GPTModel(config, ps.build_parallel_state(devices=jax.devices()[:1]))
            logits = model.global_logits(params, tokens)  # [b, s, config.vocab_size] float32
        """
        if self.pp > 1 or self.config.context_parallel_size > 1:
            raise ValueError(f"GPTModel.logits runs every layer on the whole sequence on one rank: not supported "
                             f"with pipeline_model_parallel_size {self.pp} or context_parallel_size "
                             f"{self.config.context_parallel_size} (both must be 1)")
        batch = {"tokens": tokens} if positions is None else {"tokens": tokens, "position_ids": positions}
        x, _ = self._hidden_states(params, batch, model_state)
        local = self._output_logits(params, x)  # [s, b, V/tp]
        full = lax.all_gather(local, TP_AXIS, axis=2, tiled=True)[..., :self.config.vocab_size]
        return jnp.swapaxes(full, 0, 1).astype(jnp.float32)

    def global_logits(self, params: dict, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """:meth:`logits` from the host: global params (as :func:`~core.param_metadata.init_sharded_params`
        returns them, or host arrays of the same shapes) and global ``[b, s]`` tokens, the batch
        split over data parallelism (``b`` must divide by it); one compiled program per model."""
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        return self._logits_program(params, tokens, positions)

    @functools.cached_property
    def _logits_program(self):
        dp = self.state.data_parallel_axis_name
        sample = jax.ShapeDtypeStruct((1, self.config.seq_length), jnp.int32)
        if self.param_gather is not None:  # the parameters at rest, FSDP splits included
            specs = self.param_gather.specs
        else:
            boxed = abstract_boxed_params(self.init, self.state.mesh, (jax.random.key(0), sample), (P(), P()))
            specs = jax.tree.map(lambda info: info.partition_spec, param_info_tree(boxed))
        return jax.jit(jax.shard_map(self.logits, mesh=self.state.mesh, in_specs=(specs, P(dp), P(dp)),
                                     out_specs=P(dp), check_vma=False))

    def moe_metrics(self, stats: list[dict]) -> dict:
        """Logged MoE values of one microbatch from :meth:`run_layers`'s stats (in layer order):
        ``moe_aux_loss`` and ``moe_z_loss`` (summed over the MoE layers: what enters the objective),
        and ``moe_tokens_per_expert`` ``[n_moe_layers, E]``, each summed over tp and cp (the shares of
        the ranks that split a sequence add up to its loss); the trainer averages them over data
        parallelism."""
        return _sum_sequence_shares({"moe_aux_loss": sum(st["aux_loss"] for st in stats),
                                     "moe_z_loss": sum(st["z_loss"] for st in stats),
                                     "moe_tokens_per_expert": jnp.concatenate([st["tokens_per_expert"]
                                                                               for st in stats])})

    def _stage_step(self, micro_batch_size: int, aux_loss_scale: float = 1.0):
        """The executor's ``stage_step``; with MoE layers it also returns the chunk's
        :meth:`stage_moe_metrics`."""
        last = self.pp * self.vpp - 1
        shape = self.activation_shape(micro_batch_size)
        dtype = self.config.compute_dtype

        def stage_step(chunk_and_state, shared, mb, received, vs):
            chunk, chunk_state = chunk_and_state
            received = jnp.broadcast_to(received, shape).astype(dtype)
            x = lax.cond(vs == 0, lambda: self.embed(shared, mb), lambda: received)
            y, stats = self.run_layers(chunk, x, mb, vs * self.layers_per_chunk, *_chunk_state(chunk_state))
            if self.moe_layer is not None:  # the MoE losses' gradient enters through the chunk's output
                y = attach_aux_loss(y, stats["total"], aux_loss_scale)
            loss = lax.cond(vs == last,
                            lambda: sequence_mean(*self.loss(shared, y, mb), self.sequence_axis).astype(jnp.float32),
                            lambda: jnp.zeros((), jnp.float32))
            if self.moe_layer is not None:
                return y, (loss, {"lm loss": loss}), self.stage_moe_metrics(stats, vs)
            return y, (loss, {"lm loss": loss})

        return stage_step

    def stage_moe_metrics(self, stats: dict, virtual_stage: int | jax.Array) -> dict:
        """One chunk's share of :meth:`moe_metrics` (before the tp / cp sums) from its
        :meth:`run_layers` stats: the aux and z losses, and ``moe_tokens_per_expert`` as the
        ``[n_moe_layers, E]`` of the whole model with the chunk's rows filled in (the chunk of
        virtual stage ``v`` holds MoE layers ``v * n_moe_chunk`` onwards), zeros elsewhere, so the
        sum over the virtual stages is the whole model's."""
        tpe = lax.stop_gradient(stats["tokens_per_expert"])
        n_chunk = tpe.shape[0]
        rows = jnp.zeros((self.pp * self.vpp * n_chunk, tpe.shape[1]), tpe.dtype)
        return {"moe_aux_loss": lax.stop_gradient(stats["aux_loss"]),
                "moe_z_loss": lax.stop_gradient(stats["z_loss"]),
                "moe_tokens_per_expert": lax.dynamic_update_slice(rows, tpe, (virtual_stage * n_chunk, 0))}

    def forward_backward(self, params: dict, batch: dict, num_microbatches: int, *, forward_only: bool = False,
                         model_state: dict | None = None) -> tuple:
        """Pipelined forward (and backward) of this rank's local batch, split into microbatches:
        the training step's ``forward_backward`` contract, ``(grads or None, mean loss, num_tokens,
        report)``. The loss (the microbatches' mean) is valid on every pipeline stage; the grads
        are those of that mean (the per-microbatch normalisation); ``num_tokens`` is zero (no
        per-token normalisation with pipelining); ``report`` is :meth:`moe_metrics` averaged over
        the microbatches on every rank (each virtual stage's share, summed by the executor over the
        stages; empty for a dense model). ``model_state`` (:meth:`model_state_shape`'s local
        arrays) travels with each chunk's layers; with it a fifth item is returned, the state's
        cotangent combined over the microbatches with max (the FP8 scales': the amaxes their
        GEMMs saw; None when ``forward_only``)."""
        m = num_microbatches
        moe = self.moe_layer is not None
        mbs = split_microbatches(batch, m)
        shared = {k: v for k, v in params.items() if k != "layers"}
        zero_bubble = {"zb-h1": execute_stages_zb_h1, "zb-v": execute_stages_zb_v}.get(self.config.pipeline_schedule)
        execute = execute_stages if zero_bubble is None else functools.partial(
            zero_bubble, w_recompute=self.config.zero_bubble_w_recompute)
        losses, g_chunks, g_shared, _, *stage = execute(
            self._stage_step(mbs["tokens"].shape[1], 1.0 / m), mbs, (params["layers"], model_state), shared,
            num_model_chunks=self.vpp, forward_only=forward_only, axis_name=PP_AXIS, stage_metrics=moe,
            chunk_grad_combine=("sum", "max"))
        loss = lax.psum(sum(d["lm loss"] for d in losses) / m, PP_AXIS)  # zeros except on the last stage
        grads = None if forward_only else {"layers": g_chunks[0], **g_shared}
        report = _sum_sequence_shares(jax.tree.map(lambda *v: sum(v) / m, *stage[0])) if moe else {}
        out = (grads, loss, jnp.zeros((), jnp.float32), report)
        if model_state is None:
            return out
        return (*out, None if forward_only else g_chunks[1])

    def eval_loss(self, params: dict, batch: dict, num_microbatches: int,
                  model_state: dict | None = None) -> jax.Array:
        """Mean loss of this rank's local batch (forward only; inside ``shard_map``): each
        microbatch's mean over its tokens (the whole sequence's under context parallelism),
        averaged over the microbatches."""
        if self.pp > 1:
            return self.forward_backward(params, batch, num_microbatches, forward_only=True,
                                         model_state=model_state)[1]

        def one(mb):
            loss_sum, num_tokens, _ = self.loss_fn(params, mb, model_state)
            return sequence_mean(loss_sum, num_tokens, self.sequence_axis)

        return jnp.mean(lax.map(one, split_microbatches(batch, num_microbatches)))


def _chunk_state(chunk_state: dict | None) -> tuple[jax.Array | None, Any]:
    """A model chunk's slice of the model state as :meth:`GPTModel.run_layers` takes it: its
    expert biases ``[n_moe, E]`` and its FP8 scales (each None when absent)."""
    chunk_state = chunk_state or {}
    return chunk_state.get("expert_bias"), fp8_state.chunk_scales(chunk_state.get("fp8"))


def _sum_sequence_shares(metrics: dict) -> dict:
    """Logged MoE values summed over the ranks that split a sequence (tp under sequence
    parallelism, cp): their shares add up to the sequence's value. No gradient flows."""
    return jax.tree.map(lambda v: lax.psum(lax.stop_gradient(v), ("tp", CP_AXIS)), metrics)


def _is_box(x: Any) -> bool:
    return isinstance(x, nn.meta.AxisMetadata)


__all__ = ["GPTModel"]
