"""Start-up as a new user meets it: the whole ``mpirun`` process, from launch to exit, training
13 iterations of the end-to-end benchmark's GPT (4 layers, hidden 256, seq 256, global batch 32,
dp only, fp32), for ``launch/pretrain.py`` with a cold and then a warm persistent compilation
cache, against PyTorch DDP (``bench/e2e_torch.py``, 3 warm-up + 10 steps), side by side in one
run: ``python bench/startup.py`` (torch: ``pip install torch==2.13.0``).

Each world size runs cold, warm, torch, ``--rounds`` times round-robin; the table reports each
one's fastest round and the ratios to torch. Writes ``bench/results/startup.md``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from mpi_launch import free_port  # noqa: E402

from core.atomic_files import write_text_atomically  # noqa: E402

GPT = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "256",
       "--global-batch-size", "32", "--train-iters", "13", "--log-interval", "13", "--eval-interval", "1000000",
       "--eval-iters", "1", "--no-progress-bar", "--tensor-model-parallel-size", "1",
       "--pipeline-model-parallel-size", "1"]


def _mpirun(n: int) -> list[str]:
    cmd = ["mpirun", "--oversubscribe", "-n", str(n)]
    return cmd[:1] + ["--allow-run-as-root"] + cmd[1:] if os.getuid() == 0 else cmd


def timed(cmd: list[str], timeout: int) -> float | None:
    """Wall seconds of the whole command (None when it failed)."""
    env = dict(os.environ, MASTER_PORT=str(free_port()))
    start = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    if out.returncode:
        print(f"  failed ({out.returncode}): {' '.join(cmd)}\n{out.stderr[-2000:]}", file=sys.stderr)
        return None
    return time.perf_counter() - start


def package_cmd(world: int, cache: Path) -> list[str]:
    """launch/pretrain.py on the benchmark GPT, micro batch sized for one device per core."""
    devices = max(world, os.cpu_count() or 1)
    return _mpirun(world) + [sys.executable, str(ROOT / "launch" / "pretrain.py"), *GPT, "--micro-batch-size",
                             str(max(1, 32 // devices)), "--compilation-cache-dir", str(cache)]


def main() -> None:
    """Run every case and print the table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "startup.md"))
    a = p.parse_args()
    has_torch = importlib.util.find_spec("torch") is not None
    best: dict[tuple[int, str], float] = {}
    for r in range(a.rounds):
        for world in a.worlds:
            cache = Path(tempfile.mkdtemp(prefix="mcj-startup-"))
            runs = [("cold", package_cmd(world, cache)), ("warm", package_cmd(world, cache))]
            if has_torch:
                runs.append(("torch", _mpirun(world) + [sys.executable, str(ROOT / "bench" / "e2e_torch.py")]))
            for name, cmd in runs:
                t = timed(cmd, a.timeout)
                print(f"round {r + 1}, {world} processes, {name}: {t if t is None else round(t, 1)} s", flush=True)
                if t is not None:
                    best[(world, name)] = min(t, best.get((world, name), t))
            shutil.rmtree(cache, ignore_errors=True)
    ratio = lambda w, n: f"{best[(w, n)] / best[(w, 'torch')]:.2f}x" if (w, n) in best and (w, "torch") in best \
        else "n/a"
    s = lambda w, n: f"{best[(w, n)]:.1f}" if (w, n) in best else "n/a"
    lines = ["| processes | package cold cache (s) | package warm cache (s) | torch DDP (s) | cold / torch | "
             "warm / torch |", "|---|---|---|---|---|---|"]
    lines += [f"| {w} | {s(w, 'cold')} | {s(w, 'warm')} | {s(w, 'torch')} | {ratio(w, 'cold')} | {ratio(w, 'warm')} |"
              for w in a.worlds]
    table = "\n".join(lines)
    print(table)
    write_text_atomically(a.out, "Whole-process time, 13 iterations (`python bench/startup.py`, "
                                 f"{time.strftime('%Y-%m-%d')})\n\n{table}\n")


if __name__ == "__main__":
    main()
