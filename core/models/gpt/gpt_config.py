"""``GPTConfig``: the model's shape and numerics (Megatron's ``TransformerConfig`` subset)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from core.transformer.moe.moe_config import MoEConfig
from core.transformer.recompute import RECOMPUTE_POLICIES


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Hyper-parameters of :class:`~core.models.gpt.GPTModel`."""

    vocab_size: int = 256
    """The tokenizer's vocabulary: token ids the loss may predict."""
    padded_vocab_size: int | None = None
    """Rows of the embedding and output layer (Megatron pads to a multiple of
    ``make_vocab_size_divisible_by x tp``); None means ``vocab_size``. Logits of the padding rows
    are masked: they never win and carry no loss, so padding does not change the loss."""
    num_layers: int = 4
    """Transformer layers (must divide by pipeline x virtual-pipeline size)."""
    hidden_size: int = 128
    """Model width."""
    num_attention_heads: int = 4
    """Attention heads (must divide by the tensor-parallel size)."""
    ffn_hidden_size: int | None = None
    """MLP width; None means ``4 * hidden_size``."""
    seq_length: int = 128
    """Tokens per sample (must divide by tp under sequence parallelism)."""
    num_query_groups: int | None = None
    """Grouped-query attention: K/V head groups (None = one per head, plain multi-head
    attention). Must divide ``num_attention_heads`` and be divisible by tp."""
    position_embedding_type: str = "learned_absolute"
    """``"learned_absolute"`` (a ``[seq_length, hidden]`` table) or ``"rope"`` (rotary on q and k)."""
    rotary_base: float = 10000.0
    """Base of the rotary frequencies."""
    rotary_percent: float = 1.0
    """Share of each head's dims that rotary rotates (the rest pass unrotated), in (0, 1]."""
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
    share_embeddings_and_output_weights: bool = True
    """Tie the output layer to the word embedding (Megatron's default)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism: norms and residuals on ``[s/tp, b, h]`` shards."""
    context_parallel_size: int = 1
    """Context parallelism (mesh axis ``"cp"``): each rank holds ``s/cp`` tokens of every sample,
    the load-balanced chunks ``r`` and ``2cp-1-r`` (``core.context_parallel``); the batch arrives
    reordered and split that way. Must match the parallel state's ``context_parallel_size``."""
    cp_comm_type: str = "p2p"
    """How context-parallel attention exchanges K/V: ``"p2p"`` (ring) or ``"all_gather"``."""
    recompute_granularity: str | None = None
    """Activation recompute in the backward (Megatron's ``--recompute-granularity``): ``"full"``
    reruns each whole layer (``jax.checkpoint``); ``"selective"`` keeps the linear layers' outputs
    and reruns the rest (core attention, norms, activations, dropout), much of the memory saving
    of full for a fraction of its extra FLOPs; None keeps everything."""
    unroll_layers: bool = True
    """Unroll the loop over a chunk's layers: faster steps (a rolled ``lax.scan`` stacks every
    layer's residuals, 20% of a CPU step here), compile time linear in the layer count."""
    bf16: bool = False
    """Compute in bfloat16 (parameters, gradients and optimizer stay float32)."""
    init_method_std: float = 0.02
    """Standard deviation of the normal weight init."""
    layernorm_epsilon: float = 1e-5
    """Epsilon of every LayerNorm / RMSNorm."""
    moe: MoEConfig | None = None
    """Mixture of experts (``docs/moe.md``): the MoE layers' options; None: a dense GPT."""
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
        chunk: :meth:`validate` checks it)."""
        return self.moe_layer_pattern[:layers_per_chunk]

    @property
    def ffn_size(self) -> int:
        """The MLP width actually used."""
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def vocab_rows(self) -> int:
        """Rows of the embedding and output layer: ``padded_vocab_size`` or ``vocab_size``."""
        return self.padded_vocab_size or self.vocab_size

    @property
    def query_groups(self) -> int:
        """K/V head groups actually used (``num_query_groups`` or one per head)."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        """Channels per attention head."""
        return self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """Leading channels of each head that rotary rotates (Megatron: ``int(head_dim * rotary_percent)``)."""
        return int(self.head_dim * self.rotary_percent)

    @property
    def compute_dtype(self):
        """Activation dtype."""
        return jnp.bfloat16 if self.bf16 else jnp.float32

    def flops_per_token(self) -> float:
        """Model FLOPs of forward + backward per token (``6 N`` + attention, Megatron's formula,
        with its grouped-query and SwiGLU terms; the logits over the padded vocabulary; MoE layers
        count their router, top-k routed experts and shared expert)."""
        h, s, layers = self.hidden_size, self.seq_length, self.num_layers
        # forward per token and layer: qkv 2h(h + 2 G d) (6h^2 for multi-head), projection 2h^2,
        # MLP 4h*ffn (x 3/2 with SwiGLU's third matrix), scores + values 4sh
        qkv = 2 * h * (h + 2 * self.query_groups * self.head_dim)
        glu = 1.5 if self.swiglu else 1.0
        mlp = 4 * h * self.ffn_size * glu
        per_layer = qkv + 2 * h * h + 4 * s * h
        logits = 2 * h * self.vocab_rows
        # MoE layers: the router, each token's k experts and the shared expert (active parameters).
        moe_layers = sum(self.moe_layer_pattern)
        moe_mlp = 0.0
        if self.moe is not None:
            moe = self.moe
            moe_mlp = 2 * h * moe.num_experts + 4 * h * moe.moe_ffn_hidden_size * moe.moe_router_topk * glu
            moe_mlp += 4 * h * (moe.moe_shared_expert_intermediate_size or 0) * glu
        mlps = (layers - moe_layers) * mlp + moe_layers * moe_mlp
        return 3.0 * (layers * per_layer + mlps + logits)  # backward = 2x forward

    def describe(self) -> str:
        """One line naming the shape and the options that differ from the plain GPT."""
        heads = f"{self.num_attention_heads} heads"
        if self.num_query_groups not in (None, self.num_attention_heads):
            heads += f" in {self.num_query_groups} query groups"
        parts = [f"{self.num_layers} layers", f"hidden {self.hidden_size}", heads, f"ffn {self.ffn_size}",
                 f"seq {self.seq_length}", self.normalization, "SwiGLU" if self.swiglu else "GELU",
                 "rope" if self.position_embedding_type == "rope" else "learned positions"]
        if not self.add_bias_linear:
            parts.append("no bias")
        if not self.share_embeddings_and_output_weights:
            parts.append("untied output")
        if self.vocab_rows != self.vocab_size:
            parts.append(f"vocab {self.vocab_size} padded to {self.vocab_rows}")
        else:
            parts.append(f"vocab {self.vocab_size}")
        if self.attention_dropout or self.hidden_dropout:
            parts.append(f"dropout {self.attention_dropout}/{self.hidden_dropout}")
        if self.moe is not None:
            parts.append(f"MoE on {sum(self.moe_layer_pattern)} layers: {self.moe.num_experts} experts top-"
                         f"{self.moe.moe_router_topk}, expert ffn {self.moe.moe_ffn_hidden_size}")
        return ", ".join(parts)

    def validate(self, tensor_model_parallel_size: int, pipeline_chunks: int) -> None:
        """Raise ``ValueError`` naming the numbers when a size does not divide."""
        tp = tensor_model_parallel_size
        checks = [
            (self.num_attention_heads % tp == 0, f"num_attention_heads {self.num_attention_heads} is not divisible "
                                                 f"by tensor_model_parallel_size {tp}"),
            (self.hidden_size % self.num_attention_heads == 0, f"hidden_size {self.hidden_size} is not divisible "
                                                               f"by num_attention_heads {self.num_attention_heads}"),
            (self.padded_vocab_size is not None or self.vocab_size % tp == 0,
             f"vocab_size {self.vocab_size} is not divisible by tensor_model_parallel_size {tp}"),
            (self.padded_vocab_size is None or self.padded_vocab_size >= self.vocab_size,
             f"padded_vocab_size {self.padded_vocab_size} is smaller than vocab_size {self.vocab_size}"),
            (self.padded_vocab_size is None or self.padded_vocab_size % tp == 0,
             f"padded_vocab_size {self.padded_vocab_size} is not divisible by tensor_model_parallel_size {tp}"),
            (self.num_attention_heads % self.query_groups == 0,
             f"num_attention_heads {self.num_attention_heads} is not divisible by num_query_groups "
             f"{self.query_groups}"),
            (self.query_groups % tp == 0, f"num_query_groups {self.query_groups} is not divisible by "
                                          f"tensor_model_parallel_size {tp}"),
            (self.ffn_size % tp == 0, f"ffn_hidden_size {self.ffn_size} is not divisible by "
                                      f"tensor_model_parallel_size {tp}"),
            (self.num_layers % pipeline_chunks == 0, f"num_layers {self.num_layers} is not divisible by pipeline "
                                                     f"stages x virtual chunks = {pipeline_chunks}"),
            (not self.sequence_parallel or self.seq_length % tp == 0,
             f"seq_length {self.seq_length} is not divisible by tensor_model_parallel_size {tp} "
             "(needed by --sequence-parallel)"),
            (self.position_embedding_type in ("learned_absolute", "rope"),
             f"position_embedding_type must be 'learned_absolute' or 'rope', got {self.position_embedding_type!r}"),
            (0.0 < self.rotary_percent <= 1.0, f"rotary_percent must be in (0, 1], got {self.rotary_percent}"),
            (self.position_embedding_type != "rope" or (self.rotary_dim > 0 and self.rotary_dim % 2 == 0),
             f"rotary_percent {self.rotary_percent} of head_dim {self.head_dim} gives {self.rotary_dim} rotary "
             "dims; rope needs a positive even number"),
            (self.normalization in ("LayerNorm", "RMSNorm"),
             f"normalization must be 'LayerNorm' or 'RMSNorm', got {self.normalization!r}"),
            (0.0 <= self.attention_dropout < 1.0, f"attention_dropout must be in [0, 1), got {self.attention_dropout}"),
            (0.0 <= self.hidden_dropout < 1.0, f"hidden_dropout must be in [0, 1), got {self.hidden_dropout}"),
            (self.context_parallel_size >= 1,
             f"context_parallel_size must be >= 1, got {self.context_parallel_size}"),
            (self.cp_comm_type in ("p2p", "all_gather"),
             f"cp_comm_type must be 'p2p' or 'all_gather', got {self.cp_comm_type!r}"),
            # Both comm types read the load-balanced order: two equal chunks per cp rank.
            (self.context_parallel_size == 1 or self.seq_length % (2 * self.context_parallel_size) == 0,
             f"seq_length {self.seq_length} is not divisible by 2 x context_parallel_size "
             f"{self.context_parallel_size} = {2 * self.context_parallel_size} (load-balanced context parallelism "
             "gives every cp rank two equal chunks)"),
            (not self.sequence_parallel or self.seq_length % (self.context_parallel_size * tp) == 0,
             f"seq_length {self.seq_length} is not divisible by context_parallel_size {self.context_parallel_size} x "
             f"tensor_model_parallel_size {tp} = {self.context_parallel_size * tp} (needed by --sequence-parallel)"),
            (self.recompute_granularity is None or self.recompute_granularity in RECOMPUTE_POLICIES,
             f"recompute_granularity must be None, 'full' or 'selective', got {self.recompute_granularity!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.moe is not None:
            self._validate_moe(pipeline_chunks)

    def _validate_moe(self, pipeline_chunks: int) -> None:
        freq = self.moe_layer_freq
        if isinstance(freq, int):
            if freq < 1:
                raise ValueError(f"moe_layer_freq must be >= 1, got {freq}")
        else:
            if len(freq) != self.num_layers:
                raise ValueError(f"moe_layer_freq has {len(freq)} entries, num_layers is {self.num_layers}")
            if any(v not in (0, 1) for v in freq):
                raise ValueError(f"moe_layer_freq entries must be 0 or 1, got {list(freq)}")
        pattern = self.moe_layer_pattern
        per_chunk = self.num_layers // pipeline_chunks
        if any(pattern[i] != pattern[i % per_chunk] for i in range(self.num_layers)):
            raise ValueError(f"moe_layer_freq {freq if isinstance(freq, int) else list(freq)} gives the "
                             f"{pipeline_chunks} pipeline chunks of {per_chunk} layers different MoE layer "
                             "patterns (not supported yet: every chunk must have the same pattern)")
        if not any(pattern):
            raise ValueError(f"moe_layer_freq {freq if isinstance(freq, int) else list(freq)} makes no layer MoE")
