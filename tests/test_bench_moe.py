"""``bench/moe.py --quick`` runs in one process on the suite's simulated devices and its figures
are sane: positive, finite times, the ratios to the dense step and to the padded batched matmul
present, dispatch + combine a share of the MoE layer below 1 (no timing assertions)."""

import importlib.util
import math
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_moe", ROOT / "bench" / "moe.py")
bench_moe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_moe)


def _positive(x) -> bool:
    return math.isfinite(x) and x > 0


def test_quick_run_figures_and_report(tmp_path):
    import jax

    out = tmp_path / "moe.md"
    # A smoke run: XLA's backend optimisations cost more compile time than these tiny programs run.
    jax.config.update("jax_disable_most_optimizations", True)
    try:
        res = bench_moe.main(["--quick", "--out", str(out)])
    finally:
        jax.config.update("jax_disable_most_optimizations", False)

    dense, *moe = res["steps"]
    assert (dense["model"], dense["ratio"]) == ("dense", 1.0)
    # --quick: 2 devices, ep 2 (no ragged_dot row: that one is at ep 1).
    assert [(r["model"], r["routing"], r["ep"], r["dp"]) for r in moe] == [("moe, windowed grouped GEMM", "balanced", 2, 1)]
    assert dense["load"] is None and moe[0]["load"] >= 1.0  # the busiest expert's load over the mean
    for r in res["steps"]:
        assert all(_positive(r[k]) for k in ("params", "step_s", "tokens_per_s", "ratio"))
        assert math.isclose(r["tokens_per_s"] * r["step_s"], 4 * 32)  # global batch x seq
    # 8 experts of FFN 32 (+ a router) against one FFN of 2 x 32: more parameters, same active ones.
    assert moe[0]["params"] > dense["params"]

    (d,) = res["dispatch"]
    assert d["ep"] == 2 and all(_positive(d[k]) for k in ("layer_s", "router_s", "dispatch_combine_s", "experts_s"))
    assert _positive(d["share_of_layer"]) and _positive(d["share_of_step"])  # timings: no bounds
    assert d["share_of_step"] == res["dispatch_share_max_ep"]

    gemm = {r["method"]: r for r in res["gemm"]}
    assert set(gemm) == {"ragged_dot", "windowed_ragged_dot", "per-expert loop", "padded batched matmul"}
    assert gemm["padded batched matmul"]["over_batched"] == 1.0
    assert all(_positive(r["time_s"]) and _positive(r["gflops"]) and _positive(r["over_batched"]) for r in gemm.values())

    text = out.read_text()
    for heading in ("## 1. Training step", "## 2. Dispatch + combine", "## 3. Expert computation"):
        assert heading in text
    assert "| moe, windowed grouped GEMM | balanced |" in text and "| ragged_dot |" in text


def test_exchanges_between_processes_under_mpirun(tmp_path):
    """``mpirun -n 2 python bench/moe.py --quick``: dispatch + combine between real processes
    (ep 2, one device each) with the default two exchanges and one worst-case exchange, the table
    on rank 0 only and in the report."""
    import subprocess
    import sys

    from spawn_env import spawn_env

    out = tmp_path / "processes.md"
    cmd = ["mpirun", "--oversubscribe", "-n", "2", sys.executable, str(ROOT / "bench" / "moe.py"), "--quick",
           "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=spawn_env(), cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ep 2: 2 processes, one cpu device each" in result.stdout
    rows = [line.split("|")[1:-1] for line in out.read_text().splitlines() if line.startswith("| ") and "ms" not in line]
    assert [name.strip() for name, _, _ in rows] == ["two exchanges (default)", "one worst-case exchange"]
    assert all(_positive(float(ms)) and _positive(float(ratio)) for _, ms, ratio in rows)
    assert result.stdout.count("| all-to-all | ms |") == 1  # rank 0 only
