"""Tokenizers behind Megatron's ``--tokenizer-type``, with Megatron's ``MegatronTokenizer`` interface.

Every tokenizer has ``vocab_size``, ``eod`` (the end-of-document id that ``--append-eod``
appends), ``tokenize(text) -> list[int]`` and ``detokenize(ids) -> str``.
:func:`build_tokenizer` picks one by name from :data:`TOKENIZER_TYPES`:

* ``ByteLevel`` (this package's, not Megatron's): the UTF-8 bytes of the text
  (:class:`core.data.text_dataset.ByteTokenizer`, ids 0-255) plus one EOD id, **256**, so the
  vocabulary has **257** ids and Megatron's dtype rule stores the tokens as uint16.
* ``NullTokenizer`` (Megatron's): the text is space-separated ids; ``eod = vocab_size``
  and the vocabulary has ``vocab_size + 1`` ids.
* ``HuggingFaceTokenizer`` (``--tokenizer-model``: a ``tokenizer.json`` or a directory holding
  one) and ``GPT2BPETokenizer`` (``--vocab-file`` + ``--merge-file``) need the ``tokenizers``
  package; without it they raise ``ImportError`` saying ``pip install tokenizers``.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from core.data.text_dataset import ByteTokenizer

_EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")
"""Names of the end-of-text token looked up in a Hugging Face vocabulary, first match wins."""


class MegatronTokenizer(abc.ABC):
    """Megatron's tokenizer interface: ``vocab_size``, ``eod``, ``tokenize``, ``detokenize``."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids, EOD included."""

    @property
    @abc.abstractmethod
    def eod(self) -> int:
        """The end-of-document id."""

    @abc.abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """The token ids of ``text``."""

    @abc.abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str:
        """The text of ``ids``."""


class ByteLevelTokenizer(MegatronTokenizer):
    """UTF-8 bytes (ids 0-255, :class:`ByteTokenizer`) plus the EOD id 256: a vocabulary of 257."""

    def __init__(self) -> None:
        """Wrap a :class:`ByteTokenizer`."""
        self._bytes = ByteTokenizer()

    @property
    def vocab_size(self) -> int:
        """257: the 256 byte values and the EOD."""
        return ByteTokenizer.vocab_size + 1

    @property
    def eod(self) -> int:
        """256, the id after the byte values."""
        return ByteTokenizer.vocab_size

    def tokenize(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text``."""
        return self._bytes.encode(text).tolist()

    def detokenize(self, ids: Sequence[int]) -> str:
        """The text of the byte ids, EOD ids dropped (invalid UTF-8 becomes U+FFFD)."""
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        return self._bytes.decode(arr[arr != self.eod])


class NullTokenizer(MegatronTokenizer):
    """Megatron's ``NullTokenizer``: the text is space-separated ids; EOD is ``vocab_size``."""

    def __init__(self, vocab_size: int) -> None:
        """Ids ``0 .. vocab_size - 1`` plus the EOD ``vocab_size``."""
        if vocab_size < 1:
            raise ValueError(f"NullTokenizer needs --vocab-size >= 1, got {vocab_size}")
        self._vocab_size_without_eod = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        """``vocab_size + 1`` (the EOD included)."""
        return self._vocab_size_without_eod + 1

    @property
    def eod(self) -> int:
        """The given ``vocab_size``."""
        return self._vocab_size_without_eod

    def tokenize(self, text: str) -> list[int]:
        """The integers of the space-separated ``text``."""
        return [int(x) for x in text.split()]

    def detokenize(self, ids: Sequence[int]) -> str:
        """The ids joined by spaces."""
        return " ".join(str(int(i)) for i in ids)


def _import_tokenizers(tokenizer_type: str) -> Any:
    """The ``tokenizers`` package, or ``ImportError`` telling how to install it."""
    try:
        import tokenizers
    except ImportError:
        message = f"--tokenizer-type {tokenizer_type} needs the tokenizers package: pip install tokenizers"
        raise ImportError(message) from None
    return tokenizers


class _TokenizersLibraryTokenizer(MegatronTokenizer):
    """A ``tokenizers.Tokenizer`` with Megatron's interface; EOD from a known end-of-text token."""

    def __init__(self, tokenizer: Any, eod_token: str | None, source: str) -> None:
        """Wrap ``tokenizer``; ``eod_token`` None looks up the usual end-of-text names."""
        self._tokenizer = tokenizer
        names = (eod_token,) if eod_token is not None else _EOD_CANDIDATES
        ids = [tokenizer.token_to_id(name) for name in names]
        found = [i for i in ids if i is not None]
        if not found:
            raise ValueError(f"{source}: no end-of-text token among {list(names)}; name it with eod_token")
        self._eod = int(found[0])

    @property
    def vocab_size(self) -> int:
        """Size of the vocabulary, added tokens included."""
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def eod(self) -> int:
        """Id of the end-of-text token."""
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        """The ids of ``text`` (the tokenizer's post-processor applied, as Hugging Face does by default)."""
        return list(self._tokenizer.encode(text).ids)

    def detokenize(self, ids: Sequence[int]) -> str:
        """The decoded text."""
        return self._tokenizer.decode([int(i) for i in ids])

    def tokenize_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of ``text`` and each token's character span ``(start, end)`` in it, without the
        post-processor's special tokens: a rendered chat template writes its own (as
        ``apply_chat_template`` tokenizes with ``add_special_tokens=False``)."""
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        return list(encoding.ids), [tuple(o) for o in encoding.offsets]


def huggingface_tokenizer(tokenizer_model: str | None, eod_token: str | None = None) -> MegatronTokenizer:
    """``HuggingFaceTokenizer``: a ``tokenizer.json`` file, or a directory holding one."""
    if not tokenizer_model:
        raise ValueError(
            "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model (a tokenizer.json or its directory)"
        )
    tokenizers = _import_tokenizers("HuggingFaceTokenizer")
    path = os.path.join(tokenizer_model, "tokenizer.json") if os.path.isdir(tokenizer_model) else tokenizer_model
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--tokenizer-model {tokenizer_model}: no tokenizer.json there")
    return _TokenizersLibraryTokenizer(tokenizers.Tokenizer.from_file(path), eod_token, path)


def gpt2_bpe_tokenizer(vocab_file: str | None, merge_file: str | None) -> MegatronTokenizer:
    """``GPT2BPETokenizer``: GPT-2's byte-level BPE from ``vocab.json`` and ``merges.txt``; EOD ``<|endoftext|>``."""
    if not vocab_file or not merge_file:
        raise ValueError("--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file")
    tokenizers = _import_tokenizers("GPT2BPETokenizer")
    for path in (vocab_file, merge_file):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: no such file")
    tokenizer = tokenizers.ByteLevelBPETokenizer(vocab_file, merge_file)
    return _TokenizersLibraryTokenizer(tokenizer, "<|endoftext|>", vocab_file)


TOKENIZER_TYPES: dict[str, Callable[..., MegatronTokenizer]] = {
    "ByteLevel": lambda **kw: ByteLevelTokenizer(),
    "NullTokenizer": lambda **kw: NullTokenizer(kw.get("vocab_size") or 0),
    "HuggingFaceTokenizer": lambda **kw: huggingface_tokenizer(kw.get("tokenizer_model"), kw.get("eod_token")),
    "GPT2BPETokenizer": lambda **kw: gpt2_bpe_tokenizer(kw.get("vocab_file"), kw.get("merge_file")),
}
"""``--tokenizer-type`` name -> factory taking the keyword arguments of :func:`build_tokenizer`."""


def build_tokenizer(
    tokenizer_type: str,
    *,
    tokenizer_model: str | None = None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    vocab_size: int | None = None,
    eod_token: str | None = None,
) -> MegatronTokenizer:
    """The tokenizer named ``tokenizer_type`` (Megatron's ``build_tokenizer``); ``ValueError`` for an unknown name."""
    if tokenizer_type not in TOKENIZER_TYPES:
        raise ValueError(f"unknown --tokenizer-type {tokenizer_type!r}; known: {', '.join(TOKENIZER_TYPES)}")
    return TOKENIZER_TYPES[tokenizer_type](
        tokenizer_model=tokenizer_model,
        vocab_file=vocab_file,
        merge_file=merge_file,
        vocab_size=vocab_size,
        eod_token=eod_token,
    )
