"""Mixture of experts: a MoE GPT's training throughput against the dense GPT of equal active
parameters at ep = 1, 2, 4, 8; the share of the step in token dispatch and combine; and the
expert computation as a grouped GEMM (``ragged_dot``) vs a per-expert loop vs a padded batched
matmul.

    python bench/moe.py            # ~3 min on 2 cores (2026-11-27)
    python bench/moe.py --quick    # tiny sizes, 2 devices, one round (~35 s of CPU time)
    mpirun -n 8 python bench/moe.py   # the all-to-all's exchanges between 8 processes (ep 8)

One process, ``--devices`` (8) simulated CPU devices, float32; ``--global-batch`` 64 sequences of 256
tokens, 2048 per device (at 512 per device each device's parameter work, 2.85x the dense model's
for the MoE, weighs more: MoE/dense 1.47-1.59 at ep 1 instead of 1.29-1.38, 2026-11-27).

1. **Training step.** ``Pretrainer`` (``launch/pretrain.py``'s training step: GPT model, DDP,
   Adam) at tp = pp = 1 on the 8 devices. The MoE GPT has ``--num-experts`` (8) experts, top-k
   (2), the dropless ``alltoall`` dispatcher and the grouped GEMM (``--moe-grouped-gemm``) in every
   layer; the dense GPT has the same model with an FFN of ``k x --moe-ffn-hidden-size`` (the
   MoE's active parameters per token, the router's ``h x E`` aside). ep = 1, 2, 4, 8 for the MoE
   (data parallelism fills the rest: dp x ep = 8, the same global batch), dp = 8 for the dense
   model, routing balanced by ``--moe-router-force-load-balancing`` (Megatron's benchmarking
   switch: random router logits), so the times measure the implementation rather than how the
   initial router happens to split this data; at ep = 1 also the learned routing (the gate's
   own choices) and, on the CPU, ``jax.lax.ragged_dot`` experts (what accelerators run, traced
   with :func:`ragged_dot_experts`; on the CPU ``GroupedMLP`` runs the expert MLP over row
   windows, ``core/transformer/moe/grouped_gemm.py``). Each row reports its busiest expert's
   load over the mean (max over layers, one more step's global counts). All programs timed
   round-robin, median step time; tokens/s = global batch x sequence length / step time; ratio =
   MoE step / dense step. Target: <= 1.5 at ep = 1 (balanced).
2. **Dispatch and combine.** At each ep, the MoE layer of part 1 (same tokens per rank, hidden
   size and experts, on the same mesh) forward + backward as one jitted ``shard_map``, and its
   pieces each jitted alone, forward + backward: the router (gate matmul, top-k, aux loss); the
   dispatch and combine with the experts replaced by the identity (sort by expert, gathers,
   ``all_to_all`` of counts and rows there and back, re-sort, prob-weighted sum; routing from the
   router as input); the experts (``GroupedMLP`` on the rows a dispatch produced). All timed
   round-robin, balanced routing as in part 1. Dispatch + combine share of the step = layers x
   dispatch-and-combine / part 1's balanced MoE step at that ep (an estimate: isolated pieces,
   summed; the step also has attention, embedding, loss, the gradient all-reduce and Adam).
   Target: <= 25% at ep = 8.
3. **Expert computation** (one device): the expert MLP ``fc2(gelu(fc1(x)))`` forward + backward
   (grads of the rows and both weights) on ``--gemm-rows`` rows grouped by expert (group sizes of
   a uniform random routing) over ``--experts`` experts: ``jax.lax.ragged_dot`` (``GroupedMLP`` on
   accelerators; XLA:CPU lowers it to a masked product over every expert); ``windowed_ragged_dot``
   (the CPU's windows per GEMM: a batched matmul over a window a little above the mean group per
   expert, a second one for rows past it); a
   loop over experts, each over all rows, keeping its group's (``SequentialMLP``); and the
   padded batched matmul ``[E, rows / E, h] x [E, h, F]`` (every expert exactly ``rows / E`` rows:
   capacity factor 1 with perfect balance, the active FLOPs; the floor of the others).

Under ``mpirun -n N`` (one device per process, ep = N): part 2's dispatch + combine piece with the
dropless all-to-all's default two exchanges (1.25x the mean rows per peer, the rest only when a
rank overflows) against one exchange of the worst-case buffer, so the rows really cross processes;
rank 0 writes ``bench/results/moe_processes_<platform>.md``.

Simulated devices share the host's cores, so a step time is the sum of every device's work as
it serialises on them, not a cluster's speed. Prints the tables and writes
``bench/results/moe_cpu.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from mpi_launch import start_worker_process, write_processes_report  # noqa: E402
from timing import BenchRun, round_robin_medians  # noqa: E402

from core.atomic_files import write_text_atomically  # noqa: E402

DEFAULT_OUT = ROOT / "bench" / "results" / "moe_cpu.md"
"""The one-process report (under mpirun: ``moe_processes_<platform>.md``)."""
TARGET_STEP_RATIO = 1.5
"""Target: MoE step time over the dense model of equal active parameters at ep = 1."""
TARGET_DISPATCH_SHARE = 0.25
"""Target: dispatch + combine share of the MoE step at ep = 8."""


# -- 1. the training step ----------------------------------------------------------------------
def model_flags(a: argparse.Namespace) -> list[str]:
    """The flags shared by the dense and the MoE model."""
    return ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads", str(a.heads),
            "--seq-length", str(a.seq),
            "--micro-batch-size", str(a.global_batch // a.devices), "--global-batch-size", str(a.global_batch)]


def moe_flags(a: argparse.Namespace, ep: int) -> list[str]:
    """The MoE model's extra flags at ``ep``: dropless alltoall, grouped GEMM, every layer MoE."""
    return ["--num-experts", str(a.experts), "--moe-router-topk", str(a.topk), "--moe-ffn-hidden-size", str(a.ffn),
            "--moe-layer-freq", "1", "--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm",
            "--moe-aux-loss-coeff", "0.01", "--moe-router-dtype", "fp32", "--expert-model-parallel-size", str(ep)]


def trainer(flags: list[str], devices: int) -> Any:
    """A ``Pretrainer`` at tp = pp = 1 over the first ``devices`` devices (dp, and ep from ``flags``)."""
    import jax

    from core import parallel_state as ps
    from core.training.arguments import parse_args, validate_args
    from core.training.pretrainer import Pretrainer
    from core.training.run_config import pretrain_config

    args = parse_args([*flags, "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
                       "--train-iters", "100000", "--eval-interval", "100000000", "--lr", "1e-4", "--min-lr", "1e-5",
                       "--no-progress-bar"])
    layout = validate_args(args, devices)
    state = ps.build_parallel_state(1, 1, expert_model_parallel_size=layout.expert_model_parallel_size,
                                    devices=jax.devices()[:devices])
    return Pretrainer(pretrain_config(args), layout, state)


def _one_step(t: Any) -> Any:
    return t.dispatch_step()["loss"]


def ragged_dot_experts() -> contextlib.AbstractContextManager:
    """``GroupedMLP`` traced inside this context uses ``jax.lax.ragged_dot`` on every backend (on
    the CPU it otherwise uses windows, see ``core/transformer/moe/grouped_gemm.py``)."""
    from core.transformer.moe import experts

    return mock.patch.object(experts, "default_grouped_implementation", lambda: "ragged_dot")


BALANCED = ["--moe-router-force-load-balancing"]
"""Balanced routing: random router logits (Megatron's benchmarking option), every expert about
``T * k / E`` rows, so the step time measures the implementation, not the router's state."""


def _expert_load(t: Any) -> float:
    """Max over layers of the most loaded expert's share over the mean, from one more step."""
    import numpy as np

    report = t.dispatch_step()["_metrics"]["report"]
    counts = np.asarray(report["moe_tokens_per_expert"]).reshape(-1, t.config.moe.num_experts)
    return float((counts.max(axis=1) / counts.mean(axis=1)).max())


def step_rows(a: argparse.Namespace, eps: Sequence[int]) -> list[dict[str, Any]]:
    """Part 1: the dense model, the MoE model with balanced routing at each ep, and at ep=1 the MoE
    model with its own (learned) routing and, on the CPU, with ``ragged_dot`` experts (traced, by
    its first step, in :func:`ragged_dot_experts`); round-robin median step times."""
    import jax

    grouped = "grouped GEMM" if jax.default_backend() != "cpu" else "windowed grouped GEMM"
    cases = [("dense", "", 1, trainer(model_flags(a) + ["--ffn-hidden-size", str(a.topk * a.ffn)], a.devices))]
    cases += [(f"moe, {grouped}", "balanced", ep, trainer(model_flags(a) + moe_flags(a, ep) + BALANCED, a.devices))
              for ep in eps]
    if 1 in eps:
        cases.append((f"moe, {grouped}", "learned", 1, trainer(model_flags(a) + moe_flags(a, 1), a.devices)))
    if 1 in eps and jax.default_backend() == "cpu":
        with ragged_dot_experts():
            cases.append(("moe, ragged_dot", "balanced", 1,
                          trainer(model_flags(a) + moe_flags(a, 1) + BALANCED, a.devices)))
            jax.block_until_ready(_one_step(cases[-1][3]))
    params = [sum(x.size for x in jax.tree.leaves(t.params)) for *_, t in cases]
    times = round_robin_medians([partial(_one_step, t) for *_, t in cases], reps=a.reps, warmup=2)
    tokens = a.global_batch * a.seq
    dense_s = times[0][0]
    return [{"model": name, "routing": routing, "ep": ep, "dp": a.devices // ep, "params": n, "step_s": s,
             "tokens_per_s": tokens / s, "ratio": s / dense_s, "load": _expert_load(t) if routing else None}
            for (name, routing, ep, t), n, (s,) in zip(cases, params, times)]


def _balanced_step(steps: list[dict[str, Any]], ep: int, model_prefix: str = "moe, ") -> dict[str, Any] | None:
    return next((r for r in steps if r["model"].startswith(model_prefix) and r["routing"] == "balanced"
                 and r["ep"] == ep and "ragged_dot" not in r["model"]), None)


# -- 2. dispatch and combine -------------------------------------------------------------------
def _moe_config(a: argparse.Namespace) -> Any:
    from core.transformer.moe import MoEConfig

    return MoEConfig(num_experts=a.experts, moe_ffn_hidden_size=a.ffn, moe_router_topk=a.topk,
                     moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True, moe_aux_loss_coeff=0.01,
                     moe_router_dtype="fp32", moe_router_force_load_balancing=True)  # part 1's balanced routing


def layer_pieces(a: argparse.Namespace, ep: int) -> dict[str, Callable[[], Any]]:
    """Part 2's programs at ``ep``, each a no-argument call of a jitted forward + backward:
    ``"layer"`` (the whole ``MoELayer``), ``"router"``, ``"dispatch_combine"`` (experts = identity)
    and ``"experts"`` (``GroupedMLP`` on dispatched rows)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from core import parallel_state as ps
    from core.param_metadata import init_sharded_params
    from core.transformer.moe import MoELayer
    from core.transformer.moe.experts import GroupedMLP
    from core.transformer.moe.grouped_gemm import default_window
    from core.transformer.moe.router import RouterOutput, TopKRouter
    from core.transformer.moe.token_dispatcher import build_token_dispatcher

    cfg = _moe_config(a)
    state = ps.build_parallel_state(expert_model_parallel_size=ep, devices=jax.devices()[:a.devices])
    axes = state.data_parallel_axis_name
    tokens = (a.global_batch // a.devices) * a.seq  # per rank, as in part 1
    x = jax.random.normal(jax.random.key(0), (tokens, a.devices, a.hidden), jnp.float32)  # [s, b, h]: b over ranks
    xs = P(None, axes)
    layer = MoELayer(cfg, a.hidden, batch_axes=("dp", "ep"))
    params, specs, _ = init_sharded_params(layer.init, state.mesh, (jax.random.key(1), x), (P(), xs))
    inner = params["params"]
    jit = lambda f, i, o: jax.jit(jax.shard_map(f, mesh=state.mesh, in_specs=i, out_specs=o, check_vma=False))
    rspec, especs = specs["params"]["router"], specs["params"]["experts"]

    def layer_grads(p, x):
        def loss(p, x):
            y, aux = layer.apply(p, x)
            return jnp.sum(y * y) + aux["aux_loss"]
        return jax.grad(loss, argnums=(0, 1))(p, x)

    router = TopKRouter(cfg, batch_axes=("dp", "ep"))

    def router_grads(p, x):
        def loss(p, x):
            r = router.apply({"params": p}, x)
            return jnp.sum(r.probs * r.probs) + r.aux_loss
        return jax.grad(loss, argnums=(0, 1))(p, x)

    dispatcher = build_token_dispatcher("alltoall", a.experts, ep)

    def route_and_dispatch(p, x):  # the pieces' inputs: the router's decisions and the rows they dispatch
        r = router.apply({"params": p}, x)
        flat = x.reshape(-1, x.shape[-1])
        rows, group_sizes, _ = dispatcher.dispatch(flat, RouterOutput(r.probs, r.indices, None, None))
        return flat, r.probs, r.indices, rows, group_sizes

    def dispatch_combine_grads(x, probs, indices):
        def loss(x, probs):
            rows, _, ctx = dispatcher.dispatch(x.reshape(-1, x.shape[-1]), RouterOutput(probs, indices, None, None))
            y = dispatcher.combine(rows, ctx)
            return jnp.sum(y * y)
        return jax.grad(loss, argnums=(0, 1))(x, probs)

    experts = GroupedMLP(a.experts // ep, a.hidden, a.ffn, window=default_window(tokens * a.topk, a.experts // ep))

    def expert_grads(p, rows, group_sizes):
        def loss(p, rows):
            y = experts.apply({"params": p}, rows, group_sizes)
            return jnp.sum(y * y)
        return jax.grad(loss, argnums=(0, 1))(p, rows)

    ts = P(axes)  # a [T, k] or [M, h] array per rank, stacked over the ranks
    x_tokens, probs, indices, rows, group_sizes = jit(route_and_dispatch, (rspec, xs), (ts,) * 5)(inner["router"], x)
    programs = {
        "layer": (jit(layer_grads, (specs, xs), (specs, xs)), (params, x)),
        "router": (jit(router_grads, (rspec, xs), (rspec, xs)), (inner["router"], x)),
        "dispatch_combine": (jit(dispatch_combine_grads, (ts, ts, ts), (ts, ts)), (x_tokens, probs, indices)),
        "experts": (jit(expert_grads, (especs, ts, ts), (especs, ts)), (inner["experts"], rows, group_sizes)),
    }
    return {name: partial(fn, *args) for name, (fn, args) in programs.items()}


def dispatch_rows(a: argparse.Namespace, eps: Sequence[int], steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Part 2 at each ep: the pieces' round-robin medians and the dispatch + combine shares."""
    rows = []
    for ep in eps:
        pieces = layer_pieces(a, ep)
        times = dict(zip(pieces, (t for (t,) in round_robin_medians(list(pieces.values()), reps=a.reps))))
        step = _balanced_step(steps, ep)["step_s"]
        rows.append({"ep": ep, **{f"{k}_s": v for k, v in times.items()}, "step_s": step,
                     "share_of_layer": times["dispatch_combine"] / times["layer"],
                     "share_of_step": a.layers * times["dispatch_combine"] / step})
    return rows


# -- between processes: the all-to-all's two exchanges ------------------------------------------
def one_worst_case_exchange() -> contextlib.AbstractContextManager:
    """The dropless all-to-all traced inside this context sends every peer its worst-case buffer in
    one exchange (the dispatcher otherwise sends 1.25x the mean rows first and the rest only on
    overflow, see ``core/transformer/moe/token_dispatcher.py``)."""
    from core.transformer.moe import token_dispatcher

    return mock.patch.object(token_dispatcher, "exchange_width", lambda rows, ep, width: width)


def exchange_rows(a: argparse.Namespace, ep: int) -> list[dict[str, Any]]:
    """Dispatch + combine forward + backward (part 2's piece) at ``ep``, the default two exchanges
    against one worst-case exchange, round-robin medians."""
    programs = {"two exchanges (default)": layer_pieces(a, ep)["dispatch_combine"]}
    programs["two exchanges (default)"]()
    with one_worst_case_exchange():
        programs["one worst-case exchange"] = layer_pieces(a, ep)["dispatch_combine"]
        programs["one worst-case exchange"]()  # traced here
    times = [t for (t,) in round_robin_medians(list(programs.values()), reps=a.reps, warmup=2)]
    return [{"exchange": name, "time_s": t, "over_default": t / times[0]} for name, t in zip(programs, times)]


def processes_main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Under ``mpirun -n N``: the all-to-all's exchanges between N processes (ep = N, one device
    each, so the rows cross processes); rank 0 prints the table and writes the report."""
    a = _args(argv)
    import jax

    ep = jax.process_count()
    if jax.device_count() != ep or a.experts % ep:
        raise SystemExit(f"needs one device per process and --experts divisible by {ep}: got "
                         f"{jax.device_count()} devices in {ep} processes, --experts {a.experts}")
    a.devices, a.global_batch = ep, ep * max(1, a.global_batch // a.devices)  # part 1's tokens per rank
    run = BenchRun()
    rows = exchange_rows(a, ep)
    if jax.process_index() == 0:
        platform = jax.devices()[0].platform
        tokens = a.global_batch // ep * a.seq
        workload = (f"dispatch + combine forward + backward, {tokens} tokens per rank, hidden {a.hidden}, "
                    f"{a.experts} experts, top-{a.topk}, balanced routing, ep {ep}: {ep} processes, one "
                    f"{platform} device each")
        lines = ["| all-to-all | ms | / default |", "|---|---|---|"]
        lines += [f"| {r['exchange']} | {r['time_s'] * 1e3:.1f} | {r['over_default']:.2f} |" for r in rows]
        write_processes_report(run, a, "moe.py", workload, "the dropless all-to-all's exchanges between processes",
                               a.reps, "\n".join(lines), DEFAULT_OUT, "moe_processes")
    return rows


# -- 3. expert computation ---------------------------------------------------------------------
def expert_mlps(experts: int) -> dict[str, Callable[..., Any]]:
    """The expert MLP ``(rows [M, h], w1 [E, h, F], w2 [E, F, h], group_sizes [E]) -> [M, h]`` by
    each method of part 3 (the batched one ignores ``group_sizes``: ``M / E`` rows per expert)."""
    import jax.numpy as jnp
    from jax import lax

    from core.tensor_parallel.fast_vjp import gelu
    from core.transformer.moe.grouped_gemm import group_ids, windowed_ragged_dot

    def ragged(rows, w1, w2, gs):
        return lax.ragged_dot(gelu(lax.ragged_dot(rows, w1, gs)), w2, gs)

    def windowed(rows, w1, w2, gs):
        return windowed_ragged_dot(gelu(windowed_ragged_dot(rows, w1, gs)), w2, gs)

    def loop(rows, w1, w2, gs):
        gid = group_ids(gs, rows.shape[0])
        out = jnp.zeros_like(rows)
        for e in range(experts):
            out = jnp.where((gid == e)[:, None], gelu(rows @ w1[e]) @ w2[e], out)
        return out

    def batched(rows, w1, w2, gs):
        x = rows.reshape(experts, -1, rows.shape[-1])
        return jnp.einsum("ecf,efh->ech", gelu(jnp.einsum("ech,ehf->ecf", x, w1)), w2).reshape(rows.shape)

    return {"ragged_dot": ragged, "windowed_ragged_dot": windowed, "per-expert loop": loop,
            "padded batched matmul": batched}


def gemm_rows(a: argparse.Namespace) -> list[dict[str, Any]]:
    """Part 3: forward + backward of each method, round-robin medians, and each over the batched one."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    m, e, h, f = a.gemm_rows, a.experts, a.gemm_hidden, a.gemm_ffn
    keys = jax.random.split(jax.random.key(2), 3)
    rows = jax.random.normal(keys[0], (m, h), jnp.float32)
    w1 = jax.random.normal(keys[1], (e, h, f), jnp.float32) / np.sqrt(h)
    w2 = jax.random.normal(keys[2], (e, f, h), jnp.float32) / np.sqrt(f)
    gs = jnp.asarray(np.bincount(np.random.default_rng(0).integers(0, e, m), minlength=e), jnp.int32)
    mlps = expert_mlps(e)

    def grads(mlp):
        return jax.jit(jax.grad(lambda x, w1, w2, gs: jnp.sum(mlp(x, w1, w2, gs) ** 2), argnums=(0, 1, 2)))

    programs = [partial(grads(mlp), rows, w1, w2, gs) for mlp in mlps.values()]
    times = [t for (t,) in round_robin_medians(programs, reps=a.reps)]
    flops = 3 * 2 * 2 * m * h * f  # two GEMMs, forward + 2 backward
    return [{"method": name, "time_s": t, "gflops": flops / t / 1e9, "over_batched": t / times[-1]}
            for name, t in zip(mlps, times)]


# -- the tables --------------------------------------------------------------------------------
def step_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | routing | busiest expert / mean | ep | dp | parameters | step ms | tokens/s | step / dense |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['routing'] or '-'} | {'-' if r['load'] is None else format(r['load'], '.2f')} | "
              f"{r['ep']} | {r['dp']} | {r['params'] / 1e6:.2f}M | {r['step_s'] * 1e3:.0f} | "
              f"{r['tokens_per_s']:.0f} | {r['ratio']:.2f} |" for r in rows]
    return "\n".join(lines)


def dispatch_table(rows: list[dict[str, Any]], layers: int) -> str:
    lines = ["| ep | MoE layer ms | router ms | dispatch + combine ms | experts ms | dispatch + combine / layer "
             f"| step ms | {layers} x dispatch + combine / step |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['ep']} | {r['layer_s'] * 1e3:.1f} | {r['router_s'] * 1e3:.1f} | "
              f"{r['dispatch_combine_s'] * 1e3:.1f} | {r['experts_s'] * 1e3:.1f} | {r['share_of_layer']:.0%} | "
              f"{r['step_s'] * 1e3:.0f} | {r['share_of_step']:.0%} |" for r in rows]
    return "\n".join(lines)


def gemm_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| expert MLP, forward + backward | ms | GFLOP/s (active FLOPs) | / padded batched |", "|---|---|---|---|"]
    lines += [f"| {r['method']} | {r['time_s'] * 1e3:.1f} | {r['gflops']:.1f} | {r['over_batched']:.2f} |"
              for r in rows]
    return "\n".join(lines)


# -- the command -------------------------------------------------------------------------------
def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, one round (a smoke run)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--global-batch", type=int, default=64,
                   help="sequences per step (a multiple of --devices; 64: 2048 tokens per device)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--ffn", type=int, default=512, help="expert FFN width (the dense FFN: topk x this)")
    p.add_argument("--eps", default="1,2,4,8", help="expert-parallel sizes")
    p.add_argument("--gemm-rows", type=int, default=4096, help="part 3: rows (tokens x top-k)")
    p.add_argument("--gemm-hidden", type=int, default=256, help="part 3: model width")
    p.add_argument("--gemm-ffn", type=int, default=512, help="part 3: expert FFN width")
    p.add_argument("--reps", type=int, default=5, help="round-robin rounds (median)")
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--machine", default="2-core AVX2 VM (AMD EPYC), simulated CPU devices",
                   help="the machine, for the report")
    p.add_argument("--note", default="", help="a note for the report (e.g. other jobs on the cores)")
    a = p.parse_args(argv)
    if a.quick:
        a.layers, a.hidden, a.heads, a.seq, a.global_batch, a.ffn, a.devices = 1, 32, 2, 32, 4, 32, 2
        a.eps, a.gemm_rows, a.gemm_hidden, a.gemm_ffn, a.reps = "2", 256, 32, 64, 1
    if a.global_batch % a.devices:
        p.error(f"--global-batch ({a.global_batch}) must be a multiple of --devices ({a.devices})")
    if a.gemm_rows % a.experts:
        p.error(f"--gemm-rows ({a.gemm_rows}) must be a multiple of --experts ({a.experts})")
    return a


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the three parts, print the tables, write the report; returns the figures."""
    a = _args(argv)
    import jax

    eps = _ints(a.eps)
    if jax.device_count() < a.devices:
        raise SystemExit(f"needs {a.devices} devices, JAX has {jax.device_count()} (run as a script, or set "
                         f"JAX_NUM_CPU_DEVICES)")
    run = BenchRun()
    workload = (f"GPT, {a.layers} layers, hidden {a.hidden}, {a.heads} heads, seq {a.seq}, global batch "
                f"{a.global_batch} ({a.global_batch * a.seq} tokens per step); MoE: {a.experts} experts, top-{a.topk}, "
                f"expert FFN {a.ffn}, every layer, dropless alltoall, grouped GEMM; dense: FFN "
                f"{a.topk * a.ffn}; float32, Adam, {a.devices} simulated {jax.devices()[0].platform} devices in one "
                f"process")
    print(workload, flush=True)

    steps = step_rows(a, eps)
    at1 = (_balanced_step(steps, 1) or {}).get("ratio", float("nan"))
    step_text = step_table(steps)
    if 1 in eps:
        learned = next(r for r in steps if r["routing"] == "learned")
        step_text += (f"\n\nMoE step / dense step at ep=1, balanced routing: **{at1:.2f}** (target <= "
                      f"{TARGET_STEP_RATIO}: {'met' if at1 <= TARGET_STEP_RATIO else 'NOT met'}); with the "
                      f"router's own routing {learned['ratio']:.2f} (busiest expert {learned['load']:.2f}x the mean)")
        ragged = [r["ratio"] for r in steps if r["model"] == "moe, ragged_dot"]
        if ragged:
            step_text += f"; balanced with `ragged_dot` experts {ragged[0]:.2f}"
    print(f"\n1. training step (median of {a.reps} round-robin rounds; {run.lap()})\n\n{step_text}", flush=True)

    dispatch = dispatch_rows(a, eps, steps)
    at8 = next((r["share_of_step"] for r in dispatch if r["ep"] == max(eps)), float("nan"))
    dispatch_text = (f"{dispatch_table(dispatch, a.layers)}\n\nDispatch + combine share of the step at "
                     f"ep={max(eps)}: **{at8:.0%}** (target <= {TARGET_DISPATCH_SHARE:.0%}"
                     + (f": {'met' if at8 <= TARGET_DISPATCH_SHARE else 'NOT met'})" if max(eps) == 8
                        else ", which is at ep=8)"))
    print(f"\n2. dispatch and combine, pieces jitted alone, forward + backward (median of {a.reps} round-robin "
          f"rounds; {run.lap()})\n\n{dispatch_text}", flush=True)

    gemm = gemm_rows(a)
    gemm_text = gemm_table(gemm)
    print(f"\n3. expert computation, {a.gemm_rows} rows, {a.experts} experts, h {a.gemm_hidden}, F {a.gemm_ffn}, one "
          f"device (median of {a.reps} round-robin rounds; {run.lap()})\n\n{gemm_text}", flush=True)

    header = (run.header(f"python bench/moe.py{' --quick' if a.quick else ''}",
                         f"{a.machine}, {jax.default_backend()} backend", a.note) + f"\n\nWorkload: {workload}.\n")
    report = (f"{header}\n## 1. Training step, MoE vs dense of equal active parameters (median of {a.reps} "
              f"round-robin rounds)\n\n{step_text}\n\n"
              f"## 2. Dispatch + combine (MoE layer pieces jitted alone, forward + backward, median of {a.reps} "
              f"round-robin rounds; share of step = layers x dispatch + combine / part 1's step)\n\n{dispatch_text}\n\n"
              f"## 3. Expert computation ({a.gemm_rows} rows, {a.experts} experts, h {a.gemm_hidden}, "
              f"F {a.gemm_ffn}, forward + backward, one device)\n\n{gemm_text}\n")
    write_text_atomically(a.out, report)
    print(f"\n{run.elapsed():.0f} s; wrote {a.out}")
    return {"steps": steps, "step_ratio_ep1": at1, "dispatch": dispatch, "dispatch_share_max_ep": at8, "gemm": gemm}


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    from core.parallel_state import mpi_world_size_from_env

    if mpi_world_size_from_env() > 1:
        start_worker_process()
        processes_main()
        sys.exit(0)
    from core.runtime.cpu_devices import configure_cpu_devices
    from core.runtime.cpu_malloc import reexec_with_malloc_settings

    reexec_with_malloc_settings()
    configure_cpu_devices(_args(sys.argv[1:]).devices)
    main()
