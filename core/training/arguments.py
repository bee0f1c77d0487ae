"""Megatron-style command-line flags of ``launch/pretrain.py`` and their validation (the parser is
:mod:`core.training.flags`; the configs the validated flags map to, :mod:`core.training.run_config`).

Defaults give a small GPT sized to train on a CPU machine with a few cores, both under
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
from typing import TYPE_CHECKING, Any

from core.training.checkpoint_args import checkpoint_vocab_size
from core.training.flags import (  # noqa: F401 (the parser's names, re-exported)
    EXIT_SIGNALS,
    TOKENIZER_TYPE_NAMES,
    ArgumentError,
    OneLineErrorParser,
    build_parser,
)

if TYPE_CHECKING:
    from core.data.tokenizers import MegatronTokenizer
    from core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
    from core.models.gpt import GPTConfig

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
    num_distributed_optimizer_instances: int = 1
    """The instances the mesh is built with (``build_parallel_state``'s argument): the flag's under
    ``--data-parallel-sharding-strategy optim_grads_params`` (HSDP: the outer data-parallel axis),
    else 1 (the partial distributed optimizer of the other strategies uses sub-group collectives)."""

    def describe(self) -> str:
        """``tp=2 pp=2 dp=2`` (+ vpp, + cp, + ep when above 1)."""
        vpp = f" vpp={self.virtual_pipeline_model_parallel_size}" if self.virtual_pipeline_model_parallel_size else ""
        cp = f" cp={self.context_parallel_size}" if self.context_parallel_size > 1 else ""
        ep = f" ep={self.expert_model_parallel_size}" if self.expert_model_parallel_size > 1 else ""
        return (f"tp={self.tensor_model_parallel_size} pp={self.pipeline_model_parallel_size}{vpp}{cp} "
                f"dp={self.data_parallel_size}{ep}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse flags (argparse exits with code 2 and its usage line on unknown flags). The
    namespace also records ``explicit_flags``: the flags written on the command line (what
    ``--use-checkpoint-args`` must not silently override)."""
    import sys

    from core.training.checkpoint_args import explicit_flags

    parser = build_parser()
    args = parser.parse_args(argv)
    args.explicit_flags = explicit_flags(parser, sys.argv[1:] if argv is None else argv)
    return args


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
        raise model_error(e) from None
    if not args.spiky_loss_factor > 1.0:
        raise ArgumentError(f"--spiky-loss-factor must be > 1, got {args.spiky_loss_factor}")
    _validate_optimizer_instances(args, dp * cp, dp * cp // ep, dp // ep)
    _validate_megatron_fsdp(args)
    _validate_pipeline_schedule(args, dp)
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
    for flag in ("finetune", "ckpt_step", "exit_on_missing_checkpoint", "use_checkpoint_args"):
        if getattr(args, flag) not in (None, False) and args.load is None:
            raise ArgumentError(f"--{flag.replace('_', '-')} needs --load DIR")
    _validate_logging(args)
    validate_data_args(args)
    hsdp = args.num_distributed_optimizer_instances if sharding_strategy(args) == "optim_grads_params" else 1
    return ParallelLayout(tp, pp, vpp, dp, args.global_batch_size // (args.micro_batch_size * dp), cp, ep, hsdp)


def _validate_logging(args: argparse.Namespace) -> None:
    """The TensorBoard / W&B flags: positive intervals, W&B's names with a project, and the
    optional package each needs installed (one line naming it and its ``pip install``)."""
    from core.training.metric_writers import missing_packages_error

    for name in ("tensorboard_log_interval", "tensorboard_queue_size"):
        if getattr(args, name) < 1:
            raise ArgumentError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    given = [_flag(n) for n in ("wandb_exp_name", "wandb_save_dir") if getattr(args, n)]
    if given and not args.wandb_project:
        raise ArgumentError(f"{' '.join(given)} need{'s' if len(given) == 1 else ''} --wandb-project")
    missing = missing_packages_error(args)
    if missing:
        raise ArgumentError(missing)


def sharding_strategy(args: argparse.Namespace) -> str:
    """The DDP's ``data_parallel_sharding_strategy``: the flag's with ``--use-megatron-fsdp``, else
    ``no_shard`` (Megatron reads the strategy only with Megatron-FSDP)."""
    return args.data_parallel_sharding_strategy if args.use_megatron_fsdp else "no_shard"


def ddp_config(args: argparse.Namespace) -> DistributedDataParallelConfig:
    """The data-parallel flags as a :class:`~core.distributed.DistributedDataParallelConfig`
    (``ValueError`` from its checks; ``validate_args`` words them as flags)."""
    from core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig

    # No in-step NaN skip unless asked (check_for_nan_in_grad): the loop stops at the first
    # non-finite loss or grad norm and saves nothing after it (Megatron's
    # --check-for-nan-in-loss-and-grad), so parameters left unchanged would never be used.
    return DistributedDataParallelConfig(
        use_distributed_optimizer=args.use_distributed_optimizer, overlap_grad_reduce=args.overlap_grad_reduce,
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances, grad_reduce_in_fp32=True,
        check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad, check_for_spiky_loss=args.check_for_spiky_loss,
        spiky_loss_factor=args.spiky_loss_factor, use_megatron_fsdp=args.use_megatron_fsdp,
        data_parallel_sharding_strategy=sharding_strategy(args),
        fsdp_reshard_after_forward=not args.no_fsdp_reshard_after_forward)


def _validate_pipeline_schedule(args: argparse.Namespace, dp: int) -> None:
    """``--pipeline-schedule`` against the virtual stages and the microbatches per step."""
    schedule, pp = args.pipeline_schedule, args.pipeline_model_parallel_size
    vpp = args.virtual_pipeline_model_parallel_size or 1
    if args.zero_bubble_w_recompute and schedule not in ("zb-h1", "zb-v"):
        raise ArgumentError(f"--zero-bubble-w-recompute needs --pipeline-schedule zb-h1 or zb-v, got {schedule}")
    if schedule is None:
        return
    if schedule == "interleaved" and vpp == 1:
        raise ArgumentError("--pipeline-schedule interleaved needs --virtual-pipeline-model-parallel-size > 1")
    if schedule == "zb-v" and vpp != 2:
        raise ArgumentError(f"--pipeline-schedule zb-v runs two model chunks per stage in a V: it needs "
                            f"--virtual-pipeline-model-parallel-size 2, got {vpp}")
    if schedule not in ("interleaved", "zb-v") and vpp > 1:
        raise ArgumentError(f"--pipeline-schedule {schedule} runs one model chunk per stage; "
                            f"--virtual-pipeline-model-parallel-size {vpp} needs interleaved")
    m = args.global_batch_size // (args.micro_batch_size * dp)
    if schedule in ("zb-h1", "zb-v") and pp > 1 and m < pp:
        raise ArgumentError(f"--pipeline-schedule {schedule} needs at least pipeline-model-parallel-size {pp} "
                            f"microbatches per step, got {m} (global-batch-size / (micro-batch-size x dp))")


def _validate_megatron_fsdp(args: argparse.Namespace) -> None:
    """``--data-parallel-sharding-strategy``: one of Megatron's four and not contradicting
    ``--use-distributed-optimizer``; then the DDP config's own checks, worded as flags."""
    from core.distributed.distributed_data_parallel_config import SHARDING_STRATEGIES

    flag, strategy = "--data-parallel-sharding-strategy", args.data_parallel_sharding_strategy
    if strategy not in SHARDING_STRATEGIES:
        raise ArgumentError(f"{flag} must be one of {', '.join(SHARDING_STRATEGIES)}, got {strategy!r}")
    if args.use_megatron_fsdp and strategy == "no_shard" and args.use_distributed_optimizer:
        raise ArgumentError(f"{flag} no_shard contradicts --use-distributed-optimizer (which shards the optimizer "
                            "state); pass optim, optim_grads or optim_grads_params")
    if args.no_fsdp_reshard_after_forward and sharding_strategy(args) != "optim_grads_params":
        raise ArgumentError("--no-fsdp-reshard-after-forward needs --use-megatron-fsdp with "
                            f"{flag} optim_grads_params")
    try:
        ddp_config(args)
    except ValueError as e:
        raise model_error(e) from None


def _validate_optimizer_instances(args: argparse.Namespace, data_parallel: int, expert_data_parallel: int,
                                  data_axis: int) -> None:
    """``--num-distributed-optimizer-instances``: >= 1, more than one only with the distributed
    optimizer, dividing the data-parallel x context-parallel size and the experts' share of it (and,
    under ``optim_grads_params``, ``data_axis`` = dp / ep, the mesh axis split into instances)."""
    n, flag = args.num_distributed_optimizer_instances, "--num-distributed-optimizer-instances"
    if n < 1:
        raise ArgumentError(f"{flag} must be >= 1, got {n}")
    if n > 1 and not (args.use_distributed_optimizer or sharding_strategy(args) != "no_shard"):
        raise ArgumentError(f"{flag} {n} needs --use-distributed-optimizer")
    for what, size in (("data-parallel x context-parallel size", data_parallel),
                       ("expert data-parallel x context-parallel size", expert_data_parallel)):
        if size % n:
            raise ArgumentError(f"{what} {size} is not divisible by {flag} {n}")
    if n > 1 and sharding_strategy(args) == "optim_grads_params" and data_axis % n:
        raise ArgumentError(f"data-parallel size / expert-model-parallel-size = {data_axis} (the data-parallel mesh "
                            f"axis HSDP splits into instances) is not divisible by {flag} {n}")


MOE_FLAGS = ("moe_layer_freq", "moe_ffn_hidden_size", "moe_router_topk", "moe_router_score_function",
             "moe_router_pre_softmax", "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff",
             "moe_token_dispatcher_type", "moe_grouped_gemm", "moe_grouped_gemm_implementation",
             "moe_expert_capacity_factor", "moe_token_drop_policy",
             "moe_pad_expert_input_to_capacity", "moe_shared_expert_intermediate_size", "moe_router_dtype",
             "moe_router_enable_expert_bias", "moe_router_bias_update_rate", "moe_router_force_load_balancing")
"""The MoE flags besides ``--num-experts`` (None when not given)."""


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
    if args.sft or args.sft_tokenizer_prompt_format is not None:
        _validate_sft(args, source, eod_flags)
        return source
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


def _validate_sft(args: argparse.Namespace, source: DataSource, eod_flags: list[str]) -> None:
    """``--sft``: one JSONL file, a Hugging Face tokenizer with a chat template, none of the EOD flags
    (packed conversations get their own positions, attention and loss mask). The conversations
    themselves are read when the data is built (``core.data.sft_dataset``), naming a bad line."""
    if not args.sft:
        raise ArgumentError("--sft-tokenizer-prompt-format needs --sft")
    if args.tokenizer_type != "HuggingFaceTokenizer":
        raise ArgumentError(f"--sft needs --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR (its chat "
                            f"template renders the conversations), got --tokenizer-type {args.tokenizer_type}")
    if source.kind != "text" or not os.path.isfile(str(source.text_path)):
        raise ArgumentError(f"--sft needs --data-path FILE.jsonl (one file of conversations), got "
                            f"{source.describe()}")
    if eod_flags:
        raise ArgumentError(f"{' '.join(eod_flags)} with --sft: packed conversations always get their own "
                            "positions, attention and loss mask (drop the flags)")
    from core.data.chat_template import load_chat_template
    from core.data.gpt_dataset import parse_and_normalize_split

    try:
        load_chat_template(args.tokenizer_model, args.sft_tokenizer_prompt_format or "default")
        parse_and_normalize_split(args.split)
    except ValueError as e:
        raise ArgumentError(_one_line(e)) from None


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


MODEL_FLAG_RULES: dict[str, Any] = {
    "vocab_size": lambda args, vocab: checkpoint_vocab_size(args, vocab),
    "padded_vocab_size": lambda args, vocab: getattr(args, "checkpoint_padded_vocab_size", None) or padded_vocab_size(
        checkpoint_vocab_size(args, vocab), args.make_vocab_size_divisible_by, args.tensor_model_parallel_size or 1),
    "num_query_groups": lambda args, _: args.num_query_groups if args.group_query_attention else None,
    "layernorm_epsilon": lambda args, _: args.norm_epsilon,
    "rope_scaling": lambda args, _: args.use_rope_scaling,
    "add_bias_linear": lambda args, _: not args.disable_bias_linear,
    "share_embeddings_and_output_weights": lambda args, _: not args.untie_embeddings_and_output_weights,
    "recompute_granularity": lambda args, _: recompute_granularity(args),
    "fp8": lambda args, _: args.fp8_format,
    "fp8_wgrad": lambda args, _: not args.no_fp8_wgrad,
    "unroll_layers": lambda args, _: not args.scan_layers,
    "moe": lambda args, _: moe_config(args),
    "moe_layer_freq": lambda args, _: 1 if args.moe_layer_freq is None else args.moe_layer_freq,
    "hierarchical_context_parallel_sizes": lambda args, _: (None if args.hierarchical_context_parallel_sizes is None
                                                            else tuple(args.hierarchical_context_parallel_sizes)),
}
"""How a :class:`GPTConfig` field whose flag differs in name or meaning is read, ``rule(args,
vocab_size)``; every other field is the flag of the same name (a new model option is a
``GPTConfig`` field and a flag, nothing else)."""


def model_config(args: argparse.Namespace, vocab_size: int = 256) -> GPTConfig:
    """The :class:`GPTConfig` the flags describe (with the tokenizer's ``vocab_size``)."""
    from core.models.gpt import GPTConfig

    values = {}
    for field in dataclasses.fields(GPTConfig):
        rule = MODEL_FLAG_RULES.get(field.name)
        values[field.name] = rule(args, vocab_size) if rule is not None else getattr(args, field.name)
    return GPTConfig(**values)


# The GPTConfig fields whose names are not their flags' (messages of GPTConfig.validate name fields).
_MODEL_FIELD_FLAGS = {"layernorm_epsilon": "norm-epsilon", "rope_scaling": "use-rope-scaling",
                      "padded_vocab_size": "padded vocabulary",
                      "vocab_size": "vocabulary", "unroll_layers": "scan-layers", "head_dim": "head dimension",
                      "query_groups": "num-query-groups", "ffn_size": "ffn-hidden-size"}


def model_error(error: ValueError) -> ArgumentError:
    """A :meth:`GPTConfig.validate` message with its field names written as their flags (without
    the dashes, as the other layout messages write them)."""
    import re

    def flag(match: re.Match) -> str:
        name = match.group(0)
        return _MODEL_FIELD_FLAGS.get(name, name.replace("_", "-"))

    # Quoted values ('all_gather') stay as they are; names may carry digits (fp8_recipe).
    return ArgumentError(re.sub(r"(?<!')\b[a-z]+[0-9]*(?:_[a-z0-9]+)+\b(?!')", flag, str(error)))
