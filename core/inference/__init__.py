"""Inference: generation with a KV cache and scoring for ``GPTModel`` (``docs/inference.md``).

* :mod:`~core.inference.sampling_params`: ``SamplingParams`` (temperature, top-k, top-p, seed);
* :mod:`~core.inference.sampling`: the next token from logits;
* :mod:`~core.inference.kv_cache`: the per-layer key/value buffers;
* :mod:`~core.inference.cached_forward`: prefill and decode steps through the model's layers;
* :mod:`~core.inference.generation_loop`: one generation call as one compiled program;
* :mod:`~core.inference.engine`: ``GenerationEngine`` (batched generation and scoring, tp and dp).
* :mod:`~core.inference.model_loading`: a checkpoint or a Hugging Face directory into an inference layout;
* :mod:`~core.inference.text_generation`: text in, text out (tokenize, stop tokens, detokenize);
* :mod:`~core.inference.text_generation_server`: Megatron's REST interface (``PUT /api``);
* :mod:`~core.inference.arguments`: ``launch/generate.py``'s flags.
"""

from core.inference.engine import GenerationEngine, GenerationResult, ScoreResult, inference_config
from core.inference.sampling_params import SamplingParams

__all__ = ["GenerationEngine", "GenerationResult", "SamplingParams", "ScoreResult", "inference_config"]
