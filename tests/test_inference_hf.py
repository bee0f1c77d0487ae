"""``GenerationEngine`` on imported Hugging Face models against ``transformers``: tiny random Llama
(Llama 3.1 rope scaling), Mistral, Qwen2 (tied embeddings, qkv bias) and Qwen3 (qk-norm) models
(``hf_weights.tiny_hf_families`` at 2 layers), randomized (``hf_weights.randomize``),
imported with ``import_hf_model``.

* Greedy generation of 32 new tokens for a batch of prompts of mixed lengths equals
  ``transformers``' ``model.generate(do_sample=False)`` token for token: one HF ``generate`` call
  for the batch, left-padded with an ``attention_mask`` (HF then derives the positions from the
  mask), with the generation config's ``eos_token_id`` unset so that no row stops early.
* Scoring equals the log-softmax of ``transformers``' logits at the continuation positions
  within 1e-4.

Skipped without ``transformers`` and ``torch``.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_weights import TINY_HF_COMMON, checkpoint_params, randomize, tiny_hf_families  # noqa: E402

from core import parallel_state as ps  # noqa: E402
from core.inference import GenerationEngine, SamplingParams  # noqa: E402
from core.models.huggingface import import_hf_model  # noqa: E402
from core.models.huggingface.conversion import checkpoint_model_config  # noqa: E402

N_NEW = 32
COMMON = {**TINY_HF_COMMON, "num_hidden_layers": 2}
FAMILIES = tiny_hf_families()
PROMPTS = [[5, 17, 3], [9, 60, 44, 12, 71, 38, 2], [11, 2, 33, 47, 70, 8, 19, 54, 61, 12, 77, 90], [30]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """``{family: (transformers model, GenerationEngine on one device)}``."""
    out = {}
    for family, (config_class, extra) in FAMILIES.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config_class(**{**COMMON, **extra}))
        randomize(model, seed=0, std=0.15)
        model.eval()
        model.generation_config.eos_token_id = None  # never stop early
        model.generation_config.pad_token_id = 0
        root = tmp_path_factory.mktemp(family)
        hf_dir, ckpt = str(root / "hf"), str(root / "ckpt")
        model.save_pretrained(hf_dir)
        import_hf_model(hf_dir, ckpt)
        config, _ = checkpoint_model_config(ckpt)
        engine = GenerationEngine(config, ps.build_parallel_state(devices=jax.devices()[:1]), checkpoint_params(ckpt))
        out[family] = (model, engine)
    return out


def _hf_greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    """One ``generate`` call for the batch, left-padded (pad id 0, masked out)."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=N_NEW, min_new_tokens=0)
    assert out.shape == (len(prompts), width + N_NEW)
    return out[:, width:].tolist()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generation_equals_transformers_generate(models, family):
    model, engine = models[family]
    want = _hf_greedy(model, PROMPTS)
    got = engine.generate(PROMPTS, SamplingParams(temperature=0, num_tokens_to_generate=N_NEW))
    assert all(len(set(row)) >= 5 for row in want), want  # 6 to 25 distinct tokens per row: no short loop
    for i, r in enumerate(got):
        assert r.tokens == want[i], (i, r.tokens, want[i])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_scores_equal_transformers_log_probs(models, family):
    model, engine = models[family]
    contexts = [[5, 17, 3], [9], [11, 2, 33, 47, 70, 8, 19, 54, 61, 12]]
    continuations = [[40, 41, 42, 43], [60, 44, 12, 71, 38, 2], [77]]
    got = engine.score(contexts, continuations)
    for i, (c, x) in enumerate(zip(contexts, continuations)):
        with torch.no_grad():
            logits = model(torch.tensor([c + x])).logits[0].double()
        log_probs = torch.log_softmax(logits, dim=-1).numpy()
        positions = range(len(c) - 1, len(c) - 1 + len(x))
        want = [log_probs[j, t] for j, t in zip(positions, x)]
        np.testing.assert_allclose(got[i].log_probs, want, atol=1e-4, rtol=0)
        assert got[i].is_greedy == [bool(np.argmax(log_probs[j]) == t) for j, t in zip(positions, x)]
