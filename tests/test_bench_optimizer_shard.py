"""``bench/optimizer_shard.py``: building the distributed optimizer's shard from the params that
overlap it gives the same update as cutting it out of the whole flat bucket (the bench checks the
values) and holds at most the shard, no whole bucket (XLA's ``memory_analysis``: deterministic),
where the cut keeps one (the temporary found on 2026-11-28)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_optimizer_shard", ROOT / "bench" / "optimizer_shard.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_the_shard_is_built_without_the_whole_bucket():
    rows = bench.main(["--quick"])
    assert [r["shards"] for r in rows] == [2, 8]
    for r in rows:
        assert r["whole bucket temp_mib"] >= 0.99 * r["bucket_mib"], r  # the reference does keep it
        assert r["package temp_mib"] <= 1.01 * r["bucket_mib"] / r["shards"], r  # at most the shard itself
        assert r["package ms"] > 0 and r["whole bucket ms"] > 0
    assert "| 8 | " in bench.table(rows, "cpu")
