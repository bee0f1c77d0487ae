"""Published ``config.json`` files (as the Hub serves them, transformers-4 style) map to the
``GPTConfig`` the model needs: the shape, GQA, head width, rope base and Llama 3.1 scaling, tying,
Qwen's q/k/v biases and q/k norms; the parameter count is the published model's; the way back
gives the original's fields. No weights, no ``transformers``: the parameter shapes are abstract."""

import math

import pytest

from core.models.huggingface import gpt_config_from_hf, hf_config_from_gpt
from core.models.huggingface.conversion import param_shapes

LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 128256}
MISTRAL_7B_V0_3 = {
    "architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 32768}
QWEN2_5_0_5B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151643,
    "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02, "intermediate_size": 4864,
    "max_position_embeddings": 32768, "max_window_layers": 24, "model_type": "qwen2", "num_attention_heads": 14,
    "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936}
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02,
    "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}

# config, expected GPTConfig fields, published parameter count (billions, to 2 places), a tp it loads at
CASES = {
    "Llama-3.2-1B": (LLAMA_3_2_1B, dict(num_layers=16, num_query_groups=8, kv_channels=None, rope_scaling=True,
                                        rope_scaling_factor=32.0, rotary_base=500000.0,
                                        share_embeddings_and_output_weights=True, add_qkv_bias=False,
                                        qk_layernorm=False), 1.24, 8),
    "Mistral-7B-v0.3": (MISTRAL_7B_V0_3, dict(num_layers=32, num_query_groups=8, ffn_hidden_size=14336,
                                              rope_scaling=False, rotary_base=1e6,
                                              share_embeddings_and_output_weights=False), 7.25, 8),
    "Qwen2.5-0.5B": (QWEN2_5_0_5B, dict(num_layers=24, num_attention_heads=14, num_query_groups=2,
                                        add_qkv_bias=True, layernorm_epsilon=1e-6,
                                        share_embeddings_and_output_weights=True), 0.49, 2),
    "Qwen3-0.6B": (QWEN3_0_6B, dict(num_layers=28, kv_channels=128, qk_layernorm=True, add_qkv_bias=False,
                                    share_embeddings_and_output_weights=True), 0.60, 8),
}


@pytest.mark.parametrize("name", list(CASES))
def test_published_configs_map_to_the_models_shape(name):
    hf, fields, billions, tp = CASES[name]
    config = gpt_config_from_hf(hf)
    for field, value in fields.items():
        assert getattr(config, field) == value, field
    assert config.vocab_rows == hf["vocab_size"]  # already a multiple of 128: no padding rows
    config.validate(tp)
    count = sum(math.prod(shape) for shape in param_shapes(config).values())
    assert round(count / 1e9, 2) == billions


@pytest.mark.parametrize("name", list(CASES))
def test_the_way_back_keeps_the_published_fields(name):
    hf = CASES[name][0]
    back = hf_config_from_gpt(gpt_config_from_hf(hf), base=hf, dtype="bfloat16")
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "rope_theta", "tie_word_embeddings", "vocab_size",
                "max_position_embeddings", "bos_token_id", "eos_token_id"):
        assert back[key] == hf[key], key
    assert back["architectures"] == hf["architectures"]
    assert back["head_dim"] == hf.get("head_dim", hf["hidden_size"] // hf["num_attention_heads"])
    assert back["rope_scaling"] == hf.get("rope_scaling")
