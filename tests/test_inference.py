"""``core.inference`` on simulated CPU devices in one process.

* KV-cache decoding (``forward_with_cache`` + ``full_vocab_logits``: a prefill of prompts of
  mixed lengths, then decode steps feeding chosen tokens) gives the logits of a full recomputation
  (``GPTModel.global_logits`` on the whole sequence) within 1e-5 (fp32) for tiny models of each
  architecture option, MoE and bf16 included, and with the GPU's ``bsnd`` attention layout.
* ``GenerationEngine``: greedy generation equals greedy recomputation token for token; a row's
  output does not depend on the other rows; tp2, tp2 x dp2 and dp4 give tp1's tokens, log-probs
  and sampled tokens; stop tokens end rows and the loop; scoring equals ``log_softmax`` of the
  recomputed logits; bad inputs raise one-line ``ValueError``\\ s.
* ``core.inference.sampling``: ``filter_logits`` against ``transformers``' warpers (ties and
  ``top_k`` 0 included), sampled frequencies against the filtered softmax, greedy = argmax.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from core import parallel_state as ps
from core.inference import GenerationEngine, SamplingParams
from core.inference.cached_forward import forward_with_cache, full_vocab_logits, layerwise_params
from core.inference.kv_cache import allocate_kv_cache
from core.inference.sampling import filter_logits, sample_tokens
from core.models.gpt import GPTConfig, GPTModel
from core.param_metadata import init_sharded_params
from core.transformer.moe import MoEConfig

VOCAB = 97
BASE = dict(vocab_size=VOCAB, num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96,
            seq_length=64, init_method_std=0.3)
LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
             num_query_groups=2)
MOE = MoEConfig(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)
VARIANTS = {
    "rope_gqa_rmsnorm_swiglu": LLAMA,
    "learned_layernorm_gelu_bias": {},  # Megatron's GPT defaults
    "qwen3_like": {**LLAMA, "qk_layernorm": True, "add_qkv_bias": True, "kv_channels": 24},
    "llama3_rope_scaling": {**LLAMA, "rope_scaling": True, "rope_scaling_factor": 8.0,
                            "rope_scaling_original_max_position_embeddings": 8},
    "untied_output": {**LLAMA, "share_embeddings_and_output_weights": False},
    "padded_vocab": {**LLAMA, "padded_vocab_size": 128},
    "moe": {**LLAMA, "moe": MOE, "moe_layer_freq": 2},
    "moe_expert_bias": {**LLAMA, "moe_layer_freq": 1, "moe": dataclasses.replace(
        MOE, moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid")},
    "bf16": {**LLAMA, "bf16": True},
}
# Prompts of mixed lengths (right-padded to PROMPT_WIDTH in the cache tests).
PROMPTS = [[5, 17, 3, 88, 41], [9, 60], [11, 2, 33, 47, 70, 8, 19, 54], [30, 31, 96]]
PROMPT_WIDTH, DECODE_STEPS = 8, 5
# fp32 logits (magnitudes up to ~10) agree within 1e-5 + 1e-5 * |logit|: the cached and the
# recomputed programs sum in different orders (observed up to ~1.1e-5 absolute). Feeding a token
# at a wrong position or reading a wrong cache slot moves logits by O(1).
ATOL, RTOL = 1e-5, 1e-5
BF16_ATOL = 0.25
"""bf16: the two programs round activations at different points (attention over the cache vs
the causal kernel); with logits up to ~11 (a bf16 ulp at 8 is 0.0625) the largest difference
observed is 0.13."""


def _one_device():
    return ps.build_parallel_state(devices=jax.devices()[:1])


def _model_and_params(config: GPTConfig, seed: int = 0):
    """``(model on one device, host params, specs)``: the init plus ``N(0, 0.1)`` on every entry (nonzero
    biases, norms away from 1), so a misplaced bias or scale shows."""
    model = GPTModel(config, _one_device())
    params, specs, _ = init_sharded_params(model.init, model.state.mesh,
                                           (jax.random.key(seed), jnp.zeros((1, 8), jnp.int32)), (P(), P()))
    rng = np.random.default_rng(seed)
    host = jax.tree.map(lambda a: (np.asarray(a) + 0.1 * rng.standard_normal(a.shape)).astype(np.float32), params)
    return model, host, specs


def _expert_bias(model: GPTModel) -> dict:
    shape = model.moe_state_shape()["expert_bias"].shape
    return {"expert_bias": np.random.default_rng(1).normal(size=shape).astype(np.float32)}


def _reference_logits(model: GPTModel, params: dict, tokens: np.ndarray, moe_state: dict | None) -> np.ndarray:
    """Float32 ``[b, s, vocab]`` logits recomputed over the whole sequences: ``global_logits``, or
    ``GPTModel.logits`` with the expert biases."""
    if moe_state is None:
        return np.asarray(model.global_logits(params, jnp.asarray(tokens)))
    _, specs, _ = init_sharded_params(model.init, model.state.mesh, (jax.random.key(0), jnp.zeros((1, 8), jnp.int32)),
                                      (P(), P()))
    run = jax.jit(jax.shard_map(lambda p, t, m: model.logits(p, t, None, m), mesh=model.state.mesh,
                                in_specs=(specs, P(), GPTModel.moe_state_spec()), out_specs=P(), check_vma=False))
    return np.asarray(run(params, jnp.asarray(tokens), moe_state))


def _cached_logits(model: GPTModel, specs, params: dict, prompts: np.ndarray, lengths: np.ndarray,
                   feed: np.ndarray, moe_state: dict | None) -> np.ndarray:
    """Float32 ``[P + K, b, vocab]``: the prefill's logits at the ``P`` prompt positions, then those of
    ``K`` decode steps, step ``t`` feeding ``feed[:, t]`` at position ``lengths + t`` (one program)."""
    b, p = prompts.shape
    k = feed.shape[1]

    def program(params, moe_state, tokens, lengths, feed):
        params = layerwise_params(model, model._cast(params), moe_state)
        cache = allocate_kv_cache(model, b, p + k, model.config.compute_dtype)
        positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
        x, cache = forward_with_cache(model, params, tokens, positions, cache, True)
        out = [full_vocab_logits(model, params, x)]
        for t in range(k):
            h, cache = forward_with_cache(model, params, feed[:, t:t + 1], (lengths + t)[:, None], cache, False)
            out.append(full_vocab_logits(model, params, h))
        return jnp.concatenate(out, axis=0)

    moe_spec = None if moe_state is None else GPTModel.moe_state_spec()
    run = jax.jit(jax.shard_map(program, mesh=model.state.mesh, in_specs=(specs, moe_spec, P(), P(), P()),
                                out_specs=P(), check_vma=False))
    return np.asarray(run(params, moe_state, jnp.asarray(prompts), jnp.asarray(lengths), jnp.asarray(feed)))


def _check_cache_equals_recomputation(model, specs, params, moe_state, atol: float) -> None:
    b = len(PROMPTS)
    lengths = np.array([len(p) for p in PROMPTS], np.int32)
    prompts = np.zeros((b, PROMPT_WIDTH), np.int32)
    feed = np.random.default_rng(2).integers(0, VOCAB, (b, DECODE_STEPS)).astype(np.int32)
    full = np.zeros((b, PROMPT_WIDTH + DECODE_STEPS), np.int32)  # each row: prompt, fed tokens, padding
    for i, p in enumerate(PROMPTS):
        prompts[i, :len(p)] = p
        full[i, :len(p) + DECODE_STEPS] = list(p) + list(feed[i])
    got = _cached_logits(model, specs, params, prompts, lengths, feed, moe_state)
    want = _reference_logits(model, params, full, moe_state)
    assert np.ptp(want) > 5.0  # not a degenerate model
    for i, n in enumerate(lengths):
        np.testing.assert_allclose(got[:n, i], want[i, :n], atol=atol, rtol=RTOL, err_msg=f"prefill, row {i}")
        for t in range(DECODE_STEPS):
            np.testing.assert_allclose(got[PROMPT_WIDTH + t, i], want[i, n + t], atol=atol, rtol=RTOL,
                                       err_msg=f"decode step {t}, row {i}")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_kv_cache_decoding_equals_recomputation(variant):
    config = GPTConfig(**BASE, **VARIANTS[variant])
    model, params, specs = _model_and_params(config)
    moe_state = _expert_bias(model) if variant == "moe_expert_bias" else None
    if config.bf16:  # bf16 params, as GenerationEngine places them; the tolerance: see BF16_ATOL
        params = jax.tree.map(lambda a: jnp.asarray(a, jnp.bfloat16), params)
    _check_cache_equals_recomputation(model, specs, params, moe_state, atol=BF16_ATOL if config.bf16 else ATOL)


def test_kv_cache_decoding_in_the_gpus_bsnd_layout(monkeypatch):
    """The GPU's q/k/v layout ([b, s, heads, d]) on the CPU: the cache is written and read through
    the layout changes of ``_cached_attention``."""
    from core.transformer import attention

    config = GPTConfig(**BASE, **VARIANTS["qwen3_like"])
    model, params, specs = _model_and_params(config)
    traced = []
    monkeypatch.setattr(attention, "preferred_layout", lambda: traced.append("bsnd") or "bsnd")
    _check_cache_equals_recomputation(model, specs, params, None, atol=ATOL)
    assert traced


# -- GenerationEngine ------------------------------------------------------------------------------
GEN_PROMPTS = [[5, 17, 3, 88, 41], [9], [11, 2, 33, 47, 70, 8, 19, 54, 61, 12, 77], [30, 31, 96]]
N_NEW = 12
GREEDY = SamplingParams(temperature=0, num_tokens_to_generate=N_NEW, return_log_probs=True)
SAMPLED = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, num_tokens_to_generate=N_NEW, seed=3)
LAYOUTS = [(2, 1), (2, 2), (1, 4)]  # (tp, dp)
REF_WIDTH = 32  # the recomputation's padded width: every prompt plus N_NEW fits


class Dense:
    """A tiny rope / GQA / SwiGLU model (vocabulary padded to 100, so tp2 splits it 50 / 50), its host
    params and one engine per ``(tp, dp)``, built when first asked for."""

    def __init__(self):
        self.config = GPTConfig(**BASE, **LLAMA, padded_vocab_size=100)
        self.model, self.params, _ = _model_and_params(self.config, seed=3)
        self._engines = {}

    def engine(self, tp: int = 1, dp: int = 1) -> GenerationEngine:
        if (tp, dp) not in self._engines:
            state = ps.build_parallel_state(tp, devices=jax.devices()[:tp * dp])
            self._engines[tp, dp] = GenerationEngine(self.config, state, self.params)
        return self._engines[tp, dp]

    def log_softmax(self, rows: list[list[int]]) -> np.ndarray:
        """``[b, REF_WIDTH, vocab]`` log-probabilities recomputed over the right-padded rows."""
        tokens = np.zeros((len(rows), REF_WIDTH), np.int32)
        for i, row in enumerate(rows):
            tokens[i, :len(row)] = row
        return np.asarray(jax.nn.log_softmax(self.model.global_logits(self.params, jnp.asarray(tokens)), axis=-1))


@pytest.fixture(scope="module")
def dense():
    return Dense()


@pytest.fixture(scope="module")
def greedy_reference(dense):
    """Greedy recomputation of ``GEN_PROMPTS`` (the whole sequence through ``global_logits`` for each
    new token): ``(tokens, log-probs, prompt log-probs)`` per row."""
    seqs = [list(p) for p in GEN_PROMPTS]
    log_probs = [[] for _ in seqs]
    for _ in range(N_NEW):
        lp = dense.log_softmax(seqs)
        for i, seq in enumerate(seqs):
            token = int(np.argmax(lp[i, len(seq) - 1]))
            log_probs[i].append(float(lp[i, len(seq) - 1, token]))
            seq.append(token)
    lp = dense.log_softmax(seqs)
    prompt_lp = [[float(lp[i, j, p[j + 1]]) for j in range(len(p) - 1)] for i, p in enumerate(GEN_PROMPTS)]
    return [seq[len(p):] for seq, p in zip(seqs, GEN_PROMPTS)], log_probs, prompt_lp


def test_greedy_generation_equals_recomputation(dense, greedy_reference):
    tokens, log_probs, prompt_lp = greedy_reference
    assert all(len(set(row)) > 4 for row in tokens), tokens  # the model does not repeat one token
    out = dense.engine().generate(GEN_PROMPTS, GREEDY)
    for i, r in enumerate(out):
        assert r.prompt_tokens == GEN_PROMPTS[i]
        assert r.tokens == tokens[i], i
        assert not r.stopped
        np.testing.assert_allclose(r.log_probs, log_probs[i], atol=1e-5, rtol=0)
        np.testing.assert_allclose(r.prompt_log_probs, prompt_lp[i], atol=1e-5, rtol=0)
    assert out[1].prompt_log_probs == []  # a one-token prompt has none


def test_a_rows_generation_does_not_depend_on_the_other_rows(dense):
    """The same prompt alone and in batches of shorter and longer prompts (17 tokens: the padded
    prompt width grows from 16 to 32): identical tokens, log-probs within 1e-5 (a program for
    another batch shape sums in another order: up to ~7e-6 observed). In one program (the same
    padded batch shape) the row's results are bit-identical whatever the other rows hold and
    wherever the row stands."""
    prompt = GEN_PROMPTS[0]
    alone = dense.engine().generate([prompt], GREEDY)[0]
    batches = [[[4], prompt, list(range(40, 57))], [prompt, [1, 2, 3, 4, 5, 6, 7, 8, 9], [90, 91], [7]],
               [[60, 61], [62], [63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74], prompt]]
    results = [dense.engine().generate(batch, GREEDY)[batch.index(prompt)] for batch in batches]
    for got in results:
        assert got.tokens == alone.tokens
        np.testing.assert_allclose(got.log_probs, alone.log_probs, atol=1e-5, rtol=0)
        np.testing.assert_allclose(got.prompt_log_probs, alone.prompt_log_probs, atol=1e-5, rtol=0)
    same_program = results[1:]
    assert same_program[0].log_probs == same_program[1].log_probs
    assert same_program[0].prompt_log_probs == same_program[1].prompt_log_probs


@pytest.mark.parametrize("tp,dp", LAYOUTS)
def test_layouts_generate_and_score_as_tp1(dense, tp, dp):
    """tp2 (the heads, KV cache and vocabulary split), tp2 x dp2 and dp4 (the rows split): greedy
    tokens and (prompt) log-probs, a sampled continuation with temperature, top-k, top-p and a seed,
    and scores equal the one-device engine's."""
    one, other = dense.engine(), dense.engine(tp, dp)
    assert other.state.tensor_model_parallel_size == tp and other.data_parallel_size == dp
    for r, e in zip(other.generate(GEN_PROMPTS, GREEDY), one.generate(GEN_PROMPTS, GREEDY)):
        assert r.tokens == e.tokens
        np.testing.assert_allclose(r.log_probs, e.log_probs, atol=1e-5, rtol=0)
        np.testing.assert_allclose(r.prompt_log_probs, e.prompt_log_probs, atol=1e-5, rtol=0)
    sampled = [r.tokens for r in one.generate(GEN_PROMPTS, SAMPLED)]
    assert [r.tokens for r in other.generate(GEN_PROMPTS, SAMPLED)] == sampled
    contexts, continuations = [[1, 2, 3], [7], [50, 51, 52, 53, 54]], [[4, 5], [8, 9, 10], [6]]
    for r, e in zip(other.score(contexts, continuations), one.score(contexts, continuations)):
        np.testing.assert_allclose(r.log_probs, e.log_probs, atol=1e-5, rtol=0)
        assert r.is_greedy == e.is_greedy


def test_sampling_follows_the_seed(dense, greedy_reference):
    engine = dense.engine()
    first = [r.tokens for r in engine.generate(GEN_PROMPTS, SAMPLED)]
    assert [r.tokens for r in engine.generate(GEN_PROMPTS, SAMPLED)] == first
    other = [r.tokens for r in engine.generate(GEN_PROMPTS, dataclasses.replace(SAMPLED, seed=4))]
    assert other != first
    assert sum(a != b for x, y in zip(first, other) for a, b in zip(x, y)) > N_NEW  # not one token
    assert first != greedy_reference[0]


def test_a_stop_token_ends_its_row(dense, greedy_reference):
    """A token that row 0 generates at step k > 1 and no other row generates: row 0 ends with it
    (``stopped``), the others run to the budget."""
    tokens, log_probs, _ = greedy_reference
    others = {t for row in tokens[1:] for t in row}
    k = next(k for k in range(2, N_NEW - 1) if tokens[0][k] not in tokens[0][:k] and tokens[0][k] not in others)
    out = dense.engine().generate(GEN_PROMPTS, GREEDY, stop_token_ids=[tokens[0][k]])
    assert out[0].tokens == tokens[0][:k + 1] and out[0].stopped
    np.testing.assert_allclose(out[0].log_probs, log_probs[0][:k + 1], atol=1e-5, rtol=0)
    for i in range(1, len(GEN_PROMPTS)):
        assert out[i].tokens == tokens[i] and not out[i].stopped


def test_the_loop_ends_when_every_row_stopped(dense, greedy_reference, monkeypatch):
    """Each row's second greedy token is a stop token: each row ends at its first stop token, and
    the decode loop runs only until the last row has stopped (its steps counted by a callback in
    the traced program)."""
    from core.inference import generation_loop

    steps = []
    real = generation_loop.forward_with_cache

    def counted(model, params, tokens, positions, cache, prefill):
        if not prefill:
            jax.debug.callback(lambda: steps.append(1))
        return real(model, params, tokens, positions, cache, prefill)

    monkeypatch.setattr(generation_loop, "forward_with_cache", counted)
    engine = GenerationEngine(dense.config, ps.build_parallel_state(devices=jax.devices()[:1]), dense.params)
    tokens = greedy_reference[0]
    engine.generate(GEN_PROMPTS, GREEDY)
    assert len(steps) == N_NEW - 1  # without stop tokens: every step
    stop = sorted({row[1] for row in tokens})
    ends = [next(j for j, t in enumerate(row) if t in stop) for row in tokens]
    assert max(ends) < N_NEW - 2
    steps.clear()
    out = engine.generate(GEN_PROMPTS, GREEDY, stop_token_ids=stop)
    assert [len(r.tokens) for r in out] == [j + 1 for j in ends]
    assert all(r.stopped for r in out) and [r.tokens for r in out] == [row[:j + 1] for row, j in zip(tokens, ends)]
    assert len(steps) == max(ends)


def test_score_equals_recomputed_log_softmax(dense, greedy_reference):
    """Mixed lengths; the first continuation is the greedy one (every ``is_greedy`` true)."""
    contexts = [GEN_PROMPTS[0], [7], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69], [3, 4]]
    continuations = [greedy_reference[0][0][:4], [8, 9, 10, 11, 12, 13], [1], [20, 21, 22]]
    out = dense.engine().score(contexts, continuations)
    lp = dense.log_softmax([list(c) + list(x) for c, x in zip(contexts, continuations)])
    for i, (c, x) in enumerate(zip(contexts, continuations)):
        positions = range(len(c) - 1, len(c) - 1 + len(x))
        want = [float(lp[i, j, t]) for j, t in zip(positions, x)]
        np.testing.assert_allclose(out[i].log_probs, want, atol=1e-5, rtol=0)
        assert out[i].is_greedy == [bool(np.argmax(lp[i, j]) == t) for j, t in zip(positions, x)]
        assert out[i].total == pytest.approx(sum(want), abs=1e-4)
    assert all(out[0].is_greedy) and not all(out[1].is_greedy)


def _one_line_value_error(call, match: str) -> None:
    with pytest.raises(ValueError, match=match) as e:
        call()
    assert "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("prompts,sampling,stop,match", [
    ([], {}, (), "no prompts given"),
    ([[1, 2], []], {}, (), "prompt 1 is empty"),
    ([[1, VOCAB]], {}, (), f"prompt 0 has token id {VOCAB} outside the vocabulary"),
    ([[1, -1]], {}, (), "prompt 0 has token id -1 outside the vocabulary"),
    ([[1] * 60], {"num_tokens_to_generate": 5}, (), "prompt 0: 65 tokens exceed the model's maximum sequence length 64"),
    ([[1]], {"top_p": 0.0}, (), r"top_p must be in \(0, 1\]"),
    ([[1]], {"top_p": 1.5}, (), r"top_p must be in \(0, 1\]"),
    ([[1]], {"temperature": -0.5}, (), "temperature must be >= 0"),
    ([[1]], {"top_k": VOCAB + 1}, (), r"top_k must be in \[0, vocab size 97\]"),
    ([[1]], {"num_tokens_to_generate": 0}, (), "num_tokens_to_generate must be >= 1"),
    ([[1]], {}, (3, VOCAB + 5), f"stop token 0 has token id {VOCAB + 5} outside the vocabulary"),
])
def test_bad_generation_inputs(dense, prompts, sampling, stop, match):
    _one_line_value_error(lambda: dense.engine().generate(prompts, SamplingParams(**sampling), stop), match)


@pytest.mark.parametrize("contexts,continuations,match", [
    ([[1]], [[2], [3]], "1 contexts but 2 continuations"),
    ([[]], [[2]], "context 0 is empty"),
    ([[1]], [[]], "continuation 0 is empty"),
    ([[1]], [[2, VOCAB]], f"continuation 0 has token id {VOCAB} outside the vocabulary"),
    ([[1] * 40], [[2] * 30], "context \\+ continuation 0: 70 tokens exceed"),
])
def test_bad_scoring_inputs(dense, contexts, continuations, match):
    _one_line_value_error(lambda: dense.engine().score(contexts, continuations), match)


def test_unsupported_layouts_are_refused(dense):
    devices = jax.devices()
    pp2 = ps.build_parallel_state(1, 2, devices=devices[:2])
    _one_line_value_error(lambda: GenerationEngine(dense.config, pp2, None), "pipeline_model_parallel_size 2 is not")
    cp2 = ps.build_parallel_state(context_parallel_size=2, devices=devices[:2])
    _one_line_value_error(lambda: GenerationEngine(dense.config, cp2, None), "context_parallel_size 2 is not")
    moe = GPTConfig(**BASE, **VARIANTS["moe"])
    tp2 = ps.build_parallel_state(2, devices=devices[:2])
    _one_line_value_error(lambda: GenerationEngine(moe, tp2, None), "MoE model decodes at tensor_model_parallel_size 1")


# -- sampling --------------------------------------------------------------------------------------
def _hf_filter(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """``transformers``' temperature, top-k and top-p warpers in ``generate``'s order (top_k 0 and
    top_p 1: that warper is not used, as ``generate`` does)."""
    torch = pytest.importorskip("torch")
    warpers = pytest.importorskip("transformers.generation.logits_process")
    scores = torch.from_numpy(logits.copy())
    ids = torch.zeros((logits.shape[0], 1), dtype=torch.long)
    scores = warpers.TemperatureLogitsWarper(temperature)(ids, scores)
    if top_k:
        scores = warpers.TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1.0:
        scores = warpers.TopPLogitsWarper(top_p)(ids, scores)
    return scores.numpy()


def _ours(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """``filter_logits`` as the engine calls it: top-k traced (0 included) when asked, top-p only below 1."""
    k = jnp.int32(top_k) if top_k or temperature == 1.3 else None  # 1.3: also pass a traced 0
    p = jnp.float32(top_p) if top_p < 1.0 else None
    return np.asarray(filter_logits(jnp.asarray(logits), jnp.float32(temperature), k, p))


FILTERS = [(t, k, p) for t in (0.7, 1.3) for k in (0, 1, 5, 50) for p in (1.0, 0.3, 0.9)]


@pytest.mark.parametrize("temperature,top_k,top_p", FILTERS)
def test_filter_logits_equals_transformers_warpers(temperature, top_k, top_p):
    logits = np.random.default_rng(0).normal(0, 2, (64, 50)).astype(np.float32)
    got, want = _ours(logits, temperature, top_k, top_p), _hf_filter(logits, temperature, top_k, top_p)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    np.testing.assert_allclose(got[np.isfinite(got)], want[np.isfinite(want)], rtol=1e-6)
    if top_k == 5:
        assert (np.isfinite(got).sum(-1) <= 5).all()


@pytest.mark.parametrize("temperature,top_k,top_p", FILTERS)
def test_filter_logits_with_ties(temperature, top_k, top_p):
    """Integer logits (many ties). Top-k keeps every token tied with the k-th, as ``transformers``
    does. Top-p keeps whole groups of tied tokens: ``transformers`` keeps the tokens of the sort
    order up to the mass ``top_p``, which may split a tied group; the groups it reaches are
    exactly the ones kept here."""
    logits = np.random.default_rng(1).integers(-3, 4, (64, 50)).astype(np.float32)
    got, want = _ours(logits, temperature, top_k, top_p), _hf_filter(logits, temperature, top_k, top_p)
    reached = np.stack([np.isin(row, row[np.isfinite(w)]) for row, w in zip(logits, want)])
    np.testing.assert_array_equal(np.isfinite(got), reached)
    np.testing.assert_allclose(got[reached], logits[reached] / np.float32(temperature), rtol=1e-6)
    if top_k == 5:
        assert (np.isfinite(got).sum(-1) > 5).any()  # ties with the 5th kept


def test_sampled_frequencies_follow_the_filtered_softmax():
    """20000 rows of the same logits (each row its own key): the token counts against the softmax
    of the filtered logits (temperature 0.8, top-k 6, top-p 0.9), a chi-square statistic below
    40 (4 degrees of freedom here: its 1e-7 tail is ~40; sampling at temperature 1, or without a
    filter, gives thousands); filtered tokens are never drawn."""
    n, row = 20000, np.array([2.0, 1.6, 1.2, 1.0, 0.5, 0.2, 0.0, -0.5, -1.0, -3.0], np.float32)
    logits = jnp.asarray(np.tile(row, (n, 1)))
    temperature, top_k, top_p = jnp.float32(0.8), jnp.int32(6), jnp.float32(0.9)
    tokens = np.asarray(sample_tokens(logits, jax.random.key(7), jnp.int32(3), jnp.arange(n, dtype=jnp.int32),
                                      greedy=False, temperature=temperature, top_k=top_k, top_p=top_p))
    probs = np.asarray(jax.nn.softmax(filter_logits(logits[:1], temperature, top_k, top_p)))[0]
    counts = np.bincount(tokens, minlength=row.size)
    kept = probs > 0
    assert kept.sum() == 5 and counts[~kept].sum() == 0
    chi2 = float(np.sum((counts[kept] - n * probs[kept]) ** 2 / (n * probs[kept])))
    assert chi2 < 40, (chi2, counts, n * probs)
    # Each row's draw depends on its index, not on the batch: rows 5..9 alone draw the same tokens.
    alone = sample_tokens(logits[:5], jax.random.key(7), jnp.int32(3), jnp.arange(5, 10, dtype=jnp.int32),
                          greedy=False, temperature=temperature, top_k=top_k, top_p=top_p)
    np.testing.assert_array_equal(np.asarray(alone), tokens[5:10])


def test_greedy_is_the_argmax():
    logits = np.random.default_rng(2).normal(size=(32, 50)).astype(np.float32)
    got = sample_tokens(jnp.asarray(logits), jax.random.key(0), jnp.int32(0), jnp.arange(32), greedy=True,
                        temperature=jnp.float32(1.0))
    np.testing.assert_array_equal(np.asarray(got), logits.argmax(-1))
    assert SamplingParams(temperature=0).greedy and SamplingParams(top_k=1).greedy
    assert not SamplingParams(temperature=0.5, top_k=2).greedy
