"""``bench/gpu.py --fp8`` (``bench/gpu_fp8.py``): its CPU smoke run writes the FP8 rows with finite
figures, its launches are flags the launcher accepts in both shapes, and its report reads the
ratios, the peaks and the HLO's cuBLASLt FP8 GEMMs."""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _modules():
    """``bench/gpu.py`` and ``bench/gpu_fp8.py`` as modules (gpu.py puts bench/ on the path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "bench" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, module.gpu_fp8


def _namespace(smoke: bool, recipes: str = "delayed,tensorwise") -> argparse.Namespace:
    return argparse.Namespace(smoke=smoke, fp8_recipes=recipes, fp8_format="hybrid", fp8_iters=None)


def test_fp8_smoke_run_writes_bf16_and_fp8_rows_with_finite_figures(tmp_path):
    out = tmp_path / "fp8.md"
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("JAX_NUM_CPU_DEVICES", None)
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--smoke", "--no-gpt", "--no-tests",
                             "--fp8", "--fp8-recipes", "delayed", "--out", str(out)], capture_output=True, text=True,
                            timeout=400, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = out.read_text()
    assert "failed" not in text and "skipped" not in text, text
    assert "--use-rope-scaling" in text and "--num-query-groups 2" in text
    rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| ") and "model |" not in line]
    assert [(r[0].strip(), r[1].strip()) for r in rows] == [
        ("GPT (tiny)", "bf16"), ("GPT (tiny)", "bf16 + FP8 hybrid delayed"),
        ("Llama-shaped (tiny)", "bf16"), ("Llama-shaped (tiny)", "bf16 + FP8 hybrid delayed")]
    for row in rows:
        tokens, ratio, tflops, mfu_bf16, mfu_fp8, memory, loss = (row[i].strip("*x% ") for i in range(2, 9))
        for figure in (tokens, ratio, tflops, mfu_bf16, mfu_fp8, memory, loss):
            assert math.isfinite(float(figure)) and float(figure) >= 0, row
        assert float(tokens) > 0 and float(loss) > 0
        if "FP8" in row[1]:
            assert math.isfinite(float(row[9].strip(" %+"))) and row[10].strip() == "n/a (CPU)"
    for model in ("gpt_tiny", "llama_shaped_tiny"):  # the FP8 step's HLO, kept (its GEMMs are counted on a GPU)
        assert (tmp_path / f"fp8.md.fp8_{model}_delayed.hlo.txt.gz").stat().st_size > 0


@pytest.mark.parametrize("smoke", [True, False])
def test_fp8_launches_are_valid_flags_of_the_stated_shapes(smoke, tmp_path):
    from core.training.arguments import parse_args, validate_args

    bench_gpu, fp8 = _modules()
    prefix = str(tmp_path / "ids")
    bench_gpu.write_token_ids(prefix, fp8.llama_vocab(_namespace(smoke)) - 1, 5000)
    training = bench_gpu._training(argparse.Namespace(iters=fp8.iters(_namespace(smoke))))
    launches = fp8.launches(_namespace(smoke), bench_gpu.gpt_shape(argparse.Namespace(smoke=smoke)), training,
                            prefix)
    assert [(x.precision, x.fp8) for x in launches[:3]] == [
        ("bf16", False), ("bf16 + FP8 hybrid delayed", True), ("bf16 + FP8 hybrid tensorwise", True)]
    assert len(launches) == 6 and len({x.model for x in launches}) == 2
    one_gpu = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"]
    for launch in launches:
        args = parse_args(launch.flags + one_gpu)
        assert args.bf16 and args.train_iters == (6 if smoke else 200)
        assert args.fp8_format == ("hybrid" if launch.fp8 else None)
        validate_args(args, 1)
    gpt, llama = parse_args(launches[0].flags), parse_args(launches[3].flags)
    assert (gpt.num_layers, gpt.hidden_size, gpt.micro_batch_size) == ((2, 64, 2) if smoke else (24, 2048, 8))
    assert llama.normalization == "RMSNorm" and llama.swiglu and llama.group_query_attention
    assert llama.untie_embeddings_and_output_weights and llama.use_rope_scaling and llama.disable_bias_linear
    if not smoke:  # Llama-3.2-1B's shape
        assert (llama.num_layers, llama.hidden_size, llama.ffn_hidden_size, llama.num_attention_heads,
                llama.num_query_groups, llama.seq_length, llama.vocab_size + 1, llama.rotary_base,
                llama.rope_scaling_factor) == (16, 2048, 8192, 32, 8, 4096, 128256, 500000.0, 32.0)


def test_fp8_report_reads_ratios_peaks_losses_and_cublaslt_gemms():
    _, fp8 = _modules()
    hlo = ('%a = (bf16[8,8]{1,0}, s8[0]{0}) custom-call(...), custom_call_target="__cublas$lt$matmul$f8"\n'
           '%b = (bf16[8,8]{1,0}, s8[0]{0}) custom-call(...), custom_call_target="__cublas$lt$matmul$f8"\n'
           '%c = (bf16[8,8]{1,0}, s8[0]{0}) custom-call(...), custom_call_target="__cublas$lt$matmul"\n')
    assert fp8.cublaslt_fp8_gemms(hlo) == 2
    launches = fp8.launches(_namespace(False), ["--num-layers", "24"], ["--bf16"], "DATA")
    row = {"tokens_per_sec": 60000.0, "tflops_per_device": 500.0, "mfu": 0.505, "memory_gib": 40.0,
           "last_loss": 4.0}
    runs = [(launches[0], row), (launches[1], {"error": "exit 1: out of memory"}),
            (launches[2], {**row, "tokens_per_sec": 81000.0, "tflops_per_device": 675.0, "last_loss": 4.02,
                           "cublaslt_fp8": "96"})]
    text = "\n".join(fp8.report(runs, "NVIDIA H100 80GB HBM3", 200))
    assert "dense peaks: bf16 989.4 TFLOP/s, FP8 1978.9 TFLOP/s (datasheet)" in text
    assert "| GPT ~1.2B | bf16 + FP8 hybrid delayed | failed: exit 1: out of memory |" in text
    assert re.search(r"\| GPT ~1\.2B \| bf16 \+ FP8 hybrid tensorwise \| 81000 \| \*\*1\.35x\*\* \| 675\.0 \| "
                     r"68\.2% \| 34\.1% \| 40\.0 \| 4\.0200 \| \+0\.50% \| 96 \|", text), text
    assert "loss after 200 steps" in text
    with pytest.raises(SystemExit, match="unknown mxfp8"):
        fp8.recipes(_namespace(False, "tensorwise,mxfp8"))


def test_fp8_datasheet_peaks():
    from core.training.device_peak import datasheet_peak

    assert datasheet_peak("NVIDIA H200", "float8_e4m3fn") == pytest.approx(1978.9e12)
    assert datasheet_peak("NVIDIA H100 80GB HBM3", "float8_e5m2") == pytest.approx(1978.9e12)
    assert datasheet_peak("NVIDIA H100 80GB HBM3", "bfloat16") == pytest.approx(989.4e12)
    assert datasheet_peak("NVIDIA A100-SXM4-80GB", "float8_e4m3fn") is None  # no FP8 tensor cores
    assert datasheet_peak("cpu", "float8_e4m3fn") is None
