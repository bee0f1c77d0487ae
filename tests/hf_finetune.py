"""An imported Hugging Face model fine-tuned on chat data, shared by both test levels: a tiny
random ``LlamaForCausalLM`` whose vocabulary is a chat tokenizer's, converted by
``tools/checkpoint/convert.py``'s code, then trained with ``--load CKPT --use-checkpoint-args
--finetune --sft`` (Megatron's flags) through the trainer the launcher builds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
from chat_data import conversation, write_tokenizer
from spawn_env import spawn_env

from core import parallel_state as ps
from core.training.arguments import fill_defaults, parse_args, validate_args
from core.training.checkpoint_args import apply_checkpoint_args
from core.training.pretrainer import Pretrainer
from core.training.run_config import pretrain_config

ROOT = Path(__file__).resolve().parents[1]


def make_imported_model(root: Path) -> tuple[Path, Path, Path]:
    """``(tokenizer dir, checkpoint dir, JSONL of conversations)`` under ``root``: the model is a
    random 2-layer Llama (GQA, Llama 3.1 rope scaling, untied) in the tokenizer's vocabulary,
    converted by ``tools/checkpoint/convert.py`` run as users run it (a process of its own)."""
    import torch
    import transformers

    tokenizer = write_tokenizer(root / "tokenizer", "llama3")
    vocab = len(json.loads((tokenizer / "tokenizer.json").read_text())["model"]["vocab"])
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab + 4, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16})
    transformers.LlamaForCausalLM(config).save_pretrained(root / "hf")
    subprocess.run([sys.executable, str(ROOT / "tools" / "checkpoint" / "convert.py"), "--loader", "hf", "--saver",
                    "core", "--load-dir", str(root / "hf"), "--save-dir", str(root / "ckpt")], check=True,
                   env=spawn_env())
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": conversation(i)}) + "\n" for i in range(48)))
    return tokenizer, root / "ckpt", data


def finetune_flags(tokenizer: Path, ckpt: Path, data: Path, *extra: str) -> list[str]:
    """The flags of an SFT run from the imported checkpoint (model flags from the checkpoint)."""
    return ["--load", str(ckpt), "--use-checkpoint-args", "--finetune", "--sft", "--data-path", str(data),
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer), "--seq-length", "64",
            "--split", "90,10,0", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "3e-3",
            "--lr-warmup-iters", "1", "--eval-iters", "1", "--no-progress-bar", "--train-iters", "6", *extra]


def finetune_trainer(flags: list[str], tp: int, devices: list) -> Pretrainer:
    """The trainer of ``flags`` at tensor parallelism ``tp`` (dp: the rest of ``devices``), its
    parameters loaded from the checkpoint (``--finetune``)."""
    args = parse_args(flags + ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", "1"])
    apply_checkpoint_args(args)
    fill_defaults(args, len(devices))
    layout = validate_args(args, len(devices))
    trainer = Pretrainer(pretrain_config(args), layout, ps.build_parallel_state(tp, 1, None, devices=devices))
    assert trainer.load(args.load, load_optimizer=False, finetune=True)
    return trainer


def finetune_losses(flags: list[str], tp: int, devices: list | None = None, iters: int = 6) -> list[float]:
    """Losses of ``iters`` fine-tuning iterations."""
    trainer = finetune_trainer(flags, tp, devices or jax.devices())
    return [trainer.step()["loss"] for _ in range(iters)]
