"""Hugging Face ``config.json`` <-> :class:`~core.models.gpt.GPTConfig` for the Llama, Mistral
and Qwen families.

The mapping is exact or refused: a field whose value the package cannot compute as
``transformers`` does (another rope type, sliding-window attention, biases the families' layers
do not have) raises :class:`HFConversionError` naming the field and its value, never an
approximation.
"""

from __future__ import annotations

from typing import Any

from core.models.gpt.gpt_config import GPTConfig

FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM"}
"""Supported ``model_type`` values and their ``transformers`` architecture class."""

VOCAB_PADDING = 128
"""The embedding's rows are padded to a multiple of this (Megatron's
``--make-vocab-size-divisible-by`` default), so the model loads at any power-of-two tp up to it."""


class HFConversionError(ValueError):
    """A Hugging Face model or a checkpoint that cannot be converted exactly; one line."""


def _rope(hf: dict) -> tuple[float, dict | None]:
    """``(rope_theta, scaling dict or None)`` from either config style: ``rope_theta`` +
    ``rope_scaling`` (transformers 4, the published files) or ``rope_parameters`` (transformers 5)."""
    params = hf.get("rope_parameters") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(theta), scaling


def _refuse(field: str, value: Any, why: str) -> None:
    raise HFConversionError(f"config.json: {field}={value!r} is not supported ({why})")


def _check_supported(hf: dict) -> None:
    """Refuse the fields whose values the package cannot honour exactly."""
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        _refuse("model_type", model_type, f"supported: {', '.join(FAMILIES)}")
    if hf.get("hidden_act", "silu") != "silu":
        _refuse("hidden_act", hf["hidden_act"], "the families' MLP is SwiGLU with silu")
    if hf.get("attention_bias"):
        _refuse("attention_bias", True, "biases on q/k/v and o_proj; the package has q/k/v biases only (Qwen2)")
    if hf.get("mlp_bias"):
        _refuse("mlp_bias", True, "MLP biases")
    if model_type == "mistral" and hf.get("sliding_window") is not None:
        _refuse("sliding_window", hf["sliding_window"], "sliding-window attention is not built; Mistral v0.2 and "
                "later set it to null")
    if model_type in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
        _refuse("use_sliding_window", True, "sliding-window attention is not built")
    factor = hf.get("partial_rotary_factor", 1.0)
    if factor != 1.0:
        _refuse("partial_rotary_factor", factor, "rotary on every channel of a head only")
    _, scaling = _rope(hf)
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type"))
        if rope_type != "llama3":
            _refuse("rope_scaling.rope_type", rope_type, "rope types: default, llama3")


def gpt_config_from_hf(hf: dict) -> GPTConfig:
    """The :class:`GPTConfig` that computes what ``transformers`` computes for ``hf`` (a parsed
    ``config.json``). ``seq_length`` is the model's ``max_position_embeddings`` (rotary
    positions have no parameters: a run trains at its own ``--seq-length``)."""
    _check_supported(hf)
    try:
        heads, hidden = int(hf["num_attention_heads"]), int(hf["hidden_size"])
        vocab = int(hf["vocab_size"])
        fields = dict(
            num_layers=int(hf["num_hidden_layers"]), hidden_size=hidden, num_attention_heads=heads,
            num_query_groups=int(hf.get("num_key_value_heads") or heads), ffn_hidden_size=int(hf["intermediate_size"]),
            vocab_size=vocab, seq_length=int(hf.get("max_position_embeddings", 4096)), position_embedding_type="rope",
            normalization="RMSNorm", swiglu=True, add_bias_linear=False,
            layernorm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
            share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
            init_method_std=float(hf.get("initializer_range", 0.02)))
    except KeyError as e:
        raise HFConversionError(f"config.json has no {e.args[0]!r} field") from None
    except (TypeError, ValueError) as e:
        raise HFConversionError(f"config.json holds a malformed value: {e}") from None
    padded = -(-vocab // VOCAB_PADDING) * VOCAB_PADDING
    if padded != vocab:
        fields["padded_vocab_size"] = padded
    theta, scaling = _rope(hf)
    fields["rotary_base"] = theta
    head_dim = hf.get("head_dim")
    if head_dim is not None and int(head_dim) * heads != hidden:
        fields["kv_channels"] = int(head_dim)
    if scaling is not None:
        fields.update(rope_scaling=True, rope_scaling_factor=float(scaling["factor"]),
                      rope_scaling_low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
                      rope_scaling_high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
                      rope_scaling_original_max_position_embeddings=int(
                          scaling.get("original_max_position_embeddings", 8192)))
    if hf["model_type"] == "qwen2":
        fields["add_qkv_bias"] = True
    if hf["model_type"] == "qwen3":
        fields["qk_layernorm"] = True
    return GPTConfig(**fields)


def _family(config: GPTConfig) -> str:
    """The ``model_type`` that holds ``config``'s options."""
    if config.qk_layernorm:
        return "qwen3"
    if config.add_qkv_bias:
        return "qwen2"
    return "llama"


def _check_exportable(config: GPTConfig) -> None:
    """Refuse a model that no supported family can hold."""
    problems = [
        (config.moe is not None, "moe", "mixture-of-experts layers"),
        (config.position_embedding_type != "rope", "position_embedding_type", "learned positions"),
        (config.normalization != "RMSNorm", "normalization", "the families use RMSNorm"),
        (not config.swiglu, "swiglu", "the families' MLP is SwiGLU"),
        (config.add_bias_linear, "add_bias_linear", "the families have no linear biases (Qwen2's q/k/v only)"),
        (config.rotary_percent != 1.0, "rotary_percent", "the families rotate every channel"),
        (config.add_qkv_bias and config.qk_layernorm,
         "add_qkv_bias", "with qk_layernorm: no family has both"),
    ]
    for bad, field, why in problems:
        if bad:
            raise HFConversionError(f"the checkpoint's model cannot be written as a Hugging Face model: "
                                    f"{field}={getattr(config, field)!r} ({why})")


def hf_config_from_gpt(config: GPTConfig, base: dict | None = None, dtype: str = "float32") -> dict:
    """A ``config.json`` dict for ``config``: ``base`` (the imported model's config, when the
    checkpoint came from one) with the fields the model defines set from ``config``, or a new
    one of the family that holds the model's options (Qwen3 with q/k norms, Qwen2 with q/k/v
    biases, else Llama). ``dtype``: the weights' dtype as ``transformers`` names it."""
    _check_exportable(config)
    model_type = (base or {}).get("model_type") or _family(config)
    if model_type != _family(config) and not (model_type == "mistral" and _family(config) == "llama"):
        raise HFConversionError(f"the checkpoint's model_type {model_type!r} cannot hold its options "
                                f"(they need {_family(config)!r})")
    out = dict(base or {})
    for legacy in ("rope_parameters", "rope_scaling", "torch_dtype"):
        out.pop(legacy, None)
    out.update(
        architectures=[FAMILIES[model_type]], model_type=model_type, vocab_size=config.vocab_size,
        hidden_size=config.hidden_size, intermediate_size=config.ffn_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.query_groups,
        head_dim=config.head_dim, hidden_act="silu", rms_norm_eps=config.layernorm_epsilon,
        rope_theta=config.rotary_base, tie_word_embeddings=config.share_embeddings_and_output_weights,
        initializer_range=config.init_method_std, dtype=dtype)
    out.setdefault("max_position_embeddings", config.seq_length)
    if model_type != "qwen2":
        out.setdefault("attention_bias", False)
    if config.rope_scaling:
        out["rope_scaling"] = {"rope_type": "llama3", "factor": config.rope_scaling_factor,
                               "low_freq_factor": config.rope_scaling_low_freq_factor,
                               "high_freq_factor": config.rope_scaling_high_freq_factor,
                               "original_max_position_embeddings":
                                   config.rope_scaling_original_max_position_embeddings}
    else:
        out["rope_scaling"] = None
    return out


__all__ = ["FAMILIES", "VOCAB_PADDING", "HFConversionError", "gpt_config_from_hf", "hf_config_from_gpt"]
