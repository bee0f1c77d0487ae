"""``GenerationEngine``: batched generation and scoring for one ``GPTModel`` in an inference
layout, from the host (every process calls it with the same arguments, as with any collective).

The model's heads and KV cache are split over tensor parallelism; data-parallel replicas take
different rows of the batch. Pipeline and context parallelism are refused (one stage must hold
every layer and the whole sequence). Each call compiles once per shape bucket (batch, prompt
length and new tokens rounded up to powers of two) and sampling mode; the temperature, top-k,
top-p, seed and stop tokens are values of the compiled program.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from core.inference.cached_forward import forward, layerwise_params, vocab_logits, vocab_parallel_log_probs
from core.inference.generation_loop import LoopShape, generate_local
from core.inference.sampling_params import SamplingParams
from core.models.gpt.gpt_config import GPTConfig
from core.models.gpt.gpt_model import GPTModel
from core.parallel_state import ParallelState
from core.param_metadata import abstract_boxed_params, param_info_tree

STOP_ID_SLOTS = 8
"""Stop tokens are passed padded to a power of two of at least this many ids (fewer recompiles)."""


@dataclasses.dataclass
class GenerationResult:
    """One prompt's generation."""

    prompt_tokens: list[int]
    """The prompt's token ids."""
    tokens: list[int]
    """The generated token ids, up to and including the first stop token."""
    log_probs: list[float]
    """Each generated token's log-probability under the model (before temperature and filters)."""
    prompt_log_probs: list[float] | None = None
    """With ``return_log_probs``: token ``j + 1``'s log-probability given the prompt before it,
    for ``j = 0 .. len(prompt) - 2``."""
    stopped: bool = False
    """Whether generation ended on a stop token (else on the token budget)."""


@dataclasses.dataclass
class ScoreResult:
    """One continuation's score after its context (lm-eval-harness's ``loglikelihood``)."""

    log_probs: list[float]
    """Each continuation token's log-probability given everything before it."""
    is_greedy: list[bool]
    """Whether each continuation token is the model's most likely next token."""

    @property
    def total(self) -> float:
        """The continuation's log-likelihood (the sum)."""
        return float(sum(self.log_probs))


def inference_config(config: GPTConfig) -> GPTConfig:
    """``config`` as inference runs it: no sequence parallelism (a decode step has one token per
    row), no recompute, and the linear layers in the compute dtype (an FP8-trained model decodes
    without FP8 GEMMs, which would need its training scales); the parameters are the same."""
    return dataclasses.replace(config, sequence_parallel=False, recompute_granularity=None, fp8=None)


def _to_host(array: jax.Array) -> np.ndarray:
    """A global result on every calling process: read directly when this process holds all of it
    (an engine on this process's devices alone, e.g. one process's reference in a multi-process
    job, whose peers do not take part), else gathered from the processes."""
    if array.is_fully_addressable:
        return np.asarray(array)
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def _bucket(n: int, smallest: int) -> int:
    """``n`` rounded up to a power of two, at least ``smallest``."""
    return max(smallest, 1 << max(0, n - 1).bit_length())


class GenerationEngine:
    """Generation (:meth:`generate`) and scoring (:meth:`score`) of token ids.

    ``params``: the model's global parameters (any sharding on the state's devices, or host
    arrays), placed once in the inference layout in the compute dtype (bf16 models decode in
    bf16). ``moe_state``: a MoE model's expert biases (``GPTModel.moe_state_shape``), when it has
    them. ``max_sequence_length``: the longest prompt plus generation (default the config's
    ``seq_length``)::

        engine = GenerationEngine(config, ps.build_parallel_state(tp, devices=jax.devices()[:tp]), params)
        out = engine.generate([[1, 5, 9], [7]], SamplingParams(temperature=0, num_tokens_to_generate=16))
    """

    def __init__(self, config: GPTConfig, state: ParallelState, params: Any, moe_state: dict | None = None,
                 max_sequence_length: int | None = None):
        if state.pipeline_model_parallel_size > 1 or (state.virtual_pipeline_model_parallel_size or 1) > 1:
            raise ValueError(f"inference runs every layer on one stage: pipeline_model_parallel_size "
                             f"{state.pipeline_model_parallel_size} is not supported (use 1; split the model with "
                             "tensor parallelism)")
        if state.context_parallel_size > 1 or config.context_parallel_size > 1:
            cp = max(state.context_parallel_size, config.context_parallel_size)
            raise ValueError(f"inference runs the whole sequence on one rank: context_parallel_size {cp} is not "
                             "supported (use 1)")
        if config.moe is not None and state.tensor_model_parallel_size > 1:
            raise ValueError(f"a MoE model decodes at tensor_model_parallel_size 1 (its experts are not split over tp; "
                             f"got {state.tensor_model_parallel_size}): serve it with data or expert parallelism")
        self.config = inference_config(config)
        self.state = state
        self.model = GPTModel(self.config, state)
        self.max_sequence_length = max_sequence_length or self.config.seq_length
        self.data_parallel_size = state.data_parallel_size
        stacked_specs = self._param_specs()
        if moe_state is not None:
            stacked_specs, params = {**stacked_specs, "moe_state": GPTModel.moe_state_spec()}, {**params,
                                                                                                "moe_state": moe_state}
        self._specs = self._layerwise(stacked_specs, lambda spec, i: P(*tuple(spec)[2:]))
        self.params = self._place(params, stacked_specs)
        """The parameters in the inference layout and compute dtype, the layers' as one tree of
        flax variables per layer (``cached_forward.layerwise_params``; a MoE layer's with its
        expert bias)."""
        self._programs: dict = {}

    # -- placement --------------------------------------------------------------------------
    def _param_specs(self) -> Any:
        sample = jax.ShapeDtypeStruct((1, 8), jnp.int32)
        boxed = abstract_boxed_params(self.model.init, self.state.mesh, (jax.random.key(0), sample), (P(), P()))
        return jax.tree.map(lambda info: info.partition_spec, param_info_tree(boxed))

    def _layerwise(self, stacked: dict, take: Callable[[Any, int], Any], is_leaf: Any = None) -> dict:
        """``stacked`` (params, with ``"moe_state"`` when given) in :func:`layerwise_params`' form,
        ``take(leaf, i)`` giving layer ``i`` of a stacked leaf (a spec, or a list of arrays)."""
        params = {k: v for k, v in stacked.items() if k != "moe_state"}
        return layerwise_params(self.model, params, stacked.get("moe_state"), take, is_leaf)

    def _place(self, tree: dict, stacked_specs: dict) -> dict:
        """``tree`` (stacked params, and ``"moe_state"`` when given; jax arrays of any sharding on
        any devices, or host arrays) in the inference layout: floating parameters in the compute
        dtype, each stacked leaf split into one array per layer right after it is placed (the peak
        is one leaf's second copy; the engine then holds one copy of the weights)."""
        dtype = self.config.compute_dtype

        def one(leaf: Any, spec: P, cast: bool, stacked: bool) -> Any:
            sharding = NamedSharding(self.state.mesh, spec)
            to_cast = cast and jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.dtype != dtype
            if not isinstance(leaf, jax.Array):
                placed = self._global(np.asarray(leaf).astype(dtype) if to_cast else np.asarray(leaf), spec)
            else:
                placed = jax.device_put(leaf, sharding)
            if not stacked:
                return jax.jit(lambda a: a.astype(dtype), out_shardings=sharding)(placed) if to_cast else placed
            n = placed.shape[1]
            layer = NamedSharding(self.state.mesh, P(*tuple(spec)[2:]))
            split = lambda a: [a[0, i].astype(dtype) if to_cast else a[0, i] for i in range(n)]  # noqa: E731
            return jax.jit(split, out_shardings=[layer] * n)(placed)

        params = {k: v for k, v in tree.items() if k != "moe_state"}
        placed = {k: jax.tree.map(lambda a, s, k=k: one(a, s, True, k == "layers"), v, stacked_specs[k])
                  for k, v in params.items()}
        if "moe_state" in tree:
            placed["moe_state"] = jax.tree.map(lambda a, s: one(a, s, False, True), tree["moe_state"],
                                               stacked_specs["moe_state"])
        return self._layerwise(placed, lambda pieces, i: pieces[i], is_leaf=lambda x: isinstance(x, list))

    def _global(self, array: np.ndarray, spec: P) -> jax.Array:
        sharding = NamedSharding(self.state.mesh, spec)
        return jax.make_array_from_callback(array.shape, sharding, lambda idx: array[idx])

    @property
    def _dp(self) -> tuple[str, ...]:
        return self.state.data_parallel_axis_name

    # -- checks -----------------------------------------------------------------------------
    def _check_tokens(self, what: str, rows: Sequence[Sequence[int]], allow_empty: bool = False) -> None:
        if not rows:
            raise ValueError(f"no {what}s given")
        vocab = self.config.vocab_size
        for i, row in enumerate(rows):
            if not allow_empty and len(row) == 0:
                raise ValueError(f"{what} {i} is empty")
            bad = [t for t in row if not 0 <= int(t) < vocab]
            if bad:
                raise ValueError(f"{what} {i} has token id {bad[0]} outside the vocabulary (0..{vocab - 1})")

    def _check_length(self, what: str, i: int, length: int) -> None:
        if length > self.max_sequence_length:
            raise ValueError(f"{what} {i}: {length} tokens exceed the model's maximum sequence length "
                             f"{self.max_sequence_length}")

    def _pad_rows(self, n: int) -> int:
        """Rows per call: ``n`` padded to a power of two per data-parallel rank."""
        return self.data_parallel_size * _bucket(-(-n // self.data_parallel_size), 1)

    # -- generation -------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams | None = None,
                 stop_token_ids: Sequence[int] = ()) -> list[GenerationResult]:
        """Continue each prompt (token ids, lengths may differ) by up to
        ``sampling.num_tokens_to_generate`` tokens (default :class:`SamplingParams`), stopping a
        row at its first token in ``stop_token_ids`` (e.g. the tokenizer's end of document).
        ``ValueError`` with one line for an empty prompt, an id outside the vocabulary, a prompt
        plus generation longer than :attr:`max_sequence_length`, or a sampling value out of range."""
        sampling = sampling or SamplingParams()
        sampling.validate(self.config.vocab_size)
        self._check_tokens("prompt", prompts)
        self._check_tokens("stop token", [list(stop_token_ids)], allow_empty=True)
        n_new = sampling.num_tokens_to_generate
        for i, prompt in enumerate(prompts):
            self._check_length("prompt", i, len(prompt) + n_new)
        rows = self._pad_rows(len(prompts))
        longest = max(len(p) for p in prompts)
        width = min(_bucket(longest, 16), self.max_sequence_length)
        tokens = np.zeros((rows, width), np.int32)
        lengths = np.ones((rows,), np.int32)
        for i, prompt in enumerate(prompts):
            tokens[i, :len(prompt)] = prompt
            lengths[i] = len(prompt)
        stop = np.full((_bucket(max(1, len(stop_token_ids)), STOP_ID_SLOTS),), -1, np.int32)
        stop[:len(stop_token_ids)] = list(stop_token_ids)
        shape = LoopShape(greedy=sampling.greedy, top_k=not sampling.greedy and sampling.top_k > 0,
                          top_p=not sampling.greedy and sampling.top_p < 1.0,
                          prompt_log_probs=sampling.return_log_probs, new_tokens=_bucket(n_new, 16))
        values = {"temperature": np.float32(sampling.temperature or 1.0), "top_k": np.int32(sampling.top_k),
                  "top_p": np.float32(sampling.top_p), "seed": np.uint32(sampling.seed)}
        dp = P(self._dp)
        out = self._generation_program(shape)(
            self.params, self._global(tokens, dp), self._global(lengths, dp),
            self._global(np.arange(rows, dtype=np.int32), dp), stop, np.int32(n_new), values)
        out = {k: _to_host(v) for k, v in out.items()}
        return [self._result(out, i, list(prompt), set(stop_token_ids)) for i, prompt in enumerate(prompts)]

    @staticmethod
    def _result(out: dict, i: int, prompt: list[int], stop: set[int]) -> GenerationResult:
        n = int(out["lengths"][i])
        tokens = [int(t) for t in out["tokens"][i, :n]]
        prompt_lp = None
        if "prompt_log_probs" in out:
            prompt_lp = [float(x) for x in out["prompt_log_probs"][i, :len(prompt) - 1]]
        return GenerationResult(prompt, tokens, [float(x) for x in out["log_probs"][i, :n]], prompt_lp,
                                stopped=bool(tokens) and tokens[-1] in stop)

    def _generation_program(self, shape: LoopShape) -> Any:
        if shape not in self._programs:
            dp = P(self._dp)
            out_specs = {"tokens": dp, "log_probs": dp, "lengths": dp}
            if shape.prompt_log_probs:
                out_specs["prompt_log_probs"] = dp

            def program(params, tokens, lengths, rows, stop, n_new, values):
                sampling = {**values, "key": jax.random.key(values["seed"])}
                return generate_local(self.model, shape, params, tokens, lengths, rows, stop, n_new, sampling)

            self._programs[shape] = jax.jit(jax.shard_map(
                program, mesh=self.state.mesh, in_specs=(self._specs, dp, dp, dp, P(), P(), P()),
                out_specs=out_specs, check_vma=False))
        return self._programs[shape]

    # -- scoring ----------------------------------------------------------------------------
    def score(self, contexts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]]) -> list[ScoreResult]:
        """Per-token log-probabilities of each continuation after its context (both token ids;
        lm-eval-harness's ``loglikelihood``), and whether each token is the greedy choice.
        ``ValueError`` with one line for an empty context or continuation, mismatched counts, ids
        outside the vocabulary or a pair longer than :attr:`max_sequence_length`."""
        if len(contexts) != len(continuations):
            raise ValueError(f"{len(contexts)} contexts but {len(continuations)} continuations")
        self._check_tokens("context", contexts)
        self._check_tokens("continuation", continuations)
        pairs = [list(c) + list(x) for c, x in zip(contexts, continuations)]
        for i, pair in enumerate(pairs):
            self._check_length("context + continuation", i, len(pair))
        rows = self._pad_rows(len(pairs))
        width = min(_bucket(max(len(p) for p in pairs), 16), self.max_sequence_length)
        tokens = np.zeros((rows, width), np.int32)
        for i, pair in enumerate(pairs):
            tokens[i, :len(pair)] = pair
        log_probs, greedy = (_to_host(v) for v in
                             self._scoring_program(self.params, self._global(tokens, P(self._dp))))
        results = []
        for i, (context, continuation) in enumerate(zip(contexts, continuations)):
            span = slice(len(context) - 1, len(context) - 1 + len(continuation))  # entry j predicts token j + 1
            results.append(ScoreResult([float(x) for x in log_probs[i, span]], [bool(g) for g in greedy[i, span]]))
        return results

    @functools.cached_property
    def _scoring_program(self) -> Any:
        dp = P(self._dp)

        def program(params, tokens):
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
            x = forward(self.model, params, tokens, positions)
            logits = vocab_logits(self.model, params, x[:-1])  # [s - 1, b, V/tp]
            log_probs, greedy = vocab_parallel_log_probs(self.model, logits, tokens[:, 1:].T)
            return log_probs.T, greedy.T

        return jax.jit(jax.shard_map(program, mesh=self.state.mesh, in_specs=(self._specs, dp),
                                     out_specs=(dp, dp), check_vma=False))


__all__ = ["GenerationEngine", "GenerationResult", "ScoreResult", "inference_config"]
