"""Text in, text out over :class:`~core.inference.GenerationEngine` and a Megatron tokenizer
(what ``launch/generate.py`` and the REST server share).

A request goes through three steps, so that a multi-process job can split them: :func:`prepare`
(rank 0: validate, tokenize, resolve the stop tokens; :class:`TextGenerationError` with one
line), :func:`execute` (every rank, with the same :class:`PreparedRequest`: the collective) and
:func:`text_results` (rank 0: detokenize). :func:`megatron_response` writes the results as
Megatron's server answers (``text``, ``segments``, ``logprobs``).

Megatron's conventions: ``add_BOS`` prepends the tokenizer's BOS token (its end-of-document
token where it has no BOS, as Megatron's ``tokenize_prompts`` does); ``tokens_to_generate`` 0
only scores the prompt (its log-probabilities); a ``top_p`` of 0 means no nucleus filtering;
``text`` is the prompt and its continuation, ``segments`` the text of each token, ``logprobs``
the log-probability of every token after the first.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

from core.data.tokenizers import MegatronTokenizer
from core.inference.sampling_params import SamplingParams


class TextGenerationError(ValueError):
    """A request that cannot be served (one line)."""


@dataclasses.dataclass
class PreparedRequest:
    """A validated request in token ids: what every rank runs."""

    prompts: list[str]
    """The prompts' texts."""
    prompt_tokens: list[list[int]]
    """Each prompt's ids (with the BOS token under ``add_BOS``)."""
    sampling: SamplingParams | None
    """How to sample; None when ``tokens_to_generate`` is 0 (the prompts are only scored)."""
    stop_token_ids: list[int]
    """Generation of a row ends at its first of these (included in the output)."""
    logprobs: bool = False
    """Whether the answer carries log-probabilities (the prompt's included)."""


@dataclasses.dataclass
class TextResult:
    """One prompt's generation as text."""

    prompt: str
    """The prompt's text."""
    prompt_tokens: list[int]
    """The prompt's ids (BOS included)."""
    tokens: list[int]
    """The generated ids (the stop token included when one ended the row)."""
    text: str
    """The generated text (the continuation only)."""
    full_text: str
    """Megatron's ``text``: the prompt's ids and the generated ones, detokenized together."""
    segments: list[str]
    """The text of each token of the prompt and of the generation."""
    log_probs: list[float]
    """Each generated token's log-probability."""
    prompt_log_probs: list[float] | None
    """Token ``j + 1``'s log-probability given the prompt before it (with ``logprobs``)."""
    stopped: bool
    """Whether a stop token ended the row."""


def tokenizer_bos(tokenizer: MegatronTokenizer, tokenizer_dir: str | None = None) -> int:
    """The id ``add_BOS`` prepends: the BOS token of ``tokenizer_config.json`` in
    ``tokenizer_dir`` (a Hugging Face tokenizer's), else the end-of-document id (Megatron)."""
    inner = getattr(tokenizer, "_tokenizer", None)
    if tokenizer_dir and inner is not None and hasattr(inner, "token_to_id"):
        path = os.path.join(tokenizer_dir, "tokenizer_config.json")
        try:
            with open(path) as f:
                bos = json.load(f).get("bos_token")
        except (OSError, ValueError, AttributeError):
            bos = None
        if isinstance(bos, dict):  # {"content": "<s>", ...}
            bos = bos.get("content")
        if isinstance(bos, str) and inner.token_to_id(bos) is not None:
            return int(inner.token_to_id(bos))
    return tokenizer.eod


def _plain_ids(tokenizer: MegatronTokenizer, text: str) -> list[int]:
    """``text``'s ids without the special tokens a post-processor adds."""
    with_offsets = getattr(tokenizer, "tokenize_with_offsets", None)
    return list(with_offsets(text)[0]) if with_offsets is not None else list(tokenizer.tokenize(text))


def resolve_stop_tokens(tokenizer: MegatronTokenizer, stops: Sequence[int | str], vocab_size: int) -> list[int]:
    """Stop tokens as ids: an int is an id (inside the model's vocabulary), a string a token of
    the tokenizer (a special token's name such as ``<|eot_id|>``, or text that is one token)."""
    ids = []
    inner = getattr(tokenizer, "_tokenizer", None)
    for stop in stops:
        if isinstance(stop, bool) or not isinstance(stop, int | str):
            raise TextGenerationError(f"stop token {stop!r} is neither a token id nor a token's text")
        if isinstance(stop, int):
            if not 0 <= stop < vocab_size:
                raise TextGenerationError(f"stop token {stop} is outside the vocabulary (ids 0..{vocab_size - 1})")
            ids.append(stop)
            continue
        if not stop:
            raise TextGenerationError("stop token '' is empty")
        found = inner.token_to_id(stop) if inner is not None and hasattr(inner, "token_to_id") else None
        if found is None:
            try:
                pieces = _plain_ids(tokenizer, stop)
            except ValueError:
                pieces = []
            if len(pieces) != 1:
                what = f"it is {len(pieces)} tokens" if pieces else "the tokenizer cannot encode it"
                raise TextGenerationError(f"unknown stop token {stop!r}: not a token of the tokenizer ({what})")
            found = pieces[0]
        if not 0 <= int(found) < vocab_size:
            raise TextGenerationError(f"stop token {stop!r} is id {found}, outside the model's vocabulary "
                                      f"(ids 0..{vocab_size - 1})")
        ids.append(int(found))
    return ids


def tokenize_prompts(tokenizer: MegatronTokenizer, prompts: Sequence[str], add_bos: bool = False,
                     bos: int | None = None) -> list[list[int]]:
    """Each prompt's ids, ``bos`` (default: the end-of-document id) first under ``add_bos``
    unless the tokenizer already put it there; an empty prompt is an error."""
    bos = tokenizer.eod if bos is None else bos
    rows = []
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str):
            raise TextGenerationError(f"prompt {i} is a {type(prompt).__name__}, not a string")
        if not prompt:
            raise TextGenerationError(f"prompt {i} is empty")
        try:
            ids = [int(t) for t in tokenizer.tokenize(prompt)]
        except ValueError as e:
            raise TextGenerationError(f"prompt {i}: the tokenizer cannot encode it ({e})") from None
        if add_bos and (not ids or ids[0] != bos):
            ids = [bos] + ids
        if not ids:
            raise TextGenerationError(f"prompt {i} has no tokens")
        rows.append(ids)
    return rows


def check_lengths(prompt_tokens: Sequence[Sequence[int]], tokens_to_generate: int, max_length: int,
                  vocab_size: int) -> None:
    """Every prompt plus the tokens to generate fits the model's maximum sequence length, and
    every id is inside the model's vocabulary."""
    for i, ids in enumerate(prompt_tokens):
        if len(ids) + tokens_to_generate > max_length:
            raise TextGenerationError(
                f"prompt {i} is too long: {len(ids)} tokens + {tokens_to_generate} to generate exceed the model's "
                f"maximum sequence length {max_length}")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise TextGenerationError(f"prompt {i} has token id {bad[0]}, outside the model's vocabulary "
                                      f"(ids 0..{vocab_size - 1}): use the tokenizer the model was trained with")


def sampling_params(tokens_to_generate: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 0.0,
                    seed: int = 0, logprobs: bool = False, vocab_size: int | None = None) -> SamplingParams:
    """:class:`SamplingParams` from Megatron's values (``top_p`` 0: no nucleus filtering),
    checked; :class:`TextGenerationError` names the value out of range."""
    if not 0.0 <= top_p <= 1.0:
        raise TextGenerationError(f"top_p must be in [0, 1] (0: no nucleus filtering), got {top_p}")
    if not temperature >= 0.0:
        raise TextGenerationError(f"temperature must be >= 0 (0: greedy), got {temperature}")
    if top_k < 0:
        raise TextGenerationError(f"top_k must be >= 0 (0: no top-k), got {top_k}")
    if seed < 0:
        raise TextGenerationError(f"random_seed must be >= 0, got {seed}")
    params = SamplingParams(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p) or 1.0,
                            num_tokens_to_generate=int(tokens_to_generate), return_log_probs=logprobs,
                            seed=int(seed) % 2**32)
    try:
        params.validate(vocab_size)
    except ValueError as e:
        raise TextGenerationError(str(e)) from None
    return params


def prepare(tokenizer: MegatronTokenizer, prompts: Sequence[str], *, tokens_to_generate: int, max_length: int,
            vocab_size: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 0.0, seed: int = 0,
            logprobs: bool = False, add_bos: bool = False, bos: int | None = None,
            stop_tokens: Sequence[int | str] = (), default_stop: Sequence[int] = ()) -> PreparedRequest:
    """A :class:`PreparedRequest`, or :class:`TextGenerationError` naming the first problem.
    The stop tokens are ``default_stop`` and the resolved ``stop_tokens``."""
    if not prompts:
        raise TextGenerationError("no prompts given")
    if tokens_to_generate < 0:
        raise TextGenerationError(f"tokens_to_generate must be >= 0, got {tokens_to_generate}")
    sampling = None
    if tokens_to_generate > 0:
        sampling = sampling_params(tokens_to_generate, temperature, top_k, top_p, seed, logprobs, vocab_size)
    stops = list(dict.fromkeys(list(default_stop) + resolve_stop_tokens(tokenizer, stop_tokens, vocab_size)))
    rows = tokenize_prompts(tokenizer, prompts, add_bos, bos)
    check_lengths(rows, tokens_to_generate, max_length, vocab_size)
    return PreparedRequest(list(prompts), rows, sampling, stops, logprobs)


def execute(engine: Any, request: PreparedRequest) -> list[Any]:
    """The engine's :class:`~core.inference.GenerationResult` per prompt (a collective: every
    rank calls it with the same request). Without tokens to generate the prompts are scored."""
    from core.inference.engine import GenerationResult

    if request.sampling is not None:
        return engine.generate(request.prompt_tokens, request.sampling, request.stop_token_ids)
    scored_rows = [i for i, ids in enumerate(request.prompt_tokens) if len(ids) > 1]
    scores = {}
    if scored_rows:
        rows = [request.prompt_tokens[i] for i in scored_rows]
        for i, score in zip(scored_rows, engine.score([r[:1] for r in rows], [r[1:] for r in rows])):
            scores[i] = score.log_probs
    return [GenerationResult(list(ids), [], [], scores.get(i, []), False)
            for i, ids in enumerate(request.prompt_tokens)]


def text_results(tokenizer: MegatronTokenizer, request: PreparedRequest, results: Sequence[Any]) -> list[TextResult]:
    """The engine's results as text."""
    out = []
    for prompt, ids, result in zip(request.prompts, request.prompt_tokens, results):
        every = list(ids) + list(result.tokens)
        out.append(TextResult(
            prompt=prompt, prompt_tokens=list(ids), tokens=list(result.tokens),
            text=tokenizer.detokenize(result.tokens) if result.tokens else "",
            full_text=tokenizer.detokenize(every), segments=[tokenizer.detokenize([t]) for t in every],
            log_probs=list(result.log_probs), prompt_log_probs=result.prompt_log_probs, stopped=result.stopped))
    return out


def megatron_response(results: Sequence[TextResult], logprobs: bool) -> dict:
    """Megatron's answer: ``{"text": [...], "segments": [[...]], "logprobs": [[...]] or None}``."""
    response: dict[str, Any] = {"text": [r.full_text for r in results], "segments": [r.segments for r in results],
                                "logprobs": None}
    if logprobs:
        response["logprobs"] = [list(r.prompt_log_probs or []) + list(r.log_probs) for r in results]
    return response


__all__ = ["PreparedRequest", "TextGenerationError", "TextResult", "check_lengths", "execute", "megatron_response",
           "prepare", "resolve_stop_tokens", "sampling_params", "text_results", "tokenize_prompts", "tokenizer_bos"]
