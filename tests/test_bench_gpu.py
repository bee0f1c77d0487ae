"""``bench/gpu.py`` is run once per GPU lease with no chance to debug there: its CPU smoke run
(every step, tiny shapes) must work and write its report."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_benchmark_smoke_run_writes_its_report(tmp_path):
    out = tmp_path / "gpu.md"
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("JAX_NUM_CPU_DEVICES", None)
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--smoke", "--moe", "--iters", "3",
                             "--out", str(out)], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = out.read_text()
    assert "GPU test set: 0 passed, 0 failed" in text  # collected and skipped off the GPU
    assert "| package `causal_attention` |" in text and "GPT pretraining" in text
    assert "GPT training failed" not in text
    assert "| moe |" in text and "failed:" not in text and "MoE step / dense step: **" in text
