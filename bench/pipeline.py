"""Pipeline schedules at pp=4: step time, bubble fraction and compiled peak temp memory.

    python bench/pipeline.py        # one process, 4 simulated CPU devices

Stages are ``hidden x hidden`` tanh layers on ``[tokens, hidden]`` microbatches. For GPipe (the
autodiff of the xlstm_jax-style forward scan) and Megatron's 1F1B order run by the table-driven
executor (``core.pipeline_parallel.table_driven``) at M in {4, 8, 16}: the median of ``--steps``
jitted forward+backward calls, the measured bubble ``1 - t_ideal / t_step`` with ``t_ideal`` =
one device running all pp stages on all M microbatches divided by pp (a perfect pipeline), the
idle share of the executed slots (GPipe ``(p-1)/(m+p-1)``; table-driven
``Timeline.bubble_fraction()``, i.e. ``(p-1)/(m+p-1)`` for 1F1B and ``(p-1)/(v m+p-1)``
interleaved), Megatron's theoretical ``(p-1)/m`` and ``(p-1)/(v m)``, and
``memory_analysis().temp_size_in_bytes``. Simulated devices share the host's cores, so step
times are only indicative. Interleaved runs the table-driven executor with vpp=2 chunks per
rank, each a full stage (i.e. twice the layers). ZB-H1 runs the zero-bubble executor
(``core.pipeline_parallel.zero_bubble_executor``: each backward split into B, the input
gradient, and a later W, the weight gradient); its slot bubble counts F, B and W as one slot
each (``ZeroBubbleTimeline.bubble_fraction()``), next to 1F1B's in the same units (the paper's
``(p-1)/(m+p-1)`` with a backward of B + W) in the Megatron column. ZB-V runs the same executor
with two chunks per rank in a V (chunk 1 of rank ``r`` is virtual stage ``2 pp - 1 - r``), each a
full stage like the interleaved row's (2x layers): compare its step time with that row.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import median_seconds  # noqa: E402


def main() -> None:
    """Parse flags, run the schedules, print the Markdown table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ms", default="4,8,16")
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.pp}")
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from core import parallel_state as ps
    from core.pipeline_parallel.table_driven import forward_backward_table_driven
    from core.pipeline_parallel.timeline import build_timeline
    from core.pipeline_parallel.zero_bubble import build_zb_h1_timeline, build_zb_v_timeline, one_f_one_b_reference
    from core.pipeline_parallel.zero_bubble_executor import execute_schedule_zb_h1, execute_schedule_zb_v

    pp, hid = args.pp, args.hidden
    state = ps.build_parallel_state(pipeline_model_parallel_size=pp, devices=jax.devices()[:pp])

    def stage(p, x):
        return jnp.tanh(x @ p["w"] + p["b"])

    def loss_fn(y, t):
        return jnp.mean((y - t) ** 2)

    def gpipe(p, x, t):
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

    def megatron_1f1b(p, x, t):  # Megatron's exact order, table-driven (params get a chunk dim of 1)
        loss, g = forward_backward_table_driven(stage, loss_fn, jax.tree.map(lambda a: a[None], p), x, t)
        return loss, jax.tree.map(lambda a: a[0], g)

    def forward_step_func(d, model):
        y = model(d["x"])
        return y, lambda y: (loss_fn(y, d["t"]), {"loss": loss_fn(y, d["t"])})

    def zb_h1(p, x, t, w_recompute=False):  # ZB-H1 on the same stage and loss (params with a chunk dim of 1)
        losses, g, _ = execute_schedule_zb_h1(forward_step_func, {"x": x, "t": t}, stage,
                                              jax.tree.map(lambda a: a[None], p), w_recompute=w_recompute)
        return jnp.mean(jnp.stack([d["loss"] for d in losses])), jax.tree.map(lambda a: a[0], g)

    def megatron_interleaved(p, x, t):
        return forward_backward_table_driven(stage, loss_fn, p, x, t, num_model_chunks=2)

    def zb_v(p, x, t, w_recompute=False):  # ZB-V: two chunks per rank in the V placement (chunk dim of 2)
        losses, g, _ = execute_schedule_zb_v(forward_step_func, {"x": x, "t": t}, stage, p, w_recompute=w_recompute)
        return jnp.mean(jnp.stack([d["loss"] for d in losses])), g

    def build(fn):
        def body(p, x, t):
            loss, g = fn(jax.tree.map(lambda a: a[0], p), x, t)
            return loss, jax.tree.map(lambda a: a[None], g)
        return jax.jit(jax.shard_map(body, mesh=state.mesh, in_specs=(P("pp"), P(), P()),
                                     out_specs=(P(), P("pp")), check_vma=False))

    def timed(f, *a):
        return median_seconds(f, *a, reps=args.steps)

    key = jax.random.key(0)
    params = {"w": jax.random.normal(key, (pp, hid, hid)) / hid ** 0.5, "b": jnp.zeros((pp, hid))}
    single = jax.devices()[0]

    @jax.jit
    def sequential(params, x, t):
        def loss(params):
            def one(xm, tm):
                for s in range(pp):
                    xm = stage(jax.tree.map(lambda a, s=s: a[s], params), xm)
                return loss_fn(xm, tm)
            return jnp.mean(jax.vmap(one)(x, t))
        return jax.value_and_grad(loss)(params)

    print(f"pp={pp}, tokens={args.tokens}, hidden={hid}, {args.steps} steps, {jax.devices()[0].platform}\n")
    print("| schedule | M | step ms | ideal ms | measured bubble | slot bubble | Megatron (p-1)/m | temp KiB |")
    print("|---|---|---|---|---|---|---|---|")
    for m in map(int, args.ms.split(",")):
        x = jax.random.normal(key, (m, args.tokens, hid))
        t = jax.random.normal(jax.random.key(1), (m, args.tokens, hid))
        ps_, xs, ts_ = (jax.device_put(a, single) for a in (params, x, t))
        ideal = timed(sequential, ps_, xs, ts_) / pp
        rows = [("GPipe", gpipe, (pp - 1) / (m + pp - 1), f"{(pp - 1) / m:.2f}"),
                ("1F1B (Megatron order, table-driven)", megatron_1f1b, build_timeline(m, pp).bubble_fraction(),
                 f"{(pp - 1) / m:.2f}")]
        if m >= pp:  # ZB-H1 needs a microbatch per stage
            zb_bubble = build_zb_h1_timeline(m, pp).bubble_fraction()
            ref = f"1F1B in F/B/W slots {one_f_one_b_reference(m, pp)[0]:.2f}"
            rows.append(("ZB-H1 (F, B, W slots)", zb_h1, zb_bubble, ref))
            rows.append(("ZB-H1, W recomputes the forward", functools.partial(zb_h1, w_recompute=True), zb_bubble, ref))
        for name, fn, grid, theory in rows:
            f = build(fn)
            temp = f.lower(params, x, t).compile().memory_analysis().temp_size_in_bytes
            step = timed(f, params, x, t)
            print(f"| {name} | {m} | {step * 1e3:.1f} | {ideal * 1e3:.1f} | {1 - ideal / step:.2f} | {grid:.2f} "
                  f"| {theory} | {temp / 1024:.0f} |")
        # Interleaved: 2 chunks per rank, each half the width's work would need half-size stages; here each
        # chunk is a full stage (2x the model), so compare its slot bubble and memory, not its step time.
        ip = jax.tree.map(lambda a: jnp.stack([a, a], axis=1), params)
        rows = [("interleaved v=2, Megatron order (2x layers)", megatron_interleaved,
                 build_timeline(m, pp, 2).bubble_fraction(), f"{(pp - 1) / (2 * m):.2f}")]
        if m >= pp:  # ZB-V needs a microbatch per stage
            zb_bubble = build_zb_v_timeline(m, pp).bubble_fraction()
            ref = f"1F1B in F/B/W slots {one_f_one_b_reference(m, pp)[0]:.2f}"
            rows.append(("ZB-V v=2 (F, B, W slots; 2x layers)", zb_v, zb_bubble, ref))
            rows.append(("ZB-V, W recomputes the forward", functools.partial(zb_v, w_recompute=True), zb_bubble, ref))
        for name, fn, grid, theory in rows:
            f = build(fn)
            temp = f.lower(ip, x, t).compile().memory_analysis().temp_size_in_bytes
            step = timed(f, ip, x, t)
            print(f"| {name} | {m} | {step * 1e3:.1f} | {2 * ideal * 1e3:.1f} | {1 - 2 * ideal / step:.2f} "
                  f"| {grid:.2f} | {theory} | {temp / 1024:.0f} |")

if __name__ == "__main__":
    main()
