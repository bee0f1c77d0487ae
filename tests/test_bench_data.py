"""``bench/data.py``'s measurement functions run on tiny sizes and give positive, finite numbers
(no timing assertions), and the 1- and 2-worker preprocessing outputs are identical."""

import importlib.util
import math
from pathlib import Path

import jax
import pytest
from pretrain_harness import TINY

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_data", ROOT / "bench" / "data.py")
bench_data = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_data)


def _positive(x) -> bool:
    return math.isfinite(x) and x > 0


def test_preprocessing_rows_and_loader_share(tmp_path):
    sections = bench_data.corpus_documents("section")
    paragraphs = bench_data.corpus_documents("paragraph")
    assert len(paragraphs) > len(sections) > 100
    bench_data.write_jsonl(tmp_path / "s.jsonl", sections, 0, min_copies=2)
    cases = {"ByteLevel": (tmp_path / "s.jsonl", ["--tokenizer-type", "ByteLevel"])}
    if importlib.util.find_spec("tokenizers") is not None:
        bench_data.write_jsonl(tmp_path / "b.jsonl", sections[:50], 0)
        cases["BPE"] = (tmp_path / "b.jsonl", bench_data.train_bpe(sections[:50], tmp_path / "bpe", 300))
    rows = bench_data.preprocessing_rows(cases, tmp_path, reps=1)
    assert [(r["tokenizer"], r["workers"]) for r in rows] == [(c, w) for c in cases for w in (1, 2)]
    for r in rows:
        assert r["identical"] and r["docs"] > 0
        assert all(_positive(r[k]) for k in ("mib", "tool_s", "wall_s", "docs_per_s", "mib_per_s", "speedup"))
    assert "| ByteLevel | 2 |" in bench_data.preprocessing_table(rows)

    bench_data.write_jsonl(tmp_path / "p.jsonl", paragraphs, 0)
    bench_data.run_preprocess(tmp_path / "p.jsonl", tmp_path / "p", ["--tokenizer-type", "ByteLevel"], 1)
    trainer = bench_data.default_pretrainer([*TINY, "--num-layers", "1", "--train-iters", "4"], jax.devices()[:2])
    indexed = bench_data.indexed_data([str(tmp_path / "ByteLevel_w1_text_document"), str(tmp_path / "p_text_document")],
                                      trainer, str(tmp_path / "cache"))
    assert len(indexed.train_data) == trainer.training.train_iters * trainer.training.global_batch_size
    batch = indexed.next_train_host_batch()
    assert {k: v.shape for k, v in batch.items()} == {k: (16, 32) for k in ("tokens", "labels", "loss_mask")}
    times = bench_data.loader_and_step_seconds(trainer, indexed, rounds=2, warmup=1)
    assert set(times) == {"megatron", "megatron_host", "text", "step"}
    assert all(len(ts) == 2 and all(_positive(t) for t in ts) for ts in times.values())
    table = bench_data.loader_table(times, {k: k for k in times})
    assert table.count("%") == 4


@pytest.mark.parametrize("quick", [True, False])
def test_arguments(quick):
    a = bench_data._args(["--quick"] if quick else [])
    assert (a.reps, a.rounds) == ((1, 5) if quick else (5, 30))
