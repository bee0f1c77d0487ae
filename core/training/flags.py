"""The command-line flags of ``launch/pretrain.py``, Megatron's names: the parser (``--help`` lists
them all). Building it imports nothing of JAX or the data layer; :mod:`core.training.arguments`
validates the parsed flags."""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Callable
from typing import Any


def _list_expression(node):
    """Value of an expression of int literals, lists, ``+`` and ``*`` (Megatron evaluates
    ``--moe-layer-freq`` strings such as ``([1]*3+[0])*2`` with Python's ``eval``; nothing else
    is evaluated here)."""
    import ast

    if isinstance(node, ast.Expression):
        return _list_expression(node.body)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_list_expression(e) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _list_expression(node.left), _list_expression(node.right)
        if isinstance(node.op, ast.Mult) and max(abs(v) for v in (left, right) if isinstance(v, int)) > 1 << 16:
            raise ValueError("repeat count too large")
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise ValueError(f"unsupported expression {type(node).__name__}")


def _moe_layer_freq(text: str) -> int | tuple[int, ...]:
    """``--moe-layer-freq``: an int, or a list of 0/1 per layer, written out or as Megatron's list
    expression (``([1]*3+[0]*1)*2``)."""
    import ast

    try:
        value = _list_expression(ast.parse(text.strip(), mode="eval"))
    except (ValueError, SyntaxError, TypeError):
        raise argparse.ArgumentTypeError(f"expected an int or a list like [0,1,1,1] or ([1]*3+[0])*2, got "
                                         f"{text!r}") from None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(value)
    raise argparse.ArgumentTypeError(f"expected an int or a list like [0,1,1,1], got {text!r}")


TOKENIZER_TYPE_NAMES = ("ByteLevel", "HuggingFaceTokenizer", "GPT2BPETokenizer", "NullTokenizer")
"""``--tokenizer-type`` choices (``core.data.tokenizers.TOKENIZER_TYPES``' names, listed here so that
building the parser imports nothing of the data layer)."""


SFT_PROMPT_FORMAT_NAMES = ("default", "nemotron-h-aligned", "nemotron-nano-v2", "identity")
"""``--sft-tokenizer-prompt-format`` choices (``core.data.chat_template.PROMPT_FORMATS``' names)."""


class ArgumentError(ValueError):
    """Flags that cannot work together (reported as one line, exit code 2)."""


EXIT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")
"""The signals ``--exit-signal`` may name (Megatron's choices; :mod:`core.training.exit_conditions`)."""


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse with its errors as one line (exit code 2): the usage of over a hundred flags
    would bury the one that is wrong."""

    def error(self, message: str):
        """Print ``error: message`` and exit with code 2."""
        self.exit(2, f"error: {message} (--help lists the flags)\n")


def parse_on_rank_0(parse_args: Callable[[list[str] | None], argparse.Namespace], argv: list[str] | None,
                    rank: int) -> argparse.Namespace:
    """``parse_args(argv)`` with argparse's usage and errors (and ``--help``) printed by rank 0
    only: the other ranks parse silently and, on a bad flag, exit with the same code once rank 0
    has had time to print (the launcher ends the job at the first exit)."""
    if rank == 0:
        return parse_args(argv)
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        try:
            return parse_args(argv)
        except SystemExit:
            time.sleep(2.0)
            raise


def add_tokenizer_flags(group: Any, default_type: str | None, type_help: str) -> None:
    """Megatron's tokenizer flags (``--tokenizer-type`` defaulting to ``default_type``, its file
    flags and ``--vocab-size``) on an argument group."""
    group.add_argument("--tokenizer-type", choices=TOKENIZER_TYPE_NAMES, default=default_type, help=type_help)
    group.add_argument("--tokenizer-model", default=None,
                       help="HuggingFaceTokenizer: a tokenizer.json or the directory holding one")
    group.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json")
    group.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")
    group.add_argument("--vocab-size", type=int, default=None,
                       help="NullTokenizer: ids below this, EOD = this id (vocabulary of this + 1)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (``--help`` lists every flag)."""
    p = OneLineErrorParser(
        description="Pretrain a GPT with tensor, pipeline and data parallelism (Megatron flags).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=None,
                   help="tensor-parallel size (default: 2 when the world size is 8, else 1)")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=None,
                   help="pipeline stages (default: 2 when the world size is 8, else 1)")
    g.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None,
                   help="model chunks per pipeline stage (interleaved 1F1B)")
    g.add_argument("--pipeline-schedule", choices=["1f1b", "interleaved", "zb-h1", "zb-v"], default=None,
                   help="pipeline schedule: Megatron's 1F1B (the default without virtual stages), interleaved 1F1B "
                        "(the default with --virtual-pipeline-model-parallel-size > 1), ZB-H1 zero-bubble (one "
                        "chunk per stage, at least pp microbatches: each backward split into the input gradient "
                        "and a weight gradient that fills the bubble) or ZB-V (zero-bubble with two chunks per "
                        "stage in a V: --virtual-pipeline-model-parallel-size 2, at least pp microbatches)")
    g.add_argument("--zero-bubble-w-recompute", action="store_true",
                   help="with --pipeline-schedule zb-h1 or zb-v: the weight-gradient step recomputes the stage's "
                        "forward from its input instead of keeping the input-gradient step's activations until "
                        "then (about 1F1B's activation memory, one more forward per microbatch and stage)")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="context-parallel size: every sample's sequence split over this many ranks "
                        "(load-balanced chunks; dp = world / (tp x pp x cp))")
    g.add_argument("--cp-comm-type", choices=["p2p", "all_gather", "a2a", "a2a+p2p"], default="p2p",
                   help="context-parallel attention: K/V passed around a ring (p2p), all-gathered, an all-to-all "
                        "to a head split around the backend's attention (a2a, Ulysses), or that all-to-all inside "
                        "groups with the ring across them (a2a+p2p)")
    g.add_argument("--hierarchical-context-parallel-sizes", type=int, nargs=2, default=None, metavar=("A2A", "P2P"),
                   help="a2a+p2p: all-to-all group size (consecutive cp ranks) and ring size; A2A x P2P = cp")
    g.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism")
    g.add_argument("--use-distributed-optimizer", action="store_true", help="shard optimizer state over dp (ZeRO-1)")
    g.add_argument("--num-distributed-optimizer-instances", type=int, default=1,
                   help="partial distributed optimizer: the dp x cp ranks form this many instances of "
                        "contiguous ranks, each holding a whole copy of the sharded optimizer state")
    g.add_argument("--overlap-grad-reduce", action="store_true", help="start bucket reductions during the backward")
    g.add_argument("--use-megatron-fsdp", action="store_true",
                   help="Megatron-FSDP: shard over dp what --data-parallel-sharding-strategy says")
    g.add_argument("--data-parallel-sharding-strategy", default="optim_grads_params",
                   help="with --use-megatron-fsdp: no_shard (plain DDP), optim (ZeRO-1, the distributed optimizer), "
                        "optim_grads (ZeRO-2: grads reduce-scattered per microbatch) or optim_grads_params "
                        "(ZeRO-3, Megatron's default: params sharded too, gathered per layer)")
    g.add_argument("--no-fsdp-reshard-after-forward", action="store_true",
                   help="optim_grads_params: keep each layer's gathered params from its forward for its backward "
                        "(one gather fewer, more memory) instead of gathering them again")
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=128)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="MLP width (default 4 x hidden)")
    g.add_argument("--seq-length", type=int, default=128)
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"], default="learned_absolute")
    g.add_argument("--rotary-base", type=float, default=10000.0, help="base of the rotary frequencies")
    g.add_argument("--rotary-percent", type=float, default=1.0, help="share of each head's dims that rotary rotates")
    g.add_argument("--use-rope-scaling", action="store_true", help="Llama 3.1's rotary frequency scaling")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0,
                   help="with --use-rope-scaling: the low frequencies are divided by this factor")
    g.add_argument("--rope-scaling-low-freq-factor", type=float, default=1.0,
                   help="with --use-rope-scaling: wavelengths above original / this are fully scaled")
    g.add_argument("--rope-scaling-high-freq-factor", type=float, default=4.0,
                   help="with --use-rope-scaling: wavelengths below original / this are left unscaled")
    g.add_argument("--rope-scaling-original-max-position-embeddings", type=int, default=8192,
                   help="with --use-rope-scaling: the context length before the scaling")
    g.add_argument("--kv-channels", type=int, default=None,
                   help="channels per attention head (default hidden-size / num-attention-heads)")
    g.add_argument("--add-qkv-bias", action="store_true", help="a bias on the QKV projection (with "
                                                               "--disable-bias-linear too)")
    g.add_argument("--qk-layernorm", action="store_true",
                   help="normalise each query and key head (the --normalization norm) before rotary")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5, help="epsilon of every LayerNorm / RMSNorm")
    g.add_argument("--swiglu", action="store_true", help="gated MLP: fc2(silu(x W_gate) * x W_up)")
    g.add_argument("--disable-bias-linear", action="store_true", help="no biases in the linear layers")
    g.add_argument("--group-query-attention", action="store_true", help="grouped-query attention (GQA)")
    g.add_argument("--num-query-groups", type=int, default=1,
                   help="K/V head groups with --group-query-attention (tp must divide it)")
    g.add_argument("--attention-dropout", type=float, default=0.0,
                   help="dropout on the attention probabilities (Megatron's default is 0.1)")
    g.add_argument("--hidden-dropout", type=float, default=0.0,
                   help="dropout on the embedding and block outputs (Megatron's default is 0.1)")
    g.add_argument("--init-method-std", type=float, default=0.02, help="std of the normal weight init")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this x tensor-model-parallel-size")
    g.add_argument("--recompute-activations", action="store_true",
                   help="Megatron's shorthand for --recompute-granularity selective")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None,
                   help="recompute in the backward: full (each whole layer) or selective (keep the linear layers' "
                        "outputs, rerun core attention and the elementwise ops)")
    g.add_argument("--scan-layers", action="store_true",
                   help="run each pipeline chunk's layers as a rolled lax.scan: compile time independent of depth "
                        "(default: unrolled, faster steps)")
    g.add_argument("--bf16", action="store_true", help="compute in bfloat16 (fp32 params and optimizer)")
    g.add_argument("--fp8-format", choices=["e4m3", "hybrid"], default=None,
                   help="FP8 GEMMs in the transformer's linear layers (QKV, projection, fc1, fc2): e4m3 everywhere, "
                        "or hybrid (E4M3 forward, E5M2 gradients); embeddings, output layer, norms, attention and "
                        "loss stay in high precision (default: off)")
    g.add_argument("--fp8-recipe", choices=["delayed", "tensorwise"], default="delayed",
                   help="FP8 scaling: delayed (from an amax history, Megatron's default) or tensorwise "
                        "(from the current tensor)")
    g.add_argument("--fp8-margin", type=int, default=0, help="delayed recipe: scales divided by 2^margin")
    g.add_argument("--fp8-amax-history-len", type=int, default=1, help="delayed recipe: amaxes kept per tensor")
    g.add_argument("--fp8-amax-compute-algo", choices=["most_recent", "max"], default="most_recent",
                   help="delayed recipe: the amax a scale comes from")
    g.add_argument("--no-fp8-wgrad", action="store_true", help="weight-gradient GEMMs in high precision under FP8")
    g = p.add_argument_group("mixture of experts (docs/moe.md; Megatron's defaults where unset)")
    g.add_argument("--num-experts", type=int, default=None, help="routed experts per MoE layer (enables MoE)")
    g.add_argument("--moe-layer-freq", type=_moe_layer_freq, default=None,
                   help="MoE layers: N (every Nth layer, starting at layer 0) or a list of 0/1 per layer, "
                        "e.g. '[0,1,1,1]' (default 1: every layer)")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="experts split over this many ranks (a split of data parallelism; must divide "
                        "world / (tp x pp x cp), works with --context-parallel-size)")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="expert MLP width (default --ffn-hidden-size)")
    g.add_argument("--moe-router-topk", type=int, default=None, help="experts per token (default 2)")
    g.add_argument("--moe-router-score-function", choices=["softmax", "sigmoid"], default=None,
                   help="router scores (default softmax)")
    g.add_argument("--moe-router-pre-softmax", action="store_true", default=None,
                   help="softmax over all experts before the top-k")
    g.add_argument("--moe-router-load-balancing-type", choices=["aux_loss", "seq_aux_loss", "none"], default=None,
                   help="load-balancing loss (default aux_loss)")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=None, help="load-balancing loss weight (default 0)")
    g.add_argument("--moe-z-loss-coeff", type=float, default=None, help="router z-loss weight (default: off)")
    g.add_argument("--moe-token-dispatcher-type", choices=["allgather", "alltoall"], default=None,
                   help="token dispatcher over the expert-parallel ranks (default allgather)")
    g.add_argument("--moe-grouped-gemm", action="store_true", default=None,
                   help="all local experts in one grouped GEMM (jax.lax.ragged_dot)")
    g.add_argument("--moe-grouped-gemm-implementation", choices=["ragged_dot", "windows"], default=None,
                   help="the grouped GEMM's implementation (default: windows of each expert's rows on the CPU, "
                        "jax.lax.ragged_dot elsewhere)")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                   help="expert capacity factor (tokens over capacity are dropped; default: dropless)")
    g.add_argument("--moe-token-drop-policy", choices=["probs", "position"], default=None,
                   help="over capacity keep the highest-prob or the earliest tokens (default probs)")
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true", default=None,
                   help="every expert computes exactly its capacity of rows")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None, help="shared expert width")
    g.add_argument("--moe-router-dtype", choices=["fp32"], default=None, help="router linear layer in float32")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true", default=None,
                   help="DeepSeek-V3 aux-loss-free balancing: a per-expert bias on the top-k choice "
                        "(sigmoid score function), moved after every step by the rate against the step's global "
                        "load; checkpointed, not optimized")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=None,
                   help="expert-bias update rate (with --moe-router-enable-expert-bias; default 1e-3)")
    g.add_argument("--moe-router-force-load-balancing", action="store_true", default=None,
                   help="benchmarking only: route by random logits (balanced expert loads), gradients straight "
                        "through to the gate")
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=4)
    g.add_argument("--global-batch-size", type=int, default=16)
    g.add_argument("--train-iters", type=int, default=100)
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--min-lr", type=float, default=None,
                   help="learning rate at the end of the decay (default: --lr / 10; at most --lr)")
    g.add_argument("--lr-warmup-iters", type=int, default=None,
                   help="iterations of linear warm-up (default: 10, fewer when the decay phase is shorter: Megatron "
                        "requires warm-up to end before --lr-decay-iters)")
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="cosine")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--clip-grad", type=float, default=1.0, help="global grad-norm clip (0 disables)")
    g.add_argument("--seed", type=int, default=1234)
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="Megatron indexed-dataset prefixes (PREFIX.bin/.idx from tools/preprocess_data.py), "
                        "optionally weighted: '0.3 PREFIX_A 0.7 PREFIX_B'; or one text file or directory "
                        "(default: the Python reference manual shipped with CPython)")
    g.add_argument("--split", default="969,30,1",
                   help="train,valid,test weights of the documents of each indexed dataset")
    g.add_argument("--valid-fraction", type=float, default=0.05, help="share of a text corpus held out")
    g.add_argument("--data-cache-path", default=None,
                   help="directory of the cached sample indices (default: PREFIX/cache/GPTDataset_indices)")
    add_tokenizer_flags(g, "ByteLevel", "ByteLevel: UTF-8 bytes + EOD 256; the others as in Megatron")
    g.add_argument("--reset-position-ids", action="store_true",
                   help="restart position ids after every end-of-document token (indexed data)")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="no attention across an end-of-document token (indexed data; sent as segment_ids)")
    g.add_argument("--eod-mask-loss", action="store_true",
                   help="no loss where the input token is the end-of-document token (indexed data)")
    g.add_argument("--num-workers", type=int, default=0,
                   help="accepted for Megatron's command lines; batches are assembled in the training process "
                        "while the previous step runs")
    g = p.add_argument_group("supervised fine-tuning (docs/data.md, Supervised fine-tuning)")
    g.add_argument("--sft", action="store_true",
                   help="train on chat conversations: --data-path is a JSONL file of {\"messages\": [{\"role\", "
                        "\"content\"}, ...]} lines, rendered with the chat template of --tokenizer-model (a "
                        "HuggingFaceTokenizer directory), the loss on the assistant's tokens only, conversations "
                        "packed into --seq-length with their own positions and attention")
    g.add_argument("--sft-tokenizer-prompt-format", choices=SFT_PROMPT_FORMAT_NAMES, default=None,
                   help="with --sft: 'default' renders with the tokenizer's own chat template (the default here; "
                        "Megatron's default is nemotron-h-aligned), the others are Megatron's fixed templates")
    g = p.add_argument_group("checkpointing and logging")
    g.add_argument("--save", default=None, help="checkpoint directory")
    g.add_argument("--load", default=None, help="checkpoint directory to resume from")
    g.add_argument("--save-interval", type=int, default=None, help="iterations between checkpoints")
    g.add_argument("--no-load-optim", action="store_true", help="load only parameters (e.g. into another layout)")
    g.add_argument("--no-save-optim", action="store_true",
                   help="checkpoints hold the parameters only (about a quarter of the bytes with Adam); resume from "
                        "one with --no-load-optim or --finetune")
    g.add_argument("--finetune", action="store_true",
                   help="load the parameters only from --load and start a new run from them: iteration 0, the "
                        "start of the data, a fresh optimizer state")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="take the model's shape (layers, widths, heads, vocabulary, rope and norm options) from the "
                        "checkpoint in --load; model flags given too must agree with it")
    g.add_argument("--ckpt-step", type=int, default=None,
                   help="load this iteration's checkpoint from --load instead of the newest")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="exit with an error when --load holds no checkpoint, instead of starting from random "
                        "initialization (a path typo)")
    g.add_argument("--check-for-nan-in-loss-and-grad", action="store_true",
                   help="skip the update of a step with a NaN/Inf gradient and name the parameters and ranks "
                        "that had it (the run stops at a non-finite loss or grad norm either way)")
    g.add_argument("--check-for-spiky-loss", action="store_true",
                   help="skip the update of a step whose loss is above --spiky-loss-factor x the largest of the "
                        "last 100 losses, with a warning line")
    g.add_argument("--spiky-loss-factor", type=float, default=10.0,
                   help="multiple of the recent maximum loss that counts as spiky (Megatron's 10)")
    g.add_argument("--async-save", action="store_true",
                   help="write checkpoints in the background while training goes on (by a writer process per "
                        "training process, as Megatron's persistent checkpoint worker; see --async-save-writer)")
    g.add_argument("--async-save-writer", choices=["process", "thread"], default=None,
                   help="what writes an --async-save checkpoint: a writer process (the default on Linux; it "
                        "shares no GIL with the training loop) or a thread of the training process")
    g.add_argument("--eval-interval", type=int, default=50)
    g.add_argument("--eval-iters", type=int, default=4, help="validation batches per evaluation")
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--metrics-file", default=None, help="append one JSON object per logged iteration")
    g.add_argument("--no-progress-bar", action="store_true")
    g.add_argument("--debug", action="store_true",
                   help="on a failure, print the Python traceback before the one error line")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="save (with --save) and exit at the next iteration divisible by this value")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="save (with --save) and exit once this many minutes have passed since the trainer was built "
                        "(all processes at the same iteration)")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on --exit-signal, save (with --save) and exit with code 0 at the next iteration, all "
                        "processes together (a scheduler's warning before it ends the job)")
    g.add_argument("--exit-signal", choices=EXIT_SIGNALS, default="SIGTERM",
                   help="the signal --exit-signal-handler catches")
    g.add_argument("--profile", action="store_true",
                   help="jax.profiler trace of iterations (--profile-step-start, --profile-step-end]")
    g.add_argument("--profile-step-start", type=int, default=10, help="iterations run before the trace starts")
    g.add_argument("--profile-step-end", type=int, default=12, help="the iteration after which the trace stops")
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[0], help="ranks that write a trace")
    g.add_argument("--profile-dir", default="profile", help="where the traces go (one subfolder per trace)")
    g = p.add_argument_group("TensorBoard, Weights & Biases and timers (docs/observability.md)")
    g.add_argument("--tensorboard-dir", default=None,
                   help="write TensorBoard event files to this directory (rank 0; needs tensorboardX)")
    g.add_argument("--tensorboard-log-interval", type=int, default=1,
                   help="TensorBoard and W&B get the scalars of every this-many-th iteration")
    g.add_argument("--tensorboard-queue-size", type=int, default=1000,
                   help="events queued before the TensorBoard writer flushes them to disk")
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="write iteration-time, throughput and the timers' <name>-time")
    g.add_argument("--log-memory-to-tensorboard", action="store_true", help="write the mem-* tags")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true",
                   help="write the validation perplexity besides the validation loss")
    g.add_argument("--log-learning-rate-to-tensorboard", action=argparse.BooleanOptionalAction, default=True,
                   help="write the learning-rate tags")
    g.add_argument("--log-loss-scale-to-tensorboard", action=argparse.BooleanOptionalAction, default=True,
                   help="accepted for Megatron's scripts: no run here scales its loss (fp32 or bf16), so there is no "
                        "loss-scale tag")
    g.add_argument("--wandb-project", default=None,
                   help="log to this Weights & Biases project (rank 0; needs wandb; WANDB_MODE=offline keeps the run "
                        "on disk)")
    g.add_argument("--wandb-exp-name", default=None, help="the W&B run's name (default: W&B chooses one)")
    g.add_argument("--wandb-save-dir", default=None,
                   help="W&B's local directory (default: <--save>/wandb, else ./wandb)")
    g.add_argument("--timing-log-level", type=int, choices=[0, 1, 2], default=0,
                   help="time each rank's host-side phases (data, dispatch, waiting for the device, evaluation, "
                        "checkpoint) and log them at each log line; 0: off")
    g.add_argument("--timing-log-option", choices=["max", "minmax", "all"], default="minmax",
                   help="report the max over ranks, the min and max, or every rank's time (each with the slowest "
                        "rank)")
    g = p.add_argument_group("compilation")
    g.add_argument("--compilation-cache-dir", default=None,
                   help="JAX persistent compilation cache (default: $JAX_COMPILATION_CACHE_DIR, else "
                        "~/.cache/megatron_core_jax/jax)")
    g.add_argument("--no-compilation-cache", action="store_true", help="compile every program afresh")
    return p
