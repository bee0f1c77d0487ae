"""``launch/generate.py``'s flags (Megatron's names where Megatron has them) and their checks
before JAX starts (one-line :class:`~core.training.flags.ArgumentError`)."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence

from core.training.flags import ArgumentError, OneLineErrorParser, add_tokenizer_flags


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (``--help`` lists every flag)."""
    p = OneLineErrorParser(
        description="Generate text from a checkpoint of this package or a Hugging Face model directory, or serve "
                    "Megatron's REST interface (--server PORT).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--load", required=True,
                   help="a checkpoint directory (launch/pretrain.py --save, tools/checkpoint/convert.py) or a Hugging "
                        "Face model directory (config.json and safetensors weights)")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="accepted for Megatron's command lines: the model always comes from --load")
    g.add_argument("--ckpt-step", type=int, default=None,
                   help="load this checkpoint step (default: the newest intact one)")
    g.add_argument("--bf16", action="store_true", help="decode in bfloat16 (parameters cast when loaded)")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="tensor-parallel size; data parallelism takes the rest of the devices")
    g = p.add_argument_group("tokenizer")
    add_tokenizer_flags(g, None, "default: HuggingFaceTokenizer from --load for a Hugging Face directory with a "
                                 "tokenizer.json, else ByteLevel")
    g = p.add_argument_group("prompts and sampling")
    g.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    g.add_argument("--prompts-file", default=None,
                   help="one prompt per line, or JSONL lines with a \"prompt\" field (a .jsonl file, or every line "
                        "a JSON object)")
    g.add_argument("--max-new-tokens", "--out-seq-length", "--tokens-to-generate", dest="max_new_tokens", type=int,
                   default=64, help="tokens to generate per prompt (fewer when a stop token comes first)")
    g.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    g.add_argument("--top-k", type=int, default=0, help="0: no top-k filtering")
    g.add_argument("--top-p", type=float, default=0.0, help="nucleus sampling in [0, 1]; 0: no top-p (Megatron)")
    g.add_argument("--seed", "--random-seed", dest="seed", type=int, default=0, help="the sampling seed")
    g.add_argument("--stop-token", action="append", default=[],
                   help="stop at this token too (repeatable): an id (digits) or a token's text such as '<|eot_id|>'; "
                        "the end-of-document token always stops")
    g.add_argument("--add-BOS", "--add-bos", dest="add_bos", action="store_true",
                   help="prepend the tokenizer's BOS token (its end-of-document token where it has none)")
    g = p.add_argument_group("output")
    g.add_argument("--output-format", choices=("text", "jsonl"), default="text",
                   help="text: each prompt and its continuation, a blank line between; jsonl: one object per prompt "
                        "(prompt, text, prompt_tokens, tokens, log_probs, stopped)")
    g.add_argument("--output", default=None, help="write the output to this file (atomically) instead of stdout")
    g = p.add_argument_group("server")
    g.add_argument("--server", type=int, default=None, metavar="PORT",
                   help="serve Megatron's REST interface (PUT /api) on this port (0: a free one) instead of generating")
    g.add_argument("--host", default="127.0.0.1", help="with --server: the address to listen on")
    p.add_argument("--debug", action="store_true", help="print the traceback of a failure")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The flags of ``argv`` (``sys.argv[1:]`` when None)."""
    return build_parser().parse_args(argv)


def read_prompts_file(path: str) -> list[str]:
    """The prompts of ``--prompts-file``: JSONL objects' ``"prompt"`` fields (a ``.jsonl`` file,
    or one whose every non-empty line is a JSON object), else one prompt per line."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.rstrip("\n").rstrip("\r") for line in f]
    except FileNotFoundError:
        raise ArgumentError(f"--prompts-file {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ArgumentError(f"--prompts-file {path}: cannot read it ({e})") from None
    while lines and not lines[-1]:
        lines.pop()
    jsonl = path.endswith(".jsonl") or (bool(lines) and all(line.lstrip().startswith("{") for line in lines if line))
    if not jsonl:
        return lines
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise ArgumentError(f"--prompts-file {path}: line {number} is not JSON ({e})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise ArgumentError(f"--prompts-file {path}: line {number} has no \"prompt\" string")
        prompts.append(record["prompt"])
    return prompts


def validate_args(args: argparse.Namespace) -> list[str]:
    """Check the flags that need no model; returns the prompts (``--prompt`` then
    ``--prompts-file``'s), empty with ``--server``."""
    if args.tensor_model_parallel_size < 1:
        raise ArgumentError(f"--tensor-model-parallel-size must be >= 1, got {args.tensor_model_parallel_size}")
    if args.max_new_tokens < 1:
        raise ArgumentError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not 0.0 <= args.top_p <= 1.0:
        raise ArgumentError(f"--top-p must be in [0, 1] (0: no top-p), got {args.top_p}")
    if not args.temperature >= 0.0:
        raise ArgumentError(f"--temperature must be >= 0 (0: greedy), got {args.temperature}")
    if args.top_k < 0:
        raise ArgumentError(f"--top-k must be >= 0 (0: no top-k), got {args.top_k}")
    if args.seed < 0:
        raise ArgumentError(f"--seed must be >= 0, got {args.seed}")
    if args.ckpt_step is not None and args.ckpt_step < 0:
        raise ArgumentError(f"--ckpt-step must be >= 0, got {args.ckpt_step}")
    if args.server is not None:
        if not 0 <= args.server <= 65535:
            raise ArgumentError(f"--server PORT must be in 0..65535, got {args.server}")
        given = [f for f, v in (("--prompt", args.prompt), ("--prompts-file", args.prompts_file),
                                ("--output", args.output)) if v]
        if given:
            raise ArgumentError(f"{given[0]} does not go with --server (requests bring their prompts)")
        return []
    prompts = list(args.prompt)
    if args.prompts_file:
        prompts += read_prompts_file(args.prompts_file)
    if not prompts:
        raise ArgumentError("no prompts: give --prompt TEXT (repeatable) or --prompts-file FILE, or --server PORT")
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ArgumentError(f"prompt {i} is empty")
    if args.output and os.path.isdir(args.output):
        raise ArgumentError(f"--output {args.output} is a directory")
    return prompts


def stop_tokens(args: argparse.Namespace) -> list[int | str]:
    """``--stop-token`` values: digits are ids, anything else a token's text."""
    return [int(s) if s.isdigit() else s for s in args.stop_token]


def tokenizer_settings(args: argparse.Namespace, hf_dir: bool) -> tuple[str, str | None]:
    """``(tokenizer type, tokenizer model)``: the flags', or for a Hugging Face ``--load`` with a
    ``tokenizer.json`` and no ``--tokenizer-type``, that directory's own tokenizer."""
    if args.tokenizer_type is not None:
        return args.tokenizer_type, args.tokenizer_model
    if hf_dir and os.path.isfile(os.path.join(args.load, "tokenizer.json")):
        return "HuggingFaceTokenizer", args.tokenizer_model or args.load
    return "ByteLevel", args.tokenizer_model


__all__ = ["build_parser", "parse_args", "read_prompts_file", "stop_tokens", "tokenizer_settings", "validate_args"]
