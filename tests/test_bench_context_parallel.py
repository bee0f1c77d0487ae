"""``bench/context_parallel.py --quick`` runs in one process on the suite's simulated devices and
its figures are sane: memory falls with cp, the longest sequence grows with it, load-balanced
ranks do equal block products and contiguous ones do not (no timing assertions)."""

import importlib.util
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_context_parallel", ROOT / "bench" / "context_parallel.py")
bench_cp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_cp)


def _positive(x) -> bool:
    return math.isfinite(x) and x > 0


def test_quick_run_figures_and_report(tmp_path):
    out = tmp_path / "cp.md"
    res = bench_cp.main(["--quick", "--out", str(out)])

    rows = [r for r in res["cp"] if r["comm"] in bench_cp.COMPARED]
    assert {(r["comm"], r["cp"]) for r in rows} == {(c, cp) for c in bench_cp.COMPARED for cp in (1, 4)}
    for r in rows:
        assert all(_positive(r[k]) for k in ("args", "out", "total", "step_s"))
        # Per device: the local q, k, v, w shrink with cp (the outputs too, plus a tuple's pointer table).
        one = next(x for x in rows if x["comm"] == r["comm"] and x["cp"] == 1)
        assert r["args"] * r["cp"] == one["args"] and r["out"] < one["out"] / r["cp"] + 1024
        assert (r["ratio"] < 1) == (r["cp"] > 1)
    assert set(res["memory_ratios"]) == set(bench_cp.COMPARED)
    assert all(0 < x < 1 for x in res["memory_ratios"].values())
    # Every type saves q, k, v, the output and the row LSE of 1/cp of the (token, head) pairs: exactly 1/cp.
    # (the a2a types also keep their chunk reorders' small index vectors: within 2%).
    assert {c: res["saved_ratios"][c] for c in bench_cp.COMM_TYPES} == {comm: 0.25 for comm in bench_cp.COMM_TYPES}
    assert all(res["saved_ratios"][c] == pytest.approx(0.25, rel=0.02) for c in bench_cp.COMPARED)

    assert all(_positive(total) for total in res["grid"].values())
    for comm in bench_cp.COMPARED:
        longest = {r["cp"]: r for r in res["longest"] if r["comm"] == comm}
        assert longest[4]["seq"] > longest[1]["seq"] > 0
        assert all(r["confirmed"] and r["total"] <= 1.0 * bench_cp.MIB for r in longest.values())

    balanced, contiguous = res["balance"]
    assert balanced["load_balanced"] and not contiguous["load_balanced"]
    assert balanced["products"] == [5, 5] and balanced["products_imbalance"] == 0  # 2 cp + 1 each
    assert contiguous["products"] == [1, 2]
    assert all(_positive(t) for r in res["balance"] for key in ("times_s", "cpu_s") for t in r[key])

    (hide,) = res["hiding"]
    assert hide["cp"] == 2 and all(_positive(hide[k]) for k in ("ring_s", "no_hops_s", "hops_s"))
    assert math.isfinite(hide["hidden"])

    # Query tiles (compiled memory, deterministic): tiles of 32 rows need less than the 64-row chunks.
    assert [(r["seq"], r["cp"], r["comm"]) for r in res["tiling"]] == [(256, 2, c) for c in bench_cp.COMM_TYPES]
    assert all(0 < r["temp"][32] < r["temp"][0] for r in res["tiling"])

    text = out.read_text()
    for heading in ("## 1. Memory", "## 2. Per-device", "## 3. Load balance", "## 4. Ring communication",
                    "## 5. Einsum blocks"):
        assert heading in text
    assert "| p2p | 4 |" in text and "| load-balanced: block products | 64 | 5 | 5 |" in text


def test_longest_within_steps_to_the_exact_multiple():
    # A quadratic the fit recovers, and one it does not (a step at 1000): both end on the last multiple that fits.
    assert bench_cp.longest_within(lambda s: s * s, [100, 200, 400], budget=300 ** 2 + 1, granule=10) == (300, True)
    step = lambda s: s * s + (10**7 if s > 1000 else 0)
    assert bench_cp.longest_within(step, [400, 800, 1600], budget=1500 ** 2, granule=100) == (1000, True)
    assert bench_cp.longest_within(lambda s: s, [10, 20], budget=5, granule=10) == (0, True)
    # Linear totals (the flash kernel's): the fit's root is far from the data, found by bracketing.
    assert bench_cp.longest_within(lambda s: 4 * s + 7, [16, 32, 64], budget=4 * 65536 + 7, granule=16) == \
        (65536, True)
    assert bench_cp.longest_within(lambda s: s, [16, 32], budget=1e30, granule=16, max_seq=4096) == (4096, False)


def test_hiding_between_processes_under_mpirun(tmp_path):
    """``mpirun -n 2 python bench/context_parallel.py --quick``: part 4 between real processes
    (cp 2, one device each, the hops real transfers), the table on rank 0 and in the report."""
    import subprocess
    import sys

    from spawn_env import spawn_env

    out = tmp_path / "processes.md"
    env = spawn_env()
    cmd = ["mpirun", "--oversubscribe", "-n", "2", sys.executable, str(ROOT / "bench" / "context_parallel.py"),
           "--quick", "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 processes, one cpu device each" in result.stdout
    (row,) = [line for line in out.read_text().splitlines() if line.startswith("| 2 |")]
    _, ring, no_hops, _, _, hops, hidden = row.split("|")[1:-1]  # one round: no interquartile range
    assert all(_positive(float(t)) for t in (ring, no_hops, hops)) and hidden.strip().endswith("%")
    assert result.stdout.count("ring communication hidden") == 1  # rank 0 only
    # The step time by comm type: p2p, a2a and the local reference (2 heads over the full sequence).
    text = out.read_text()
    assert "## Step time by comm type between processes" in text and result.stdout.count("Step time by comm") == 1
    steps = {line.split("|")[1].strip(): line for line in text.splitlines()
             if line.startswith(("| p2p | 2 |", "| a2a | 2 |", "| reference: `causal_attention`"))}
    assert len(steps) == 3 and "2 heads, one device" in next(k for k in steps if k.startswith("reference"))
    assert all(_positive(float(line.split("|")[4])) for line in steps.values())  # step ms
    assert "`a2a` step / `p2p` step **" in text


def test_comm_verdict():
    rows = [{"comm": "p2p", "cp": 2, "vs_p2p": 1.0, "vs_reference": 1.2},
            {"comm": "a2a", "cp": 2, "vs_p2p": 0.9, "vs_reference": 1.05}]
    assert "(target <= 1: met)" in bench_cp.comm_verdict(rows) and "so its attention compute is too" in \
        bench_cp.comm_verdict(rows)
    rows[1].update(vs_p2p=1.2, vs_reference=1.5)
    assert "NOT met" in bench_cp.comm_verdict(rows) and "over 1.1x" in bench_cp.comm_verdict(rows)
