"""``TransformerConfig``: what the transformer layers read, their shape and numerics (a subset of
Megatron's ``TransformerConfig``); a model's config extends it (``core.models.gpt.GPTConfig``)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from core.fp8 import FP8Config
from core.transformer.moe.moe_config import MoEConfig
from core.transformer.recompute import RECOMPUTE_POLICIES


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Hyper-parameters of the transformer layers (``core.transformer``)."""

    num_layers: int = 4
    """Transformer layers (must divide by pipeline x virtual-pipeline size)."""
    hidden_size: int = 128
    """Model width."""
    num_attention_heads: int = 4
    """Attention heads (must divide by the tensor-parallel size)."""
    ffn_hidden_size: int | None = None
    """MLP width; None means ``4 * hidden_size``."""
    num_query_groups: int | None = None
    """Grouped-query attention: K/V head groups (None = one per head, plain multi-head
    attention). Must divide ``num_attention_heads`` and be divisible by tp."""
    position_embedding_type: str = "learned_absolute"
    """``"learned_absolute"`` (a ``[seq_length, hidden]`` table) or ``"rope"`` (rotary on q and k)."""
    rotary_base: float = 10000.0
    """Base of the rotary frequencies."""
    rotary_percent: float = 1.0
    """Share of each head's dims that rotary rotates (the rest pass unrotated), in (0, 1]."""
    rope_scaling: bool = False
    """Llama 3.1's rotary frequency scaling (Megatron's ``--use-rope-scaling``, HF ``rope_type="llama3"``)."""
    rope_scaling_factor: float = 8.0
    """With ``rope_scaling``: the low frequencies are divided by this factor."""
    rope_scaling_low_freq_factor: float = 1.0
    """With ``rope_scaling``: wavelengths above ``original / low_freq_factor`` are fully scaled."""
    rope_scaling_high_freq_factor: float = 4.0
    """With ``rope_scaling``: wavelengths below ``original / high_freq_factor`` are left unscaled."""
    rope_scaling_original_max_position_embeddings: int = 8192
    """With ``rope_scaling``: the context length the model was pretrained with before the scaling."""
    kv_channels: int | None = None
    """Channels per attention head (Megatron's ``--kv-channels``); None means ``hidden_size / num_attention_heads``."""
    add_qkv_bias: bool = False
    """A bias on the fused QKV projection even without ``add_bias_linear`` (Megatron's ``--add-qkv-bias``, Qwen2)."""
    qk_layernorm: bool = False
    """The configured norm on each query and key head before rotary (Megatron's ``--qk-layernorm``, Qwen3)."""
    normalization: str = "LayerNorm"
    """``"LayerNorm"`` or ``"RMSNorm"`` (every norm of the model)."""
    swiglu: bool = False
    """Gated MLP ``fc2(silu(x W_gate) * (x W_up))`` (Megatron's ``--swiglu``)."""
    add_bias_linear: bool = True
    """Biases on every linear layer (False: Megatron's ``--disable-bias-linear``)."""
    attention_dropout: float = 0.0
    """Dropout on the attention probabilities (training batches only)."""
    hidden_dropout: float = 0.0
    """Dropout on the embedding output and on each block's output before the residual add."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism: norms and residuals on ``[s/tp, b, h]`` shards."""
    context_parallel_size: int = 1
    """Context parallelism (mesh axis ``"cp"``): each rank holds ``s/cp`` tokens of every sample,
    the load-balanced chunks ``r`` and ``2cp-1-r`` (``core.context_parallel``); the batch arrives
    reordered and split that way. Must match the parallel state's ``context_parallel_size``."""
    cp_comm_type: str = "p2p"
    """How context-parallel attention exchanges K/V: ``"p2p"`` (ring), ``"all_gather"``, ``"a2a"``
    (Ulysses: an all-to-all from the sequence split to a head split around the backend's
    attention; the local heads ``heads / tp`` must divide by cp) or ``"a2a+p2p"`` (the all-to-all
    inside groups of ``hierarchical_context_parallel_sizes[0]`` ranks, the ring across them)."""
    hierarchical_context_parallel_sizes: tuple[int, ...] | None = None
    """``(a2a size, ring size)`` of ``cp_comm_type="a2a+p2p"`` (product: ``context_parallel_size``);
    the local heads must divide by the a2a size. Only with ``a2a+p2p``."""
    recompute_granularity: str | None = None
    """Activation recompute in the backward (Megatron's ``--recompute-granularity``): ``"full"``
    reruns each whole layer (``jax.checkpoint``); ``"selective"`` keeps the linear layers' outputs
    and reruns the rest (core attention, norms, activations, dropout), much of the memory saving
    of full for a fraction of its extra FLOPs; None keeps everything."""
    bf16: bool = False
    """Compute in bfloat16 (parameters, gradients and optimizer stay float32)."""
    fp8: str | None = None
    """FP8 GEMMs in the transformer's linear layers (QKV, attention projection, fc1, fc2, the MoE
    experts' fc1/fc2 and the shared expert's; Megatron's ``--fp8-format``): None (off), ``"e4m3"``
    or ``"hybrid"`` (E4M3 forward, E5M2 gradients). Embeddings, the output layer, norms, attention,
    the MoE router and the loss stay in ``compute_dtype``."""
    fp8_recipe: str = "delayed"
    """``"delayed"`` (scales from an amax history: model state carried and updated by the training
    step) or ``"tensorwise"`` (scales from the current tensor)."""
    fp8_margin: int = 0
    """Delayed recipe: scales are divided by ``2**fp8_margin``."""
    fp8_amax_history_len: int = 1
    """Delayed recipe: amaxes kept per tensor."""
    fp8_amax_compute_algo: str = "most_recent"
    """Delayed recipe: ``"most_recent"`` or ``"max"`` over the history."""
    fp8_wgrad: bool = True
    """Weight-gradient GEMMs in FP8 too (False: Megatron's ``--no-fp8-wgrad``)."""
    init_method_std: float = 0.02
    """Standard deviation of the normal weight init."""
    layernorm_epsilon: float = 1e-5
    """Epsilon of every LayerNorm / RMSNorm."""
    moe: MoEConfig | None = None
    """Mixture of experts (``docs/moe.md``): the MoE layers' options; None: dense layers only."""
    moe_layer_freq: int | tuple[int, ...] = 1
    """Which layers are MoE (with ``moe``), Megatron's ``--moe-layer-freq``: an int ``N`` (layer
    ``l`` is MoE when ``l % N == 0``) or one 0/1 entry per layer."""

    @property
    def moe_layer_pattern(self) -> tuple[bool, ...]:
        """Per global layer: whether it is a MoE layer (all False without ``moe``)."""
        if self.moe is None:
            return (False,) * self.num_layers
        if isinstance(self.moe_layer_freq, int):
            return tuple(self.moe_layer_freq > 0 and i % self.moe_layer_freq == 0 for i in range(self.num_layers))
        return tuple(bool(v) for v in self.moe_layer_freq)

    def chunk_moe_pattern(self, layers_per_chunk: int) -> tuple[bool, ...]:
        """The MoE pattern of one model chunk's ``layers_per_chunk`` layers (the same for every
        chunk: the model's ``validate`` checks it)."""
        return self.moe_layer_pattern[:layers_per_chunk]

    @property
    def ffn_size(self) -> int:
        """The MLP width actually used."""
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def query_groups(self) -> int:
        """K/V head groups actually used (``num_query_groups`` or one per head)."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        """Channels per attention head: ``kv_channels`` or ``hidden_size / num_attention_heads``."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """Leading channels of each head that rotary rotates (Megatron: ``int(head_dim * rotary_percent)``)."""
        return int(self.head_dim * self.rotary_percent)

    @property
    def fp8_config(self) -> FP8Config | None:
        """The linear layers' :class:`~core.fp8.FP8Config`, or None with FP8 off."""
        return FP8Config.from_config(self) if self.fp8 is not None else None

    @property
    def compute_dtype(self):
        """Activation dtype."""
        return jnp.bfloat16 if self.bf16 else jnp.float32

    def validate(self, tensor_model_parallel_size: int) -> None:
        """Raise ``ValueError`` naming the numbers when a size does not divide or a value is out of range."""
        tp = tensor_model_parallel_size
        checks = [
            (self.num_attention_heads % tp == 0, f"num_attention_heads {self.num_attention_heads} is not divisible "
                                                 f"by tensor_model_parallel_size {tp}"),
            (self.kv_channels is not None or self.hidden_size % self.num_attention_heads == 0,
             f"hidden_size {self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads} "
             "(set kv_channels for another head width)"),
            (self.kv_channels is None or self.kv_channels > 0, f"kv_channels must be positive, got {self.kv_channels}"),
            (self.num_attention_heads % self.query_groups == 0,
             f"num_attention_heads {self.num_attention_heads} is not divisible by num_query_groups "
             f"{self.query_groups}"),
            (self.query_groups % tp == 0, f"num_query_groups {self.query_groups} is not divisible by "
                                          f"tensor_model_parallel_size {tp}"),
            (self.ffn_size % tp == 0, f"ffn_hidden_size {self.ffn_size} is not divisible by "
                                      f"tensor_model_parallel_size {tp}"),
            (self.position_embedding_type in ("learned_absolute", "rope"),
             f"position_embedding_type must be 'learned_absolute' or 'rope', got {self.position_embedding_type!r}"),
            (0.0 < self.rotary_percent <= 1.0, f"rotary_percent must be in (0, 1], got {self.rotary_percent}"),
            (self.position_embedding_type != "rope" or (self.rotary_dim > 0 and self.rotary_dim % 2 == 0),
             f"rotary_percent {self.rotary_percent} of head_dim {self.head_dim} gives {self.rotary_dim} rotary "
             "dims; rope needs a positive even number"),
            *self._rope_scaling_checks(),
            (self.normalization in ("LayerNorm", "RMSNorm"),
             f"normalization must be 'LayerNorm' or 'RMSNorm', got {self.normalization!r}"),
            (0.0 <= self.attention_dropout < 1.0, f"attention_dropout must be in [0, 1), got {self.attention_dropout}"),
            (0.0 <= self.hidden_dropout < 1.0, f"hidden_dropout must be in [0, 1), got {self.hidden_dropout}"),
            (self.context_parallel_size >= 1,
             f"context_parallel_size must be >= 1, got {self.context_parallel_size}"),
            (self.cp_comm_type in ("p2p", "all_gather", "a2a", "a2a+p2p"),
             f"cp_comm_type must be 'p2p', 'all_gather', 'a2a' or 'a2a+p2p', got {self.cp_comm_type!r}"),
            *self._a2a_checks(),
            *self._a2a_head_checks(tp),
            (self.recompute_granularity is None or self.recompute_granularity in RECOMPUTE_POLICIES,
             f"recompute_granularity must be None, 'full' or 'selective', got {self.recompute_granularity!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.fp8 is not None:
            self.fp8_config  # noqa: B018 -- FP8Config checks the values (formats, recipes, algorithms)

    def _a2a_checks(self) -> list[tuple[bool, str]]:
        """``validate``'s checks of ``hierarchical_context_parallel_sizes`` (only with ``a2a+p2p``)."""
        sizes, cp = self.hierarchical_context_parallel_sizes, self.context_parallel_size
        if self.cp_comm_type != "a2a+p2p":
            return [(sizes is None, f"hierarchical_context_parallel_sizes {sizes} need cp_comm_type 'a2a+p2p', "
                                    f"got {self.cp_comm_type!r}")]
        if sizes is None or len(sizes) != 2 or min(sizes) < 1 or sizes[0] * sizes[1] != cp:
            return [(False, f"cp_comm_type 'a2a+p2p' needs hierarchical_context_parallel_sizes of two sizes "
                            f"(a2a, ring) whose product is context_parallel_size {cp}, got {sizes}")]
        return []

    def _a2a_head_checks(self, tp: int) -> list[tuple[bool, str]]:
        """The local query heads (``heads / tp``) must split over the a2a group (K/V heads need not:
        they are repeated where they do not split, see ``core.context_parallel.a2a_attention``)."""
        a2a = self.a2a_size
        if a2a == 1 or self.num_attention_heads % tp:
            return []
        local = self.num_attention_heads // tp
        return [(local % a2a == 0, f"cp_comm_type {self.cp_comm_type!r} needs the local attention heads "
                                   f"(num_attention_heads {self.num_attention_heads} / tensor_model_parallel_size "
                                   f"{tp} = {local}) divisible by its all-to-all size {a2a}")]

    @property
    def a2a_size(self) -> int:
        """How many cp ranks each all-to-all spans: cp for ``a2a``, the first hierarchical size
        for ``a2a+p2p``, 1 (none) otherwise."""
        if self.cp_comm_type == "a2a":
            return self.context_parallel_size
        if self.cp_comm_type == "a2a+p2p" and self.hierarchical_context_parallel_sizes:
            return self.hierarchical_context_parallel_sizes[0]
        return 1

    def _rope_scaling_checks(self) -> list[tuple[bool, str]]:
        """``validate``'s checks of the Llama 3.1 rope scaling (only when it is on)."""
        if not self.rope_scaling:
            return []
        low, high = self.rope_scaling_low_freq_factor, self.rope_scaling_high_freq_factor
        return [
            (self.position_embedding_type == "rope",
             f"rope_scaling needs position_embedding_type 'rope', got {self.position_embedding_type!r}"),
            (self.rope_scaling_factor > 0, f"rope_scaling_factor must be positive, got {self.rope_scaling_factor}"),
            (0 < low < high, f"rope_scaling_low_freq_factor {low} must be positive and below "
                             f"rope_scaling_high_freq_factor {high}"),
            (self.rope_scaling_original_max_position_embeddings > 0,
             "rope_scaling_original_max_position_embeddings must be positive, got "
             f"{self.rope_scaling_original_max_position_embeddings}"),
        ]
