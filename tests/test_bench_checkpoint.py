"""``bench/checkpoint.py``'s measurement runs on a tiny model and gives positive, finite numbers
(no timing assertions)."""

import importlib.util
import math
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_checkpoint", ROOT / "bench" / "checkpoint.py")
bench_checkpoint = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_checkpoint)


def test_checkpoint_row_is_sane(tmp_path):
    row = bench_checkpoint.measure(bench_checkpoint.QUICK_MODELS[0], 2, steps=2, reps=1, workdir=str(tmp_path / "w"),
                                   trace_dir=str(tmp_path / "trace"))
    for key in ("params", "state_mib", "disk_mib", "save_s", "load_s", "step_ms", "blocking_ms", "blocking_ms_thread"):
        assert math.isfinite(row[key]) and row[key] > 0, key
    for key in ("stall_share", "stall_share_thread", "stall_share_thread_fast_switch"):
        assert math.isfinite(row[key]), key
    assert len(list((tmp_path / "trace").rglob("*.xplane.pb"))) == 1  # the traced extra save
    assert 0.5 * row["state_mib"] < row["disk_mib"] < 2 * row["state_mib"]  # params + Adam moments, compressed
    assert f"| {row['params'] / 1e6:.2f}M |" in bench_checkpoint.table([row])
    for key in ("opt_shard_mib", "copy_mib", "copy_temp_mib", "load_temp_mib", "whole_opt_mib"):
        assert math.isfinite(row[key]) and row[key] >= 0, key
    assert row["copy_mib"] < row["state_mib"]  # split over the 2 data-parallel ranks
    assert f"| {row['dp']} |" in bench_checkpoint.memory_table([row])
    phases = row["writer_phases_ms"]  # the writer process's save, timed in the training process
    assert set(phases) == set(bench_checkpoint.PHASES) and all(v >= 0 for v in phases.values())
    assert phases["writer"] > 0 and bench_checkpoint.phases_table([row]).count("ms |") == len(phases)


def test_snapshot_designs_measure_the_same_bytes():
    spec = importlib.util.spec_from_file_location("bench_snapshot_dispatch", ROOT / "bench" / "snapshot_dispatch.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    import jax
    import numpy as np

    rows = bench.measure(bench.SMOKE_MODEL, reps=2)
    assert [r["program"] for r in rows[:3]] == ["step", "per leaf", "packed by dtype"]
    for r in rows:  # the step has no outputs to stage
        keys = ("dispatch", "run") + (("wall", "cpu") if r["outputs"] else ())
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in keys), r
    per_leaf, packed = rows[1], rows[2]
    assert packed["outputs"] < per_leaf["outputs"] and abs(packed["out_mib"] - per_leaf["out_mib"]) < 0.01
    assert "| packed by dtype | 2 |" in bench.table(rows, "cpu")
    # The packed blocks hold the per-leaf snapshot's values, leaf after leaf (one device).
    trainer = bench_checkpoint._trainer(bench.SMOKE_MODEL, 1, [])
    programs = bench.programs(trainer)
    args = (trainer.params, trainer.opt_state, trainer.model_state)
    leaves = jax.tree.leaves(programs["per leaf"](*args))
    blocks = programs["packed by dtype"](*args)
    for dtype, block in blocks.items():
        expected = np.concatenate([np.asarray(x).reshape(-1) for x in leaves if str(x.dtype) == dtype])
        np.testing.assert_array_equal(np.asarray(block).reshape(-1), expected)
