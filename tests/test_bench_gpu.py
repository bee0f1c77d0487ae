"""``bench/gpu.py`` runs on a GPU machine with no chance to debug there: its CPU smoke run
(every step, tiny shapes) must work and write its report."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench_gpu():
    """``bench/gpu.py`` as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "bench" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_benchmark_smoke_run_writes_its_report(tmp_path):
    out = tmp_path / "gpu.md"
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("JAX_NUM_CPU_DEVICES", None)
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--smoke", "--iters", "12", "--profile",
                             "--sweep", "--sweep-settings", "1", "--ddp-overhead", "--checkpoint-gpt", "--out",
                             str(out)], capture_output=True, text=True,
                            timeout=600, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = out.read_text()
    assert "GPU test set: 0 passed, 0 failed" in text  # collected and skipped off the GPU
    assert "| package `causal_attention` |" in text and "GPT pretraining" in text
    assert "GPT training failed" not in text and "failed" not in text.split("GPT pretraining")[1]
    assert "| V=256 fp32_scatter |" in text and "| V=1024 one_hot_matmul |" in text
    assert "Profile of 2 steady GPT steps" in text and "| matmul |" in text and "summary failed" not in text
    assert "| source (HLO op metadata) | ms/step | share |" in text  # the kept HLO names the ops' sources
    assert "| unrolled, mb default (the run above) |" in text and "| scanned, mb 2 |" in text
    assert "| package ms | plain jit ms | package / plain |" in text  # --ddp-overhead
    assert "Async-save stall, benchmark GPT: **" in text  # --checkpoint-gpt
    for kept in (".xplane.pb", ".trace.txt", ".hlo.txt.gz"):  # the trace, its raw listing, the step's HLO
        assert (tmp_path / f"gpu.md{kept}").stat().st_size > 0


def test_no_gpt_skips_attention_and_the_gpt_and_the_deadline_skips_the_rest(tmp_path):
    # A second call on the same machine: steps 3 and 4 skipped; past --deadline-s every later step says it was skipped.
    out = tmp_path / "second.md"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("JAX_NUM_CPU_DEVICES", None)
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--smoke", "--no-gpt", "--sweep",
                             "--checkpoint", "--deadline-s", "0", "--out", str(out)], capture_output=True, text=True,
                            timeout=300, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = out.read_text()
    assert text.startswith("# GPU benchmark: ") and "causal_attention" not in text and "GPT pretraining" not in text
    for step in ("sweep setting 'scanned, mb 2'", "GPU test set", "checkpoints"):
        assert f"{step}: skipped" in text
    assert "> attention ms" not in result.stdout and "> GPT:" not in result.stdout


def test_moe_step_flags_are_valid_and_its_report_reads_the_ratio():
    # --moe's two launches (the GPT launch itself is the smoke run's): flags the launcher accepts
    # (equal active parameters: 2 experts of half the dense FFN), and the report's ratio.
    import argparse

    from core.training.arguments import parse_args, validate_args

    bench_gpu = _bench_gpu()
    for smoke in (True, False):
        flags = bench_gpu.moe_vs_dense_flags(argparse.Namespace(smoke=smoke, iters=3))
        one_gpu = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"]
        dense, moe, windows = (parse_args(flags[name] + one_gpu) for name in ("dense", "moe", "moe, windows"))
        for args in (dense, moe, windows):
            validate_args(args, 1)
        assert (moe.moe_grouped_gemm_implementation, windows.moe_grouped_gemm_implementation) == \
            ("ragged_dot", "windows")
        assert moe.num_experts == 8 and moe.moe_router_topk * moe.moe_ffn_hidden_size == dense.ffn_hidden_size
        assert moe.moe_router_force_load_balancing  # the CPU benchmark's target row: balanced routing
    chosen = bench_gpu.moe_runs(argparse.Namespace(smoke=True, iters=3, moe_runs="windows, dense"))
    smoke_flags = bench_gpu.moe_vs_dense_flags(argparse.Namespace(smoke=True, iters=3))
    assert list(chosen) == ["moe, windows", "dense"] and chosen["dense"] == smoke_flags["dense"]
    with pytest.raises(SystemExit, match="unknown blocked"):
        bench_gpu.moe_runs(argparse.Namespace(smoke=True, iters=3, moe_runs="dense,blocked"))
    row = {"tokens_per_sec": 1000.0, "step_s": 0.5, "tflops_per_device": 100.0, "mfu": 0.4, "memory_gib": 10.0,
           "compile_s": 30.0}
    text = "\n".join(bench_gpu.moe_report({"dense": row, "moe": {**row, "step_s": 0.6}}, flags))
    assert "| moe | 1000 | 0.600 |" in text and "Step / dense step: moe **1.20**" in text
    failed = "\n".join(bench_gpu.moe_report({"dense": row, "moe": {"error": "exit 1"},
                                             "moe, windows": {**row, "step_s": 0.7}}, flags))
    assert "| moe | failed: exit 1 |" in failed and "Step / dense step: moe, windows **1.40**" in failed


def test_checkpoint_step_runs_on_the_default_backend_and_its_report_reads_the_stall(tmp_path):
    # --checkpoint's child step: bench/checkpoint.py --gpu on the default backend's first device
    # (the CPU here, one device: the path a one-GPU host takes), then the report's verdict.
    bench_gpu = _bench_gpu()
    env = dict(os.environ)
    env.pop("JAX_NUM_CPU_DEVICES", None)  # --gpu must not ask for simulated devices
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--part", "checkpoint", "--smoke"],
                            capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (row,) = json.loads(result.stdout.strip().splitlines()[-1])
    assert row["params"] > 0 and row["save_s"] > 0 and row["step_ms"] > 0
    text = "\n".join(bench_gpu.checkpoint_report([{**row, "stall_share": 0.05}]))
    assert f"Async-save stall, default model: **5%** of a step with the writer process (met); " \
           f"{row['stall_share_thread']:.0%} with the writer thread" in text
    assert "(NOT met)" in "\n".join(bench_gpu.checkpoint_report([{**row, "stall_share": 0.5}]))
    assert "failed: exit 1" in "\n".join(bench_gpu.checkpoint_report({"error": "exit 1"}))


def test_sweep_settings_are_valid_launches_with_distinct_names():
    import argparse

    from core.training.arguments import parse_args, validate_args

    bench_gpu = _bench_gpu()
    one_gpu = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"]
    for smoke in (True, False):
        settings = bench_gpu.sweep_settings(argparse.Namespace(smoke=smoke, iters=30, micro_batch_size=4,
                                                               global_batch_size=8, gpt_flags=""))
        assert len(settings) == 15 and len({name for name, *_ in settings}) == 15
        assert [xla for *_, xla in settings if xla] == list(bench_gpu.SWEEP_XLA_FLAGS)
        for name, flags, _ in settings:
            args = parse_args(flags + one_gpu)
            if "--data-path" not in flags:  # the vocabulary row's data is written by the run (smoke-tested)
                validate_args(args, 1)
            assert args.scan_layers == name.startswith("scanned")
            assert (args.recompute_granularity or "none") in (name if args.recompute_granularity else "none")
