"""GPU benchmark, one command: ``PYTHONPATH=. python bench/gpu.py`` on a GPU host (nothing to
download; about 5 minutes on one H100, 2 of them the GPU test set).

Steps, in order (each in its own process, so each gets the whole GPU; JAX reserves 75% of its
memory at start):

1. The device, JAX and jaxlib versions.
2. Causal attention forward + backward in bf16 on ``[b=8, s=2048, heads=16, d=128]``: the
   package's ``causal_attention`` against a direct ``jax.nn.dot_product_attention(...,
   implementation="cudnn")`` call and XLA's implementation; an embedding lookup's forward +
   backward as a bf16 scatter, an fp32 scatter (the model's) and a one-hot matmul.
3. A ~1.2B-parameter GPT (24 layers, hidden 2048, 16 heads, seq 2048, ``--bf16``) trained with
   ``launch/pretrain.py`` for 30 iterations: tokens/s, model TFLOP/s and MFU per GPU (against
   the datasheet dense bf16 peak), peak memory, compile time (first iteration minus a steady
   one), the process's time. ``--profile`` traces two steady steps and tabulates them
   (``core.training.profile_summary``), keeping the trace, its raw listing and the step's
   optimized HLO next to the report.
4. ``--sweep``: the one-GPU tuning sweep (micro-batch size, ``--recompute-granularity``,
   ``--scan-layers``), one launch per setting, most telling first (``--sweep-settings``).
5. The GPU test set (``pytest -m gpu tests/test_gpu.py``; ``--no-tests`` skips it).
6. ``--ddp-overhead``: ``bench/ddp_overhead.py --gpt-1b --bf16``: the package's step against a
   plain jitted step of the same GPT at dp = 1 (target: within 3%).
7. ``--checkpoint``: ``bench/checkpoint.py --gpu --devices 1``: checkpoint save and load time
   and size by model size, and the step-time stall of an async save (target: <= 10% of a step
   for the default model).
8. ``--moe``: a MoE GPT (12 layers, hidden 1024, 8 experts top-2 of FFN 2048, dropless
   all-to-all, ``ragged_dot`` grouped GEMM, balanced routing by
   ``--moe-router-force-load-balancing``) and the dense GPT of equal active parameters (FFN
   4096), and their step-time ratio (target: <= 1.5x).
9. ``--fp8`` (run after step 3): the ~1.2B GPT and a Llama-3.2-1B-shaped model, each in bf16 and
   bf16 + FP8 (``--fp8-format``, once per ``--fp8-recipes`` entry) on the same data, 200 steps:
   tokens/s and its ratio to bf16's, MFU against the bf16 and the FP8 dense peaks, memory, the
   loss against bf16's, cuBLASLt FP8 GEMMs in the compiled HLO (``bench/gpu_fp8.py``). The
   issue-63 rows on one H100 / H200, one command::

       PYTHONPATH=. python bench/gpu.py --no-gpt --no-tests --fp8 --fp8-recipes delayed,tensorwise --deadline-s 1800

``--no-gpt`` skips steps 2 and 3 (a second call after a run that had them; written to
``gpu_<device>_moe_checkpoint.md``, ``gpu_<device>_fp8.md``). ``--deadline-s`` starts no step
after that many seconds (to fit a time limit on the command): the report says what was skipped,
and is rewritten as each step ends. Writes ``bench/results/gpu_<device>.md`` (``--out``) and
prints it. ``--smoke`` runs the same steps with tiny shapes (it runs on the CPU too: the test
suite checks the script that way).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import gpu_fp8  # noqa: E402

from core.atomic_files import write_atomically, write_text_atomically  # noqa: E402


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes: check the script (CPU or GPU)")
    p.add_argument("--no-tests", action="store_true", help="skip the GPU test set")
    p.add_argument("--no-gpt", action="store_true", help="skip the attention timing and the ~1.2B GPT (steps 3 "
                   "and 4): with --moe and/or --checkpoint, a second call after a run that had them")
    p.add_argument("--no-kernels", action="store_true", help="skip the attention and embedding timings (measured "
                   "before): the GPT run alone, the baseline of a sweep")
    p.add_argument("--iters", type=int, default=30, help="GPT training iterations")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--gpt-flags", default="", help="extra launch/pretrain.py flags (e.g. --scan-layers)")
    p.add_argument("--moe", action="store_true", help="also time a MoE GPT against the dense one of equal active "
                   "parameters (step 5)")
    p.add_argument("--moe-runs", default="dense,ragged_dot,windows", help="--moe's launches, in order: the dense "
                   "GPT and the MoE GPT's grouped GEMM implementations (--profile traces the first MoE one)")
    p.add_argument("--ddp-overhead", action="store_true", help="also time the package's step against a plain "
                   "jitted step of the GPT at dp = 1 (bench/ddp_overhead.py; target: <= 3%%)")
    p.add_argument("--checkpoint-gpt", action="store_true", help="also the checkpoint benchmark and async-save "
                   "stall of the ~1.2B GPT (one round, 20 steps after the save)")
    p.add_argument("--checkpoint", action="store_true", help="also measure checkpoints and the async-save stall "
                   "on one GPU (step 6)")
    p.add_argument("--profile", action="store_true", help="trace two steps of the GPT (launch/pretrain.py "
                   "--profile) and tabulate device time per op category and the top ops; with --moe the MoE GPT too")
    p.add_argument("--sweep", action="store_true", help="then the one-GPU tuning sweep: micro-batch size, "
                   "recompute none/selective/full, layers scanned vs unrolled (one launch each)")
    p.add_argument("--sweep-settings", type=int, default=5, help="how many of the sweep's settings to run (most "
                   "telling first; 15 in all)")
    p.add_argument("--sweep-skip", type=int, default=0, help="skip the sweep's first settings (measured before)")
    gpu_fp8.add_arguments(p)
    p.add_argument("--deadline-s", type=float, default=None, help="start no step after this many seconds (to fit "
                   "a time limit on the command): the report keeps what ran; each step's report is written as it "
                   "ends")
    p.add_argument("--out", default=None, help="markdown file (default bench/results/gpu_<device>.md)")
    p.add_argument("--part", choices=["info", "attention", "embedding", "checkpoint", "checkpoint-gpt"], default=None,
                   help=argparse.SUPPRESS)  # a child step
    return p.parse_args()


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def run_gpu_tests(timeout: float = 600) -> dict:
    """The GPU test set in a subprocess: passed/failed/skipped counts and seconds."""
    start = time.perf_counter()
    try:
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-m", "gpu",
                              str(ROOT / "tests" / "test_gpu.py")], capture_output=True, text=True, cwd=ROOT,
                             env=_env(), timeout=max(1, timeout))
    except subprocess.TimeoutExpired as err:
        # TimeoutExpired holds bytes whatever text= said
        out = subprocess.CompletedProcess(err.cmd, 1, (err.stdout or b"").decode(errors="replace"), "timed out")
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", out.stdout)}
    if out.returncode not in (0, 5):
        print(out.stdout[-4000:], out.stderr[-2000:], sep="\n")
    return {"passed": counts.get("passed", 0), "failed": counts.get("failed", 0) + counts.get("error", 0),
            "skipped": counts.get("skipped", 0), "seconds": time.perf_counter() - start}


def time_attention(shape: tuple[int, int, int, int], reps: int) -> dict[str, float | None]:
    """Median ms of forward + backward of causal attention on bf16 ``shape`` ([b, s, heads, d])."""
    import jax
    import jax.numpy as jnp
    from timing import median_seconds

    from core.transformer.dot_product_attention import causal_attention

    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, cot = (jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16) for key in keys)

    def fwd_bwd(attention):
        loss = lambda q, k, v: jnp.sum((attention(q, k, v) * cot).astype(jnp.float32))
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

    variants = {
        "package": lambda q, k, v: causal_attention(q, k, v, "bsnd"),
        "cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"),
        "xla": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla"),
    }
    times: dict[str, float | None] = {}
    for name, attention in variants.items():
        try:
            times[name] = 1e3 * median_seconds(fwd_bwd(attention), q, k, v, reps=reps, warmup=2)
        except Exception as err:  # cuDNN absent (CPU smoke run) or refusing the shape
            print(f"  attention {name}: {type(err).__name__}: {str(err).splitlines()[0][:200]}")
            times[name] = None
    return times


def time_embedding_backward(tokens: int, hidden: int, vocabs: tuple[int, ...], reps: int) -> dict[str, float]:
    """Median ms of an embedding lookup's forward + backward (``tokens`` byte-distributed ids into
    ``[V, hidden]``), per vocabulary size: the lookup in bf16 (a bf16 scatter-add backward), in
    fp32 then cast (an fp32 scatter-add: the model's path), and as a one-hot matmul."""
    import jax
    import jax.numpy as jnp
    from timing import median_seconds

    out = {}
    for vocab in vocabs:
        key_w, key_i, key_c = jax.random.split(jax.random.key(vocab), 3)
        weight = jax.random.normal(key_w, (vocab, hidden), jnp.float32)
        # Zipf-like ids: a few tokens take most positions, as in text (collisions in the scatter)
        ids = jnp.minimum(jax.random.pareto(key_i, 1.0, (tokens,)).astype(jnp.int32), vocab - 1)
        cot = jax.random.normal(key_c, (tokens, hidden), jnp.float32).astype(jnp.bfloat16)
        variants = {
            "bf16_scatter": lambda w, i, v: w.astype(jnp.bfloat16)[i],
            "fp32_scatter": lambda w, i, v: w[i].astype(jnp.bfloat16),
            "one_hot_matmul": lambda w, i, v: jax.nn.one_hot(i, v, dtype=jnp.bfloat16) @ w.astype(jnp.bfloat16),
        }
        for name, lookup in variants.items():
            loss = lambda w, i, c, f=lookup, v=vocab: jnp.sum((f(w, i, v) * c).astype(jnp.float32))
            grad = jax.jit(jax.grad(loss))
            out[f"V={vocab} {name}"] = 1e3 * median_seconds(grad, weight, ids, cot, reps=reps, warmup=2)
    return out


SMOKE_SHAPE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64"]
SMOKE_BATCH = ["--micro-batch-size", "2", "--global-batch-size", "4"]


def _training(a: argparse.Namespace) -> list[str]:
    return ["--bf16", "--train-iters", str(a.iters), "--log-interval", "1", "--eval-interval", "1000000", "--lr",
            "3e-4", "--lr-warmup-iters", "2", "--no-progress-bar"]


def gpt_shape(a: argparse.Namespace) -> list[str]:
    """The launch/pretrain.py flags of the benchmark GPT's shape."""
    if a.smoke:
        return SMOKE_SHAPE
    return ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048"]


def gpt_batch(a: argparse.Namespace) -> list[str]:
    """The launch/pretrain.py flags of the benchmark GPT's batch."""
    if a.smoke:
        return SMOKE_BATCH
    return ["--micro-batch-size", str(a.micro_batch_size), "--global-batch-size", str(a.global_batch_size)]


def gpt_flags(a: argparse.Namespace) -> list[str]:
    """The launch/pretrain.py flags of the benchmark GPT."""
    return [*gpt_shape(a), *gpt_batch(a), *_training(a), *a.gpt_flags.split()]


MOE = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall",
       "--moe-aux-loss-coeff", "0.01", "--moe-router-force-load-balancing"]
"""Step 5's MoE: 8 experts, top-2, dropless all-to-all, grouped GEMM, Megatron's aux loss; routing
balanced as in ``bench/moe.py``'s target row (random router logits, Megatron's benchmarking switch)."""


def moe_vs_dense_flags(a: argparse.Namespace) -> dict[str, list[str]]:
    """Step 5's GPTs: the dense GPT, the MoE of equal active parameters (every layer; each expert
    half the dense FFN, top-2) with ``ragged_dot`` experts, and the same MoE with the windowed
    grouped GEMM (``--moe-grouped-gemm-implementation windows``, the CPU's default)."""
    if a.smoke:
        shape, batch, ffn = SMOKE_SHAPE, SMOKE_BATCH, 128
    else:
        shape = ["--num-layers", "12", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "2048"]
        batch, ffn = ["--micro-batch-size", "4", "--global-batch-size", "8"], 4096
    common = [*shape, *batch, *_training(a)]
    moe = [*common, *MOE, "--moe-ffn-hidden-size", str(ffn // 2)]
    return {"dense": [*common, "--ffn-hidden-size", str(ffn)],
            "moe": [*moe, "--moe-grouped-gemm-implementation", "ragged_dot"],
            "moe, windows": [*moe, "--moe-grouped-gemm-implementation", "windows"]}


MOE_RUNS = {"dense": "dense", "ragged_dot": "moe", "windows": "moe, windows"}
"""``--moe-runs``' names and :func:`moe_vs_dense_flags`' keys."""


def moe_runs(a: argparse.Namespace) -> dict[str, list[str]]:
    """:func:`moe_vs_dense_flags`, those ``--moe-runs`` names, in its order."""
    flags = moe_vs_dense_flags(a)
    names = [n.strip() for n in a.moe_runs.split(",") if n.strip()]
    unknown = [n for n in names if n not in MOE_RUNS]
    if unknown:
        raise SystemExit(f"--moe-runs: unknown {', '.join(unknown)} (choose from {', '.join(MOE_RUNS)})")
    return {MOE_RUNS[n]: flags[MOE_RUNS[n]] for n in names}


def train_gpt(flags: list[str], timeout: float = 900, xla_flags: str = "") -> dict:
    """Run launch/pretrain.py with ``flags`` (one process, every local GPU; ``xla_flags`` added to
    ``XLA_FLAGS``); summarise its metrics file."""
    env = _env()
    env["XLA_FLAGS"] = " ".join(filter(None, [env.get("XLA_FLAGS"), xla_flags]))
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        cmd = [sys.executable, str(ROOT / "launch" / "pretrain.py"), *flags, "--metrics-file", str(metrics),
               "--compilation-cache-dir", str(Path(tmp) / "xla-cache")]  # a cold compile, measured
        start = time.perf_counter()
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=max(1, timeout))
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s", "process_s": time.perf_counter() - start}
        wall = time.perf_counter() - start
        if out.returncode:
            print(out.stdout[-3000:], out.stderr[-3000:], sep="\n")
            last = (out.stderr.strip().splitlines() or ["no output"])[-1]
            return {"error": f"exit {out.returncode}: {last[:200]}", "process_s": wall}
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
    header = next((line for line in out.stdout.splitlines() if "parameters" in line), "")
    steady = records[min(5, len(records) - 1):]  # after compile and the first steps
    step = statistics.median(r["step_time_s"] for r in steady)
    return {"header": header, "peak": next((line for line in out.stdout.splitlines() if "MFU against" in line), ""),
            "step_s": step, "tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in steady),
            "tflops_per_device": statistics.median(r["tflops_per_device"] for r in steady),
            "mfu": statistics.median(r["mfu"] for r in steady),
            "memory_gib": max(r["memory_per_device_bytes"] for r in records) / 2**30,
            "compile_s": records[0]["step_time_s"] - step, "first_loss": records[0]["loss"],
            "last_loss": records[-1]["loss"], "process_s": wall}


PROFILE_STEPS = 2
"""Steps ``--profile`` traces (ending 8 iterations before the last, in the steady state)."""


def profile_flags(a: argparse.Namespace, directory: str) -> list[str]:
    """launch/pretrain.py's flags that trace ``PROFILE_STEPS`` steady steps into ``directory``."""
    end = max(PROFILE_STEPS + 1, a.iters - 8)
    return ["--profile", "--profile-step-start", str(end - PROFILE_STEPS), "--profile-step-end", str(end),
            "--profile-dir", directory]


def hlo_dump_flags(directory: str) -> str:
    """XLA flags that dump the optimized HLO of the train step (``jit_body``, the shard-mapped step)
    under ``directory``: the trace's op names are its instructions, whose metadata names the source."""
    return f"--xla_dump_to={directory}/hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_body"


def _keep_hlo(directory: str, out: Path) -> str | None:
    """The largest optimized HLO dumped under ``directory`` (the train step), gzipped to
    ``<out>.hlo.txt.gz``; returns its text (None: nothing dumped)."""
    import gzip

    dumps = sorted(Path(directory).glob("hlo/*after_optimizations.txt"), key=lambda f: f.stat().st_size)
    if not dumps:
        return None
    text = dumps[-1].read_text()
    compressed = gzip.compress(text.encode())
    write_atomically(str(out) + ".hlo.txt.gz", lambda stream: stream.write(compressed))
    return text


def profile_report(directory: str, out: Path) -> list[str]:
    """The trace's summary tables (``core.training.profile_summary``); the trace file, its raw
    plane listing and the step's optimized HLO are kept next to ``out`` (``<out>.xplane.pb`` when
    under 15 MB, ``<out>.trace.txt``, ``<out>.hlo.txt.gz``)."""
    from core.training.profile_summary import markdown, summarize

    hlo = None
    try:
        hlo = _keep_hlo(directory, out)
    except OSError as err:
        print(f"  HLO dump not kept: {err}")
    lines = [f"Profile of {PROFILE_STEPS} steady GPT steps (`launch/pretrain.py --profile`; "
             "`python -m core.training.profile_summary DIR`), device time per step:", ""]
    try:
        trace = _keep_trace(directory, out)
        return lines + [markdown(summarize(trace, steps=PROFILE_STEPS, top=12, hlo_text=hlo)), ""]
    except Exception as err:  # a trace layout the summary misreads: the raw listing is kept
        return lines + [f"summary failed: {type(err).__name__}: {str(err)[:300]}", ""]


def embedding_report(times: dict) -> list[str]:
    """The embedding backward timing's lines (``times``: the child's dict, or ``{"error": ...}``)."""
    lines = ["Embedding lookup, forward + backward, 8192 tokens (Zipf-distributed ids), hidden 2048 (median ms):", ""]
    if "error" in times:
        return lines + [f"failed: {times['error']}", ""]
    rows = [f"| {k} | {v:.3f} |" for k, v in times.items()]
    return lines + ["| vocabulary, variant | ms |", "|---|---|", *rows, ""]


SWEEP_XLA_FLAGS = ("--xla_gpu_enable_cublaslt=true", "--xla_gpu_enable_triton_gemm=false")
"""The sweep's XLA flag rows (each on the default setting)."""


SMOKE_VOCAB = 1000
"""The smoke run's realistic-vocabulary row."""
GPT2_VOCAB = 50256
"""The realistic-vocabulary row's ``--vocab-size`` (NullTokenizer: 50257 ids with EOD, padded to
50304 as GPT-2's)."""


def write_token_ids(prefix: str, vocab: int, tokens: int, seed: int = 0) -> None:
    """A Megatron ``.bin``/``.idx`` dataset at ``prefix`` of ``tokens`` random ids below ``vocab``
    (Zipf-distributed, as text is), in documents of 1000-3000 tokens: data for a GPT of a real
    vocabulary without a tokenizer or a download."""
    import numpy as np

    from core.data.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path

    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(get_bin_path(prefix))
    written = 0
    while written < tokens:
        n = int(rng.integers(1000, 3000))
        builder.add_item(np.minimum(rng.zipf(1.2, n) - 1, vocab - 1).astype(np.int32))
        builder.end_document()
        written += n
    builder.finalize(get_idx_path(prefix))


def sweep_vocab(a: argparse.Namespace) -> int:
    """The realistic-vocabulary row's ``--vocab-size``."""
    return SMOKE_VOCAB if a.smoke else GPT2_VOCAB


def sweep_settings(a: argparse.Namespace, data_prefix: str = "DATA") -> list[tuple[str, list[str], str]]:
    """The one-GPU tuning sweep of the benchmark GPT, most telling first: ``(name, launch flags,
    XLA flags)``; the realistic-vocabulary row reads ``data_prefix`` (:func:`write_token_ids`)."""
    m, half, double = (2, 1, 4) if a.smoke else (a.micro_batch_size, a.micro_batch_size // 2, a.micro_batch_size * 2)
    gb = 4 if a.smoke else a.global_batch_size
    training = _training(argparse.Namespace(iters=SWEEP_ITERS))

    def setting(layers: str, mb: int, recompute: str | None = None, batch: int = gb, xla: str = "",
                vocab: int | None = None) -> tuple[str, list[str], str]:
        flags = [*gpt_shape(a), "--micro-batch-size", str(mb), "--global-batch-size", str(batch), *training]
        flags += ["--scan-layers"] if layers == "scanned" else []
        flags += ["--recompute-granularity", recompute] if recompute else []
        name = f"{layers}, mb {mb}" + (f", {recompute} recompute" if recompute else "")
        name += (f", global batch {batch}" if batch != gb else "") + (f", XLA_FLAGS={xla}" if xla else "")
        if vocab:
            flags += ["--data-path", data_prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab)]
            name += f", vocabulary {vocab} + EOD (random ids)"
        return name, flags, xla

    # The most telling first (bench/results/2026-11-gpu.md); then one microbatch per step (no
    # gradient accumulation), and the optimizer step amortised over 4x the batch.
    return [setting("scanned", m), setting("scanned", m, "selective"), setting("scanned", m, "full"),
            setting("scanned", half), setting("unrolled", m, "selective"), setting("scanned", double, "selective"),
            setting("unrolled", double), setting("unrolled", m, batch=4 * gb), setting("unrolled", double, "selective"),
            # GPT-2's vocabulary: the output layer and fp32 logits a real vocabulary costs
            setting("unrolled", m, vocab=sweep_vocab(a)),
            # XLA's GPU flags a user (or MaxText) would try: cuBLASLt epilogues (bias, GELU) in the
            # GEMMs; cuBLAS for every GEMM instead of XLA's Triton GEMM fusions.
            *(setting("unrolled", m, xla=flag) for flag in SWEEP_XLA_FLAGS),
            setting("unrolled", half), setting("unrolled", double, "full"), setting("unrolled", m, "full")]


SWEEP_ITERS = 12
"""Iterations per sweep launch (the median of the steps after the fifth)."""


def sweep_report(runs: list[tuple[str, dict]], baseline: dict | None) -> list[str]:
    """The sweep's table (``baseline``: the unrolled GPT run above, its first row)."""
    lines = ["One-GPU tuning sweep (global batch as above unless named; `--scan-layers` rolls the layer loop, "
             "`--recompute-granularity`; 12 iterations each):", "",
             "| setting | tokens/s | step s | MFU | peak memory GiB | compile s |", "|---|---|---|---|---|---|"]
    rows = ([("unrolled, mb default (the run above)", baseline)] if baseline and "error" not in baseline else []) + runs
    for name, run in rows:
        if "error" in run:
            lines.append(f"| {name} | failed: {run['error']} | | | | |")
        else:
            lines.append(f"| {name} | {run['tokens_per_sec']:.0f} | {run['step_s']:.3f} | {100 * run['mfu']:.1f}% "
                         f"| {run['memory_gib']:.1f} | {run['compile_s']:.1f} |")
    return lines + [""]


def moe_report(runs: dict[str, dict], flags: dict[str, list[str]]) -> list[str]:
    """Step 5's lines: the dense and MoE rows and the MoE / dense step ratio."""
    lines = ["MoE GPT against the dense GPT of equal active parameters (one process, every local GPU; "
             "target: MoE step <= 1.5x dense):", ""]
    for name in runs:
        lines.append(f"    {name}: launch/pretrain.py {' '.join(flags[name])}")
    lines += ["", "| model | tokens/s | step s | model TFLOP/s/GPU | MFU | peak memory GiB | compile s |",
              "|---|---|---|---|---|---|---|"]
    for name, run in runs.items():
        if "error" in run:
            lines.append(f"| {name} | failed: {run['error']} | | | | | |")
            continue
        lines.append(f"| {name} | {run['tokens_per_sec']:.0f} | {run['step_s']:.3f} | {run['tflops_per_device']:.1f} "
                     f"| {100 * run['mfu']:.1f}% | {run['memory_gib']:.1f} | {run['compile_s']:.1f} |")
    dense = runs.get("dense", {})
    ratios = [f"{name} **{run['step_s'] / dense['step_s']:.2f}**" for name, run in runs.items()
              if name != "dense" and "error" not in run and "error" not in dense]
    if ratios:
        lines += ["", "Step / dense step: " + ", ".join(ratios)]
    return lines + [""]


def ddp_overhead(a: argparse.Namespace, timeout: float) -> dict:
    """``bench/ddp_overhead.py`` in a subprocess (the GPT in bf16; smoke: its small GPT, one round)."""
    cmd = [sys.executable, str(ROOT / "bench" / "ddp_overhead.py"), "--bf16"]
    return _run_json(cmd + (["--steps", "1", "--rounds", "1"] if a.smoke else ["--gpt-1b"]), timeout)


def ddp_overhead_report(record: dict) -> list[str]:
    """The DDP-overhead lines (``record``: bench/ddp_overhead.py's JSON, or ``{"error": ...}``)."""
    lines = ["DDP path at dp = 1 against a plain jitted step of the same GPT, one microbatch "
             "(`bench/ddp_overhead.py`; goal: <= 1.03x):", ""]
    if "error" in record:
        return lines + [f"failed: {record['error']}", ""]
    return lines + ["| model | package ms | plain jit ms | package / plain |", "|---|---|---|---|",
                    f"| {record['model']} | {record['package_ms']:.2f} | {record['plain_ms']:.2f} | "
                    f"**{record['ratio']:.3f}** |", ""]


STALL_TARGET = 0.10
"""The target: an async save stalls the steps by at most this share of a step."""


def _bench_checkpoint():
    """``bench/checkpoint.py`` as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_checkpoint", ROOT / "bench" / "checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def checkpoint_rows(smoke: bool, gpt: list[str] | None = None, out: Path | None = None) -> list[dict]:
    """The checkpoint step (run in a child process): ``bench/checkpoint.py --gpu --devices 1``'s
    rows; with ``gpt`` (model flags) that model's row alone, one round of 20 steps. With ``out``
    (the report) a trace of one more async save of the first model and its steps is kept next to
    it (:func:`_keep_trace`: ``<out>.checkpoint.xplane.pb``, ``<out>.checkpoint.trace.txt``)."""
    with tempfile.TemporaryDirectory() as tmp:
        argv = ["--gpu", "--devices", "1", "--out", os.path.join(tmp, "checkpoint.md")]
        if gpt is not None:
            argv += ["--reps", "1", "--steps", "3" if smoke else "20", "--model-flags", " ".join(gpt), "--one-copy"]
        if out is not None:
            argv += ["--trace-dir", os.path.join(tmp, "trace")]
        rows = _bench_checkpoint().main(argv + (["--quick"] if smoke and gpt is None else []))
        if out is not None:
            try:
                _keep_trace(os.path.join(tmp, "trace"), Path(str(out) + ".checkpoint"))
            except Exception as err:  # the benchmark's figures stand without the trace
                print(f"  trace not kept: {type(err).__name__}: {str(err)[:200]}")
        return rows


def _keep_trace(directory: str, stem: Path) -> str:
    """Keep the trace under ``directory`` next to the report: ``<stem>.xplane.pb`` (when under
    15 MB) and its raw listing ``<stem>.trace.txt``; returns the trace's path."""
    from core.training.profile_summary import describe_planes, trace_file

    trace = trace_file(directory)
    if os.path.getsize(trace) < 15 * 2**20:
        with open(trace, "rb") as source:
            write_atomically(str(stem) + ".xplane.pb", lambda stream: shutil.copyfileobj(source, stream))
    write_text_atomically(str(stem) + ".trace.txt", describe_planes(trace, top=12))
    return trace


def checkpoint_report(rows: list[dict] | dict, label: str = "default model") -> list[str]:
    """The checkpoint step's lines: the table and the first row's stall against the target
    (``rows``: the child's rows, or ``{"error": ...}``; ``label`` names the first row's model)."""
    lines = ["Checkpoints on one GPU (`bench/checkpoint.py --gpu --devices 1`: distributed optimizer; sync save, "
             f"load, and the step-time stall of an async save; target: stall <= {STALL_TARGET:.0%} of a step for "
             "the default model):", ""]
    if "error" in rows:
        return lines + [f"failed: {rows['error']}", ""]
    stall, thread = rows[0]["stall_share"], rows[0]["stall_share_thread"]
    verdict = "met" if stall <= STALL_TARGET else "NOT met"
    with_thread = "" if thread is None else f"; {thread:.0%} with the writer thread"
    bench = _bench_checkpoint()
    return lines + [bench.table(rows), "",
                    f"Async-save stall, {label}: **{stall:.0%}** of a step with the writer process ({verdict})"
                    f"{with_thread}", "", "The writer process's saves in the training process (median):", "",
                    bench.phases_table(rows), ""]


def fp8_rows(a: argparse.Namespace, out: Path, platform: str, device_kind: str, left: Callable[[], float],
             skipped: Callable[[str, float], bool]) -> list[str]:
    """Step 9 (``--fp8``): the GPT and the Llama-shaped model in bf16 and bf16 + FP8, each FP8
    launch's optimized HLO kept next to ``out`` (``<out>.fp8_<model>_<recipe>.hlo.txt.gz``) and its
    cuBLASLt FP8 GEMMs counted (``left``, ``skipped``: :func:`main`'s deadline checks)."""
    steps = gpu_fp8.iters(a)
    training = _training(argparse.Namespace(iters=steps))

    def train(launch: gpu_fp8.Launch) -> dict:
        if not launch.fp8:
            return train_gpt(launch.flags, timeout=min(900, left()))
        with tempfile.TemporaryDirectory() as hlo_dir:
            record = train_gpt(launch.flags, timeout=min(900, left()), xla_flags=hlo_dump_flags(hlo_dir))
            if "error" in record:
                return record
            try:
                hlo = _keep_hlo(hlo_dir, gpu_fp8.hlo_name(out, launch))
            except OSError as err:
                print(f"  HLO dump not kept: {err}")
                hlo = None
        if platform == "cpu":
            record["cublaslt_fp8"] = "n/a (CPU)"
        else:
            record["cublaslt_fp8"] = "no HLO dumped" if hlo is None else str(gpu_fp8.cublaslt_fp8_gemms(hlo))
        return record

    with tempfile.TemporaryDirectory() as data_dir:
        prefix = os.path.join(data_dir, "llama_ids")
        write_token_ids(prefix, gpu_fp8.llama_vocab(a) - 1, gpu_fp8.token_count(a))  # ids below EOD
        rows = gpu_fp8.run_rows(a, gpu_fp8.launches(a, gpt_shape(a), training, prefix), train, skipped)
    return gpu_fp8.report(rows, device_kind, steps)


def report(info: dict, tests: dict | None, attention: dict | None, attention_shape, gpt: dict | None,
           flags: list[str]) -> str:
    """The markdown the run writes (``attention`` and ``gpt`` None: skipped by ``--no-gpt``;
    ``attention`` alone: by ``--no-kernels``)."""
    lines = [f"# GPU benchmark: {info['device']}", "",
             f"{time.strftime('%Y-%m-%d')}; {info['count']} x {info['device']}; JAX {info['jax']}, jaxlib "
             f"{info['jaxlib']}, Python {info['python']}; `python bench/gpu.py`.", ""]
    if tests is not None:
        lines += [f"GPU test set: {tests['passed']} passed, {tests['failed']} failed, {tests['skipped']} skipped "
                  f"({tests['seconds']:.0f} s).", ""]
    if gpt is None:
        return "\n".join(lines)
    if attention is not None:  # None: --no-kernels
        b, s, n, d = attention_shape
        package, cudnn, xla = (attention.get(k) for k in ("package", "cudnn", "xla"))
        ms = lambda x: "n/a" if x is None else f"{x:.2f}"
        ratio = f"{package / cudnn:.2f}x" if package and cudnn else "n/a"
        lines += [f"Causal attention, forward + backward, bf16 [b={b}, s={s}, heads={n}, d={d}] (median ms):", "",
                  "| package `causal_attention` | direct cuDNN call | XLA implementation | package / cuDNN |",
                  "|---|---|---|---|", f"| {ms(package)} | {ms(cudnn)} | {ms(xla)} | {ratio} |", ""]
    if "error" in gpt:
        lines += [f"GPT training failed: {gpt['error']}", ""]
    else:
        lines += [f"GPT pretraining (`launch/pretrain.py {' '.join(flags)}`):", "", f"    {gpt['header']}",
                  f"    {gpt['peak']}", "",
                  "| tokens/s | step s | model TFLOP/s/GPU | MFU | peak memory GiB | compile s | process s | loss |",
                  "|---|---|---|---|---|---|---|---|",
                  f"| {gpt['tokens_per_sec']:.0f} | {gpt['step_s']:.3f} | {gpt['tflops_per_device']:.1f} | "
                  f"{100 * gpt['mfu']:.1f}% | {gpt['memory_gib']:.1f} | {gpt['compile_s']:.1f} | "
                  f"{gpt['process_s']:.0f} | {gpt['first_loss']:.3f} -> {gpt['last_loss']:.3f} |", ""]
    return "\n".join(lines)


def device_info() -> dict:
    """Device kind and count, platform, versions (run in a child process)."""
    import jax
    import jaxlib

    device = jax.devices()[0]
    return {"device": device.device_kind, "platform": device.platform, "count": jax.local_device_count(),
            "jax": jax.__version__, "jaxlib": jaxlib.__version__, "python": sys.version.split()[0]}


def _child(part: str, a: argparse.Namespace, timeout: float = 900, out: Path | None = None) -> dict | list:
    """Run ``--part part`` of this script in a fresh process (``out``: the report, next to which
    it may keep files): :func:`_run_json`."""
    cmd = [sys.executable, __file__, "--part", part] + (["--smoke"] if a.smoke else [])
    return _run_json(cmd + (["--out", str(out)] if out is not None else []), timeout)


def _run_json(cmd: list[str], timeout: float) -> dict | list:
    """Run ``cmd`` (a script whose last output line is JSON) and return that JSON; a failed step
    gives ``{"error": ...}`` (the run goes on: the other steps' figures stand without it). The
    step's temporary files go to a directory removed when it ends, killed or not: a killed
    checkpoint step would otherwise leave its ~15 GB checkpoints on the machine's disk."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**_env(), "TMPDIR": tmp},
                                 timeout=max(1, timeout))
        except subprocess.TimeoutExpired as err:
            # what it printed before (its progress) is the only record of where the time went
            printed = err.stdout.decode(errors="replace") if isinstance(err.stdout, bytes) else err.stdout or ""
            print(printed[-3000:], flush=True)
            return {"error": f"timed out after {timeout:.0f} s"}
    print(out.stdout[:-1] if out.returncode == 0 else out.stdout + out.stderr[-3000:], flush=True)
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {out.returncode}: {last[:300]}"}


def _attention_shape(smoke: bool) -> tuple[int, int, int, int]:
    return (1, 64, 2, 64) if smoke else (8, 2048, 16, 128)


def main() -> None:
    """Run every step and write the report."""
    a = _args()
    if a.part == "info":
        print(json.dumps(device_info()))
        return
    if a.part == "attention":
        print(json.dumps(time_attention(_attention_shape(a.smoke), reps=3 if a.smoke else 20)))
        return
    if a.part == "checkpoint":
        print(json.dumps(checkpoint_rows(a.smoke, out=Path(a.out) if a.out else None)))
        return
    if a.part == "checkpoint-gpt":
        print(json.dumps(checkpoint_rows(a.smoke, [*gpt_shape(a), *gpt_batch(a), "--bf16"])))
        return
    if a.part == "embedding":
        shape = (64, 32, (256, 1024)) if a.smoke else (8192, 2048, (256, 32768, 50304))
        print(json.dumps(time_embedding_backward(*shape, reps=3 if a.smoke else 20)))
        return
    if a.fp8:
        gpu_fp8.recipes(a)  # an unknown recipe fails here, before any launch
    started = time.perf_counter()
    left = lambda: float("inf") if a.deadline_s is None else a.deadline_s - (time.perf_counter() - started)
    info = _child("info", a)
    if "error" in info:
        raise SystemExit(f"the device query failed: {info['error']}")
    print(f"> {info['count']} x {info['device']} ({info['platform']}); JAX {info['jax']}, jaxlib {info['jaxlib']}",
          flush=True)
    name = re.sub(r"[^A-Za-z0-9]+", "_", info["device"]).strip("_").lower()
    on = (("moe", a.moe), ("checkpoint", a.checkpoint), ("fp8", a.fp8))
    suffix = "_" + "_".join(n for n, flag in on if flag) if a.no_gpt else ""
    out = Path(a.out) if a.out else ROOT / "bench" / "results" / f"gpu_{name}{suffix}.md"  # --no-gpt: no overwrite
    out.parent.mkdir(parents=True, exist_ok=True)
    shape, flags = _attention_shape(a.smoke), gpt_flags(a)
    attention = gpt = tests = None
    extra: list[str] = []  # the sections after the GPT's, in order
    write = lambda: write_text_atomically(
        out, report(info, tests, attention, shape, gpt, flags) + "\n" + "\n".join(extra))

    def skipped(step: str, needs: float) -> bool:
        if left() >= needs:
            return False
        extra.extend([f"{step}: skipped ({left():.0f} s left of --deadline-s {a.deadline_s:g}).", ""])
        print(f"> {step}: skipped, {left():.0f} s left", flush=True)
        return True

    if not a.no_gpt:
        if not a.no_kernels:
            attention = _child("attention", a)
            print(f"> attention ms: {attention}", flush=True)
            embedding = _child("embedding", a)
            print(f"> embedding forward + backward ms: {embedding}", flush=True)
            extra.extend(embedding_report(embedding))
        with tempfile.TemporaryDirectory() as trace_dir:
            gpt = train_gpt(flags + (profile_flags(a, trace_dir) if a.profile else []), timeout=min(900, left()),
                            xla_flags=hlo_dump_flags(trace_dir) if a.profile else "")
            print(f"> GPT: {gpt}", flush=True)
            if a.profile and "error" not in gpt:
                extra.extend(profile_report(trace_dir, out))
        write()
    if a.fp8 and not skipped("FP8 rows", 30 if a.smoke else 240):
        extra.extend(fp8_rows(a, out, info["platform"], info["device"], left, skipped))
        write()
    if a.sweep:
        runs = []
        with tempfile.TemporaryDirectory() as data_dir:
            prefix = os.path.join(data_dir, "ids")
            write_token_ids(prefix, sweep_vocab(a), 200_000 if a.smoke else 1_200_000)
            for setting, sweep_flags, xla in sweep_settings(a, prefix)[a.sweep_skip:a.sweep_skip + a.sweep_settings]:
                if skipped(f"sweep setting '{setting}'", 75):
                    break
                runs.append((setting, train_gpt(sweep_flags, timeout=min(900, left()), xla_flags=xla)))
                print(f"> sweep {setting}: {runs[-1]}", flush=True)
        extra.extend(sweep_report(runs, gpt))
        write()
    if not a.no_tests and not skipped("GPU test set", 60):
        tests = run_gpu_tests(timeout=min(600, left()))
        print(f"> GPU tests: {tests}", flush=True)
        write()
    if a.ddp_overhead and not skipped("DDP overhead", 90):
        overhead = ddp_overhead(a, timeout=min(900, left()))
        print(f"> DDP overhead: {overhead}", flush=True)
        extra.extend(ddp_overhead_report(overhead))
        write()
    if a.checkpoint and not skipped("checkpoints", 120):
        rows = _child("checkpoint", a, timeout=min(900, left()), out=out)
        print(f"> checkpoints: {rows}", flush=True)
        extra.extend(checkpoint_report(rows))
        write()
    if a.checkpoint_gpt and not skipped("checkpoints of the GPT", 150):
        rows = _child("checkpoint-gpt", a, timeout=min(900, left()))
        print(f"> checkpoints of the GPT: {rows}", flush=True)
        extra.extend(["The same for the benchmark GPT (one round, 20 steps after the async save):", ""])
        extra.extend(checkpoint_report(rows, label="benchmark GPT")[2:])
        write()
    if a.moe and not skipped("MoE vs dense", 150):
        moe_flags = moe_runs(a)
        with tempfile.TemporaryDirectory() as trace_dir:
            runs = {}
            traced_name = next((name for name in moe_flags if name != "dense"), None) if a.profile else None
            for name, f in moe_flags.items():  # with --profile a MoE run is traced too: where its step goes
                traced = name == traced_name
                runs[name] = train_gpt(f + (profile_flags(a, trace_dir) if traced else []), timeout=min(900, left()),
                                       xla_flags=hlo_dump_flags(trace_dir) if traced else "")
            print(f"> MoE vs dense: {runs}", flush=True)
            extra.extend(moe_report(runs, moe_flags))
            if traced_name is not None and "error" not in runs[traced_name]:
                extra.extend([f"The MoE GPT's profile ({traced_name}):", ""]
                             + profile_report(trace_dir, Path(f"{out}.moe")))
        write()
    write()
    print(f"\n{out.read_text()}\nwritten to {out}")

if __name__ == "__main__":
    main()
