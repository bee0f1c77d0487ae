"""Run a few GPT pretraining iterations in-process for a given layout (both test levels)."""

import jax

from core import parallel_state as ps
from core.training.arguments import parse_args, validate_args
from core.training.pretrainer import Pretrainer
from core.training.run_config import pretrain_config

# A model small enough to compile and run 10 iterations in seconds on 2 cores; head dim 16 and
# seq 32 so that on CPU attention runs the fused C++ kernel (core/fusions/) in every layout.
TINY = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "16", "--lr", "3e-3", "--lr-warmup-iters", "2",
        "--eval-interval", "1000", "--no-progress-bar"]


def layout_losses(tp: int, pp: int, devices: list, iters: int = 10, extra: tuple = ()) -> list[float]:
    """Losses of ``iters`` iterations with tp x pp (x cp from ``--context-parallel-size`` in ``extra``;
    dp = the rest of ``devices``)."""
    return [r["loss"] for r in layout_records(tp, pp, devices, iters, extra)]


def layout_records(tp: int, pp: int, devices: list, iters: int = 10, extra: tuple = ()) -> list[dict]:
    """Each iteration's metrics record (loss, grad norm, ...) of :func:`layout_losses`' run."""
    trainer = layout_trainer(tp, pp, devices, iters, extra)
    return [trainer.step() for _ in range(iters)]


def layout_trainer(tp: int, pp: int, devices: list, iters: int = 10, extra: tuple = ()) -> Pretrainer:
    """The :class:`Pretrainer` of :func:`layout_records`' run, before its first step."""
    args = parse_args(TINY + ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
                              "--train-iters", str(iters), *extra])
    layout = validate_args(args, len(devices))
    state = ps.build_parallel_state(tp, pp, layout.virtual_pipeline_model_parallel_size,
                                    context_parallel_size=layout.context_parallel_size,
                                    expert_model_parallel_size=layout.expert_model_parallel_size, devices=devices,
                                    num_distributed_optimizer_instances=layout.num_distributed_optimizer_instances)
    return Pretrainer(pretrain_config(args), layout, state)


def train_step_temp_kib(pp: int, extra: tuple = ()) -> float:
    """Compiled temp memory (KiB per device) of the training step of :data:`TINY` with ``extra`` at
    pp (tp 1, dp 1, on the first pp devices)."""
    trainer = layout_trainer(1, pp, jax.devices()[:pp], 5, extra)
    lowered = trainer.train_step.lower(trainer.params, trainer.opt_state, trainer.data.next_train_batch())
    return lowered.compile().memory_analysis().temp_size_in_bytes / 1024


def cached_by_flags(run):
    """``get(flags)``: ``run(flags)`` computed once per flags tuple (one-device references shared
    by a test module's cases)."""
    cache = {}

    def get(flags: tuple):
        if flags not in cache:
            cache[flags] = run(flags)
        return cache[flags]

    return get


def reference_losses(iters: int = 10, extra: tuple = ()) -> list[float]:
    """The same run on one device of this process."""
    return layout_losses(1, 1, [jax.local_devices()[0]], iters, extra)


# A Llama-class model with Megatron's flags: RMSNorm, SwiGLU, grouped-query attention (4 heads in
# 2 groups, so tp=2 splits the groups), rotary positions, untied output layer, no biases, and a
# vocabulary padded to a multiple of 96 x tp (288 rows at tp=1, 384 at tp=2: padding differs by
# layout and must not change the loss).
LLAMA = ("--normalization", "RMSNorm", "--swiglu", "--group-query-attention", "--num-query-groups", "2",
         "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
         "--ffn-hidden-size", "160", "--make-vocab-size-divisible-by", "96")


# (tp, pp, extra flags): every layout of 8 devices, with and without the
# distributed optimizer and sequence parallelism, plus interleaving.
LAYOUTS = [
    (1, 1, ()),
    (1, 1, ("--use-distributed-optimizer",)),
    (2, 2, ()),
    (2, 2, ("--use-distributed-optimizer", "--sequence-parallel")),
    (2, 1, ("--sequence-parallel",)),
    (2, 1, ("--use-distributed-optimizer",)),
    (1, 4, ()),
    (1, 4, ("--use-distributed-optimizer", "--overlap-grad-reduce")),
    (2, 2, ("--virtual-pipeline-model-parallel-size", "2", "--sequence-parallel")),
    (2, 2, ("--scan-layers",)),  # rolled layer loop (compile time independent of depth)
]
