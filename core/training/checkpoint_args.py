"""Megatron's ``--use-checkpoint-args``: the model's shape from the checkpoint in ``--load``.

A checkpoint records its model (``core.checkpointing.checkpointer.model_record``); with
``--use-checkpoint-args`` those values become the model flags' values, so a run fine-tuning a
converted or trained model needs no model flags. A model flag given on the command line that
disagrees with the checkpoint is an error naming both values (never silently overridden).
Fields the record leaves out (the sequence length of a rotary model, numerics such as bf16,
recompute, dropout, sequence parallelism) stay the command line's.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from core.training.flags import ArgumentError

_INVERTED = {"add_bias_linear": "disable_bias_linear",
             "share_embeddings_and_output_weights": "untie_embeddings_and_output_weights"}
"""Fields whose flag is their negation."""

_RENAMED = {"layernorm_epsilon": "norm_epsilon", "rope_scaling": "use_rope_scaling"}
"""Fields whose flag has another name."""

_MOE_DERIVED = ("swiglu", "add_bias_linear")
"""MoE config fields the launcher derives from the dense flags."""


def explicit_flags(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The ``dest`` of every option written on the command line ``argv``."""
    actions = parser._option_string_actions  # argparse's own map from option string to action
    dests = set()
    for token in argv:
        if token.startswith("--"):
            action = actions.get(token.split("=", 1)[0])
            if action is not None:
                dests.add(action.dest)
    return dests


def checkpoint_model(load: str, step: int | None) -> dict[str, Any]:
    """The model record of checkpoint ``step`` (the newest complete one when None) in ``load``."""
    from core import checkpointing

    steps = checkpointing.complete_steps(load)
    if not steps:
        raise ArgumentError(f"--use-checkpoint-args: --load {load} holds no complete checkpoint")
    if step is not None and step not in steps:
        raise ArgumentError(f"--use-checkpoint-args: --load {load} has no complete checkpoint {step} "
                            f"(complete: {steps})")
    try:
        return dict(checkpointing.load_metadata(load, step if step is not None else steps[-1])["model"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ArgumentError(f"--use-checkpoint-args: cannot read the model of the checkpoint in --load {load} "
                            f"({e})") from None


def _flag_values(record: dict[str, Any]) -> dict[str, Any]:
    """The model record as ``{flag dest: value}``."""
    values: dict[str, Any] = {}
    for field, value in record.items():
        if field == "num_query_groups":
            values["group_query_attention"] = value is not None
            if value is not None:
                values["num_query_groups"] = value
        elif field in ("vocab_size", "padded_vocab_size"):
            values[f"checkpoint_{field}"] = value
        elif field == "moe_layer_freq" and record.get("moe") is None:
            continue  # a dense model: the flag is for MoE models only
        elif field == "moe":
            values.update({k: v for k, v in (value or {}).items() if k not in _MOE_DERIVED})
        elif field in _INVERTED:
            values[_INVERTED[field]] = not value
        else:
            values[_RENAMED.get(field, field)] = value
    return values


def apply_checkpoint_args(args: argparse.Namespace) -> None:
    """With ``--use-checkpoint-args``, set the model flags from the checkpoint in ``--load``
    (``args.explicit_flags``: the flags written on the command line, which must agree)."""
    if not getattr(args, "use_checkpoint_args", False):
        return
    if args.load is None:
        raise ArgumentError("--use-checkpoint-args needs --load DIR")
    explicit = getattr(args, "explicit_flags", set())
    for dest, value in _flag_values(checkpoint_model(args.load, args.ckpt_step)).items():
        if dest.startswith("checkpoint_"):
            setattr(args, dest, value)
            continue
        if not hasattr(args, dest):
            raise ArgumentError(f"--use-checkpoint-args: the checkpoint in --load {args.load} records "
                                f"{dest}={value!r}, which this version has no flag for")
        given = getattr(args, dest)
        if isinstance(given, list) and isinstance(value, list | tuple):
            value = list(value)
        if dest in explicit and given != value:
            flag = "--" + dest.replace("_", "-")
            raise ArgumentError(f"{flag} {given} disagrees with the checkpoint in --load {args.load} ({value}); "
                                f"drop {flag} (--use-checkpoint-args takes the model from the checkpoint)")
        setattr(args, dest, value)


def checkpoint_vocab_size(args: argparse.Namespace, tokenizer_vocab: int) -> int:
    """The model's vocabulary: the checkpoint's with ``--use-checkpoint-args``, else the tokenizer's."""
    vocab = getattr(args, "checkpoint_vocab_size", None)
    return tokenizer_vocab if vocab is None else vocab


def check_tokenizer_fits(args: argparse.Namespace, tokenizer_vocab: int) -> None:
    """With ``--use-checkpoint-args``, the tokenizer's ids must lie in the checkpoint's vocabulary."""
    vocab = getattr(args, "checkpoint_vocab_size", None)
    if vocab is not None and tokenizer_vocab > vocab:
        raise ArgumentError(f"the tokenizer's vocabulary ({tokenizer_vocab}) is larger than the model's in --load "
                            f"{args.load} ({vocab}): use the tokenizer the model was trained with")


__all__ = ["apply_checkpoint_args", "check_tokenizer_fits", "checkpoint_model", "checkpoint_vocab_size",
           "explicit_flags"]
