"""``bench/generate.py --smoke`` runs the side-by-side measurement on a tiny model (both sides'
greedy tokens agree), the bandwidth table and the GPU path's batch-1 bound (on CPU, with the
H200's peak); the byte counts match the model's parameters; the peak is found by device name.
No timing assertions. Skipped without ``transformers`` and ``torch``."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_generate", ROOT / "bench" / "generate.py")
bench_generate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_generate)


def test_smoke_run_reports_both_sides_the_bandwidth_and_the_gpu_bound(tmp_path):
    out = tmp_path / "generate.md"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "generate.py"), "--smoke", "--out", str(out)],
                            capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    side, bandwidth, gpu = (part for part in out.read_text().split("## ")[1:4])
    for batch in (1, 2):
        # Decode rates are NaN when a busy machine's noise exceeds the tiny model's decode time.
        row = re.findall(rf"^\| tiny \| {batch} \| (\d+) \| (\d+) \| ([\d.]+) \| ([\d.]+|nan) \| ([\d.]+|nan) \| "
                         rf"([\d.]+|nan) \| [\d.]+ \| (\d+)/{batch} ", side, re.M)
        assert len(row) == 1, side
        assert all(float(x) > 0 for x in row[0][:3])
        assert int(row[0][6]) == batch  # greedy tokens agree on the tiny model
        assert len(re.findall(rf"^\| tiny \| {batch} \| \d+ \| [\d.]+ \| [\d.]+ \| ([\d.]+|nan) \| ([\d.]+|nan) \|$", bandwidth,
                              re.M)) == 1, bandwidth
    n = r"(?:[\d.]+|nan)"
    assert re.search(rf"^\| tiny \| NVIDIA H200 \| fp32 \| 16 \| 8 \| \d+ \| {n} \| {n} \| \d+ \| 4.80 TB/s \| "
                     rf"\d+ \| {n} \| {n}% \|$", gpu, re.M), gpu


@pytest.mark.parametrize("name", list(bench_generate.SHAPES) + list(bench_generate.SMOKE))
def test_weight_bytes_are_the_parameters_but_the_input_embedding(name):
    import torch

    from core.models.huggingface.config_mapping import gpt_config_from_hf

    shape = {**bench_generate.SHAPES, **bench_generate.SMOKE}[name]
    config = gpt_config_from_hf(bench_generate.hf_config_dict(shape))
    import transformers

    cfg = {k: v for k, v in bench_generate.hf_config_dict(shape).items() if k != "model_type"}
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
    total = sum(p.numel() for p in model.parameters())
    embedding = 0 if shape["tie_word_embeddings"] else shape["vocab_size"] * shape["hidden_size"]
    weights, kv = bench_generate.decode_bytes_per_step(config, 2, 10, 5, 4)
    assert weights == 4 * (total - embedding)
    # keys and values of every layer, 2 rows, slots 10..13 read by steps 1..4: mean 12
    assert kv == 2 * shape["num_hidden_layers"] * 2 * shape["num_key_value_heads"] * config.head_dim * 12 * 4


def test_hbm_peak_by_device_name_and_the_bound():
    assert bench_generate.hbm_peak("NVIDIA H200") == 4.8e12
    assert bench_generate.hbm_peak("NVIDIA H100 80GB HBM3") == 3.35e12
    assert bench_generate.hbm_peak("NVIDIA H100 PCIe") == 2.0e12
    assert bench_generate.hbm_peak("TPU v5 lite") is None
    from core.models.huggingface.config_mapping import gpt_config_from_hf

    config = gpt_config_from_hf(bench_generate.hf_config_dict(bench_generate.SMOKE["tiny"]))
    weights, kv = bench_generate.decode_bytes_per_step(config, 1, 16, 8, 2)
    cells = bench_generate.bandwidth_cells(config, 1, 16, 8, 2, 100.0, 4.8e12)
    assert cells["bytes_per_token"] == weights + kv
    assert cells["achieved_gbs"] == pytest.approx(100 * (weights + kv) / 1e9)
    assert cells["fraction"] == pytest.approx(100 / cells["bound_tok_s"])
