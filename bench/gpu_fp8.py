"""``bench/gpu.py --fp8``: bf16 against bf16 + FP8 side by side, one launch each, on the same data.

FP8 against bf16 on one H100 / H200 in one command (about 15 minutes; nothing to
download; written to ``bench/results/gpu_<device>_fp8.md`` with each FP8 run's optimized HLO next
to it)::

    PYTHONPATH=. python bench/gpu.py --no-gpt --no-tests --fp8 --fp8-recipes delayed,tensorwise --deadline-s 1800

Two models, each trained ``--fp8-iters`` steps (200; ``--smoke``: 6, tiny shapes of the same kind)
by ``launch/pretrain.py`` in bf16 and then in bf16 + FP8 (``--fp8-format``, default hybrid: E4M3
forward, E5M2 gradients) once per ``--fp8-recipes`` entry, the same seed and data for all:

- the benchmark's ~1.2B GPT (24 layers, hidden 2048, 16 heads, seq 2048, the built-in text data:
  about 7 passes over it in 200 steps) at micro-batch 8, global batch 8 (the target:
  FP8 >= 1.3x bf16's tokens/s, loss after 200 steps within 1% of bf16's);
- Llama-3.2-1B's shape (16 layers, hidden 2048, FFN 8192, RMSNorm, SwiGLU, no biases, GQA 32
  heads / 8 KV groups, rotary base 500000 with Llama 3.1's scaling (factor 32, original context
  8192), vocabulary 128256, untied embeddings, seq 4096) at micro-batch 2, global batch 8, on
  random Zipf-distributed token ids written for the run (``NullTokenizer``).

Per row: tokens/s and its ratio to bf16's, model TFLOP/s per GPU and MFU against the dense bf16
peak and against the dense FP8 peak (``core.training.device_peak``'s datasheet; the CPU has no FP8
figure: its measured bf16 peak stands in), peak memory, the loss after the last step and its
relative difference to bf16's, and the number of cuBLASLt FP8 GEMMs (custom calls
``__cublas$lt$matmul$f8``) in the FP8 step's optimized HLO ("n/a (CPU)" off the GPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Callable
from pathlib import Path

FP8_RECIPES = ("delayed", "tensorwise")
"""``launch/pretrain.py --fp8-recipe``'s choices."""
FP8_ITERS, SMOKE_FP8_ITERS = 200, 6
"""Steps per launch (the loss compared is the last step's)."""
LLAMA_VOCAB = 128256
"""Llama 3's vocabulary: ``NullTokenizer --vocab-size 128255`` (ids below it, EOD = 128255)."""
SMOKE_LLAMA_VOCAB = 1000
CUBLASLT_FP8 = re.compile(r'custom_call_target="__cublas\$lt\$matmul\$f8"')
"""XLA:GPU's cuBLASLt FP8 GEMM custom call in optimized HLO text."""
FP8_PEAK_DTYPE = "float8_e4m3fn"
"""The dtype name the FP8 datasheet peak is looked up by (E4M3 and E5M2 share one figure)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``bench/gpu.py``'s ``--fp8`` options."""
    p.add_argument("--fp8", action="store_true", help="also the FP8 rows: the ~1.2B GPT and a Llama-3.2-1B-shaped "
                   "model in bf16 and bf16 + FP8 (each --fp8-recipes entry) on the same data (bench/gpu_fp8.py)")
    p.add_argument("--fp8-recipes", default=",".join(FP8_RECIPES), help="--fp8's FP8 launches, in order "
                   "(launch/pretrain.py --fp8-recipe values)")
    p.add_argument("--fp8-format", choices=["e4m3", "hybrid"], default="hybrid",
                   help="--fp8's launch/pretrain.py --fp8-format")
    p.add_argument("--fp8-iters", type=int, default=None, help=f"--fp8's steps per launch (default {FP8_ITERS}; "
                   f"--smoke: {SMOKE_FP8_ITERS})")


def recipes(a: argparse.Namespace) -> list[str]:
    """``--fp8-recipes``' names, in order (SystemExit naming an unknown one)."""
    names = [n.strip() for n in a.fp8_recipes.split(",") if n.strip()]
    unknown = [n for n in names if n not in FP8_RECIPES]
    if unknown:
        raise SystemExit(f"--fp8-recipes: unknown {', '.join(unknown)} (choose from {', '.join(FP8_RECIPES)})")
    return names


def iters(a: argparse.Namespace) -> int:
    """Steps per FP8-row launch."""
    if a.fp8_iters is not None:
        return a.fp8_iters
    return SMOKE_FP8_ITERS if a.smoke else FP8_ITERS


def gpt_model_flags(a: argparse.Namespace, gpt_shape: list[str]) -> list[str]:
    """The GPT rows' shape (``gpt_shape``: ``bench/gpu.py``'s) and batch: micro-batch 8, global 8
    (the setting the FP8 target is stated at; ``--smoke``: 2 and 4)."""
    batch = ("2", "4") if a.smoke else ("8", "8")
    return [*gpt_shape, "--micro-batch-size", batch[0], "--global-batch-size", batch[1]]


def llama_vocab(a: argparse.Namespace) -> int:
    """The Llama rows' vocabulary, EOD included."""
    return SMOKE_LLAMA_VOCAB if a.smoke else LLAMA_VOCAB


def llama_model_flags(a: argparse.Namespace, data_prefix: str) -> list[str]:
    """Llama-3.2-1B's shape (untied embeddings; ``--smoke``: 2 layers, hidden 64, 4 heads / 2 KV
    groups, seq 64, a 32-token original context so the rotary scaling acts) reading the token ids
    at ``data_prefix`` (:func:`token_count` of them, ``bench/gpu.py``'s ``write_token_ids``)."""
    if a.smoke:
        layers, hidden, ffn, heads, groups, seq, original = 2, 64, 128, 4, 2, 64, 32
        batch = ("2", "4")
    else:
        layers, hidden, ffn, heads, groups, seq, original = 16, 2048, 8192, 32, 8, 4096, 8192
        batch = ("2", "8")  # micro-batch 4 would pass JAX's 75% of 80 GiB (fp32 logits of 128256)
    return ["--num-layers", str(layers), "--hidden-size", str(hidden), "--ffn-hidden-size", str(ffn),
            "--num-attention-heads", str(heads), "--group-query-attention", "--num-query-groups", str(groups),
            "--seq-length", str(seq), "--position-embedding-type", "rope", "--rotary-base", "500000",
            "--use-rope-scaling", "--rope-scaling-factor", "32", "--rope-scaling-low-freq-factor", "1",
            "--rope-scaling-high-freq-factor", "4", "--rope-scaling-original-max-position-embeddings",
            str(original), "--normalization", "RMSNorm", "--norm-epsilon", "1e-5", "--swiglu",
            "--disable-bias-linear", "--untie-embeddings-and-output-weights",
            "--micro-batch-size", batch[0], "--global-batch-size", batch[1],
            "--data-path", data_prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size", str(llama_vocab(a) - 1)]


def token_count(a: argparse.Namespace) -> int:
    """Token ids the Llama rows' data needs: every step's samples once, with a margin."""
    seq, batch = (64, 4) if a.smoke else (4096, 8)
    return int(1.1 * iters(a) * batch * (seq + 1)) + 100_000


def fp8_flags(a: argparse.Namespace, recipe: str) -> list[str]:
    """The flags that turn a bf16 launch into a bf16 + FP8 one."""
    return ["--fp8-format", a.fp8_format, "--fp8-recipe", recipe]


@dataclasses.dataclass(frozen=True)
class Launch:
    """One FP8-row launch of ``launch/pretrain.py``."""

    model: str
    """The row's model (``GPT ~1.2B`` / ``Llama-3.2-1B shape``)."""
    precision: str
    """``bf16`` or ``bf16 + FP8 <format> <recipe>``."""
    flags: list[str]
    """Every launch flag (the model's, training, FP8)."""
    fp8: bool


def launches(a: argparse.Namespace, gpt_shape: list[str], training: list[str], data_prefix: str) -> list[Launch]:
    """The FP8 rows' launches in run order: per model bf16, then each recipe (``training``:
    ``bench/gpu.py``'s training flags at :func:`iters` steps; ``data_prefix``: the Llama data)."""
    gpt, llama = ("GPT (tiny)", "Llama-shaped (tiny)") if a.smoke else ("GPT ~1.2B", "Llama-3.2-1B shape")
    models = {gpt: gpt_model_flags(a, gpt_shape), llama: llama_model_flags(a, data_prefix)}
    out = []
    for model, flags in models.items():
        out.append(Launch(model, "bf16", [*flags, *training], False))
        out += [Launch(model, f"bf16 + FP8 {a.fp8_format} {r}", [*flags, *training, *fp8_flags(a, r)], True)
                for r in recipes(a)]
    return out


def cublaslt_fp8_gemms(hlo_text: str) -> int:
    """cuBLASLt FP8 GEMM custom calls in optimized HLO text."""
    return len(CUBLASLT_FP8.findall(hlo_text))


def peaks(device_kind: str, runs: list[tuple[Launch, dict]]) -> tuple[float | None, float | None, str]:
    """The dense bf16 and FP8 peaks in FLOP/s the rows' MFU is taken against, and a line saying
    where they come from: the datasheet (``core.training.device_peak``) where it has the device,
    else the bf16 peak the launches measured (their model FLOP/s over their MFU, median); the
    FP8 peak then is that same figure (a CPU has no FP8 units)."""
    import statistics

    from core.training.device_peak import datasheet_peak

    bf16, fp8 = datasheet_peak(device_kind, "bfloat16"), datasheet_peak(device_kind, FP8_PEAK_DTYPE)
    source = "datasheet"
    if bf16 is None:
        implied = [r["tflops_per_device"] * 1e12 / r["mfu"] for _, r in runs if "error" not in r and r["mfu"] > 0]
        bf16 = statistics.median(implied) if implied else None
        source = "measured by the launches: a bf16 matmul, one device's share"
    if fp8 is None:
        fp8 = bf16
        source += "; no FP8 datasheet figure for this device: the FP8 MFU is against the bf16 peak"
    fmt = lambda f: "n/a" if f is None else f"{f / 1e12:.1f} TFLOP/s" if f >= 1e12 else f"{f / 1e9:.1f} GFLOP/s"
    return bf16, fp8, f"dense peaks: bf16 {fmt(bf16)}, FP8 {fmt(fp8)} ({source})"


def run_rows(a: argparse.Namespace, launch_list: list[Launch], train: Callable[[Launch], dict],
             skipped: Callable[[str, float], bool]) -> list[tuple[Launch, dict]]:
    """Run ``launch_list`` in order with ``train`` (a launch -> ``bench/gpu.py``'s ``train_gpt``
    record; an FP8 launch's with ``"cublaslt_fp8"``: the count, or why there is none); a model whose bf16 launch
    failed or was skipped by the deadline runs no FP8 launch (nothing to compare with)."""
    rows: list[tuple[Launch, dict]] = []
    no_baseline: set[str] = set()
    for launch in launch_list:
        if launch.model in no_baseline:
            continue
        if skipped(f"FP8 row '{launch.model}, {launch.precision}'", 30 if a.smoke else 120):
            if not launch.fp8:
                no_baseline.add(launch.model)
            continue
        record = train(launch)
        print(f"> FP8 row {launch.model}, {launch.precision}: {record}", flush=True)
        rows.append((launch, record))
        if not launch.fp8 and "error" in record:
            no_baseline.add(launch.model)
    return rows


def report(runs: list[tuple[Launch, dict]], device_kind: str, steps: int) -> list[str]:
    """The FP8 rows' lines: each model's bf16 launch, then one table (``runs``: :func:`run_rows`)."""
    lines = [f"bf16 against bf16 + FP8 (`launch/pretrain.py --fp8-format/--fp8-recipe`; FP8 GEMMs in the "
             f"transformer's linear layers), {steps} steps each on the same data (`bench/gpu.py --fp8`; target "
             "for the GPT: FP8 tokens/s >= 1.3x bf16's, loss within 1% of bf16's):", ""]
    for launch, _ in runs:
        if not launch.fp8:
            lines.append(f"    {launch.model}: launch/pretrain.py {' '.join(launch.flags)}")
    bf16_peak, fp8_peak, where = peaks(device_kind, runs)
    lines += ["", f"MFU {where}.", "",
              "| model | precision | tokens/s | / bf16 | model TFLOP/s/GPU | MFU (bf16 peak) | MFU (FP8 peak) | "
              f"peak memory GiB | loss after {steps} steps | vs bf16 loss | cuBLASLt FP8 GEMMs |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    baseline = {launch.model: record for launch, record in runs if not launch.fp8 and "error" not in record}
    mfu = lambda tflops, peak: "n/a" if peak is None else f"{100 * tflops * 1e12 / peak:.1f}%"
    tflops = lambda t: f"{t:.1f}" if t >= 1 else f"{t:.4f}"  # the smoke run's tiny models: GFLOP/s
    for launch, run in runs:
        if "error" in run:
            lines.append(f"| {launch.model} | {launch.precision} | failed: {run['error']} | | | | | | | | |")
            continue
        base = baseline.get(launch.model)
        ratio = f"**{run['tokens_per_sec'] / base['tokens_per_sec']:.2f}x**" if base and launch.fp8 else "1.00x"
        loss_diff = (f"{100 * (run['last_loss'] - base['last_loss']) / base['last_loss']:+.2f}%"
                     if base and launch.fp8 else "")
        gemms = run.get("cublaslt_fp8", "") if launch.fp8 else ""
        lines.append(f"| {launch.model} | {launch.precision} | {run['tokens_per_sec']:.0f} | {ratio} | "
                     f"{tflops(run['tflops_per_device'])} | {mfu(run['tflops_per_device'], bf16_peak)} | "
                     f"{mfu(run['tflops_per_device'], fp8_peak)} | {run['memory_gib']:.1f} | "
                     f"{run['last_loss']:.4f} | {loss_diff} | {gemms} |")
    return lines + [""]


def hlo_name(out: Path, launch: Launch) -> Path:
    """Where an FP8 launch's optimized HLO is kept: ``<out>.fp8_<model>_<recipe>`` (+ ``.hlo.txt.gz``)."""
    slug = re.sub(r"[^a-z0-9]+", "_", f"{launch.model} {launch.precision.split()[-1]}".lower()).strip("_")
    return Path(f"{out}.fp8_{slug}")
