"""Megatron-LM's ``tools/preprocess_data.py``: JSONL text to an indexed dataset (``.bin``/``.idx``).

Each input line is a JSON object; for every ``--json-keys`` key its text (or list of texts,
Megatron's pre-split sentences) is tokenized, empty pieces dropped, the EOD appended to the
document with ``--append-eod``, and the document added to ``{output_prefix}_{key}_document``
(``.bin`` and ``.idx``, Megatron's names and format, tokens as ``DType.optimal_dtype(vocab_size)``).
``--workers N`` tokenizes in a ``multiprocessing.Pool`` of N processes (``imap``: order
preserved, so the output does not depend on N; each document comes back as an array of the
dataset's dtype, since pickling lists of Python ints costs more than ByteLevel's encoding and
would make more workers slower than one); 1 tokenizes in this process. Blank lines
are skipped. Megatron's ``--split-sentences``, ``--keep-newlines`` and ``--partitions`` are
not supported.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type ByteLevel --append-eod --workers 4
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from core.data.indexed_dataset import DType, IndexedDatasetBuilder  # noqa: E402
from core.data.tokenizers import TOKENIZER_TYPES, MegatronTokenizer, build_tokenizer  # noqa: E402
from core.training.arguments import OneLineErrorParser  # noqa: E402

Encoded = tuple[dict[str, np.ndarray], dict[str, list[int]], int]
"""Per key the document's ids and its sequence lengths, and the bytes of the input line."""


class InputError(ValueError):
    """A malformed input line (bad JSON, missing key, text that is not a string)."""


def make_tokenizer(args: argparse.Namespace) -> MegatronTokenizer:
    """The tokenizer chosen by the tokenizer flags."""
    return build_tokenizer(
        args.tokenizer_type,
        tokenizer_model=args.tokenizer_model,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        vocab_size=args.vocab_size,
    )


class Encoder:
    """Megatron's ``Encoder``: tokenizes one JSON line; the tokenizer is per process (``initializer``)."""

    tokenizer: MegatronTokenizer | None = None
    """This process's tokenizer, set by :meth:`initializer`."""

    def __init__(self, args: argparse.Namespace) -> None:
        """Keep the parsed arguments (picklable, sent to the workers)."""
        self.args = args

    dtype: type | None = None
    """The dataset's token dtype (``DType.optimal_dtype`` of the vocabulary), set by :meth:`initializer`."""

    def initializer(self) -> None:
        """Build this process's tokenizer."""
        Encoder.tokenizer = make_tokenizer(self.args)
        Encoder.dtype = DType.optimal_dtype(Encoder.tokenizer.vocab_size)

    def worker_initializer(self) -> None:
        """A pool worker's start: Ctrl-C is the parent's to handle (one line, the old dataset
        intact), so the workers ignore SIGINT instead of each printing a traceback."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.initializer()

    def encode(self, numbered_line: tuple[int, bytes]) -> Encoded | None:
        """The ids and sequence lengths per key of one line of the file (None for a blank line)."""
        lineno, raw = numbered_line
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise InputError(f"{self.args.input}:{lineno}: not UTF-8 text ({err.reason} at byte {err.start + 1} of "
                             "the line)") from None
        if not line.strip():
            return None
        try:
            data = json.loads(line)
        except json.JSONDecodeError as err:
            raise InputError(f"{self.args.input}:{lineno}: invalid JSON ({err.msg})") from None
        if not isinstance(data, dict):
            raise InputError(f"{self.args.input}:{lineno}: expected a JSON object, got {type(data).__name__}")
        tokenizer = Encoder.tokenizer
        assert tokenizer is not None, "Encoder.initializer was not called"
        ids, lens = {}, {}
        for key in self.args.json_keys:
            if key not in data:
                keys = " ".join(self.args.json_keys)
                raise InputError(f"{self.args.input}:{lineno}: no key {key!r} (--json-keys {keys})")
            text = data[key]
            sentences = text if isinstance(text, list) else [text]
            doc_ids: list[int] = []
            sentence_lens: list[int] = []
            for sentence in sentences:
                if not isinstance(sentence, str):
                    raise InputError(f"{self.args.input}:{lineno}: {key!r} is not a string or a list of strings")
                sentence_ids = tokenizer.tokenize(sentence)
                if sentence_ids:
                    doc_ids.extend(sentence_ids)
                    sentence_lens.append(len(sentence_ids))
            if doc_ids and self.args.append_eod:
                doc_ids.append(tokenizer.eod)
                sentence_lens[-1] += 1
            ids[key], lens[key] = np.asarray(doc_ids, dtype=Encoder.dtype), sentence_lens
        return ids, lens, len(raw)


def _encoded_lines(args: argparse.Namespace, lines: Iterable[bytes]) -> Iterator[Encoded | None]:
    """The encoded lines in input order, from this process (1 worker) or a pool."""
    encoder = Encoder(args)
    numbered = enumerate(lines, start=1)
    if args.workers == 1:
        encoder.initializer()
        yield from map(encoder.encode, numbered)
        return
    with multiprocessing.Pool(args.workers, initializer=encoder.worker_initializer) as pool:
        yield from pool.imap(encoder.encode, numbered, 128)


def output_paths(output_prefix: str, key: str, level: str = "document") -> tuple[str, str]:
    """Megatron's output names: ``{output_prefix}_{key}_{level}.bin`` and ``.idx``."""
    base = f"{output_prefix}_{key}_{level}"
    return base + ".bin", base + ".idx"


def get_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse Megatron's flags."""
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    group = parser.add_argument_group(title="input data")
    group.add_argument("--input", type=str, required=True, help="path to the input JSONL file")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract from each JSON line")
    group = parser.add_argument_group(title="tokenizer")
    group.add_argument("--tokenizer-type", type=str, required=True, choices=list(TOKENIZER_TYPES))
    group.add_argument("--tokenizer-model", type=str, default=None, help="HuggingFaceTokenizer: tokenizer.json or dir")
    group.add_argument("--vocab-file", type=str, default=None, help="GPT2BPETokenizer: vocab.json")
    group.add_argument("--merge-file", type=str, default=None, help="GPT2BPETokenizer: merges.txt")
    group.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer: ids below this; EOD = it")
    group.add_argument("--append-eod", action="store_true", help="append the EOD token to every document")
    group = parser.add_argument_group(title="output data")
    group.add_argument("--output-prefix", type=str, required=True, help="output prefix (no extension)")
    group = parser.add_argument_group(title="runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizing processes (1: this process)")
    group.add_argument("--log-interval", type=int, default=1000, help="report progress every N documents")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    if args.log_interval < 1:
        parser.error(f"--log-interval must be >= 1, got {args.log_interval}")
    if not os.path.isfile(args.input):
        parser.error(f"--input {args.input}: no such file")
    return args


def _parents(path: str) -> list[str]:
    """``path`` and each directory above it."""
    parents = [path]
    while os.path.dirname(parents[-1]) != parents[-1]:
        parents.append(os.path.dirname(parents[-1]))
    return parents


def preprocess(args: argparse.Namespace) -> dict[str, str]:
    """Tokenize ``args.input`` into one indexed dataset per JSON key; returns key -> dataset prefix."""
    tokenizer = make_tokenizer(args)
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    blocker = next((p for p in _parents(out_dir) if os.path.exists(p) and not os.path.isdir(p)), None)
    if blocker is not None:
        raise InputError(f"--output-prefix {args.output_prefix}: {blocker} is a file, not a directory")
    os.makedirs(out_dir, exist_ok=True)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    builders, idx_paths = {}, {}
    for key in args.json_keys:
        bin_path, idx_paths[key] = output_paths(args.output_prefix, key)
        builders[key] = IndexedDatasetBuilder(bin_path, dtype=dtype)
    start = time.time()
    total_bytes = 0
    count = 0
    try:
        with open(args.input, "rb") as lines:  # decoded per line, so an error can name its line
            for encoded in _encoded_lines(args, lines):
                if encoded is None:
                    continue
                doc, sentence_lens, num_bytes = encoded
                count += 1
                total_bytes += num_bytes
                for key in doc:
                    builders[key].add_document(doc[key], sentence_lens[key])
                if count % args.log_interval == 0:
                    elapsed = max(time.time() - start, 1e-9)
                    print(
                        f"Processed {count} documents ({count / elapsed:.1f} docs/s, "
                        f"{total_bytes / elapsed / 1024 / 1024:.3f} MB/s).",
                        file=sys.stderr,
                    )
        for key in args.json_keys:  # each pair renamed into place only now
            builders[key].finalize(idx_paths[key])
    except BaseException:
        for builder in builders.values():  # the temporary files go; an earlier dataset stays as it was
            builder.abort()
        raise
    elapsed = max(time.time() - start, 1e-9)
    print(
        f"Done: {count} documents, {total_bytes} bytes in {elapsed:.2f} s; "
        + ", ".join(f"{key}: {output_paths(args.output_prefix, key)[0][:-4]}" for key in args.json_keys),
        file=sys.stderr,
    )
    return {key: output_paths(args.output_prefix, key)[0][:-4] for key in args.json_keys}


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; malformed input exits with one ``error:`` line and status 1."""
    args = get_args(argv)
    try:
        preprocess(args)
    except (InputError, ImportError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except OSError as err:  # a missing tokenizer file, a full disk, an unwritable --output-prefix
        where = f" {err.filename}" if err.filename else ""
        print(f"error:{where} {err.strerror or err} (--output-prefix {args.output_prefix}: nothing replaced)",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"error: interrupted; --output-prefix {args.output_prefix}: nothing written or replaced",
              file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
