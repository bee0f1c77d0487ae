"""Tests' copy of a tiny HF Llama / Qwen2 / Qwen3 (torch, fp32) into GPTModel params and config.

Only what the option tests need (one device, vpp 1, no vocabulary padding); the conversion tool
proper lives in ``core/models``. HF's q and k rows go in unpermuted (HF's rotary is the same
rotate-half form); the fused QKV weight is ``[groups, r + 2, head_dim]`` rows (each group's ``r``
query heads, then its key, then its value: ``ParallelAttention``); fc1 stacks ``[gate, up]``.
"""

from __future__ import annotations

import numpy as np

from core.models.gpt.gpt_config import GPTConfig

TINY_HF_COMMON = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)
"""The shared fields of the tests' tiny HF models (:func:`tiny_hf_families`)."""


def tiny_hf_families() -> dict:
    """``{family: (transformers config class, its own fields)}`` of the tests' tiny models, one per
    imported family: Llama with Llama 3.1 rope scaling (an original context of 8 tokens, so later
    positions are scaled), Mistral with an explicit ``head_dim``, Qwen2 tied (QKV biases), Qwen3
    with q/k norm and an explicit ``head_dim``."""
    import transformers

    return {
        "llama": (transformers.LlamaConfig, dict(
            tie_word_embeddings=False, rope_theta=50000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8})),
        "mistral": (transformers.MistralConfig, dict(tie_word_embeddings=False, sliding_window=None, head_dim=24)),
        "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=True)),
        "qwen3": (transformers.Qwen3Config, dict(tie_word_embeddings=False, head_dim=32)),
    }


def checkpoint_params(ckpt: str) -> dict:
    """A parameters checkpoint (``import_hf_model``'s) as a nested dict of host arrays."""
    from core.checkpointing.params_checkpoint import read_params_arrays, saved_param_shapes

    tree: dict = {}
    for path, array in read_params_arrays(ckpt, list(saved_param_shapes(ckpt))):
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = array
    return tree


def randomize(model, seed: int = 0, std: float = 0.1) -> None:
    """Every weight and bias ``N(0, std)``, every norm weight ``1 + N(0, 0.2)``: HF's init (zero
    biases, unit norms, std 0.02) would leave the options' effects below the test's tolerance."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if "norm" in name else std * noise)


def gpt_config(hf, seq_length: int) -> GPTConfig:
    """The :class:`GPTConfig` of an HF Llama / Qwen2 / Qwen3 config."""
    rope = hf.rope_parameters
    llama3 = rope.get("rope_type") == "llama3"
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    qwen2 = hf.model_type == "qwen2"
    return GPTConfig(
        vocab_size=hf.vocab_size, num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size,
        num_attention_heads=hf.num_attention_heads, num_query_groups=hf.num_key_value_heads,
        ffn_hidden_size=hf.intermediate_size, seq_length=seq_length, position_embedding_type="rope",
        rotary_base=rope["rope_theta"], normalization="RMSNorm", swiglu=True, add_bias_linear=False,
        layernorm_epsilon=hf.rms_norm_eps, share_embeddings_and_output_weights=hf.tie_word_embeddings,
        kv_channels=head_dim if head_dim * hf.num_attention_heads != hf.hidden_size else None,
        add_qkv_bias=qwen2 or bool(getattr(hf, "attention_bias", False)), qk_layernorm=hf.model_type == "qwen3",
        rope_scaling=llama3, **(dict(
            rope_scaling_factor=rope["factor"], rope_scaling_low_freq_factor=rope["low_freq_factor"],
            rope_scaling_high_freq_factor=rope["high_freq_factor"],
            rope_scaling_original_max_position_embeddings=rope["original_max_position_embeddings"]) if llama3 else {}))


def _qkv(attn: dict, heads: int, groups: int, head_dim: int, kind: str) -> np.ndarray:
    """HF's separate q / k / v ``kind`` ("weight" or "bias") to the fused by-group rows."""
    r = heads // groups
    q = attn[f"q_proj.{kind}"].reshape((groups, r, head_dim) + attn[f"q_proj.{kind}"].shape[1:])
    k = attn[f"k_proj.{kind}"].reshape((groups, 1, head_dim) + attn[f"k_proj.{kind}"].shape[1:])
    v = attn[f"v_proj.{kind}"].reshape((groups, 1, head_dim) + attn[f"v_proj.{kind}"].shape[1:])
    fused = np.concatenate([q, k, v], axis=1)
    return fused.reshape((-1,) + fused.shape[3:])


def _layer(sd: dict, i: int, cfg: GPTConfig) -> dict:
    pre = f"model.layers.{i}."
    attn = {k[len(pre + "self_attn."):]: v for k, v in sd.items() if k.startswith(pre + "self_attn.")}
    qkv = {"weight": _qkv(attn, cfg.num_attention_heads, cfg.query_groups, cfg.head_dim, "weight")}
    if cfg.add_qkv_bias:
        qkv["bias"] = _qkv(attn, cfg.num_attention_heads, cfg.query_groups, cfg.head_dim, "bias")
    self_attention = {"linear_qkv": qkv, "linear_proj": {"weight": attn["o_proj.weight"]}}
    if cfg.qk_layernorm:
        self_attention["q_layernorm"] = {"scale": attn["q_norm.weight"]}
        self_attention["k_layernorm"] = {"scale": attn["k_norm.weight"]}
    mlp = {"layernorm": {"scale": sd[pre + "post_attention_layernorm.weight"]},
           "fc1": {"weight": np.stack([sd[pre + "mlp.gate_proj.weight"], sd[pre + "mlp.up_proj.weight"]])},
           "fc2": {"weight": sd[pre + "mlp.down_proj.weight"]}}
    return {"input_layernorm": {"scale": sd[pre + "input_layernorm.weight"]}, "self_attention": self_attention,
            "mlp": mlp}


def gpt_params(model, cfg: GPTConfig) -> dict:
    """GPTModel params (vpp 1, host numpy) holding the HF ``model``'s weights."""
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    layers = [_layer(sd, i, cfg) for i in range(cfg.num_layers)]
    stacked = _stack(layers)
    head = {"final_layernorm": {"scale": sd["model.norm.weight"]}}
    if not cfg.share_embeddings_and_output_weights:
        head["output_layer"] = sd["lm_head.weight"]
    return {"embedding": {"word_embeddings": {"weight": sd["model.embed_tokens.weight"]}},
            "layers": stacked, "head": head}


def _stack(layers: list[dict]) -> dict:
    """Per-layer dicts to one dict of ``[1, L, ...]`` arrays (vpp 1)."""
    if isinstance(layers[0], dict):
        return {k: _stack([layer[k] for layer in layers]) for k in layers[0]}
    return np.stack(layers)[None]
