"""``GPTConfig``: the GPT's hyper-parameters, the transformer layers' (``TransformerConfig``) and
the model's own: vocabulary, sequence length, output tying, the layer loop."""

from __future__ import annotations

import dataclasses

from core.transformer.moe.moe_config import MoEConfig
from core.transformer.transformer_config import TransformerConfig


@dataclasses.dataclass(frozen=True)
class GPTConfig(TransformerConfig):
    """Hyper-parameters of :class:`~core.models.gpt.GPTModel` (the transformer layers' fields are
    :class:`~core.transformer.transformer_config.TransformerConfig`'s)."""

    vocab_size: int = 256
    """The tokenizer's vocabulary: token ids the loss may predict."""
    padded_vocab_size: int | None = None
    """Rows of the embedding and output layer (Megatron pads to a multiple of
    ``make_vocab_size_divisible_by x tp``); None means ``vocab_size``. Logits of the padding rows
    are masked: they never win and carry no loss, so padding does not change the loss."""
    seq_length: int = 128
    """Tokens per sample (must divide by tp under sequence parallelism)."""
    share_embeddings_and_output_weights: bool = True
    """Tie the output layer to the word embedding (Megatron's default)."""
    unroll_layers: bool = True
    """Unroll the loop over a chunk's layers: faster steps (a rolled ``lax.scan`` stacks every
    layer's residuals, a sizeable share of a CPU step), compile time linear in the layer count."""
    pipeline_schedule: str | None = None
    """The pipeline schedule: ``"zb-h1"`` (zero-bubble, one chunk per stage) or ``"zb-v"``
    (zero-bubble, two chunks per stage in ZB-V's V placement) of
    :mod:`core.pipeline_parallel.zero_bubble_executor`, or None / ``"1f1b"`` / ``"interleaved"``
    for Megatron's 1F1B (interleaved with virtual stages). An execution choice: the results do
    not depend on it, and checkpoints store the layers in layer order whatever the placement."""
    zero_bubble_w_recompute: bool = False
    """Under a zero-bubble schedule, W (the weight gradient) recomputes the chunk's forward from
    its stashed input instead of keeping B's VJP residuals until W: about 1F1B's activation
    memory, at one more chunk forward per microbatch. An execution choice."""

    @property
    def vocab_rows(self) -> int:
        """Rows of the embedding and output layer: ``padded_vocab_size`` or ``vocab_size``."""
        return self.padded_vocab_size or self.vocab_size

    def flops_per_token(self) -> float:
        """Model FLOPs of forward + backward per token (``6 N`` + attention, Megatron's formula,
        with its grouped-query and SwiGLU terms; the logits over the padded vocabulary; MoE layers
        count their router, top-k routed experts and shared expert)."""
        h, s, layers = self.hidden_size, self.seq_length, self.num_layers
        a = self.num_attention_heads * self.head_dim  # attention width (h unless kv_channels sets it)
        # forward per token and layer: qkv 2h(a + 2 G d) (6h^2 for multi-head), projection 2ah,
        # MLP 4h*ffn (x 3/2 with SwiGLU's third matrix), scores + values 4sa
        qkv = 2 * h * (a + 2 * self.query_groups * self.head_dim)
        glu = 1.5 if self.swiglu else 1.0
        mlp = 4 * h * self.ffn_size * glu
        per_layer = qkv + 2 * a * h + 4 * s * a
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
        if self.kv_channels is not None:
            heads += f" of {self.kv_channels} channels"
        parts = [f"{self.num_layers} layers", f"hidden {self.hidden_size}", heads, f"ffn {self.ffn_size}",
                 f"seq {self.seq_length}", self.normalization, "SwiGLU" if self.swiglu else "GELU",
                 "rope" if self.position_embedding_type == "rope" else "learned positions"]
        if self.position_embedding_type == "rope" and self.rope_scaling:
            parts.append(f"llama3 rope scaling x{self.rope_scaling_factor} from "
                         f"{self.rope_scaling_original_max_position_embeddings}")
        if self.qk_layernorm:
            parts.append("qk norm")
        if not self.add_bias_linear:
            parts.append("qkv bias only" if self.add_qkv_bias else "no bias")
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

    def validate(self, tensor_model_parallel_size: int, pipeline_chunks: int = 1) -> None:
        """Raise ``ValueError`` naming the numbers when a size does not divide (the transformer
        layers' fields first, :meth:`TransformerConfig.validate`); ``pipeline_chunks``: pipeline
        stages x virtual chunks."""
        super().validate(tensor_model_parallel_size)
        tp = tensor_model_parallel_size
        checks = [
            (self.padded_vocab_size is not None or self.vocab_size % tp == 0,
             f"vocab_size {self.vocab_size} is not divisible by tensor_model_parallel_size {tp}"),
            (self.padded_vocab_size is None or self.padded_vocab_size >= self.vocab_size,
             f"padded_vocab_size {self.padded_vocab_size} is smaller than vocab_size {self.vocab_size}"),
            (self.padded_vocab_size is None or self.padded_vocab_size % tp == 0,
             f"padded_vocab_size {self.padded_vocab_size} is not divisible by tensor_model_parallel_size {tp}"),
            (self.num_layers % pipeline_chunks == 0, f"num_layers {self.num_layers} is not divisible by pipeline "
                                                     f"stages x virtual chunks = {pipeline_chunks}"),
            (not self.sequence_parallel or self.seq_length % tp == 0,
             f"seq_length {self.seq_length} is not divisible by tensor_model_parallel_size {tp} "
             "(needed by --sequence-parallel)"),
            # Both comm types read the load-balanced order: two equal chunks per cp rank.
            (self.context_parallel_size == 1 or self.seq_length % (2 * self.context_parallel_size) == 0,
             f"seq_length {self.seq_length} is not divisible by 2 x context_parallel_size "
             f"{self.context_parallel_size} = {2 * self.context_parallel_size} (load-balanced context parallelism "
             "gives every cp rank two equal chunks)"),
            (not self.sequence_parallel or self.seq_length % (self.context_parallel_size * tp) == 0,
             f"seq_length {self.seq_length} is not divisible by context_parallel_size {self.context_parallel_size} x "
             f"tensor_model_parallel_size {tp} = {self.context_parallel_size * tp} (needed by --sequence-parallel)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.moe is not None:
            self._validate_moe(pipeline_chunks)

    @classmethod
    def from_record(cls, record: dict, **overrides) -> GPTConfig:
        """The config a checkpoint's model record describes
        (:func:`core.checkpointing.checkpointer.model_record`, read back from JSON), ``overrides``
        setting the fields it leaves out (``seq_length`` with rotary positions, execution
        choices). ``ValueError`` names fields this version does not know."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(record) - names)
        if unknown:
            raise ValueError(f"the checkpoint's model has fields this version does not know: {', '.join(unknown)}")
        values = {**record, **overrides}
        if isinstance(values.get("moe"), dict):
            values["moe"] = MoEConfig(**values["moe"])
        if isinstance(values.get("moe_layer_freq"), list):
            values["moe_layer_freq"] = tuple(values["moe_layer_freq"])
        return cls(**values)

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
