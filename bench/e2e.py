"""End-to-end GPT training throughput: this package vs PyTorch DDP vs the tutorial ``pmean``
recipe, measured side by side in one run (``python bench/e2e.py``).

For each world size (``--worlds``, default 1 2 4 8) it launches, under ``mpirun``:
this package's training step for the layouts dp-only (also with the distributed optimizer
from 2 processes), tp=2, pp=2 and the default 3D one (tp=2, pp=2, dp=2 at 8), PyTorch DDP on
gloo (``bench/e2e_torch.py``, skipped when torch is not installed:
``pip install torch==2.13.0``) and the per-leaf ``pmean`` recipe
(``bench/e2e_jax.py --impl pmean``). Same model (``--layers/--hidden/--heads/--seq``, vocab
256), same global batch, fp32. Prints a table (median step time after warm-up, tokens/s, peak
memory per process, ratios against each peer at the same world size; each case is launched
``--rounds`` times, round-robin with the others, and its fastest round reported) and writes
``bench/results/e2e.{json,md,png}``. Every process sets its CPU threads from the number of
processes on the host (``core/runtime/cpu_threads.py``), and the JAX workers expose one CPU device per
core of their share, as the package's launch path does (``core/runtime/cpu_devices.py``; the
``devices`` column: all of the world's JAX devices).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from mpi_launch import free_port  # noqa: E402

from core.atomic_files import write_atomically, write_text_atomically  # noqa: E402

RESULTS = ROOT / "bench" / "results"


def _mpirun(n: int) -> list[str]:
    cmd = ["mpirun", "--oversubscribe", "-n", str(n)]
    if os.getuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    return cmd


def run_case(world: int, script: str, flags: list[str], timeout: int) -> dict | None:
    """One mpirun launch; the JSON line rank 0 prints, or None (with the error) on failure."""
    cmd = _mpirun(world) + [sys.executable, str(ROOT / "bench" / script), *flags]
    try:
        env = dict(os.environ, MASTER_PORT=str(free_port()))  # the torch peer's rendezvous
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    except subprocess.TimeoutExpired:
        print(f"  timeout: {' '.join(cmd[-len(flags) - 1:])}", file=sys.stderr)
        return None
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        print(f"  failed ({out.returncode}): {' '.join(cmd)}\n{out.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(lines[-1])


def cases(world: int, has_torch: bool) -> list[tuple[str, str, str, list[str]]]:
    """(implementation, layout, script, flags) to run at ``world`` processes."""
    out = [("package", "dp", "e2e_jax.py", ["--impl", "package"] + (["--peak"] if world == 1 else [])),
           ("pmean", "dp", "e2e_jax.py", ["--impl", "pmean"])]
    if has_torch:
        out.append(("torch_ddp", "dp", "e2e_torch.py", []))
    if world >= 2:
        # the same dp-only step with the optimizer sharded over dp (Megatron's
        # --use-distributed-optimizer; identical results, 1/dp of the optimizer work)
        out.append(("package", "dp, dist-opt", "e2e_jax.py", ["--impl", "package", "--distributed-optimizer"]))
        out.append(("package", "tp=2", "e2e_jax.py", ["--impl", "package", "--tp", "2"]))
        out.append(("package", "pp=2", "e2e_jax.py", ["--impl", "package", "--pp", "2", "--microbatches", "4"]))
    if world == 8:
        out.append(("package", "tp=2 pp=2 dp=2", "e2e_jax.py",
                    ["--impl", "package", "--tp", "2", "--pp", "2", "--microbatches", "4"]))
    return out


def run_rounds(worlds: list[int], has_torch: bool, rounds: int, timeout: int) -> list[dict]:
    """Every case at every world size, ``rounds`` times over (round-robin, so a slow spell of the
    host hits different cases); per case the round with the lowest median step time, every round's
    median kept under ``round_step_times_s``. On a shared host other jobs slow whole launches at
    random, and the fastest round is the least disturbed estimate, for each implementation alike."""
    results: dict[tuple, list[dict]] = {}
    for i in range(rounds):
        for world in worlds:
            for impl, layout, script, flags in cases(world, has_torch):
                print(f"round {i + 1}/{rounds}, world {world}: {impl} ({layout}) ...", flush=True)
                r = run_case(world, script, flags, timeout)
                results.setdefault((world, impl, layout), [])
                if r is not None:
                    results[(world, impl, layout)].append(r)
    rows = []
    for (_, impl, layout), runs in results.items():
        if runs:
            best = min(runs, key=lambda r: r["step_time_s"])
            rows.append(dict(best, impl=impl, layout=layout, round_step_times_s=[r["step_time_s"] for r in runs]))
    return rows


def markdown(rows: list[dict]) -> str:
    """The results table with ratios against the peers at the same world size."""
    base = {(r["world"], r["impl"]): r["step_time_s"] for r in rows if r["layout"] == "dp"}
    lines = ["| processes | implementation | layout | devices | step time (s) | tokens/s | peak mem/process (MiB) | "
             "vs torch DDP | vs pmean recipe |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = lambda peer, r=r: (f"{r['step_time_s'] / base[(r['world'], peer)]:.2f}x"
                              if (r["world"], peer) in base else "n/a")
        lines.append(f"| {r['world']} | {r['impl']} | {r['layout']} | {r.get('devices', r['world'])} | "
                     f"{r['step_time_s']:.3f} | "
                     f"{r['tokens_per_sec']:.0f} | {r['peak_memory_bytes'] / 2**20:.0f} | {ratio('torch_ddp')} | "
                     f"{ratio('pmean')} |")
    return "\n".join(lines)


def chart(rows: list[dict], path: Path) -> None:
    """Tokens/s per world size and implementation/layout (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for key in sorted({(r["impl"], r["layout"]) for r in rows}):
        pts = sorted((r["world"], r["tokens_per_sec"]) for r in rows if (r["impl"], r["layout"]) == key)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{key[0]} ({key[1]})")
    ax.set_xlabel("processes")
    ax.set_ylabel("tokens/s")
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=8)
    ax.set_title("GPT training throughput (same model, same global batch, fp32)")
    fig.tight_layout()
    write_atomically(str(path), lambda stream: fig.savefig(stream, format="png", dpi=100))


def main() -> None:
    """Run every case and write the results."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--timeout", type=int, default=900, help="seconds per launch")
    p.add_argument("--rounds", type=int, default=2, help="launches per case; the fastest round is reported")
    p.add_argument("--out", default=str(RESULTS / "e2e"), help="output path prefix")
    a = p.parse_args()
    has_torch = importlib.util.find_spec("torch") is not None
    rows = run_rounds(a.worlds, has_torch, a.rounds, a.timeout)
    mfu_row = next((r for r in rows if "mfu" in r), None)
    peaks = {k: mfu_row[k] for k in ("matmul_peak_flops", "model_flops_per_sec", "mfu", "device")} if mfu_row else {}
    table = markdown(rows)
    print(table)
    if peaks:
        print(f"\nsingle-process MFU: {100 * peaks['mfu']:.1f}% ({peaks['model_flops_per_sec'] / 1e9:.1f} GFLOP/s "
              f"model vs {peaks['matmul_peak_flops'] / 1e9:.1f} GFLOP/s measured jnp.dot peak) on {peaks['device']}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(out.with_suffix(".json"), json.dumps({"rows": rows, "single_process": peaks}, indent=1))
    write_text_atomically(out.with_suffix(".md"), table + "\n")
    chart(rows, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
