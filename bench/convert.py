"""Hugging Face conversion and SFT packing: time, peak host memory, packing efficiency.

    python bench/convert.py            # ~0.1B and ~1.2B (Llama-3.2-1B's shape) models, ~4 min on 2 cores
    python bench/convert.py --quick    # a tiny model, ~20 s

1. **Conversion** (``tools/checkpoint/convert.py`` as users run it, one subprocess each): a
   random Llama-class model in bf16 safetensors (shards of at most 2 GB, as published models
   are; written by the package's own export path, so ``transformers`` is not needed) converted
   to a checkpoint (``--loader hf --saver core``), then back (``--loader core --saver hf``).
   Per direction: wall time, the child's peak resident memory (``ru_maxrss`` from ``wait4``),
   the largest single array of each side (the checkpoint stores each weight of every layer as
   one stacked fp32 array; HF files store one bf16 tensor per layer), and whether the round
   trip's tensors are bit-identical.
2. **SFT packing**: conversations of a long-tailed (log-normal) length distribution packed by
   ``--sft``'s packer (``core.data.sft_dataset.SFTDataset``): conversation tokens / tokens
   processed (the packing efficiency: the rest is padding) and loss tokens / tokens processed.

Writes ``bench/results/convert.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from timing import BenchRun  # noqa: E402

from core.atomic_files import write_text_atomically  # noqa: E402

TOOL = ROOT / "tools" / "checkpoint" / "convert.py"
GIB = 2**30

SHAPES = {
    "~0.1B": dict(num_layers=12, hidden_size=768, num_attention_heads=12, num_query_groups=4, ffn_hidden_size=2048,
                  vocab_size=32000, share_embeddings_and_output_weights=False),
    "~1.2B (Llama-3.2-1B)": dict(num_layers=16, hidden_size=2048, num_attention_heads=32, num_query_groups=8,
                                  ffn_hidden_size=8192, vocab_size=128256, share_embeddings_and_output_weights=True),
}
QUICK = {"tiny": dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                      vocab_size=1000, share_embeddings_and_output_weights=False)}


def _config(shape: dict):
    from core.models.gpt import GPTConfig

    return GPTConfig(seq_length=4096, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                     add_bias_linear=False, rotary_base=500000.0, **shape)


def write_random_hf_model(directory: str, shape: dict) -> tuple[int, int]:
    """A random bf16 HF model of ``shape`` in ``directory``; ``(parameters, largest tensor bytes)``."""
    import jax.numpy as jnp

    from core.models.huggingface import conversion
    from core.models.huggingface.config_mapping import hf_config_from_gpt
    from core.models.huggingface.safetensors_files import write_safetensors
    from core.models.huggingface.weight_mapping import hf_tensors_from_param

    config = _config(shape)
    rng = np.random.default_rng(0)
    count, largest = 0, 0

    def tensors():
        nonlocal count, largest
        for path, shp in conversion.param_shapes(config).items():
            array = (rng.standard_normal(shp, dtype=np.float32) * 0.02).astype(np.float32)
            for name, tensor in hf_tensors_from_param(config, path, array):
                tensor = tensor.astype(jnp.bfloat16)
                count += tensor.size
                largest = max(largest, tensor.nbytes)
                yield name, tensor

    write_safetensors(directory, tensors(), 2 * 10**9)
    hf_config = hf_config_from_gpt(config, None, "bfloat16")
    conversion._write_json(os.path.join(directory, conversion.CONFIG_FILE), hf_config)
    return count, largest


_PEAK_WRAPPER = """
import runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0]
    print("peak-rss-kib", hwm.split()[1], file=sys.stderr)
"""
"""Runs the tool and prints its own peak resident memory (``VmHWM``: this process image's, unlike
``ru_maxrss``, which keeps the forking parent's peak across ``exec``)."""


def run_tool(args: list[str]) -> tuple[float, int]:
    """``(wall seconds, peak RSS bytes)`` of one ``convert.py`` run."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _PEAK_WRAPPER, str(TOOL), *args], stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"convert.py {' '.join(args)} failed: {proc.stderr.strip()[-2000:]}")
    peak = [line for line in proc.stderr.splitlines() if line.startswith("peak-rss-kib")][-1]
    return wall, int(peak.split()[1]) * 1024


def same_tensors(a: str, b: str) -> bool:
    """Whether two HF directories hold the same tensor names with bit-identical values."""
    from core.models.huggingface.safetensors_files import SafetensorsReader

    ra, rb = SafetensorsReader(a), SafetensorsReader(b)
    if sorted(ra.names) != sorted(rb.names):
        return False
    return all(np.array_equal(ra.get(n).view(np.uint8), rb.get(n).view(np.uint8)) for n in ra.names)


def largest_checkpoint_array(directory: str) -> int:
    """Bytes of the checkpoint's largest parameter array."""
    from core.checkpointing.params_checkpoint import saved_param_shapes

    return max(int(np.prod(s)) * d.itemsize for s, d in saved_param_shapes(directory).values())


def bench_conversion(shapes: dict) -> list[str]:
    """The conversion table's rows."""
    rows = []
    for name, shape in shapes.items():
        with tempfile.TemporaryDirectory() as tmp:
            hf, ckpt, back = (os.path.join(tmp, d) for d in ("hf", "ckpt", "back"))
            params, largest_hf = write_random_hf_model(hf, shape)
            t_in, rss_in = run_tool(["--loader", "hf", "--saver", "core", "--load-dir", hf, "--save-dir", ckpt])
            t_out, rss_out = run_tool(["--loader", "core", "--saver", "hf", "--load-dir", ckpt, "--save-dir", back])
            largest_ckpt = largest_checkpoint_array(ckpt)
            exact = same_tensors(hf, back)
            rows.append(f"| {name} | {params / 1e9:.2f} B | {largest_hf / GIB:.2f} | {largest_ckpt / GIB:.2f} | "
                        f"{t_in:.1f} s | {rss_in / GIB:.2f} | {t_out:.1f} s | {rss_out / GIB:.2f} | "
                        f"{'yes' if exact else 'NO'} |")
            print(rows[-1], flush=True)
    return rows


def bench_packing(seq_length: int, conversations: int) -> list[str]:
    """The packing table's rows: ``core.data.sft_dataset.SFTDataset`` on conversations of
    log-normal lengths whose later 60% of tokens are the assistant's (as in chat data, where the
    answer is the longer part)."""
    from core.data.sft_dataset import Conversation, SFTDataset

    rng = np.random.default_rng(0)
    rows = []
    for label, mean in (("short chats (median 300 tokens)", 300), ("long chats (median 1200 tokens)", 1200)):
        lengths = np.clip(rng.lognormal(np.log(mean), 0.8, conversations).astype(int), 16, 4 * seq_length)
        convs = [Conversation(np.zeros(n, np.int32), np.arange(n) >= int(0.4 * n)) for n in lengths]
        start = time.perf_counter()
        dataset = SFTDataset(convs, seq_length, seed=0, pad_id=0)
        seconds = time.perf_counter() - start
        processed = len(dataset) * seq_length
        loss_tokens = len(dataset.target_tokens())
        rows.append(f"| {label} | {conversations} | {dataset.num_truncated} | {len(dataset)} | {dataset.fill:.1%} | "
                    f"{loss_tokens / processed:.1%} | {seconds:.2f} s |")
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    """Run the benchmark and write the report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model only")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "convert.md"))
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    run = BenchRun()
    conv = bench_conversion(QUICK if args.quick else SHAPES)
    pack = bench_packing(4096, 200 if args.quick else 5000)
    command = "python bench/convert.py" + (" --quick" if args.quick else "")
    lines = [run.header(command, "2-core AMD EPYC VM, JAX " + __import__("jax").__version__), "",
             "## Conversion (tools/checkpoint/convert.py, one process)", "",
             "| model | parameters | largest HF tensor (GiB) | largest checkpoint array (GiB) | HF -> core | peak RSS "
             "(GiB) | core -> HF | peak RSS (GiB) | round trip bit-identical |",
             "|---|---|---|---|---|---|---|---|---|", *conv, "",
             "## SFT packing (--sft: first-fit in a seeded order into 4096-token sequences)", "",
             "| lengths | conversations | truncated to 4096 | sequences | conversation tokens / tokens processed | "
             "loss tokens / tokens processed | packing time |",
             "|---|---|---|---|---|---|---|", *pack, ""]
    write_text_atomically(args.out, "\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
