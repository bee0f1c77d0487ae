"""Supervised fine-tuning data (``launch/pretrain.py --sft``): chat conversations from a JSONL file,
tokenized with the tokenizer's chat template, the loss on the assistant's tokens only, packed
first-fit into sequences with per-conversation positions and attention.

* :func:`tokenize_conversation`: the conversation's tokens are those of its whole rendering (as
  ``apply_chat_template`` gives them); the assistant spans are found by rendering growing prefixes
  of the conversation: an assistant message's span runs from the end of the generation prompt
  (``add_generation_prompt=True`` on the messages before it) to the end of the rendering that
  includes it, so it holds the content, the end-of-turn token and whatever the template writes
  after it before the next message, but not the role header. A token is the assistant's when its
  last character lies in such a span (the tokenizer's character offsets).
* :func:`read_conversations`: one ``{"messages": [{"role": ..., "content": ...}, ...]}`` per
  line; a malformed line, a conversation without an assistant message or one the template
  rejects raises :class:`SFTDataError` naming the file and line.
* :class:`SFTDataset`: conversations longer than the sequence are truncated to it (dropped when
  no assistant token is left to predict), then packed first-fit in a seeded order into sequences
  of ``seq_length`` tokens, each packed sequence a sample with Megatron's batch fields.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from core.data.chat_template import ChatTemplate, ChatTemplateError
from core.data.tokenizers import MegatronTokenizer


class SFTDataError(ValueError):
    """A conversation of the JSONL cannot be trained on (the message names the file and line)."""


@dataclasses.dataclass(frozen=True)
class Conversation:
    """One tokenized conversation."""

    tokens: np.ndarray
    """int32 ``[n]``: the ids of the rendered conversation."""
    assistant: np.ndarray
    """bool ``[n]``: which tokens belong to an assistant message (the loss targets)."""


def _prefix_error(k: int) -> ChatTemplateError:
    return ChatTemplateError(f"the chat template renders the first {k} messages differently when more follow (it "
                             "is not append-only), so the assistant's tokens cannot be located")


def assistant_char_spans(messages: list[dict[str, Any]], template: ChatTemplate) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span ``[start, end)`` of each assistant message in it:
    from the end of the generation prompt to the end of the rendering that includes the message."""
    previous, spans = "", []
    for k, message in enumerate(messages):
        upto = template.render(messages[: k + 1])
        if not upto.startswith(previous):
            raise _prefix_error(k)
        if message["role"] == "assistant":
            prompt = template.render(messages[:k], add_generation_prompt=True)
            if not (prompt.startswith(previous) and upto.startswith(prompt)):
                raise _prefix_error(k)
            spans.append((len(prompt), len(upto)))
        previous = upto
    return previous, spans


def tokenize_conversation(messages: list[dict[str, Any]], template: ChatTemplate,
                          tokenizer: MegatronTokenizer) -> Conversation:
    """The tokens of the rendered conversation and which of them are the assistant's (see the module
    docstring); ``ValueError`` when there is no assistant message or token."""
    if not any(m["role"] == "assistant" for m in messages):
        raise SFTDataError("no assistant message (nothing to train on)")
    text, spans = assistant_char_spans(messages, template)
    ids, offsets = tokenizer.tokenize_with_offsets(text)
    # A token's last character decides its message: whitespace that the tokenizer trims from a
    # token's offsets (ByteLevel) moves its start, never its end before its first character.
    last = np.array([max(end - 1, 0) for _, end in offsets], dtype=np.int64)
    starts, ends = np.array(spans, dtype=np.int64).reshape(-1, 2).T
    which = np.searchsorted(starts, last, side="right") - 1
    assistant = (which >= 0) & (last < ends[np.maximum(which, 0)])
    if not assistant.any():
        raise SFTDataError("the assistant messages render to no tokens")
    return Conversation(np.asarray(ids, dtype=np.int32), assistant)


def _messages(record: Any) -> list[dict[str, Any]]:
    """The ``messages`` of a JSONL record, checked: a non-empty list of objects with string ``role`` and ``content``."""
    if not isinstance(record, dict) or not isinstance(record.get("messages"), list) or not record["messages"]:
        raise SFTDataError('expected an object with a non-empty "messages" list')
    for i, message in enumerate(record["messages"]):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise SFTDataError(f'message {i} is not an object with string "role" and "content"')
    return record["messages"]


def _parse_line(raw: bytes) -> list[dict[str, Any]]:
    """The messages of one JSONL line."""
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise SFTDataError(f"not UTF-8 text ({e.reason} at byte {e.start} of the line)") from None
    except json.JSONDecodeError as e:
        raise SFTDataError(f"invalid JSON ({e.msg} at column {e.colno})") from None
    return _messages(record)


def read_conversations(path: str, template: ChatTemplate, tokenizer: MegatronTokenizer) -> list[Conversation]:
    """Every conversation of the JSONL file ``path`` (blank lines skipped), tokenized; the first bad
    line raises :class:`SFTDataError` ``PATH:LINE: why``."""
    conversations = []
    try:
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                if not raw.strip():
                    continue
                try:
                    conversations.append(tokenize_conversation(_parse_line(raw), template, tokenizer))
                except ValueError as e:  # SFTDataError, ChatTemplateError
                    raise SFTDataError(f"{path}:{lineno}: {e}") from None
    except OSError as e:
        raise SFTDataError(f"{path}: cannot read it ({e.strerror or e})") from None
    if not conversations:
        raise SFTDataError(f"{path}: no conversations (the file is empty)")
    return conversations


def fit_to_length(conversation: Conversation, seq_length: int) -> Conversation | None:
    """``conversation`` cut to its first ``seq_length`` tokens; None when no assistant token is left
    to predict (the first token is never a label)."""
    if len(conversation.tokens) <= seq_length:
        return conversation
    if not conversation.assistant[1:seq_length].any():
        return None
    return Conversation(conversation.tokens[:seq_length], conversation.assistant[:seq_length])


def pack_first_fit(lengths: Sequence[int], capacity: int, order: Sequence[int]) -> list[list[int]]:
    """First-fit bin packing of items ``order`` (each at most ``capacity`` long): every item goes to
    the first bin with room for it, a new bin when none has. A max-tree over the bins' free room
    finds that bin in ``O(log n)``; bins are returned in the order they were opened."""
    size = 1 << max(0, (len(order) - 1).bit_length())
    free = [capacity] * (2 * size)  # free[node]: the most room of a bin under node (leaves: bins)
    bins: list[list[int]] = []
    for item in order:
        need, node = int(lengths[item]), 1
        while node < size:
            node = 2 * node if free[2 * node] >= need else 2 * node + 1
        free[node] -= need
        if node - size == len(bins):
            bins.append([])
        bins[node - size].append(int(item))
        while node > 1:
            node //= 2
            free[node] = max(free[2 * node], free[2 * node + 1])
    return bins


class SFTDataset:
    """Conversations packed into samples of ``seq_length`` tokens (see the module docstring).

    ``dataset[i]`` has Megatron's fields, all ``[seq_length]``: ``tokens``; ``labels``, the next
    token of the same conversation; ``loss_mask``, 1 where the label is an assistant token (0 at a
    conversation's last token, whose next token is another conversation's, and on padding);
    ``position_ids`` restarting at 0 for every conversation; ``segment_ids``, the conversation's
    index in the sample, the padding after the last one a segment of its own.
    """

    def __init__(self, conversations: Sequence[Conversation], seq_length: int, seed: int, pad_id: int) -> None:
        """Truncate (:func:`fit_to_length`) and pack ``conversations`` first-fit in the order of a
        permutation drawn from ``seed``."""
        fitted = [fit_to_length(c, seq_length) for c in conversations]
        self.num_truncated = sum(f is not None and len(f.tokens) < len(c.tokens) for f, c in zip(fitted, conversations))
        """Conversations cut to ``seq_length`` tokens."""
        self.conversations = [f for f in fitted if f is not None]
        """The conversations packed (truncated ones cut)."""
        self.num_dropped = len(conversations) - len(self.conversations)
        """Conversations left out: truncation left no assistant token to predict."""
        self.seq_length, self.pad_id = seq_length, pad_id
        lengths = [len(c.tokens) for c in self.conversations]
        order = np.random.default_rng(seed).permutation(len(lengths))
        self.packs = pack_first_fit(lengths, seq_length, order)
        """Conversation indices of each sample, in packing order."""
        self.fill = sum(lengths) / max(1, len(self.packs) * seq_length)
        """Share of the samples' positions that hold conversation tokens (the rest is padding)."""

    def __len__(self) -> int:
        """Number of packed samples."""
        return len(self.packs)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        """Sample ``i``'s fields (class docstring)."""
        s = self.seq_length
        sample = {"tokens": np.full(s, self.pad_id, np.int32), "labels": np.full(s, self.pad_id, np.int32),
                  "loss_mask": np.zeros(s, np.float32), "position_ids": np.zeros(s, np.int32),
                  "segment_ids": np.zeros(s, np.int32)}
        start = 0
        for segment, index in enumerate(self.packs[i]):
            conversation = self.conversations[index]
            n, end = len(conversation.tokens), start + len(conversation.tokens)
            sample["tokens"][start:end] = conversation.tokens
            sample["labels"][start:end - 1] = conversation.tokens[1:]
            sample["loss_mask"][start:end - 1] = conversation.assistant[1:]
            sample["position_ids"][start:end] = np.arange(n)
            sample["segment_ids"][start:end] = segment
            start = end
        sample["position_ids"][start:] = np.arange(s - start)
        sample["segment_ids"][start:] = len(self.packs[i])  # padding: a segment of its own
        return sample

    def batch(self, indices: Sequence[int]) -> dict[str, np.ndarray]:
        """The samples ``indices`` stacked: each field ``[len(indices), seq_length]``."""
        samples = [self[int(i)] for i in indices]
        return {key: np.stack([sample[key] for sample in samples]) for key in samples[0]}

    def target_tokens(self) -> np.ndarray:
        """The tokens the loss is on (the assistant tokens after each conversation's first)."""
        return np.concatenate([c.tokens[1:][c.assistant[1:]] for c in self.conversations])
