"""tools/preprocess_data.py (Megatron's preprocessing) and core.data.tokenizers: JSONL in, Megatron
``{prefix}_{key}_document.bin/.idx`` out; 1 and 2 workers give identical files; ``--append-eod``.
Runs the tool as a subprocess (numpy only, no JAX)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from core.data.indexed_dataset import IndexedDataset
from core.data.tokenizers import ByteLevelTokenizer, NullTokenizer, build_tokenizer

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "preprocess_data.py"
DOCS = [
    {"text": "Hello, world.", "title": "greeting"},
    {"text": "", "title": "empty text"},
    {"text": "Zoë says ünïcödé ✓", "title": "utf-8"},
    {"text": ["pre-split ", "sentences", ""], "title": "list"},
] + [{"text": f"document number {i} " * (i % 5 + 1), "title": f"t{i}"} for i in range(150)]


def run_tool(*args, cwd=None):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True, env=env, cwd=cwd
    )


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "input.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for i, doc in enumerate(DOCS):
            f.write(json.dumps(doc, ensure_ascii=bool(i % 2)) + "\n")
            if i == 10:
                f.write("\n")  # a blank line is skipped
    return path


def expected_documents(key, append_eod):
    tok = ByteLevelTokenizer()
    docs = []
    for doc in DOCS:
        pieces = doc[key] if isinstance(doc[key], list) else [doc[key]]
        lengths, ids = [], []
        for piece in pieces:
            piece_ids = tok.tokenize(piece)
            if piece_ids:
                ids += piece_ids
                lengths.append(len(piece_ids))
        if ids and append_eod:
            ids.append(tok.eod)
            lengths[-1] += 1
        docs.append((ids, lengths))
    return docs


def test_one_and_two_workers_give_identical_megatron_files(jsonl, tmp_path):
    outputs = {}
    for workers in (1, 2):
        prefix = tmp_path / f"out{workers}" / "corpus"
        result = run_tool(
            "--input", jsonl, "--output-prefix", prefix, "--json-keys", "text", "title",
            "--tokenizer-type", "ByteLevel", "--append-eod", "--workers", workers, "--log-interval", 50,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert "Processed 150 documents" in result.stderr
        outputs[workers] = {
            name: (prefix.parent / name).read_bytes()
            for name in (
                "corpus_text_document.bin",
                "corpus_text_document.idx",
                "corpus_title_document.bin",
                "corpus_title_document.idx",
            )
        }
    assert outputs[1] == outputs[2]
    for key in ("text", "title"):
        ds = IndexedDataset(str(tmp_path / "out2" / f"corpus_{key}_document"))
        assert ds.dtype == np.uint16  # Megatron's optimal dtype for a vocabulary of 257
        expected = expected_documents(key, append_eod=True)
        assert ds.num_documents == len(DOCS)
        flat_lengths = [n for _, lengths in expected for n in lengths]
        assert ds.sequence_lengths.tolist() == flat_lengths
        for d, (ids, _) in enumerate(expected):
            begin, end = ds.document_indices[d], ds.document_indices[d + 1]
            got = np.concatenate([ds[i] for i in range(begin, end)]) if end > begin else np.zeros(0)
            assert got.tolist() == ids
            if ids:
                assert got[-1] == 256 and (got[:-1] < 256).all()
    text = IndexedDataset(str(tmp_path / "out2" / "corpus_text_document"))
    assert ByteLevelTokenizer().detokenize(text[1]) == "Zoë says ünïcödé ✓"  # doc 1 ("") has no sequence


def test_without_append_eod_there_is_no_eod(jsonl, tmp_path):
    prefix = tmp_path / "noeod"
    result = run_tool("--input", jsonl, "--output-prefix", prefix, "--tokenizer-type", "ByteLevel")
    assert result.returncode == 0, result.stderr
    ds = IndexedDataset(f"{prefix}_text_document")
    tokens = np.concatenate([ds[i] for i in range(len(ds))])
    assert (tokens < 256).all() and len(tokens) == sum(len(ids) for ids, _ in expected_documents("text", False))
    assert not Path(f"{prefix}_title_document.idx").exists()


def test_bad_input_gives_one_error_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": broken\n')
    result = run_tool("--input", bad, "--output-prefix", tmp_path / "x", "--tokenizer-type", "ByteLevel")
    assert result.returncode == 1 and result.stderr.strip() == f"error: {bad}:2: invalid JSON (Expecting value)"
    bad.write_text('{"body": "ok"}\n')
    result = run_tool(
        "--input", bad, "--output-prefix", tmp_path / "x", "--tokenizer-type", "ByteLevel", "--workers", 2
    )
    assert result.returncode == 1 and "no key 'text'" in result.stderr
    assert not list(tmp_path.glob("x_*"))  # no partial outputs left behind
    result = run_tool(
        "--input", tmp_path / "nope.jsonl", "--output-prefix", tmp_path / "x", "--tokenizer-type", "ByteLevel"
    )
    assert result.returncode == 2 and "no such file" in result.stderr


def _files(directory):
    return {p.name: p.read_bytes() for p in sorted(Path(directory).iterdir()) if p.is_file()}


@pytest.mark.parametrize("workers", [1, 2])
def test_a_failed_run_leaves_the_existing_dataset_untouched(jsonl, tmp_path, workers):
    """Megatron's builder opens the final .bin at the start: a failure deleted the dataset it would
    have replaced. Here both files are written under temporary names and renamed only on success."""
    out = tmp_path / "out"
    result = run_tool("--input", jsonl, "--output-prefix", out / "good", "--tokenizer-type", "ByteLevel")
    assert result.returncode == 0, result.stderr
    before = _files(out)
    assert set(before) == {"good_text_document.bin", "good_text_document.idx"}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n' * 300 + '{"text": broken\n')
    result = run_tool("--input", bad, "--output-prefix", out / "good", "--tokenizer-type", "ByteLevel",
                      "--workers", workers)
    assert result.returncode == 1 and result.stderr.strip() == f"error: {bad}:301: invalid JSON (Expecting value)"
    assert _files(out) == before  # byte-identical, and no temporary file left behind
    bad.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')  # Latin-1, not UTF-8
    result = run_tool("--input", bad, "--output-prefix", out / "good", "--tokenizer-type", "ByteLevel",
                      "--workers", workers)
    assert result.returncode == 1 and result.stderr.strip() == \
        f"error: {bad}:2: not UTF-8 text (invalid continuation byte at byte 14 of the line)"
    assert _files(out) == before


def test_an_interrupted_run_leaves_the_existing_dataset_untouched(jsonl, tmp_path, monkeypatch, capsys):
    """Ctrl-C mid-run: one line, exit 130, the previous dataset as it was (in this process: the
    KeyboardInterrupt a SIGINT raises, at the builder's next document)."""
    sys.path.insert(0, str(ROOT / "tools"))
    import preprocess_data

    from core.data.indexed_dataset import IndexedDatasetBuilder

    out = tmp_path / "out"
    flags = ["--input", str(jsonl), "--output-prefix", str(out / "good"), "--tokenizer-type", "ByteLevel"]
    assert preprocess_data.main(flags) == 0
    before = _files(out)
    added = []

    def interrupted(self, tokens, lengths):
        added.append(1)
        if len(added) == 50:
            raise KeyboardInterrupt
        return original(self, tokens, lengths)

    original = IndexedDatasetBuilder.add_document
    monkeypatch.setattr(IndexedDatasetBuilder, "add_document", interrupted)
    capsys.readouterr()
    assert preprocess_data.main(flags) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        f"error: interrupted; --output-prefix {out / 'good'}: nothing written or replaced"
    assert _files(out) == before


def test_an_unwritable_output_is_one_line(jsonl, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = run_tool("--input", jsonl, "--output-prefix", blocker / "sub" / "x", "--tokenizer-type", "ByteLevel")
    assert result.returncode == 1 and result.stderr == \
        f"error: --output-prefix {blocker / 'sub' / 'x'}: {blocker} is a file, not a directory\n"
    result = run_tool("--input", tmp_path / "nope.jsonl", "--output-prefix", tmp_path / "x", "--tokenizer-type",
                      "ByteLevel")
    assert result.returncode == 2 and result.stderr == \
        f"error: --input {tmp_path / 'nope.jsonl'}: no such file (--help lists the flags)\n"


def test_tokenizer_registry():
    byte = build_tokenizer("ByteLevel")
    assert (byte.vocab_size, byte.eod) == (257, 256)
    assert byte.tokenize("é") == [195, 169] and byte.detokenize([104, 105, 256]) == "hi"
    null = build_tokenizer("NullTokenizer", vocab_size=100)
    assert isinstance(null, NullTokenizer) and (null.vocab_size, null.eod) == (101, 100)
    assert null.tokenize("3 1 4") == [3, 1, 4] and null.detokenize([3, 1]) == "3 1"
    with pytest.raises(ValueError, match="unknown --tokenizer-type 'Nope'"):
        build_tokenizer("Nope")
    with pytest.raises(ValueError, match="needs --tokenizer-model"):
        build_tokenizer("HuggingFaceTokenizer")


def test_huggingface_tokenizer_without_the_package_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as on a host without it: import fails
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ImportError, match="pip install tokenizers"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    with pytest.raises(ImportError, match="GPT2BPETokenizer needs the tokenizers package: pip install tokenizers"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "tokenizer.json"),
                        merge_file=str(tmp_path / "tokenizer.json"))


def test_huggingface_tokenizer_with_the_package(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=80, special_tokens=["[UNK]", "<|endoftext|>"])
    tok.train_from_iterator([d["text"] for d in DOCS if isinstance(d["text"], str)] * 3, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    assert hf.eod == tok.token_to_id("<|endoftext|>") and hf.vocab_size == tok.get_vocab_size()
    assert hf.tokenize("document number 7") == tok.encode("document number 7").ids
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text("".join(json.dumps({"text": f"document number {i}"}) + "\n" for i in range(5)))
    result = run_tool(
        "--input", jsonl, "--output-prefix", tmp_path / "hf", "--tokenizer-type", "HuggingFaceTokenizer",
        "--tokenizer-model", tmp_path / "tokenizer.json", "--append-eod", "--workers", 2,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    ds = IndexedDataset(str(tmp_path / "hf_text_document"))
    assert ds[3].tolist() == tok.encode("document number 3").ids + [hf.eod]


def test_gpt2_bpe_tokenizer_with_the_package(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    trained = tokenizers.ByteLevelBPETokenizer()
    texts = [d["text"] for d in DOCS if isinstance(d["text"], str)]
    trained.train_from_iterator(texts * 3, vocab_size=300, min_frequency=1, special_tokens=["<|endoftext|>"])
    vocab_file, merge_file = trained.save_model(str(tmp_path))
    gpt2 = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    assert gpt2.eod == trained.token_to_id("<|endoftext|>") and gpt2.vocab_size == trained.get_vocab_size()
    for text in texts[:20]:
        assert gpt2.tokenize(text) == trained.encode(text).ids
        assert gpt2.detokenize(gpt2.tokenize(text)) == text
    with pytest.raises(ValueError, match="needs --vocab-file and --merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file)
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts[:30]))
    result = run_tool(
        "--input", jsonl, "--output-prefix", tmp_path / "gpt2", "--tokenizer-type", "GPT2BPETokenizer",
        "--vocab-file", vocab_file, "--merge-file", merge_file, "--append-eod", "--workers", 2,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    ds = IndexedDataset(str(tmp_path / "gpt2_text_document"))
    expected = [gpt2.tokenize(text) + [gpt2.eod] for text in texts[:30] if text]  # an empty text has no sequence
    assert [ds[i].tolist() for i in range(len(ds))] == expected


def test_megatrons_flags():
    """The flags of Megatron's tools/preprocess_data.py that this tool implements."""
    help_text = run_tool("--help").stdout
    for flag in ("--input", "--json-keys", "--output-prefix", "--tokenizer-type", "--tokenizer-model",
                 "--vocab-file", "--merge-file", "--vocab-size", "--append-eod", "--workers", "--log-interval"):
        assert flag in help_text, flag
