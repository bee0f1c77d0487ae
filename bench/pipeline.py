"""Pipeline schedules at pp=4: step time, bubble fraction and compiled peak temp memory.

    python bench/pipeline.py                                  # one process, 4 simulated CPU devices
    mpirun -n 4 python bench/pipeline.py --ms 8 --steps 7      # pp = 4 processes, one device each

Stages are ``hidden x hidden`` tanh layers on ``[tokens, hidden]`` microbatches. For GPipe (the
autodiff of the xlstm_jax-style forward scan) and Megatron's 1F1B order run by the table-driven
executor (``core.pipeline_parallel.table_driven``) at M in {4, 8, 16}: the median of ``--steps``
jitted forward+backward calls, the measured bubble ``1 - t_ideal / t_step`` with ``t_ideal`` =
one device running all pp stages on all M microbatches divided by pp (a perfect pipeline), the
*slot bubble*: the idle share of the executed slots (GPipe ``(p-1)/(m+p-1)``; table-driven
``Timeline.bubble_fraction()``, i.e. ``(p-1)/(m+p-1)`` for 1F1B and ``(p-1)/(v m+p-1)``
interleaved), Megatron's *bubble time fraction* ``t_pb / t_id`` (``(p-1)/m`` and
``(p-1)/(v m)``), and ``memory_analysis().temp_size_in_bytes``. Simulated devices share the
host's cores, so step times are only indicative. Interleaved runs the table-driven executor
with vpp=2 chunks per rank, each a full stage (i.e. twice the layers). ZB-H1 runs the
zero-bubble executor (``core.pipeline_parallel.zero_bubble_executor``: each backward split into
B, the input gradient, and a later W, the weight gradient); its slot bubble counts F, B and W as
one slot each (``ZeroBubbleTimeline.bubble_fraction()``) and its bubble time fraction is the
table's idle over busy units (``bubble_time_fraction()``, the same measure as 1F1B's
``(p-1)/m``). ZB-V runs the same executor
with two chunks per rank in a V (chunk 1 of rank ``r`` is virtual stage ``2 pp - 1 - r``), each a
full stage like the interleaved row's (2x layers): compare its step time with that row. The
"W recomputes" rows run the same schedules with ``w_recompute`` (``--zero-bubble-w-recompute``):
W runs the stage's forward again from its stashed input instead of keeping B's residuals.
A second table (not with ``--no-gpt``) gives the compiled temp memory of a small GPT's training
step at pp (8 layers: ``GPT``) for each schedule: the memory a model's layers take, where a
toy stage of one layer has almost none besides its input.

**Between processes** (``mpirun -n N``, pp = N, one device per process, the sends real transfers
between processes; gloo on the CPU, NCCL on GPUs): 1F1B, ZB-H1 and ZB-H1 with W recomputing,
then interleaved, ZB-V and ZB-V with W recomputing, each group timed round-robin (rank 0's
medians), with the step's ratio to 1F1B (interleaved for the two-chunk rows), the measured
bubble against one device running every stage (each process runs that reference on its own
device), the slot bubble and the temp memory. Writes
``bench/results/pipeline_processes_<platform>.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mpi_launch import start_worker_process, write_processes_report  # noqa: E402
from timing import BenchRun, median_seconds, round_robin_medians  # noqa: E402

DEFAULT_OUT = "printed"
"""``--out``'s default: the one-process run prints its table; under mpirun the report goes to
``bench/results/pipeline_processes_<platform>.md``."""


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, default=4, help="pipeline stages (one process: simulated devices)")
    p.add_argument("--tokens", type=int, default=64, help="rows of a microbatch")
    p.add_argument("--hidden", type=int, default=256, help="width of a stage's square layer")
    p.add_argument("--ms", default="4,8,16", help="microbatch counts")
    p.add_argument("--steps", type=int, default=5, help="timed steps (round-robin rounds under mpirun)")
    p.add_argument("--no-gpt", action="store_true", help="skip the GPT training step's memory table")
    p.add_argument("--quick", action="store_true", help="under mpirun: tiny sizes, one round (a smoke run)")
    p.add_argument("--out", default=DEFAULT_OUT, help="the report under mpirun")
    p.add_argument("--machine", default="2-core AVX2 VM (AMD EPYC)", help="the host, for the report")
    p.add_argument("--note", default="", help="a note for the report (e.g. other jobs on the cores)")
    return p.parse_args(argv)


def stage(p: dict, x: Any) -> Any:
    """One pipeline stage: a square tanh layer."""
    import jax.numpy as jnp

    return jnp.tanh(x @ p["w"] + p["b"])


def loss_fn(y: Any, t: Any) -> Any:
    """Mean squared error of a microbatch."""
    import jax.numpy as jnp

    return jnp.mean((y - t) ** 2)


def _forward_step_func(d: dict, model: Callable) -> tuple:
    y = model(d["x"])
    return y, lambda y: (loss_fn(y, d["t"]), {"loss": loss_fn(y, d["t"])})


def schedules(pp: int) -> dict[str, Callable]:
    """``name -> fn(p, x, t) -> (loss, grads)`` run inside a ``shard_map`` over ``"pp"``: ``p`` this
    rank's stage (one-chunk schedules) or its two chunks stacked on a leading dim (two-chunk)."""
    import jax
    import jax.numpy as jnp

    from core.pipeline_parallel.table_driven import forward_backward_table_driven
    from core.pipeline_parallel.zero_bubble_executor import execute_schedule_zb_h1, execute_schedule_zb_v

    def gpipe(p, x, t):  # the autodiff of the xlstm_jax-style forward scan
        def loss(p):
            def step(carry, inp):
                s = jax.lax.axis_index("pp")
                h = stage(p, jnp.where(s == 0, inp, carry))
                out = jnp.where(s == pp - 1, h, 0.0)
                return jax.lax.ppermute(h, "pp", [(i, (i + 1) % pp) for i in range(pp)]), out
            xs = jnp.concatenate([x, jnp.zeros((pp - 1,) + x.shape[1:])])
            _, outs = jax.lax.scan(step, jnp.zeros_like(x[0]), xs)
            return jnp.mean(jax.vmap(loss_fn)(outs[pp - 1:], t))
        return jax.value_and_grad(loss)(p)

    def one_f_one_b(p, x, t):  # Megatron's exact order, table-driven (params get a chunk dim of 1)
        loss, g = forward_backward_table_driven(stage, loss_fn, jax.tree.map(lambda a: a[None], p), x, t)
        return loss, jax.tree.map(lambda a: a[0], g)

    def zb_h1(p, x, t, w_recompute=False):  # the same stage and loss, params with a chunk dim of 1
        losses, g, _ = execute_schedule_zb_h1(_forward_step_func, {"x": x, "t": t}, stage,
                                              jax.tree.map(lambda a: a[None], p), w_recompute=w_recompute)
        return jnp.mean(jnp.stack([d["loss"] for d in losses])), jax.tree.map(lambda a: a[0], g)

    def interleaved(p, x, t):
        return forward_backward_table_driven(stage, loss_fn, p, x, t, num_model_chunks=2)

    def zb_v(p, x, t, w_recompute=False):  # two chunks per rank in the V placement
        losses, g, _ = execute_schedule_zb_v(_forward_step_func, {"x": x, "t": t}, stage, p, w_recompute=w_recompute)
        return jnp.mean(jnp.stack([d["loss"] for d in losses])), g

    return {"GPipe": gpipe, "1F1B (Megatron order, table-driven)": one_f_one_b,
            "ZB-H1 (F, B, W slots)": zb_h1,
            "ZB-H1, W recomputes the forward": functools.partial(zb_h1, w_recompute=True),
            "interleaved v=2, Megatron order (2x layers)": interleaved,
            "ZB-V v=2 (F, B, W slots; 2x layers)": zb_v,
            "ZB-V, W recomputes the forward": functools.partial(zb_v, w_recompute=True)}


TWO_CHUNKS = ("interleaved", "ZB-V")
"""Rows whose name starts so run two chunks per rank (twice the layers)."""


def slot_bubble(name: str, m: int, pp: int) -> tuple[float, float]:
    """The row's slot bubble (the table's idle share) and Megatron's bubble time fraction
    ``t_pb / t_id`` (GPipe and 1F1B ``(p-1)/m``, interleaved ``(p-1)/(v m)``; the zero-bubble
    tables' idle over busy F, B, W units, comparable with those)."""
    from core.pipeline_parallel.timeline import build_timeline
    from core.pipeline_parallel.zero_bubble import build_zb_h1_timeline, build_zb_v_timeline

    if name.startswith("GPipe"):
        return (pp - 1) / (m + pp - 1), (pp - 1) / m
    if name.startswith("1F1B"):
        return build_timeline(m, pp).bubble_fraction(), (pp - 1) / m
    if name.startswith("interleaved"):
        return build_timeline(m, pp, 2).bubble_fraction(), (pp - 1) / (2 * m)
    table = build_zb_h1_timeline(m, pp) if name.startswith("ZB-H1") else build_zb_v_timeline(m, pp)
    return table.bubble_fraction(), table.bubble_time_fraction()


def build(fn: Callable, mesh: Any) -> Any:
    """``fn`` jitted over the pp mesh: stacked params in, the loss and stacked grads out."""
    import jax
    from jax.sharding import PartitionSpec as P

    def body(p, x, t):
        loss, g = fn(jax.tree.map(lambda a: a[0], p), x, t)
        return loss, jax.tree.map(lambda a: a[None], g)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("pp"), P(), P()), out_specs=(P(), P("pp")),
                                 check_vma=False))


def place(mesh: Any, tree: Any, spec: Any) -> Any:
    """Host arrays as global arrays on ``mesh`` (every process holds the same values)."""
    import jax
    from jax.sharding import NamedSharding

    sharding = NamedSharding(mesh, spec)
    return jax.tree.map(lambda a: jax.make_array_from_callback(a.shape, sharding,
                                                               lambda i, a=a: a[i]), tree)


def workload(pp: int, hid: int, tokens: int, m: int) -> tuple[dict, dict, Any, Any]:
    """Host params (one stage per rank, and two chunks per rank), microbatches and targets."""
    import numpy as np

    rng = np.random.default_rng(0)
    params = {"w": (rng.standard_normal((pp, hid, hid)) / hid ** 0.5).astype(np.float32),
              "b": np.zeros((pp, hid), np.float32)}
    two = {k: np.stack([v, v], axis=1) for k, v in params.items()}
    x = rng.standard_normal((m, tokens, hid)).astype(np.float32)
    t = rng.standard_normal((m, tokens, hid)).astype(np.float32)
    return params, two, x, t


def sequential(pp: int) -> Any:
    """One device running every stage on every microbatch (the perfect pipeline's work x pp)."""
    import jax

    @jax.jit
    def run(params, x, t):
        def loss(params):
            def one(xm, tm):
                for s in range(pp):
                    xm = stage(jax.tree.map(lambda a, s=s: a[s], params), xm)
                return loss_fn(xm, tm)
            return jax.numpy.mean(jax.vmap(one)(x, t))
        return jax.value_and_grad(loss)(params)
    return run


HEADER = ("| schedule | M | step ms | ideal ms | measured bubble | slot bubble | bubble time / ideal | temp KiB |\n"
          "|---|---|---|---|---|---|---|---|")


def one_process(a: argparse.Namespace) -> None:
    """The table on ``--pp`` simulated devices of one process (step times: medians of ``--steps``)."""
    import jax

    from core import parallel_state as ps

    pp = a.pp
    mesh = ps.build_parallel_state(pipeline_model_parallel_size=pp, devices=jax.devices()[:pp]).mesh
    fns = schedules(pp)
    print(f"pp={pp}, tokens={a.tokens}, hidden={a.hidden}, {a.steps} steps, {jax.devices()[0].platform}\n")
    print(HEADER)
    for m in map(int, a.ms.split(",")):
        params, two, x, t = workload(pp, a.hidden, a.tokens, m)
        single = jax.devices()[0]
        ideal = median_seconds(sequential(pp), *(jax.device_put(v, single) for v in (params, x, t)), reps=a.steps) / pp
        for name, fn in fns.items():
            if m < pp and name.startswith("ZB"):
                continue  # zero-bubble schedules need a microbatch per stage
            chunks = 2 if name.startswith(TWO_CHUNKS) else 1
            p = two if chunks == 2 else params
            f = build(fn, mesh)
            temp = f.lower(p, x, t).compile().memory_analysis().temp_size_in_bytes
            step = median_seconds(f, p, x, t, reps=a.steps)
            bubble, time_fraction = slot_bubble(name, m, pp)
            print(f"| {name} | {m} | {step * 1e3:.1f} | {chunks * ideal * 1e3:.1f} | "
                  f"{1 - chunks * ideal / step:.2f} | {bubble:.2f} | {time_fraction:.3f} | {temp / 1024:.0f} |")
    if not a.no_gpt:
        print(f"\nGPT training step at pp {pp} (8 layers, hidden 128, seq 128, m 8; compiled temp memory per device)\n")
        print(gpt_memory_table(pp))


GPT = ["--num-layers", "8", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
       "--micro-batch-size", "2", "--global-batch-size", "16", "--train-iters", "5", "--lr-warmup-iters", "1",
       "--no-progress-bar"]
"""The GPT of the memory table: 8 layers (pp 4 x 2 chunks), m 8 microbatches of 2 x 128 tokens."""

GPT_SCHEDULES = {
    "1F1B": [], "ZB-H1": ["--pipeline-schedule", "zb-h1"],
    "ZB-H1, W recomputes": ["--pipeline-schedule", "zb-h1", "--zero-bubble-w-recompute"],
    "interleaved v=2": ["--virtual-pipeline-model-parallel-size", "2"],
    "ZB-V": ["--virtual-pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-v"],
    "ZB-V, W recomputes": ["--virtual-pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-v",
                           "--zero-bubble-w-recompute"]}
"""Schedules of the GPT memory table and their flags."""


def gpt_temp_kib(pp: int, flags: list[str]) -> float:
    """Compiled temp memory (KiB per device) of the :data:`GPT` training step at pp with ``flags``."""
    import jax

    from core import parallel_state as ps
    from core.training.arguments import parse_args, validate_args
    from core.training.pretrainer import Pretrainer
    from core.training.run_config import pretrain_config

    args = parse_args([*GPT, "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", str(pp), *flags])
    layout = validate_args(args, pp)
    state = ps.build_parallel_state(1, pp, layout.virtual_pipeline_model_parallel_size, devices=jax.devices()[:pp])
    trainer = Pretrainer(pretrain_config(args), layout, state)
    lowered = trainer.train_step.lower(trainer.params, trainer.opt_state, trainer.data.next_train_batch())
    return lowered.compile().memory_analysis().temp_size_in_bytes / 1024


def gpt_memory_table(pp: int) -> str:
    """Markdown: the GPT training step's temp memory per schedule, and its ratio to 1F1B's
    (interleaved's for the two-chunk rows)."""
    temps = {name: gpt_temp_kib(pp, flags) for name, flags in GPT_SCHEDULES.items()}
    lines = ["| schedule | temp KiB | / 1F1B or interleaved |", "|---|---|---|"]
    for name, kib in temps.items():
        base = temps["interleaved v=2" if name.startswith(("interleaved", "ZB-V")) else "1F1B"]
        lines.append(f"| {name} | {kib:.0f} | {kib / base:.2f} |")
    return "\n".join(lines)


def processes_rows(a: argparse.Namespace, mesh: Any, m: int) -> list[dict[str, Any]]:
    """Under mpirun: the one- and two-chunk groups at ``m``, each timed round-robin."""
    import jax
    from jax.sharding import PartitionSpec as P

    pp = mesh.devices.size
    params, two, x, t = workload(pp, a.hidden, a.tokens, m)
    local = jax.local_devices()[0]
    ideal = median_seconds(sequential(pp), *(jax.device_put(v, local) for v in (params, x, t)), reps=a.steps) / pp
    xs, ts = place(mesh, x, P()), place(mesh, t, P())
    fns, rows = schedules(pp), []
    for group in (("1F1B", "ZB-H1"), TWO_CHUNKS):
        chunks = 2 if group == TWO_CHUNKS else 1
        p = place(mesh, two if chunks == 2 else params, P("pp"))
        names = [n for n in fns if n.startswith(group)]
        compiled = [build(fns[n], mesh).lower(p, xs, ts).compile() for n in names]
        times = round_robin_medians([functools.partial(c, p, xs, ts) for c in compiled], reps=a.steps)
        for name, c, (step,) in zip(names, compiled, times, strict=True):
            bubble, _ = slot_bubble(name, m, pp)
            rows.append({"schedule": name, "m": m, "step_s": step, "ratio": step / times[0][0],
                         "ideal_s": chunks * ideal, "slot_bubble": bubble,
                         "temp_kib": c.memory_analysis().temp_size_in_bytes / 1024})
    return rows


def processes_table(rows: list[dict[str, Any]]) -> str:
    """Markdown of :func:`processes_rows`' rows."""
    lines = ["| schedule | M | step ms | / 1F1B or interleaved | ideal ms | measured bubble | slot bubble | temp KiB |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['schedule']} | {r['m']} | {r['step_s'] * 1e3:.1f} | {r['ratio']:.2f} | {r['ideal_s'] * 1e3:.1f} "
              f"| {1 - r['ideal_s'] / r['step_s']:.2f} | {r['slot_bubble']:.2f} | {r['temp_kib']:.0f} |" for r in rows]
    return "\n".join(lines)


def processes_main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Under ``mpirun -n N`` (pp = N, one device per process): the schedules timed between
    processes; rank 0 prints the table and writes the report. Returns the rows (every rank)."""
    a = _args(argv)
    import jax

    from core import parallel_state as ps

    pp = jax.process_count()
    if jax.device_count() != pp:
        raise SystemExit(f"needs one device per process: got {jax.device_count()} devices in {pp} processes")
    if a.quick:
        a.tokens, a.hidden, a.ms, a.steps = 8, 16, str(pp), 1
    run = BenchRun()
    mesh = ps.build_parallel_state(pipeline_model_parallel_size=pp, devices=jax.devices()).mesh
    rows = [r for m in map(int, a.ms.split(",")) for r in processes_rows(a, mesh, m)]
    if jax.process_index() == 0:
        work = (f"pp {pp}: stages of one {a.hidden} x {a.hidden} tanh layer on [{a.tokens}, {a.hidden}] float32 "
                f"microbatches, M in {{{a.ms}}}, {pp} processes, one {jax.devices()[0].platform} device each")
        write_processes_report(run, a, "pipeline.py", work, "pipeline schedules between processes", a.steps,
                               processes_table(rows), DEFAULT_OUT, "pipeline_processes")
    return rows


if __name__ == "__main__":
    from core.parallel_state import mpi_world_size_from_env

    if mpi_world_size_from_env() > 1:
        start_worker_process()
        processes_main()
        sys.exit(0)
    args = _args()
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.pp}")
    one_process(args)
