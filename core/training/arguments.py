"""Megatron-style command-line flags of ``launch/pretrain.py`` and their validation.

Defaults give a small GPT that trains in a few minutes on a 2-core CPU machine, both under
``mpirun -n 8`` (tp=2, pp=2, dp=2) and in one process (tp=pp=1). Validation depends only on
the flags and the world size, so every rank reaches the same verdict without communicating.
Importing this module does not import JAX: the launch path parses its flags before it
re-executes itself with its malloc settings (``core.runtime.cpu_malloc``), so the model-side imports
are inside the two functions that need them.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from core.checkpointing.checkpointer import CheckpointConfig
    from core.data.tokenizers import MegatronTokenizer
    from core.models.gpt import GPTConfig
    from core.training.config import DataConfig, PretrainConfig, TrainingConfig

TOKENIZER_TYPE_NAMES = ("ByteLevel", "HuggingFaceTokenizer", "GPT2BPETokenizer", "NullTokenizer")
"""``--tokenizer-type`` choices (``core.data.tokenizers.TOKENIZER_TYPES``' names, listed here so that
building the parser imports nothing of the data layer)."""


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
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="context-parallel size: every sample's sequence split over this many ranks "
                        "(load-balanced chunks; dp = world / (tp x pp x cp))")
    g.add_argument("--cp-comm-type", choices=["p2p", "all_gather"], default="p2p",
                   help="context-parallel attention: K/V passed around a ring (p2p) or all-gathered")
    g.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism")
    g.add_argument("--use-distributed-optimizer", action="store_true", help="shard optimizer state over dp (ZeRO-1)")
    g.add_argument("--num-distributed-optimizer-instances", type=int, default=1,
                   help="partial distributed optimizer: the dp x cp ranks form this many instances of "
                        "contiguous ranks, each holding a whole copy of the sharded optimizer state")
    g.add_argument("--overlap-grad-reduce", action="store_true", help="start bucket reductions during the backward")
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=128)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="MLP width (default 4 x hidden)")
    g.add_argument("--seq-length", type=int, default=128)
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"], default="learned_absolute")
    g.add_argument("--rotary-base", type=float, default=10000.0, help="base of the rotary frequencies")
    g.add_argument("--rotary-percent", type=float, default=1.0, help="share of each head's dims that rotary rotates")
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
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPE_NAMES, default="ByteLevel",
                   help="ByteLevel: UTF-8 bytes + EOD 256; the others as in Megatron")
    g.add_argument("--tokenizer-model", default=None,
                   help="HuggingFaceTokenizer: a tokenizer.json or the directory holding one")
    g.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json")
    g.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="NullTokenizer: ids below this, EOD = this id (vocabulary of this + 1)")
    g.add_argument("--reset-position-ids", action="store_true",
                   help="restart position ids after every end-of-document token (indexed data)")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="no attention across an end-of-document token (indexed data; sent as segment_ids)")
    g.add_argument("--eod-mask-loss", action="store_true",
                   help="no loss where the input token is the end-of-document token (indexed data)")
    g.add_argument("--num-workers", type=int, default=0,
                   help="accepted for Megatron's command lines; batches are assembled in the training process "
                        "while the previous step runs")
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
    g = p.add_argument_group("compilation")
    g.add_argument("--compilation-cache-dir", default=None,
                   help="JAX persistent compilation cache (default: $JAX_COMPILATION_CACHE_DIR, else "
                        "~/.cache/megatron_core_jax/jax)")
    g.add_argument("--no-compilation-cache", action="store_true", help="compile every program afresh")
    return p


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """Sizes derived from the flags and the world size."""

    tensor_model_parallel_size: int
    """tp."""
    pipeline_model_parallel_size: int
    """pp."""
    virtual_pipeline_model_parallel_size: int | None
    """Model chunks per stage, or None."""
    data_parallel_size: int
    """world / (tp * pp * cp)."""
    num_microbatches: int
    """global batch / (micro batch * dp)."""
    context_parallel_size: int = 1
    """cp: ranks sharing every sample's sequence."""
    expert_model_parallel_size: int = 1
    """ep: experts split over this many of the data-parallel ranks (dp includes them)."""

    def describe(self) -> str:
        """``tp=2 pp=2 dp=2`` (+ vpp, + cp, + ep when above 1)."""
        vpp = f" vpp={self.virtual_pipeline_model_parallel_size}" if self.virtual_pipeline_model_parallel_size else ""
        cp = f" cp={self.context_parallel_size}" if self.context_parallel_size > 1 else ""
        ep = f" ep={self.expert_model_parallel_size}" if self.expert_model_parallel_size > 1 else ""
        return (f"tp={self.tensor_model_parallel_size} pp={self.pipeline_model_parallel_size}{vpp}{cp} "
                f"dp={self.data_parallel_size}{ep}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse flags (argparse exits with code 2 and its usage line on unknown flags)."""
    return build_parser().parse_args(argv)


def fill_defaults(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """The world-size-dependent defaults: tp=pp=2 on 8 ranks (the 3D default), else 1."""
    three_d = world_size % 4 == 0 and world_size >= 8
    if args.tensor_model_parallel_size is None:
        args.tensor_model_parallel_size = 2 if three_d else 1
    if args.pipeline_model_parallel_size is None:
        args.pipeline_model_parallel_size = 2 if three_d else 1
    return args


def validate_args(args: argparse.Namespace, world_size: int) -> ParallelLayout:
    """Check every size; raise :class:`ArgumentError` with a one-line message naming the numbers."""
    tp, pp, vpp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, \
        args.virtual_pipeline_model_parallel_size
    cp = args.context_parallel_size
    positive = ["tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size", "num_layers",
                "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size", "global_batch_size",
                "train_iters", "log_interval", "eval_interval", "eval_iters"]
    for name in positive:
        if getattr(args, name) < 1:
            raise ArgumentError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    _validate_model_values(args)
    _validate_schedule(args)
    # Before the world size: launch sizes the CPU devices by what validates, and an unsupported
    # cp combination must be named as such rather than as a world size that fits nothing.
    _validate_context_parallel(args)
    if world_size % (tp * pp * cp):
        what = f" x context-parallel-size {cp}" if cp > 1 else ""
        raise ArgumentError(f"world size {world_size} is not divisible by tensor-model-parallel-size {tp} x "
                            f"pipeline-model-parallel-size {pp}{what} = {tp * pp * cp}")
    dp = world_size // (tp * pp * cp)
    ep = _validate_moe(args, dp)
    if args.global_batch_size % (args.micro_batch_size * dp):
        raise ArgumentError(f"global-batch-size {args.global_batch_size} is not divisible by micro-batch-size "
                            f"{args.micro_batch_size} x data-parallel-size {dp} = {args.micro_batch_size * dp}")
    from core.pipeline_parallel.utils import get_num_layers_to_build

    try:  # heads, vocabulary, layers, SP sequence: the messages name the flags
        get_num_layers_to_build(args.num_layers, pp, vpp)
        model_config(args).validate(tp, pp * (vpp or 1))
    except ValueError as e:
        raise _model_error(e) from None
    _validate_optimizer_instances(args, dp * cp, dp * cp // ep)
    if not args.spiky_loss_factor > 1.0:
        raise ArgumentError(f"--spiky-loss-factor must be > 1, got {args.spiky_loss_factor}")
    if args.profile and not 0 <= args.profile_step_start < args.profile_step_end:
        raise ArgumentError(f"--profile-step-start {args.profile_step_start} must be >= 0 and below "
                            f"--profile-step-end {args.profile_step_end}")
    if args.save_interval is not None and args.save_interval < 1:
        raise ArgumentError(f"--save-interval must be >= 1, got {args.save_interval}")
    if args.save_interval is not None and args.save is None:
        raise ArgumentError("--save-interval needs --save DIR")
    if args.exit_interval is not None and args.exit_interval < 1:
        raise ArgumentError(f"--exit-interval must be >= 1, got {args.exit_interval}")
    if args.exit_duration_in_mins is not None and not args.exit_duration_in_mins > 0:
        raise ArgumentError(f"--exit-duration-in-mins must be > 0, got {args.exit_duration_in_mins}")
    for flag in ("finetune", "ckpt_step", "exit_on_missing_checkpoint"):
        if getattr(args, flag) not in (None, False) and args.load is None:
            raise ArgumentError(f"--{flag.replace('_', '-')} needs --load DIR")
    validate_data_args(args)
    return ParallelLayout(tp, pp, vpp, dp, args.global_batch_size // (args.micro_batch_size * dp), cp, ep)


def _validate_optimizer_instances(args: argparse.Namespace, data_parallel: int, expert_data_parallel: int) -> None:
    """``--num-distributed-optimizer-instances``: >= 1, more than one only with the distributed
    optimizer, dividing the data-parallel x context-parallel size and the experts' share of it."""
    n, flag = args.num_distributed_optimizer_instances, "--num-distributed-optimizer-instances"
    if n < 1:
        raise ArgumentError(f"{flag} must be >= 1, got {n}")
    if n > 1 and not args.use_distributed_optimizer:
        raise ArgumentError(f"{flag} {n} needs --use-distributed-optimizer")
    for what, size in (("data-parallel x context-parallel size", data_parallel),
                       ("expert data-parallel x context-parallel size", expert_data_parallel)):
        if size % n:
            raise ArgumentError(f"{what} {size} is not divisible by {flag} {n}")


MOE_FLAGS = ("moe_layer_freq", "moe_ffn_hidden_size", "moe_router_topk", "moe_router_score_function",
             "moe_router_pre_softmax", "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff",
             "moe_token_dispatcher_type", "moe_grouped_gemm", "moe_grouped_gemm_implementation",
             "moe_expert_capacity_factor", "moe_token_drop_policy",
             "moe_pad_expert_input_to_capacity", "moe_shared_expert_intermediate_size", "moe_router_dtype",
             "moe_router_enable_expert_bias", "moe_router_bias_update_rate", "moe_router_force_load_balancing")
"""The MoE flags besides ``--num-experts`` (None when not given)."""


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


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _validate_moe(args: argparse.Namespace, dp: int) -> int:
    """The MoE flags against each other and the layout (``dp`` = world / (tp x pp x cp)); returns ep."""
    ep = args.expert_model_parallel_size
    if args.num_experts is None:
        given = [_flag(n) for n in MOE_FLAGS if getattr(args, n) is not None]
        if ep != 1:
            given.insert(0, "--expert-model-parallel-size")
        if given:
            raise ArgumentError(f"{' '.join(given)} need --num-experts (MoE is off without it)")
        return 1
    if ep < 1:
        raise ArgumentError(f"--expert-model-parallel-size must be >= 1, got {ep}")
    if args.num_experts < 1:
        raise ArgumentError(f"--num-experts must be >= 1, got {args.num_experts}")
    if args.num_experts % ep:
        raise ArgumentError(f"--num-experts ({args.num_experts}) must be divisible by --expert-model-parallel-size "
                            f"({ep})")
    if dp % ep:
        # Megatron's ep groups may span cp ranks; one mesh cannot, so ep must split dp alone.
        across = (f" (it would cut across --context-parallel-size {args.context_parallel_size}, which one device "
                  "mesh cannot express)" if (dp * args.context_parallel_size) % ep == 0 else "")
        raise ArgumentError(f"--expert-model-parallel-size {ep} does not divide the data-parallel size {dp} "
                            f"(world / (tp x pp x cp)): expert parallelism is a split of data parallelism{across}")
    try:
        moe_config(args).validate(ep, args.tensor_model_parallel_size, args.sequence_parallel)
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    return ep


def moe_config(args: argparse.Namespace):
    """The :class:`~core.transformer.moe.MoEConfig` of the flags (None without ``--num-experts``);
    unset flags take Megatron's defaults, ``--moe-ffn-hidden-size`` defaults to the MLP width."""
    if args.num_experts is None:
        return None
    from core.transformer.moe import MoEConfig

    given = {n: getattr(args, n) for n in MOE_FLAGS if getattr(args, n) is not None and n != "moe_layer_freq"}
    ffn = given.pop("moe_ffn_hidden_size", None) or args.ffn_hidden_size or 4 * args.hidden_size
    return MoEConfig(num_experts=args.num_experts, moe_ffn_hidden_size=ffn, swiglu=args.swiglu,
                     add_bias_linear=not args.disable_bias_linear, **given)


def _validate_context_parallel(args: argparse.Namespace) -> None:
    """What context parallelism needs of the other flags (nothing when cp is 1)."""
    cp, tp, s = args.context_parallel_size, args.tensor_model_parallel_size, args.seq_length
    if cp == 1:
        return
    # Both comm types read the same load-balanced order: rank r holds chunks r and 2cp-1-r.
    if s % (2 * cp):
        raise ArgumentError(f"--seq-length {s} is not divisible by 2 x --context-parallel-size {cp} = {2 * cp} "
                            f"(load-balanced context parallelism, --cp-comm-type {args.cp_comm_type}, gives every "
                            "cp rank two equal chunks)")
    if args.sequence_parallel and s % (cp * tp):
        raise ArgumentError(f"--seq-length {s} is not divisible by --context-parallel-size {cp} x "
                            f"--tensor-model-parallel-size {tp} = {cp * tp} (--sequence-parallel splits each cp "
                            "rank's tokens over tp)")


@dataclasses.dataclass(frozen=True)
class DataSource:
    """What ``--data-path`` names: the built-in corpus, a text file or directory, or indexed datasets."""

    kind: str
    """``"builtin"`` (no ``--data-path``), ``"text"`` or ``"indexed"``."""
    text_path: str | None = None
    """The text file or directory (kind ``"text"``)."""
    prefixes: tuple[str, ...] = ()
    """Megatron dataset prefixes (kind ``"indexed"``)."""
    weights: tuple[float, ...] = ()
    """Their normalised blend weights."""

    def describe(self) -> str:
        """``0.3 prefixA, 0.7 prefixB`` for a blend, the path otherwise."""
        if self.kind == "builtin":
            return "the built-in corpus"
        if self.kind == "text":
            return str(self.text_path)
        return ", ".join(f"{w:.3g} {p}" for w, p in zip(self.weights, self.prefixes))


def _is_dataset_prefix(path: str) -> bool:
    """Whether ``path.bin`` or ``path.idx`` exists (the pair's other half is checked on opening)."""
    return os.path.isfile(path + ".bin") or os.path.isfile(path + ".idx")


def data_source(data_path: Sequence[str] | None) -> DataSource:
    """Classify ``--data-path``; :class:`ArgumentError` for a value that is neither kind.

    A single entry is a dataset prefix when ``entry.bin`` or ``entry.idx`` exists (checked first:
    Megatron's default index cache makes ``entry`` itself a directory), else a text file or
    directory. Several entries are Megatron's ``weight prefix`` pairs, every prefix a dataset.
    """
    if data_path is None:
        return DataSource("builtin")
    from core.data.blended_dataset import parse_data_path

    items = [str(item) for item in data_path]
    if not items:
        raise ArgumentError("--data-path needs a value: dataset prefixes ('PREFIX' or '0.3 PREFIX_A 0.7 PREFIX_B') "
                            "or a text file or directory")
    if len(items) == 1:
        (item,) = items
        if _is_dataset_prefix(item):
            return DataSource("indexed", prefixes=(item,), weights=(1.0,))
        stem, extension = os.path.splitext(item)
        if extension in (".bin", ".idx") and _is_dataset_prefix(stem):
            raise ArgumentError(f"--data-path {item}: give the dataset prefix {stem} (without {extension})")
        if os.path.exists(item):
            return DataSource("text", text_path=item)
        raise ArgumentError(f"--data-path {item}: no such file or directory (nor a Megatron dataset prefix: "
                            f"no {item}.bin or {item}.idx)")
    try:
        prefixes, weights = parse_data_path(items)
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    for prefix in prefixes:
        if not _is_dataset_prefix(prefix):
            raise ArgumentError(f"--data-path: {prefix}.bin and {prefix}.idx: no such files (a blend takes "
                                "dataset prefixes written by tools/preprocess_data.py)")
    return DataSource("indexed", prefixes=tuple(prefixes), weights=tuple(weights))


@functools.lru_cache(maxsize=8)
def _cached_tokenizer(tokenizer_type: str, tokenizer_model: str | None, vocab_file: str | None,
                      merge_file: str | None, vocab_size: int | None) -> MegatronTokenizer:
    from core.data.tokenizers import build_tokenizer

    return build_tokenizer(tokenizer_type, tokenizer_model=tokenizer_model, vocab_file=vocab_file,
                           merge_file=merge_file, vocab_size=vocab_size)


def _one_line(error: BaseException) -> str:
    """An exception's message on one line (the tokenizers library's can span several)."""
    return " ".join(str(error).split())


def tokenizer_from_args(args: argparse.Namespace) -> MegatronTokenizer:
    """The tokenizer of ``--tokenizer-type`` and its file flags (built once per process: validation
    and the data pipeline share it); :class:`ArgumentError` when it cannot be built."""
    try:
        return _cached_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file,
                                 args.vocab_size)
    except (ValueError, FileNotFoundError, ImportError) as e:
        raise ArgumentError(_one_line(e)) from None
    except Exception as e:  # noqa: BLE001 (a corrupt tokenizer.json raises the library's bare Exception)
        source = args.tokenizer_model or args.vocab_file
        raise ArgumentError(f"--tokenizer-type {args.tokenizer_type}: cannot load {source}: {_one_line(e)}") from None


def validate_data_args(args: argparse.Namespace) -> DataSource:
    """Check the data flags and the data itself; :class:`ArgumentError` with one line naming the problem.

    Indexed datasets are opened (missing ``.bin``/``.idx``, wrong magic, truncation) and their
    largest token id (:func:`core.data.max_token_id`, cached) must lie inside the tokenizer's
    vocabulary: a dataset made with another tokenizer would otherwise index past the embedding.
    """
    source = data_source(args.data_path)
    if not 0.0 < args.valid_fraction < 1.0:
        raise ArgumentError(f"--valid-fraction must be in (0, 1), got {args.valid_fraction}")
    if args.num_workers < 0:
        raise ArgumentError(f"--num-workers must be >= 0, got {args.num_workers}")
    tokenizer = tokenizer_from_args(args)
    eod_flags = [f"--{name.replace('_', '-')}" for name in ("reset_position_ids", "reset_attention_mask",
                                                             "eod_mask_loss") if getattr(args, name)]
    if source.kind != "indexed":
        if eod_flags:
            raise ArgumentError(f"{' '.join(eod_flags)} need indexed data (--data-path PREFIX): a text corpus "
                                "has no end-of-document tokens")
        return source
    from core.data.gpt_dataset import parse_and_normalize_split
    from core.data.indexed_dataset import max_token_id

    try:
        parse_and_normalize_split(args.split)
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    for prefix in source.prefixes:
        try:
            top = max_token_id(prefix, args.data_cache_path)
        except (FileNotFoundError, ValueError) as e:
            raise ArgumentError(f"--data-path: {_one_line(e)}") from None
        if top >= tokenizer.vocab_size:
            raise ArgumentError(
                f"--data-path {prefix}: token ids up to {top}, but --tokenizer-type {args.tokenizer_type} has a "
                f"vocabulary of {tokenizer.vocab_size} (ids 0..{tokenizer.vocab_size - 1}); train with the "
                "tokenizer the dataset was preprocessed with")
    return source


DEFAULT_LR_WARMUP_ITERS = 10
"""``--lr-warmup-iters`` when not given (capped by :func:`lr_warmup_iters` for short runs)."""


def min_lr(args: argparse.Namespace) -> float:
    """``--min-lr``, or ``--lr / 10`` when not given."""
    return args.min_lr if args.min_lr is not None else args.lr / 10


def lr_decay_iters(args: argparse.Namespace) -> int:
    """The iteration the learning rate reaches ``--min-lr``: ``--lr-decay-iters``, else ``--train-iters``."""
    return args.lr_decay_iters if args.lr_decay_iters is not None else args.train_iters


def lr_warmup_iters(args: argparse.Namespace) -> int:
    """``--lr-warmup-iters``, or when not given :data:`DEFAULT_LR_WARMUP_ITERS` capped below the
    decay iterations (a 4-iteration run warms up over 3, as Megatron requires warm-up < decay)."""
    if args.lr_warmup_iters is not None:
        return args.lr_warmup_iters
    return max(0, min(DEFAULT_LR_WARMUP_ITERS, lr_decay_iters(args) - 1))


def _validate_schedule(args: argparse.Namespace) -> None:
    """The learning-rate schedule and Adam's flags as Megatron's ``OptimizerParamScheduler`` and
    torch's Adam check them: ``0 <= min-lr <= lr``, decay iterations >= 1, warm-up before the end
    of the decay, betas in [0, 1)."""
    decay = lr_decay_iters(args)
    decay_flag = "--lr-decay-iters" if args.lr_decay_iters is not None else \
        "--train-iters, the default of --lr-decay-iters"
    checks = [
        (args.lr >= 0, f"--lr must be >= 0, got {args.lr}"),
        (min_lr(args) >= 0, f"--min-lr must be >= 0, got {args.min_lr}"),
        (min_lr(args) <= args.lr, f"--min-lr {min_lr(args):g} is above --lr {args.lr:g}: the decay would raise the "
                                 "learning rate (Megatron requires min-lr <= lr)"),
        (args.lr_decay_iters is None or args.lr_decay_iters >= 1,
         f"--lr-decay-iters must be >= 1, got {args.lr_decay_iters}"),
        (args.lr_warmup_iters is None or args.lr_warmup_iters >= 0,
         f"--lr-warmup-iters must be >= 0, got {args.lr_warmup_iters}"),
        (lr_warmup_iters(args) < decay or lr_warmup_iters(args) == 0,
         f"--lr-warmup-iters {lr_warmup_iters(args)} does not end before the decay does at iteration {decay} "
         f"({decay_flag}): the rate would rise, then drop in one step (Megatron requires warm-up < decay iterations)"),
        (args.weight_decay >= 0, f"--weight-decay must be >= 0, got {args.weight_decay}"),
        (0.0 <= args.adam_beta1 < 1.0, f"--adam-beta1 must be in [0, 1), got {args.adam_beta1}"),
        (0.0 <= args.adam_beta2 < 1.0, f"--adam-beta2 must be in [0, 1), got {args.adam_beta2}"),
        (args.clip_grad >= 0, f"--clip-grad must be >= 0, got {args.clip_grad}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ArgumentError(message)


def _validate_model_values(args: argparse.Namespace) -> None:
    """Values no layout can make work (Megatron would train with some of them silently)."""
    checks = [
        (args.ffn_hidden_size is None or args.ffn_hidden_size >= 1,
         f"--ffn-hidden-size must be >= 1, got {args.ffn_hidden_size}"),
        (0.0 <= args.attention_dropout < 1.0, f"--attention-dropout must be in [0, 1), got {args.attention_dropout}"),
        (0.0 <= args.hidden_dropout < 1.0, f"--hidden-dropout must be in [0, 1), got {args.hidden_dropout}"),
        (0.0 < args.rotary_percent <= 1.0, f"--rotary-percent must be in (0, 1], got {args.rotary_percent}"),
        (args.rotary_base > 0, f"--rotary-base must be > 0, got {args.rotary_base}"),
        (args.norm_epsilon > 0, f"--norm-epsilon must be > 0, got {args.norm_epsilon}"),
        (args.init_method_std > 0, f"--init-method-std must be > 0, got {args.init_method_std}"),
        (args.make_vocab_size_divisible_by >= 1,
         f"--make-vocab-size-divisible-by must be >= 1, got {args.make_vocab_size_divisible_by}"),
        (not args.group_query_attention or args.num_query_groups >= 1,
         f"--num-query-groups must be >= 1, got {args.num_query_groups}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ArgumentError(message)


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_model_parallel_size: int) -> int:
    """Megatron's ``_vocab_size_with_padding``: the vocabulary rounded up to a multiple of
    ``divisible_by x tp``, so every tp rank holds an equal, aligned share of the rows."""
    multiple = divisible_by * tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple


def layout_fits(args: argparse.Namespace, world_size: int) -> bool:
    """Whether :func:`validate_args` accepts these flags at ``world_size`` devices."""
    try:
        validate_args(args, world_size)
    except ArgumentError:
        return False
    return True


def recompute_granularity(args: argparse.Namespace) -> str | None:
    """``--recompute-granularity``, or ``"selective"`` for ``--recompute-activations`` (as Megatron)."""
    return args.recompute_granularity or ("selective" if args.recompute_activations else None)


def model_config(args: argparse.Namespace, vocab_size: int = 256) -> GPTConfig:
    """The :class:`GPTConfig` the flags describe."""
    from core.models.gpt import GPTConfig

    tp = args.tensor_model_parallel_size or 1
    return GPTConfig(
        vocab_size=vocab_size, padded_vocab_size=padded_vocab_size(vocab_size, args.make_vocab_size_divisible_by, tp),
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        seq_length=args.seq_length, position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base, rotary_percent=args.rotary_percent,
        normalization=args.normalization, layernorm_epsilon=args.norm_epsilon, swiglu=args.swiglu,
        add_bias_linear=not args.disable_bias_linear, attention_dropout=args.attention_dropout,
        hidden_dropout=args.hidden_dropout, init_method_std=args.init_method_std,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        sequence_parallel=args.sequence_parallel, context_parallel_size=args.context_parallel_size,
        cp_comm_type=args.cp_comm_type, recompute_granularity=recompute_granularity(args),
        bf16=args.bf16,
        unroll_layers=not args.scan_layers, moe=moe_config(args),
        moe_layer_freq=1 if args.moe_layer_freq is None else args.moe_layer_freq)


def checkpoint_config(args: argparse.Namespace) -> CheckpointConfig:
    """The checkpoint flags as a :class:`~core.checkpointing.checkpointer.CheckpointConfig`."""
    from core.checkpointing.checkpointer import CheckpointConfig

    return CheckpointConfig(
        save=args.save, load=getattr(args, "load", None), save_interval=getattr(args, "save_interval", None),
        async_save=bool(getattr(args, "async_save", False)),
        async_save_writer=getattr(args, "async_save_writer", None),
        save_optim=not getattr(args, "no_save_optim", False), load_optim=not getattr(args, "no_load_optim", False),
        ckpt_step=getattr(args, "ckpt_step", None), finetune=bool(getattr(args, "finetune", False)))


def data_vocab_size(args: argparse.Namespace) -> int:
    """The vocabulary the data's tokens come from: the byte vocabulary for a text corpus with
    ``--tokenizer-type ByteLevel``, else the tokenizer's."""
    from core.data import ByteTokenizer

    if args.tokenizer_type == "ByteLevel" and data_source(args.data_path).kind != "indexed":
        return ByteTokenizer.vocab_size
    return tokenizer_from_args(args).vocab_size


# The GPTConfig fields whose names are not their flags' (messages of GPTConfig.validate name fields).
_MODEL_FIELD_FLAGS = {"layernorm_epsilon": "norm-epsilon", "padded_vocab_size": "padded vocabulary",
                      "vocab_size": "vocabulary", "unroll_layers": "scan-layers", "head_dim": "head dimension",
                      "query_groups": "num-query-groups", "ffn_size": "ffn-hidden-size"}


def _model_error(error: ValueError) -> ArgumentError:
    """A :meth:`GPTConfig.validate` message with its field names written as their flags (without
    the dashes, as the other layout messages write them)."""
    import re

    def flag(match: re.Match) -> str:
        name = match.group(0)
        return _MODEL_FIELD_FLAGS.get(name, name.replace("_", "-"))

    # Quoted values ('all_gather') stay as they are.
    return ArgumentError(re.sub(r"(?<!')\b[a-z]+(?:_[a-z0-9]+)+\b(?!')", flag, str(error)))


def pretrain_config(args: argparse.Namespace, layout: ParallelLayout) -> PretrainConfig:
    """The validated flags (``validate_args``) as the trainer's typed configs, in one place; the
    model, with the tokenizer's vocabulary, is validated against ``layout`` here, its messages
    naming flags (:class:`ArgumentError`)."""
    from core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
    from core.optimizer.optimizer_config import OptimizerConfig
    from core.optimizer.optimizer_param_scheduler import SchedulerConfig
    from core.training.config import PretrainConfig, ProfileConfig

    model = model_config(args, data_vocab_size(args))
    try:
        model.validate(layout.tensor_model_parallel_size,
                       layout.pipeline_model_parallel_size * (layout.virtual_pipeline_model_parallel_size or 1))
    except ValueError as e:
        raise _model_error(e) from None
    data, training = data_config(args), training_config(args)
    # No in-step NaN skip unless asked (check_for_nan_in_grad): the loop stops at the first
    # non-finite loss or grad norm and saves nothing after it (Megatron's
    # --check-for-nan-in-loss-and-grad), so parameters left unchanged would never be used.
    ddp = DistributedDataParallelConfig(
        use_distributed_optimizer=args.use_distributed_optimizer, overlap_grad_reduce=args.overlap_grad_reduce,
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances, grad_reduce_in_fp32=True,
        check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad, check_for_spiky_loss=args.check_for_spiky_loss,
        spiky_loss_factor=args.spiky_loss_factor)
    get = lambda name, default=None: getattr(args, name, default)
    return PretrainConfig(
        model=model, training=training, ddp=ddp, data=data, checkpoint=checkpoint_config(args),
        optimizer=OptimizerConfig(optimizer="adam", lr=args.lr, weight_decay=args.weight_decay,
                                  adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, clip_grad=args.clip_grad),
        scheduler=SchedulerConfig(lr=args.lr, min_lr=min_lr(args), lr_decay_style=args.lr_decay_style,
                                  lr_warmup_iters=lr_warmup_iters(args), lr_decay_iters=lr_decay_iters(args)),
        profile=ProfileConfig(profile=bool(get("profile", False)), profile_ranks=tuple(get("profile_ranks", (0,))),
                              profile_step_start=get("profile_step_start", 10),
                              profile_step_end=get("profile_step_end", 12), profile_dir=get("profile_dir", "profile")))


def training_config(args: argparse.Namespace) -> TrainingConfig:
    """The loop's flags as a :class:`~core.training.config.TrainingConfig`."""
    from core.training.config import TrainingConfig

    return TrainingConfig(
        micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size, seq_length=args.seq_length,
        train_iters=args.train_iters, seed=args.seed, log_interval=args.log_interval, eval_interval=args.eval_interval,
        eval_iters=args.eval_iters, exit_interval=args.exit_interval,
        exit_signal=args.exit_signal if getattr(args, "exit_signal_handler", False) else None,
        exit_duration_in_mins=getattr(args, "exit_duration_in_mins", None),
        check_for_nan_in_loss_and_grad=args.check_for_nan_in_loss_and_grad,
        check_for_spiky_loss=args.check_for_spiky_loss, spiky_loss_factor=args.spiky_loss_factor)


def data_config(args: argparse.Namespace) -> DataConfig:
    """The data flags as a :class:`~core.training.config.DataConfig`."""
    from core.training.config import DataConfig

    return DataConfig(
        data_path=None if args.data_path is None else tuple(args.data_path), split=args.split,
        valid_fraction=args.valid_fraction, tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model,
        vocab_file=args.vocab_file, merge_file=args.merge_file, vocab_size=args.vocab_size,
        data_cache_path=args.data_cache_path, reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss)
