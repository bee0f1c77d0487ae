"""``SamplingParams``: how the next token is chosen (Megatron-core's ``SamplingParams`` fields)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Sampling of generated tokens; ``validate`` checks the values (one-line ``ValueError``)."""

    temperature: float = 1.0
    """Logits are divided by it before sampling; 0 means greedy (argmax)."""
    top_k: int = 0
    """Sample among the ``top_k`` most likely tokens (0: all); 1 is greedy, as in Megatron."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of most likely tokens whose probability reaches
    ``top_p``, in (0, 1]; 1 keeps every token."""
    num_tokens_to_generate: int = 30
    """New tokens per prompt (fewer when a stop token comes first)."""
    return_log_probs: bool = False
    """Also return the log-probabilities of the prompt tokens (those of the generated tokens
    always come back): the model's own, before temperature and filtering."""
    seed: int = 0
    """The sampling seed: the same seed gives the same tokens whatever the batch or layout
    (row ``i`` at step ``t`` draws from ``fold_in(fold_in(key(seed), t), i)``)."""

    @property
    def greedy(self) -> bool:
        """Whether the next token is the argmax (``temperature`` 0 or ``top_k`` 1)."""
        return self.temperature == 0 or self.top_k == 1

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ``ValueError`` naming the first value out of range."""
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {self.temperature}")
        if self.top_k < 0 or (vocab_size is not None and self.top_k > vocab_size):
            raise ValueError(f"top_k must be in [0, vocab size {vocab_size}] (0: no top-k), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1: no nucleus filtering), got {self.top_p}")
        if self.num_tokens_to_generate < 1:
            raise ValueError(f"num_tokens_to_generate must be >= 1, got {self.num_tokens_to_generate}")
