"""Megatron-LM's ``tools/checkpoint/convert.py``: models between Hugging Face directories and
the package's checkpoints (Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5, Qwen3).

    # HF -> checkpoint (iteration 0, parameters only; train it with --load DIR --finetune)
    python tools/checkpoint/convert.py --loader hf --saver core \\
        --load-dir Llama-3.2-1B --save-dir ckpt/llama-3.2-1b

    # checkpoint (converted or trained, any layout) -> HF (from_pretrained loads it)
    python tools/checkpoint/convert.py --loader core --saver hf \\
        --load-dir ckpt/run --save-dir out/llama-ft --tokenizer-dir Llama-3.2-1B

One process on the host (no accelerator needed): one parameter array and its HF tensors in
memory at a time. Bad input (missing or malformed ``config.json``, an unsupported family or
rope type, a missing shard, a non-empty destination) exits with one ``error:`` line, status 1;
nothing under ``--save-dir`` is replaced.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def get_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The tool's flags (Megatron's ``--loader``/``--saver``/``--load-dir``/``--save-dir``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-type", default="GPT", choices=["GPT"], help="Megatron's model type (GPT only)")
    parser.add_argument("--loader", required=True, choices=["hf", "core"], help="format of --load-dir")
    parser.add_argument("--saver", required=True, choices=["hf", "core"], help="format of --save-dir")
    parser.add_argument("--load-dir", required=True, help="HF model directory, or checkpoint directory")
    parser.add_argument("--save-dir", required=True, help="destination (new or empty directory)")
    parser.add_argument("--ckpt-step", type=int, default=None, help="--loader core: this step, not the newest")
    parser.add_argument("--tokenizer-dir", default=None, help="--saver hf: copy the tokenizer files from here")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="--saver hf: weight dtype (default: the imported model's, else float32)")
    parser.add_argument("--max-shard-size", default="1GB",
                        help="--saver hf: largest safetensors shard (the host holds one shard while writing it)")
    args = parser.parse_args(argv)
    if (args.loader, args.saver) not in (("hf", "core"), ("core", "hf")):
        parser.error(f"--loader {args.loader} --saver {args.saver}: convert hf -> core or core -> hf")
    return args


def convert(args: argparse.Namespace) -> str:
    """Run the conversion; returns a one-line summary."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # host-side work: never claim an accelerator
    from core.models.huggingface import conversion
    from core.models.huggingface.safetensors_files import parse_size

    start = time.time()
    if args.loader == "hf":
        config = conversion.import_hf_model(args.load_dir, args.save_dir)
        what = f"{config.describe()} -> checkpoint {os.path.join(args.save_dir, '0')}"
    else:
        hf = conversion.export_hf_model(args.load_dir, args.save_dir, args.tokenizer_dir, args.dtype,
                                        parse_size(args.max_shard_size), args.ckpt_step)
        what = f"{hf['architectures'][0]} ({hf['dtype']}) -> {args.save_dir}"
    return f"converted in {time.time() - start:.1f} s: {what}"


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; bad input exits with one ``error:`` line and status 1."""
    args = get_args(argv)
    try:
        print(convert(args), file=sys.stderr)
    except (ValueError, KeyError, FileNotFoundError, FileExistsError) as err:
        print(f"error: {err.args[0] if err.args else err}", file=sys.stderr)
        return 1
    except OSError as err:  # a full disk, an unwritable --save-dir
        where = f" {err.filename}" if err.filename else ""
        print(f"error:{where} {err.strerror or err} (--save-dir {args.save_dir}: nothing replaced)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"error: interrupted; --save-dir {args.save_dir}: nothing written or replaced", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
