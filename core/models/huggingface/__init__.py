"""Hugging Face models in and out: ``config.json`` <-> ``GPTConfig`` (:mod:`.config_mapping`),
tensor names and layouts (:mod:`.weight_mapping`), safetensors files (:mod:`.safetensors_files`)
and whole-model conversion (:mod:`.conversion`, behind ``tools/checkpoint/convert.py``).
Families: Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5, Qwen3 (``docs/huggingface.md``)."""

from core.models.huggingface.config_mapping import FAMILIES, HFConversionError, gpt_config_from_hf, hf_config_from_gpt
from core.models.huggingface.conversion import checkpoint_model_config, export_hf_model, import_hf_model

__all__ = ["FAMILIES", "HFConversionError", "checkpoint_model_config", "export_hf_model", "gpt_config_from_hf",
           "hf_config_from_gpt", "import_hf_model"]
