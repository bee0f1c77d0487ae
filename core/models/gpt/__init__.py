"""A GPT model split over tensor, sequence and pipeline parallelism (Megatron's ``GPTModel``)."""

from core.models.gpt.gpt_config import GPTConfig
from core.models.gpt.gpt_model import GPTModel

__all__ = ["GPTConfig", "GPTModel"]
