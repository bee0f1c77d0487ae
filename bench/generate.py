"""Generation speed: ``core.inference.GenerationEngine`` against ``transformers``' ``generate`` on
the same Llama-shaped models, and decode against the memory-bandwidth bound.

    python bench/generate.py                  # ~0.1B and ~1.2B (Llama-3.2-1B's shape), fp32 CPU, ~15 min on 2 cores
    python bench/generate.py --smoke          # a tiny model, seconds (tests/test_bench_generate.py)
    python bench/generate.py --device gpu     # batch-1 decode of the ~1.2B model against the HBM peak (no torch)

1. **CPU, side by side** (fp32 both sides, ``torch.set_num_threads`` = the cores): a random
   ``transformers`` ``LlamaForCausalLM`` and the same weights mapped into the package
   (``core.models.huggingface``' ``gpt_config_from_hf`` and ``param_from_hf``, the import path
   without the files). Per batch (1, 8, 32) the rows are ``P`` random prompt tokens; four calls
   run round-robin (``bench/timing.round_robin_times``): each side with ``N = 1`` (prefill and the
   first token) and with ``N`` new tokens (``GenerationEngine.generate`` greedy, no stop tokens;
   ``model.generate(do_sample=False, max_new_tokens=N, min_new_tokens=N, use_cache=True)`` under
   ``torch.inference_mode()``). Prefill tokens/s = ``batch * P / t(1)``; decode tokens/s =
   ``(N - 1) * batch / (t(N) - t(1))`` (medians). The package's compile time is its first call
   of each program minus the median call. Agreement: the rows whose ``N`` greedy tokens are the
   same on both sides (random weights have near-ties, so this is reported, not asserted).
2. **Bandwidth**: a decode step reads every weight but the input embedding's (the tied one is
   read as the output layer) plus the KV cache up to each row's position. Bytes per token and
   the achieved GB/s from the measured decode rate; on a GPU (``--device gpu`` or a GPU default
   backend) batch-1 decode of the ~1.2B model (bf16 by default, random weights, no
   ``transformers``) as a fraction of the HBM peak (:data:`HBM_PEAK` by device name, or
   ``--peak-gbs``).

Targets (the issue): CPU decode tokens/s at batch 8 at least 2x ``transformers`` on the same
model, prefill at least level; GPU batch-1 decode of the ~1.2B model at >= 60% of the bound.

Writes ``bench/results/<date>-generate-<cpu|gpu>.md`` (``--out``) atomically.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from timing import BenchRun, round_robin_times  # noqa: E402

COMMON = dict(model_type="llama", max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=500000.0,
              initializer_range=0.02, hidden_act="silu", attention_bias=False, mlp_bias=False)
SHAPES = {
    "~0.1B": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                  intermediate_size=2048, vocab_size=32000, tie_word_embeddings=False),
    "~1.2B (Llama-3.2-1B)": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                                 num_key_value_heads=8, intermediate_size=8192, vocab_size=128256,
                                 tie_word_embeddings=True),
}
SMOKE = {"tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=1000, tie_word_embeddings=False)}
# name: (prompt tokens P, new tokens N, rounds per batch {batch: rounds})
PLANS = {"~0.1B": (128, 32, {1: 3, 8: 3, 32: 2}), "~1.2B (Llama-3.2-1B)": (64, 16, {1: 2, 8: 2, 32: 1}),
         "tiny": (16, 32, {1: 3, 2: 3})}
GPU_MODEL, GPU_PROMPT, GPU_NEW, GPU_ROUNDS = "~1.2B (Llama-3.2-1B)", 128, 256, 5

HBM_PEAK = (("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12), ("A100-SXM4-80GB", 2.039e12),
            ("A100", 1.555e12))
"""Peak memory bandwidth (bytes/s) by a substring of the device name, the first match wins."""


def hbm_peak(device_kind: str) -> float | None:
    """Bytes/s of ``device_kind``'s memory (``jax.devices()[0].device_kind``), None if unknown."""
    for name, peak in HBM_PEAK:
        if name.lower() in device_kind.lower():
            return peak
    return None


def decode_bytes_per_step(config, batch: int, prompt: int, new: int, itemsize: int) -> tuple[int, int]:
    """``(weight bytes, mean KV-cache bytes)`` one decode step of ``batch`` rows reads (a GPT
    config): every parameter but the input embedding's (a tied embedding is read as the output
    layer), and each row's keys and values up to its position, averaged over the steps that
    follow a ``prompt``-token prefill and generate ``new`` tokens."""
    h, ffn, layers = config.hidden_size, config.ffn_size, config.num_layers
    q, kv = config.num_attention_heads * config.head_dim, config.query_groups * config.head_dim
    per_layer = h * (q + 2 * kv) + q * h + h * ffn * (3 if config.swiglu else 2) + 2 * h
    weights = layers * per_layer + h + config.vocab_size * h
    mean_slots = prompt + (new - 1) / 2  # steps 1..N-1 read P + t slots
    kv_bytes = 2 * layers * kv * batch * mean_slots * itemsize
    return weights * itemsize, int(kv_bytes)


def bandwidth_cells(config, batch: int, prompt: int, new: int, itemsize: int, decode_tok_s: float,
                    peak: float | None) -> dict:
    """Bytes per generated token, achieved GB/s, and with a ``peak`` (bytes/s) the bound in tokens/s
    and the measured fraction of it."""
    weights, kv = decode_bytes_per_step(config, batch, prompt, new, itemsize)
    step = weights + kv
    achieved = decode_tok_s / batch * step
    out = {"weight_bytes": weights, "kv_bytes": kv, "bytes_per_token": step / batch, "achieved_gbs": achieved / 1e9}
    if peak:
        out.update(bound_tok_s=peak / step * batch, fraction=achieved / peak)
    return out


# -- models -----------------------------------------------------------------------------------
def hf_config_dict(shape: dict) -> dict:
    return {**COMMON, **shape}


def build_hf(shape: dict):
    """A random fp32 ``transformers`` Llama of ``shape`` (nonzero norms: a mapping mistake shows)."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = {k: v for k, v in hf_config_dict(shape).items() if k != "model_type"}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def package_params(config, read):
    """The package's global parameter tree for ``config``, each built from the HF tensors ``read``
    returns and placed on the first device one at a time."""
    import jax

    from core.models.huggingface.conversion import param_shapes
    from core.models.huggingface.weight_mapping import param_from_hf

    tree: dict = {}
    device = jax.devices()[0]
    for path, shape in param_shapes(config).items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = jax.device_put(param_from_hf(config, path, shape, read), device)
    return tree


def build_engine(config, params, bf16: bool = False):
    import dataclasses

    import jax

    from core import parallel_state as ps
    from core.inference import GenerationEngine

    if bf16:
        config = dataclasses.replace(config, bf16=True)
    return GenerationEngine(config, ps.build_parallel_state(devices=jax.devices()[:1]), params)


def random_params(config):
    """Random global parameters of ``config`` (the GPU path: no ``transformers``)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from core import parallel_state as ps
    from core.models.gpt import GPTModel
    from core.param_metadata import init_sharded_params

    state = ps.build_parallel_state(devices=jax.devices()[:1])
    model = GPTModel(config, state)
    params, _, _ = init_sharded_params(model.init, state.mesh, (jax.random.key(0), jnp.zeros((1, 8), jnp.int32)),
                                       (P(), P()))
    return params


# -- measurement --------------------------------------------------------------------------------
def package_call(engine, prompts: list[list[int]], n: int):
    from core.inference import SamplingParams

    return lambda: np.array([r.tokens for r in engine.generate(prompts, SamplingParams(temperature=0,
                                                                                        num_tokens_to_generate=n))])


def hf_call(model, prompts: list[list[int]], n: int):
    import torch

    ids = torch.tensor(prompts, dtype=torch.long)

    def call():
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                                 min_new_tokens=n, use_cache=True, pad_token_id=0)
        return out[:, ids.shape[1]:].numpy()

    return call


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def rates(batch: int, prompt: int, new: int, t1: float, tn: float) -> tuple[float, float]:
    """``(prefill tokens/s, decode tokens/s)`` from the medians of the 1-token and N-token calls;
    decode is NaN when the N-token call did not take longer (a busy machine's noise exceeded the
    decode steps' time: nothing was measured)."""
    return batch * prompt / t1, (new - 1) * batch / (tn - t1) if tn > t1 else float("nan")


def agreement(a: np.ndarray, b: np.ndarray) -> tuple[int, float]:
    """Rows with identical tokens, and the mean length of the rows' common prefix."""
    same = (a == b)
    prefix = [int(np.argmin(r)) if not r.all() else len(r) for r in same]
    return int(same.all(axis=1).sum()), float(np.mean(prefix))


def measure_batch(engine, hf_model, config, batch: int, prompt: int, new: int, rounds: int, log) -> dict:
    """One batch's row of the side-by-side table (see the module docstring)."""
    rng = np.random.default_rng(batch)
    prompts = rng.integers(0, config.vocab_size, (batch, prompt)).tolist()
    pkg1, pkgn = package_call(engine, prompts, 1), package_call(engine, prompts, new)
    hf1, hfn = hf_call(hf_model, prompts, 1), hf_call(hf_model, prompts, new)
    first1, _ = timed(pkg1)
    firstn, pkg_tokens = timed(pkgn)
    _, hf_tokens = timed(hfn)  # torch's warm-up (allocator, threads), for both shapes
    timed(hf1)
    same_rows, prefix = agreement(pkg_tokens, hf_tokens)
    times = round_robin_times([pkg1, pkgn, hf1, hfn], reps=rounds, warmup=0)
    med = [statistics.median(t[0]) for t in times]
    p_pre, p_dec = rates(batch, prompt, new, med[0], med[1])
    h_pre, h_dec = rates(batch, prompt, new, med[2], med[3])
    row = dict(batch=batch, pkg_prefill=p_pre, pkg_decode=p_dec, hf_prefill=h_pre, hf_decode=h_dec,
               compile_s=max(first1 - med[0], 0.0) + max(firstn - med[1], 0.0), same_rows=same_rows, prefix=prefix,
               times=med)
    log(f"  batch {batch}: package prefill {p_pre:.0f} tok/s decode {p_dec:.1f} tok/s | transformers prefill "
        f"{h_pre:.0f} decode {h_dec:.1f} | compile {row['compile_s']:.1f} s | identical rows {same_rows}/{batch}")
    return row


def cpu_model_section(name: str, shape: dict, run: BenchRun, log) -> list[dict]:
    import gc

    from core.models.huggingface.config_mapping import gpt_config_from_hf

    prompt, new, plan = PLANS[name]
    hf_model = build_hf(shape)
    state_dict = hf_model.state_dict()
    config = gpt_config_from_hf(hf_config_dict(shape))
    engine = build_engine(config, package_params(config, lambda n: state_dict[n].detach().numpy()))  # shared storage
    params = sum(p.numel() for p in hf_model.parameters())
    log(f"{name}: {params / 1e9:.2f} B parameters, P {prompt}, N {new}, built ({run.lap()})")
    rows = []
    for batch, rounds in plan.items():
        row = measure_batch(engine, hf_model, config, batch, prompt, new, rounds, log)
        row.update(model=name, params=params, prompt=prompt, new=new, rounds=rounds,
                   bw=bandwidth_cells(config, batch, prompt, new, 4, row["pkg_decode"], None),
                   hf_bw=bandwidth_cells(config, batch, prompt, new, 4, row["hf_decode"], None))
        rows.append(row)
    log(f"{name} done ({run.lap()})")
    del engine, hf_model
    gc.collect()
    return rows


def gpu_section(config, engine, prompt: int, new: int, rounds: int, device_kind: str, peak: float | None,
                itemsize: int) -> dict:
    """Batch-1 decode of ``engine`` (any backend) against ``peak``: the GPU path's measurement,
    also what the smoke run exercises on CPU."""
    prompts = np.random.default_rng(0).integers(0, config.vocab_size, (1, prompt)).tolist()
    pkg1, pkgn = package_call(engine, prompts, 1), package_call(engine, prompts, new)
    first1, _ = timed(pkg1)
    firstn, _ = timed(pkgn)
    times = round_robin_times([pkg1, pkgn], reps=rounds, warmup=0)
    t1, tn = (statistics.median(t[0]) for t in times)
    pre, dec = rates(1, prompt, new, t1, tn)
    return dict(device=device_kind, peak=peak, prompt=prompt, new=new, prefill=pre, decode=dec,
                step_ms=1e3 / dec, compile_s=max(first1 - t1, 0) + max(firstn - tn, 0),
                bw=bandwidth_cells(config, 1, prompt, new, itemsize, dec, peak))


# -- report --------------------------------------------------------------------------------------
def cpu_table(rows: list[dict]) -> list[str]:
    lines = ["| model | batch | package prefill tok/s | transformers prefill tok/s | prefill ratio | "
             "package decode tok/s | transformers decode tok/s | decode ratio | package compile (s) | "
             "identical greedy rows (mean common prefix) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['batch']} | {r['pkg_prefill']:.0f} | {r['hf_prefill']:.0f} | "
                     f"{r['pkg_prefill'] / r['hf_prefill']:.2f} | {r['pkg_decode']:.1f} | {r['hf_decode']:.1f} | "
                     f"{r['pkg_decode'] / r['hf_decode']:.2f} | {r['compile_s']:.1f} | {r['same_rows']}/{r['batch']} "
                     f"({r['prefix']:.1f} of {r['new']}) |")
    return lines


def bandwidth_table(rows: list[dict]) -> list[str]:
    lines = ["| model | batch | weight MB / step | KV cache MB / step (mean) | MB / token | package GB/s | "
             "transformers GB/s |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        b = r["bw"]
        lines.append(f"| {r['model']} | {r['batch']} | {b['weight_bytes'] / 1e6:.0f} | {b['kv_bytes'] / 1e6:.1f} | "
                     f"{b['bytes_per_token'] / 1e6:.1f} | {b['achieved_gbs']:.1f} | {r['hf_bw']['achieved_gbs']:.1f} |")
    return lines


def gpu_lines(g: dict, model: str, dtype: str) -> list[str]:
    b = g["bw"]
    peak = f"{g['peak'] / 1e12:.2f} TB/s" if g["peak"] else "unknown (--peak-gbs)"
    lines = ["| model | device | dtype | P | N | prefill tok/s | decode tok/s | ms / step | MB / step | peak | "
             "bound tok/s | achieved GB/s | fraction of bound |", "|---" * 13 + "|"]
    bound = f"{b['bound_tok_s']:.0f}" if g["peak"] else "-"
    frac = f"{b['fraction']:.0%}" if g["peak"] else "-"
    lines.append(f"| {model} | {g['device']} | {dtype} | {g['prompt']} | {g['new']} | {g['prefill']:.0f} | "
                 f"{g['decode']:.1f} | {g['step_ms']:.3f} | {(b['weight_bytes'] + b['kv_bytes']) / 1e6:.0f} | "
                 f"{peak} | {bound} | {b['achieved_gbs']:.1f} | {frac} |")
    return lines


def verdicts(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        if r["batch"] == 8:
            dec, pre = r["pkg_decode"] / r["hf_decode"], r["pkg_prefill"] / r["hf_prefill"]
            out.append(f"- {r['model']}, batch 8: decode {dec:.2f}x transformers (target >= 2: "
                       f"{'met' if dec >= 2 else 'NOT met'}), prefill {pre:.2f}x (target >= 1: "
                       f"{'met' if pre >= 1 else 'NOT met'}).")
    return out


def machine() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = next(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        name = "unknown CPU"
    return f"{name}, {os.cpu_count()} cores"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny model, batches 1 and 2, one round; also the "
                        "GPU bound's arithmetic on CPU")
    parser.add_argument("--device", choices=("cpu", "gpu"), default=None, help="default: JAX's default backend")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default=None, help="GPU path (default bf16)")
    parser.add_argument("--peak-gbs", type=float, default=None, help="the device's peak memory GB/s (GPU path)")
    parser.add_argument("--out", default=None, help="default bench/results/<date>-generate-<device>.md")
    a = parser.parse_args()
    import jax

    device = a.device or ("gpu" if jax.default_backend() == "gpu" else "cpu")
    run = BenchRun()
    log = lambda s: print(s, flush=True)
    lines: list[str] = []
    command = "python bench/generate.py" + (" --smoke" if a.smoke else "") + (" --device gpu" if device == "gpu"
                                                                                else "")
    if device == "cpu":
        import torch

        torch.set_num_threads(os.cpu_count())
        rows = []
        for name, shape in (SMOKE if a.smoke else SHAPES).items():
            rows += cpu_model_section(name, shape, run, log)
        lines += ["## 1. Side by side on CPU (fp32, greedy, same weights)", "",
                  f"Prompt P and new tokens N: {', '.join(f'{r[0]} P {r[1][0]} N {r[1][1]}' for r in PLANS.items() if r[0] in {x['model'] for x in rows})}; "  # noqa: E501
                  "rounds per batch: " + ", ".join(f"{r['model']} b{r['batch']} {r['rounds']}" for r in rows)
                  + ". Ratios: package / transformers. Compile: the package's two programs (N = 1 and N) together.",
                  "", *cpu_table(rows), "", "Targets (batch 8): decode >= 2x transformers, prefill >= 1x.", "",
                  *verdicts(rows), "",
                  "## 2. Decode bytes per step and achieved bandwidth (CPU)", "",
                  "Weights read once per step (all but the input embedding), KV cache up to each row's position "
                  "(mean over the steps); achieved GB/s = steps/s x bytes/step.", "", *bandwidth_table(rows), ""]
    if device == "gpu" or a.smoke:
        from core.models.huggingface.config_mapping import gpt_config_from_hf

        on_gpu = device == "gpu"
        name = GPU_MODEL if on_gpu else "tiny"
        config = gpt_config_from_hf(hf_config_dict((SHAPES if on_gpu else SMOKE)[name]))
        dtype = a.dtype or ("bf16" if on_gpu else "fp32")
        engine = build_engine(config, random_params(config), bf16=dtype == "bf16")
        kind = jax.devices()[0].device_kind if on_gpu else "NVIDIA H200"
        peak = a.peak_gbs * 1e9 if a.peak_gbs else hbm_peak(kind)
        prompt, new, rounds = (GPU_PROMPT, GPU_NEW, GPU_ROUNDS) if on_gpu else (16, 8, 1)
        g = gpu_section(config, engine, prompt, new, rounds, kind, peak, 2 if dtype == "bf16" else 4)
        log(f"GPU-path decode: {g['decode']:.1f} tok/s, {g['bw']['achieved_gbs']:.1f} GB/s"
            + (f", {g['bw']['fraction']:.1%} of the bound" if peak else ""))
        title = ("## 3. Batch-1 decode against the memory-bandwidth bound (GPU)" if on_gpu else
                 "## 3. Batch-1 decode against the memory-bandwidth bound (smoke: the GPU path's arithmetic run on "
                 "CPU with the H200's peak; not a GPU measurement)")
        lines += [title, "", *gpu_lines(g, name, dtype), "", "Target: >= 60% of the bound.", ""]
    version = f"JAX {jax.__version__}"
    if device == "cpu":
        import torch
        import transformers

        version += f", torch {torch.__version__}, transformers {transformers.__version__}"
    lines = [f"# Generation speed ({device})", "", run.header(command, f"{machine()}, {version}"), "", *lines]
    text = "\n".join(lines) + "\n"
    print(text)
    out = a.out or str(ROOT / "bench" / "results" / f"{time.strftime('%Y-%m-%d')}-generate-{device}.md")
    from core.atomic_files import write_atomically

    write_atomically(out, lambda f: f.write(text), mode="w")
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
