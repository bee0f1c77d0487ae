"""The data pipeline: Megatron's preprocessing throughput and the data loader's share of a step.

    python bench/data.py            # ~1.5 min on 2 cores
    python bench/data.py --quick    # tiny sizes, ~20 s

1. **Preprocessing**: the built-in corpus (``core.data.load_corpus``: the Python reference shipped
   with CPython) is cut into documents (consecutive paragraphs of at least 1,000 characters,
   ~1.3 KB each), replicated to ``--bytelevel-mib`` / ``--bpe-mib`` of JSONL and tokenized by
   ``tools/preprocess_data.py --append-eod`` as users run it (a subprocess each), with
   ``--workers 1`` and ``--workers 2``, for the ``ByteLevel`` tokenizer and, when the
   ``tokenizers`` package is importable, a byte-level BPE of ``--bpe-vocab`` ids trained on the
   same documents (``GPT2BPETokenizer`` with its ``vocab.json``/``merges.txt``). The runs go
   round-robin (``--reps`` rounds, so the host's slow spells hit every case alike) and each
   case reports its median: documents/s and input MiB/s over the tool's own elapsed time (its
   ``Done:`` line: tokenizing and writing, not the interpreter's start), the whole process's
   wall time, and the 2-worker speed-up. The outputs of 1 and 2 workers must be identical.
2. **Loader share of a training step**: the ``ByteLevel`` sections corpus and a corpus of single
   paragraphs (~180 B documents) as two indexed datasets, blended ``0.7 / 0.3`` under
   ``--split 969,30,1`` by ``launch/pretrain.py``'s own data pipeline (``PretrainingData``
   built from its flags: ``build_gpt_datasets`` with Megatron's sample counts); one global
   batch is ``next_train_batch``: the sampler's next ``global_batch_size`` samples, their
   ``tokens``, ``labels`` and ``loss_mask`` stacked into numpy arrays and put on the devices
   (``jax.make_array_from_callback`` over the data-parallel sharding).
   Side by side, round-robin with it: the text-corpus loader of the pretraining loop
   (``PretrainingData.next_train_batch``) and one training step of ``Pretrainer`` with the
   ``launch/pretrain.py`` defaults in one process (tp=pp=1, the CPU devices and malloc settings
   of the launch path). Medians; the share is loader / step (target < 2%).

Prints the tables and writes ``bench/results/data.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import filecmp
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from timing import BenchRun  # noqa: E402

from core.atomic_files import write_text_atomically  # noqa: E402

TOOL = ROOT / "tools" / "preprocess_data.py"
MIB = 1024 * 1024
SPLIT = "969,30,1"
"""Megatron's ``--split`` of the loader's blend."""
BLEND_WEIGHTS = (0.7, 0.3)
"""Weights of the sections and the paragraphs datasets in the loader's blend."""


# -- the corpus -------------------------------------------------------------------------------
def corpus_documents(unit: str = "section", min_chars: int = 1000) -> list[str]:
    """The built-in corpus as documents: ``paragraph`` (blank-line separated) or ``section``
    (consecutive paragraphs joined until at least ``min_chars`` characters)."""
    from core.data import load_corpus

    text, _ = load_corpus(None)
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
    if unit == "paragraph":
        return paragraphs
    documents, current, length = [], [], 0
    for paragraph in paragraphs:
        current.append(paragraph)
        length += len(paragraph)
        if length >= min_chars:
            documents.append("\n\n".join(current))
            current, length = [], 0
    return documents + (["\n\n".join(current)] if current else [])


def write_jsonl(path: Path, documents: Sequence[str], target_bytes: int, min_copies: int = 1) -> int:
    """Write whole copies of ``documents`` as ``{"text": ...}`` lines until ``target_bytes``; returns the bytes."""
    lines = "".join(json.dumps({"text": d}) + "\n" for d in documents).encode()
    copies = max(min_copies, math.ceil(target_bytes / len(lines)))
    path.write_bytes(lines * copies)
    return len(lines) * copies


def train_bpe(documents: Sequence[str], directory: Path, vocab_size: int) -> list[str]:
    """Train a byte-level BPE (``tokenizers``) on ``documents``; the ``GPT2BPETokenizer`` flags for it."""
    from tokenizers import ByteLevelBPETokenizer

    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(documents, vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  show_progress=False)
    directory.mkdir(parents=True, exist_ok=True)
    vocab, merges = tokenizer.save_model(str(directory))
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges]


# -- preprocessing ----------------------------------------------------------------------------
def _tool_env() -> dict[str, str]:
    """The environment of a preprocessing run: this one without the training launch's malloc tunables."""
    env = dict(os.environ)
    env.pop("GLIBC_TUNABLES", None)
    return env


def run_preprocess(jsonl: Path, prefix: Path, tokenizer_flags: Sequence[str], workers: int) -> dict[str, float]:
    """One ``tools/preprocess_data.py`` process: documents, the tool's own seconds and the wall seconds."""
    cmd = [sys.executable, str(TOOL), "--input", str(jsonl), "--json-keys", "text", "--output-prefix", str(prefix),
           *tokenizer_flags, "--append-eod", "--workers", str(workers), "--log-interval", str(10**9)]
    start = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=_tool_env(), timeout=1800)
    wall = time.perf_counter() - start
    done = re.search(r"Done: (\d+) documents, \d+ bytes in ([0-9.]+) s", out.stderr)
    if out.returncode or done is None:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-2000:]}")
    return {"docs": int(done.group(1)), "tool_s": max(float(done.group(2)), 0.01), "wall_s": wall}


def preprocessing_rows(cases: dict[str, tuple[Path, list[str]]], workdir: Path, reps: int,
                       workers: Sequence[int] = (1, 2)) -> list[dict[str, Any]]:
    """Every case (name -> JSONL and tokenizer flags) at every worker count, round-robin for ``reps``
    rounds; one row per case and worker count with the medians and rates."""
    runs: dict[tuple[str, int], list[dict[str, float]]] = {(c, w): [] for c in cases for w in workers}
    for _ in range(reps):
        for (name, w), results in runs.items():
            jsonl, flags = cases[name]
            results.append(run_preprocess(jsonl, workdir / f"{name}_w{w}", flags, w))
    rows = []
    for (name, w), results in runs.items():
        jsonl = cases[name][0]
        tool_s = statistics.median(r["tool_s"] for r in results)
        mib = jsonl.stat().st_size / MIB
        rows.append({"tokenizer": name, "workers": w, "docs": results[0]["docs"], "mib": mib, "tool_s": tool_s,
                     "wall_s": statistics.median(r["wall_s"] for r in results),
                     "docs_per_s": results[0]["docs"] / tool_s, "mib_per_s": mib / tool_s,
                     "identical": filecmp.cmp(workdir / f"{name}_w{w}_text_document.bin",
                                              workdir / f"{name}_w{workers[0]}_text_document.bin", shallow=False)})
    for row in rows:
        first = next(r for r in rows if r["tokenizer"] == row["tokenizer"] and r["workers"] == workers[0])
        row["speedup"] = first["tool_s"] / row["tool_s"]
    return rows


# -- the loader -------------------------------------------------------------------------------
def megatron_num_samples(args: argparse.Namespace) -> list[int]:
    """Megatron's train/valid/test sample counts for ``--train-iters``, ``--eval-interval``, ``--eval-iters``."""
    valid_iters = (args.train_iters // args.eval_interval + 1) * args.eval_iters
    return [args.train_iters * args.global_batch_size, valid_iters * args.global_batch_size,
            args.eval_iters * args.global_batch_size]


def indexed_data(prefixes: Sequence[str], trainer: Any, cache_dir: str) -> Any:
    """``launch/pretrain.py``'s data pipeline (``PretrainingData``) on the blend of ``prefixes``
    (weights :data:`BLEND_WEIGHTS`, ``--split`` :data:`SPLIT`, ByteLevel) for ``trainer``'s flags."""
    from core.training.arguments import parse_args
    from core.training.pretraining_data import PretrainingData
    from core.training.run_config import data_config, training_config

    data_path = [str(x) for pair in zip(BLEND_WEIGHTS, prefixes) for x in pair]
    flags = [*trainer.argv, "--data-path", *data_path, "--split", SPLIT, "--data-cache-path", cache_dir]
    args = parse_args(flags)
    return PretrainingData(data_config(args), training_config(args), trainer.state)


def default_pretrainer(argv: Sequence[str] = (), devices: Sequence[Any] | None = None) -> Any:
    """``Pretrainer`` with the ``launch/pretrain.py`` defaults (and ``argv``), tp=pp=1 over ``devices`` (all)."""
    import jax

    from core import parallel_state as ps
    from core.training.arguments import parse_args, validate_args
    from core.training.pretrainer import Pretrainer
    from core.training.run_config import pretrain_config

    devices = list(devices or jax.devices())
    args = parse_args(["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
                       "--no-progress-bar", *argv])
    layout = validate_args(args, len(devices))
    trainer = Pretrainer(pretrain_config(args), layout, ps.build_parallel_state(1, 1, devices=devices))
    trainer.argv = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", *argv]
    return trainer


def loader_and_step_seconds(trainer: Any, indexed: Any, rounds: int, warmup: int = 2) -> dict[str, list[float]]:
    """Per round, each waited for: the next global batch of the indexed pipeline on the devices
    (``megatron``; its numpy part ``megatron_host``), the text loader's batch (``text``), one
    training step (``step``); the seconds of ``rounds`` rounds after ``warmup``."""
    import jax

    params, opt_state = trainer.params, trainer.opt_state
    times: dict[str, list[float]] = {"megatron": [], "megatron_host": [], "text": [], "step": []}
    for i in range(warmup + rounds):
        t0 = time.perf_counter()
        host = indexed.next_train_host_batch()
        t1 = time.perf_counter()
        jax.block_until_ready(indexed.to_global(host))
        t2 = time.perf_counter()
        batch = jax.block_until_ready(trainer.data.next_train_batch())
        t3 = time.perf_counter()
        params, opt_state, metrics = trainer.train_step(params, opt_state, batch)
        jax.block_until_ready((params, metrics))
        t4 = time.perf_counter()
        if i >= warmup:
            for key, seconds in zip(times, (t2 - t0, t1 - t0, t3 - t2, t4 - t3)):
                times[key].append(seconds)
    return times


# -- the command ------------------------------------------------------------------------------
def _args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, one round (a smoke run)")
    p.add_argument("--reps", type=int, default=5, help="preprocessing rounds (median)")
    p.add_argument("--bytelevel-mib", type=float, default=24.0, help="JSONL size for the ByteLevel runs")
    p.add_argument("--bpe-mib", type=float, default=6.0, help="JSONL size for the BPE runs")
    p.add_argument("--bpe-vocab", type=int, default=4096, help="vocabulary of the trained BPE")
    p.add_argument("--rounds", type=int, default=30, help="timed loader/step rounds (median)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "data.md"))
    p.add_argument("--machine", default="2-core AVX2 VM (AMD EPYC)", help="the machine, for the report")
    p.add_argument("--note", default="", help="a note for the report (e.g. other jobs on the cores)")
    a = p.parse_args(argv)
    if a.quick:
        a.reps, a.bytelevel_mib, a.bpe_mib, a.bpe_vocab, a.rounds = 1, 1.0, 0.5, 1024, 5
    return a


def _have_tokenizers() -> bool:
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        return False
    return True


def preprocessing(a: argparse.Namespace, workdir: Path) -> tuple[list[dict[str, Any]], dict[str, Path]]:
    """Part 1: the JSONL files, the BPE, the side-by-side runs; rows and the ByteLevel outputs to blend."""
    sections, paragraphs = corpus_documents("section"), corpus_documents("paragraph")
    # min_copies 2: enough documents that the 1/1000 test split of 969,30,1 is not empty.
    write_jsonl(workdir / "sections.jsonl", sections, int(a.bytelevel_mib * MIB), min_copies=2)
    cases = {"ByteLevel": (workdir / "sections.jsonl", ["--tokenizer-type", "ByteLevel"])}
    if _have_tokenizers():
        write_jsonl(workdir / "sections_bpe.jsonl", sections, int(a.bpe_mib * MIB))
        cases[f"BPE {a.bpe_vocab}"] = (workdir / "sections_bpe.jsonl",
                                       train_bpe(sections, workdir / "bpe", a.bpe_vocab))
    rows = preprocessing_rows(cases, workdir, a.reps)
    write_jsonl(workdir / "paragraphs.jsonl", paragraphs, 0)
    run_preprocess(workdir / "paragraphs.jsonl", workdir / "paragraphs", ["--tokenizer-type", "ByteLevel"], 1)
    prefixes = {"sections": workdir / "ByteLevel_w1_text_document",
                "paragraphs": workdir / "paragraphs_text_document"}
    return rows, prefixes


def preprocessing_table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of :func:`preprocessing_rows`."""
    lines = ["| tokenizer | workers | documents | input MiB | tool s | wall s | docs/s | MiB/s | vs 1 worker |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['tokenizer']} | {r['workers']} | {r['docs']} | {r['mib']:.1f} | {r['tool_s']:.2f} | "
              f"{r['wall_s']:.2f} | {r['docs_per_s']:.0f} | {r['mib_per_s']:.2f} | {r['speedup']:.2f}x |"
              for r in rows]
    return "\n".join(lines)


def loader_table(times: dict[str, list[float]], describe: dict[str, str]) -> str:
    """The markdown table of :func:`loader_and_step_seconds` (median ms, share of the step)."""
    step = statistics.median(times["step"])
    lines = ["| per global batch | median ms | share of the step |", "|---|---|---|"]
    for key, ts in times.items():
        ms = 1e3 * statistics.median(ts)
        lines.append(f"| {describe[key]} | {ms:.2f} | {100 * ms / 1e3 / step:.2f}% |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """Run both parts, print the tables, write the report."""
    a = _args(argv)
    run = BenchRun()
    with tempfile.TemporaryDirectory(prefix="mcj-bench-data-") as tmp:
        workdir = Path(tmp)
        rows, prefixes = preprocessing(a, workdir)
        pre_table = preprocessing_table(rows)
        print(pre_table, flush=True)

        import jax

        trainer = default_pretrainer()
        start = time.perf_counter()
        indexed = indexed_data([str(prefixes["sections"]), str(prefixes["paragraphs"])], trainer,
                               str(workdir / "cache"))
        build_s = time.perf_counter() - start
        times = loader_and_step_seconds(trainer, indexed, a.rounds)
    args, n = trainer.training, jax.device_count()
    describe = {
        "megatron": f"indexed data (`PretrainingData.next_train_batch`): `BlendedDataset` "
                    f"{BLEND_WEIGHTS[0]}/{BLEND_WEIGHTS[1]} of 2 `GPTDataset`s, {args.global_batch_size} x "
                    f"{args.seq_length}, tokens/labels/loss_mask, to {n} devices",
        "megatron_host": "of which samples and numpy stacking (the rest: to the devices)",
        "text": "text-corpus loader (`PretrainingData.next_train_batch`)",
        "step": f"training step, `launch/pretrain.py` defaults, tp=pp=1, dp={n} ({jax.devices()[0].platform})"}
    share = statistics.median(times["megatron"]) / statistics.median(times["step"])
    load_table = loader_table(times, describe)
    verdict = "met" if share < 0.02 else "NOT met"
    print(f"\n{load_table}\n\nMegatron loader share {100 * share:.2f}% of the step: target < 2% {verdict}; "
          f"pipeline build with its indices (once, cache miss) {build_s:.2f} s")
    same = all(r["identical"] for r in rows)
    header = run.header(f"python bench/data.py{' --quick' if a.quick else ''}", a.machine, a.note) + "\n"
    report = (f"{header}\nPreprocessing (`tools/preprocess_data.py --append-eod`, {a.reps} round(s) round-robin, "
              f"medians; rates over the tool's own time; outputs of 1 and 2 workers identical: "
              f"{'yes' if same else 'NO'}):\n\n{pre_table}\n\nData loader vs training step (median of {a.rounds} "
              f"round-robin rounds; `--split {SPLIT}`):\n\n{load_table}\n\nMegatron loader share: "
              f"**{100 * share:.2f}%** (target < 2%: {verdict}); pipeline build with its indices once (cache "
              f"miss): {build_s:.2f} s.\n")
    write_text_atomically(a.out, report)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    from core.runtime.cpu_devices import configure_cpu_devices, cpu_devices_per_process
    from core.runtime.cpu_malloc import reexec_with_malloc_settings
    from core.training.arguments import layout_fits, parse_args

    # As launch/pretrain.py does for its default run (100 iterations, compilation cache on).
    reexec_with_malloc_settings(split_heaps=False)
    defaults = parse_args(["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"])
    configure_cpu_devices(cpu_devices_per_process(lambda n: layout_fits(defaults, n)))
    main()
