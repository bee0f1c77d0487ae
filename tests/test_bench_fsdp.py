"""``bench/fsdp.py --smoke`` runs every part on tiny shapes (its planning and peak parts in
subprocesses) and its report has a memory row per strategy and dp, a timing row per strategy, the
planning rows and the measured-peak row (no timing assertions)."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def test_smoke_run_reports_every_strategy_and_the_planning_rows(tmp_path):
    out = tmp_path / "fsdp.md"
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_DISABLE_MOST_OPTIMIZATIONS="1")
    env.pop("JAX_NUM_CPU_DEVICES", None)  # the bench sets its own device counts
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "fsdp.py"), "--smoke", "--out", str(out)],
                            capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = out.read_text()
    memory, timing, planning, peak = (text.split("## ")[i] for i in range(1, 5))
    for strategy in STRATEGIES:
        for dp in (1, 2, 8):
            assert len(re.findall(rf"^\| {dp} \| {strategy} \| [\d.]+ \| [\d.]+ \| [\d.]+ \|", memory, re.M)) == 1
        assert len(re.findall(rf"^\| {strategy} \| one per buffer \| [\d.]+ \|", timing, re.M)) == 1
    assert "optim_grads_params / optim step time: **" in timing
    for layout in ("tp8 optim", "fsdp8", "tp2 x fsdp4"):
        row = re.findall(rf"^\| tiny-llama \| {layout} \| 8 \| .*\| (yes|marginal|no) \| \d+ \|$", planning, re.M)
        assert len(row) == 1, planning
    assert re.search(r"^\| optim_grads_params \| [\d.]+ \|", peak, re.M), peak
