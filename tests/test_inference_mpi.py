"""``GenerationEngine`` in 8 real processes (one device each): a tp2 x dp4 engine over all 8
devices (each tensor-parallel pair spans two processes: the heads, the KV cache and the
vocabulary's gather and log-prob reductions cross processes; the data-parallel ranks hold
different rows and agree on the loop's exit) gives the one-device engine's greedy tokens, their
log-probs and the prompt's (within 1e-5), the same sampled tokens (temperature, top-k, top-p,
seed) and the same scores (within 1e-5).

The one-device reference runs on rank 0 only and is sent to the others, which wait sleeping
(:func:`mpi_helpers.from_rank_0`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from mpi_helpers import from_rank_0

from core import parallel_state as ps
from core.inference import GenerationEngine, SamplingParams
from core.models.gpt import GPTConfig, GPTModel
from core.param_metadata import init_sharded_params

pytestmark = pytest.mark.mpi(min_size=8)

CONFIG = GPTConfig(vocab_size=97, padded_vocab_size=100, num_layers=2, hidden_size=64, num_attention_heads=4,
                   num_query_groups=2, ffn_hidden_size=96, seq_length=64, init_method_std=0.3,
                   position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False)
PROMPTS = [[5, 17, 3, 88, 41], [9], [11, 2, 33, 47, 70, 8, 19, 54, 61, 12, 77], [30, 31, 96], [4, 4, 8], [63, 1]]
GREEDY = SamplingParams(temperature=0, num_tokens_to_generate=12, return_log_probs=True)
SAMPLED = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, num_tokens_to_generate=12, seed=3)
CONTEXTS, CONTINUATIONS = [[1, 2, 3], [7], [50, 51, 52, 53, 54]], [[4, 5], [8, 9, 10], [6]]


def _host_params() -> dict:
    """The same host params on every process (initialised on the local device, plus seeded noise)."""
    model = GPTModel(CONFIG, ps.build_parallel_state(devices=[jax.local_devices()[0]]))
    params, _, _ = init_sharded_params(model.init, model.state.mesh,
                                       (jax.random.key(3), jnp.zeros((1, 8), jnp.int32)), (P(), P()))
    rng = np.random.default_rng(3)
    return jax.tree.map(lambda a: (np.asarray(a) + 0.1 * rng.standard_normal(a.shape)).astype(np.float32), params)


def _results(engine: GenerationEngine) -> dict:
    greedy = engine.generate(PROMPTS, GREEDY)
    scores = engine.score(CONTEXTS, CONTINUATIONS)
    return {"tokens": [r.tokens for r in greedy], "log_probs": [r.log_probs for r in greedy],
            "prompt_log_probs": [r.prompt_log_probs for r in greedy],
            "sampled": [r.tokens for r in engine.generate(PROMPTS, SAMPLED)],
            "scores": [s.log_probs for s in scores], "is_greedy": [s.is_greedy for s in scores]}


def test_tp2_dp4_across_processes_generates_and_scores_as_one_device():
    params = _host_params()
    want = from_rank_0(lambda: _results(GenerationEngine(
        CONFIG, ps.build_parallel_state(devices=[jax.local_devices()[0]]), params)))
    engine = GenerationEngine(CONFIG, ps.build_parallel_state(2, devices=jax.devices()), params)
    assert engine.state.tensor_model_parallel_size == 2 and engine.data_parallel_size == 4
    got = _results(engine)
    assert all(len(set(row)) > 4 for row in want["tokens"])  # not a degenerate model
    assert got["tokens"] == want["tokens"]
    assert got["sampled"] == want["sampled"]
    assert got["is_greedy"] == want["is_greedy"]
    for key in ("log_probs", "prompt_log_probs", "scores"):
        for i, (a, e) in enumerate(zip(got[key], want[key], strict=True)):
            np.testing.assert_allclose(a, e, atol=1e-5, rtol=0, err_msg=f"{key} {i}")
