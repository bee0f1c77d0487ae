"""Megatron-FSDP's four sharding strategies: the compiled step's per-device memory, its time, and
a memory plan for Llama-3-8B / 70B shapes, all on simulated CPU devices.

    python bench/fsdp.py --out bench/results/fsdp.md   # everything (about 30 minutes on 2 cores)
    python bench/fsdp.py --smoke                      # tiny shapes, every part once (tests/test_bench_fsdp.py)
    python bench/fsdp.py --parts 1,2 --rounds 3       # parts 1 and 2 only

The strategies (``DistributedDataParallelConfig(use_megatron_fsdp=True,
data_parallel_sharding_strategy=...)``, built by ``core.megatron_fsdp.fully_shard``, fp32 grad
reduction, ``--scan-layers``): ``no_shard`` (DDP), ``optim`` (ZeRO-1: the accumulated grads are
reduce-scattered once per step), ``optim_grads`` (ZeRO-2: each microbatch's grads are
reduce-scattered right after its backward, shard-sized accumulators) and ``optim_grads_params``
(ZeRO-3: parameters sharded over dp at rest, each unit gathered right before use).

1. Memory: a ~124M-parameter GPT (GPT-2 small's shape: 12 layers, hidden 768, sequence 1024,
   vocabulary 50304, 4 microbatches of one sample per rank) under each strategy at dp 1, 2, 4, 8
   (``devices=jax.devices()[:dp]``), parameters, optimizer state and batch abstract
   (``ShapeDtypeStruct``; nothing allocated): XLA's ``memory_analysis`` per device, arguments,
   temporaries and their sum as the peak estimate (and ``peak_memory_in_bytes``).
2. Time: a ~14M-parameter GPT (6 layers, hidden 384, sequence 128, vocabulary 8192, 4
   microbatches of one sample per rank) at dp 8, every strategy with one bucket per buffer plus
   ``optim`` / ``optim_grads`` with buckets of about one layer (``--bucket-size``); the variants
   are called round-robin, the median step time of ``--rounds`` rounds and its ratio to ``optim``
   (simulated devices share the host's cores: the devices' work runs one after another).
3. Planning (``--planning N``, a subprocess per device count, 8 and 64 simulated devices): the
   step of Llama-3-8B / 70B shapes (RMSNorm, SwiGLU, GQA with 8 KV groups, rope, untied, no bias,
   vocabulary 128256, ``--bf16 --scan-layers``; ``--sequence-parallel`` with tp) compiled on
   abstract params / state / batch at micro-batch 1, for the layouts tp8 ``optim`` (the distributed
   optimizer, dp 1), fsdp8 (``optim_grads_params`` dp 8), fsdp64 (dp 64) and tp8 x fsdp8, sequence
   4096 / 8192, without and with (full, some selective) recompute: 28 of the combinations
   (:func:`_plan_rows`). "fits 80 GB": arguments + temporaries at most 70 GB (yes), 80 GB (marginal).
4. Measured peak (``--measure-peak STRATEGY``, a subprocess): the host's resident-set peak during
   one real step of model 2 at dp 8 (``/proc/self/clear_refs`` resets VmHWM before the step)
   against the sum over the 8 simulated devices of ``memory_analysis``'s temporaries and outputs not
   aliased to inputs: an approximation of how well the analysis tracks what a step allocates.

Memory on CPU is XLA:CPU's buffer assignment; XLA:GPU assigns buffers differently.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DEVICES, MICROBATCHES = 8, 4
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
GB, MIB = 1e9, 2**20

# (flags, vocabulary) of the models; the smoke run replaces each by a tiny one.
MEMORY_MODEL = (["--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12",
                 "--seq-length", "1024"], 50304)
TIMING_MODEL = (["--num-layers", "6", "--hidden-size", "384", "--num-attention-heads", "6",
                 "--seq-length", "128"], 8192)
SMOKE_MODEL = (["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32"], 256)
LLAMA = ["--normalization", "RMSNorm", "--swiglu", "--group-query-attention", "--position-embedding-type", "rope",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--bf16", "--scan-layers"]
PLAN_MODELS = {
    "Llama-3-8B": (["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
                    "--num-query-groups", "8", "--ffn-hidden-size", "14336"], 128256),
    "Llama-3-70B": (["--num-layers", "80", "--hidden-size", "8192", "--num-attention-heads", "64",
                     "--num-query-groups", "8", "--ffn-hidden-size", "28672"], 128256),
    "tiny-llama": (["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "8",
                    "--num-query-groups", "8", "--ffn-hidden-size", "256"], 1024),
}
# name: (tp, dp, strategy)
LAYOUTS = {"tp8 optim": (8, 1, "optim"), "fsdp8": (1, 8, "optim_grads_params"),
           "fsdp64": (1, 64, "optim_grads_params"), "tp8 x fsdp8": (8, 8, "optim_grads_params"),
           "tp2 x fsdp4": (2, 4, "optim_grads_params")}


def _plan_rows(smoke: bool) -> list[dict]:
    """The planning table's rows, a reduced cross product (each compile takes 20-40 s on 2 cores):
    Llama-3-8B at sequence 4096 and 8192 in every layout without and with full recompute, selective
    recompute for fsdp8 only; Llama-3-70B at 4096 in every layout without and with full recompute,
    at 8192 with full recompute for the 64-device layouts only."""
    def row(model, layout, seq, recompute):
        return {"model": model, "layout": layout, "seq": seq, "recompute": recompute}

    if smoke:
        return [row("tiny-llama", "tp8 optim", 64, "none"), row("tiny-llama", "fsdp8", 64, "full"),
                row("tiny-llama", "tp2 x fsdp4", 64, "none")]
    big = ("tp8 optim", "fsdp8", "fsdp64", "tp8 x fsdp8")
    rows = [row("Llama-3-8B", lay, seq, rec) for seq in (4096, 8192) for rec in ("none", "full") for lay in big]
    rows += [row("Llama-3-8B", "fsdp8", seq, "selective") for seq in (4096, 8192)]
    rows += [row("Llama-3-70B", lay, 4096, rec) for rec in ("none", "full") for lay in big]
    rows += [row("Llama-3-70B", lay, 8192, "full") for lay in ("fsdp64", "tp8 x fsdp8")]
    return rows


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (every variant once a round)")
    p.add_argument("--bucket-size", type=int, default=2_000_000,
                   help="elements per bucket of the bucketed variants (about one layer of the timed GPT)")
    p.add_argument("--out", default=None, help="also write the report to this markdown file")
    p.add_argument("--smoke", action="store_true", help="tiny models, dp 1/2/8, one round, a tiny planning model")
    p.add_argument("--parts", default="1,2,3,4", help="which parts to run (comma-separated; default all)")
    p.add_argument("--planning", type=int, default=None, help=argparse.SUPPRESS)  # subprocess: N devices
    p.add_argument("--rows", default=None, help=argparse.SUPPRESS)  # subprocess: JSON rows
    p.add_argument("--measure-peak", default=None, help=argparse.SUPPRESS)  # subprocess: strategy
    return p.parse_args()


def _build(flags: list[str], vocab: int, *, tp: int = 1, dp: int, strategy: str, microbatches: int,
           bucket_size: int | None = None, abstract: bool = True):
    """(step, params, opt_state, batch, n_params) of a GPT under one layout and strategy; abstract:
    ``ShapeDtypeStruct`` params, state and batch with their shardings."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from core import parallel_state as ps
    from core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
    from core.megatron_fsdp import fully_shard
    from core.models.gpt import GPTModel
    from core.optimizer.optimizer_config import OptimizerConfig
    from core.training.arguments import model_config, parse_args
    from core.training.train_step import make_train_step

    flags = list(flags) + ["--tensor-model-parallel-size", str(tp)] + (["--sequence-parallel"] if tp > 1 else [])
    if "--scan-layers" not in flags:
        flags.append("--scan-layers")
    args = parse_args(flags)
    state = ps.build_parallel_state(tp, 1, devices=jax.devices()[:tp * dp])
    model = GPTModel(model_config(args, vocab), state)
    ddp, optimizer = fully_shard(model, OptimizerConfig(lr=3e-4, clip_grad=1.0), state=state,
                                 zero_dp_strategy=strategy,
                                 ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                                          bucket_size=bucket_size))
    seq = args.seq_length
    params = ddp.init(jax.random.key(0), jnp.zeros((1, seq), jnp.int32), abstract=abstract)
    opt_state = optimizer.init_state(params)
    global_batch = dp * microbatches
    if abstract:
        sharding = NamedSharding(ddp.mesh, P("dp"))
        batch = {k: jax.ShapeDtypeStruct((global_batch, seq), jnp.int32, sharding=sharding)
                 for k in ("tokens", "labels")}
    else:
        tokens = np.random.default_rng(0).integers(0, vocab, (global_batch, seq), np.int32)
        batch = ddp.shard_batch({"tokens": tokens, "labels": np.roll(tokens, -1, axis=1)})
    n_params = sum(x.size for x in jax.tree.leaves(params))
    return make_train_step(ddp, optimizer, model.loss_fn, microbatches), params, opt_state, batch, n_params


def _analysis(compiled) -> dict:
    """Per-device bytes from ``memory_analysis``: arguments, temporaries, outputs not aliased to
    arguments, their sum (arguments + temporaries) and XLA's ``peak_memory_in_bytes`` if present."""
    m = compiled.memory_analysis()
    out = {"argument": m.argument_size_in_bytes, "temp": m.temp_size_in_bytes,
           "output_not_aliased": m.output_size_in_bytes - m.alias_size_in_bytes}
    out["sum"] = out["argument"] + out["temp"]
    out["peak"] = getattr(m, "peak_memory_in_bytes", None)
    return out


def _compile_memory(step, params, opt_state, batch) -> tuple[dict, float]:
    start = time.perf_counter()
    compiled = step.lower(params, opt_state, batch).compile()
    return _analysis(compiled), time.perf_counter() - start


def _peak(value) -> str:
    return "—" if value is None else f"{value / MIB:.1f}"


# Part 1 -------------------------------------------------------------------------------------


def memory_table(model, dps) -> list[str]:
    """Per-device memory of every strategy at every dp (abstract: nothing allocated)."""
    lines, n_params = [], None
    rows = []
    for dp in dps:
        for strategy in STRATEGIES:
            step, params, opt_state, batch, n_params = _build(*model, dp=dp, strategy=strategy,
                                                               microbatches=MICROBATCHES)
            mem, seconds = _compile_memory(step, params, opt_state, batch)
            rows.append(f"| {dp} | {strategy} | {mem['argument'] / MIB:.1f} | {mem['temp'] / MIB:.1f} | "
                        f"{mem['sum'] / MIB:.1f} | {_peak(mem['peak'])} | {seconds:.0f} |")
            print(rows[-1], flush=True)
    lines += [f"GPT {n_params / 1e6:.1f}M params ({_describe(model)}), {MICROBATCHES} microbatches of one sample "
              "per rank, fp32 params and Adam state, fp32 grad reduction; per device, MiB\n",
              "| dp | strategy | arguments | temporaries | arguments + temporaries (peak estimate) | "
              "XLA peak_memory_in_bytes | compile s |", "|---|---|---|---|---|---|---|", *rows, ""]
    return lines


def _describe(model) -> str:
    flags, vocab = model
    get = lambda name: flags[flags.index(name) + 1]
    return (f"{get('--num-layers')} layers, hidden {get('--hidden-size')}, {get('--num-attention-heads')} heads, "
            f"sequence {get('--seq-length')}, vocabulary {vocab}")


# Part 2 -------------------------------------------------------------------------------------


def timing_table(model, rounds: int, bucket_size: int | None) -> list[str]:
    """Step time of every strategy at dp 8, round-robin, with the compiled memory (and ``optim`` /
    ``optim_grads`` with buckets of ``bucket_size`` elements unless it is None)."""
    import jax

    names = [(s, None) for s in STRATEGIES]
    if bucket_size:
        names += [("optim", bucket_size), ("optim_grads", bucket_size)]
    variants, memory, n_params = {}, {}, None
    for name in names:
        step, params, opt_state, batch, n_params = _build(*model, dp=DEVICES, strategy=name[0],
                                                           microbatches=MICROBATCHES, bucket_size=name[1],
                                                           abstract=False)
        compiled = step.lower(params, opt_state, batch).compile()  # timed below: one compile per variant
        variants[name] = [compiled, params, opt_state, batch]
        memory[name] = _analysis(compiled)
    times: dict = {name: [] for name in names}
    for i in range(rounds + 2):
        for name, v in variants.items():
            step, params, opt_state, batch = v
            start = time.perf_counter()
            params, opt_state, metrics = step(params, opt_state, batch)
            float(metrics["loss"])
            jax.block_until_ready((params, opt_state))
            if i >= 2:  # compile and warm-up
                times[name].append(time.perf_counter() - start)
            v[1], v[2] = params, opt_state
    medians = {name: statistics.median(t) for name, t in times.items()}
    rows = []
    for strategy, bucket in names:
        base = medians["optim", bucket]
        mem = memory[strategy, bucket]
        buckets = "one per buffer" if bucket is None else f"{bucket:,} elements"
        rows.append(f"| {strategy} | {buckets} | {mem['argument'] / MIB:.2f} | {mem['temp'] / MIB:.2f} | "
                    f"{mem['sum'] / MIB:.2f} | {1e3 * medians[strategy, bucket]:.0f} | "
                    f"{medians[strategy, bucket] / base:.2f} |")
    ratio = medians["optim_grads_params", None] / medians["optim", None]
    verdict = "meets" if ratio <= 1.2 else "misses"
    return [f"GPT {n_params / 1e6:.1f}M params ({_describe(model)}), dp {DEVICES}, {MICROBATCHES} microbatches of "
            f"one sample per rank; median of {rounds} rounds (variants called round-robin); memory per device, "
            "MiB\n", "| strategy | buckets | arguments | temporaries | arguments + temporaries | step ms | "
            "/ optim (same buckets) |", "|---|---|---|---|---|---|---|", *rows, "",
            f"optim_grads_params / optim step time: **{ratio:.2f}x** ({verdict} the target of at most 1.2x).", ""]


# Part 3 -------------------------------------------------------------------------------------


def plan_rows_in_process(rows: list[dict]) -> None:
    """Compile each planning row (this process has the devices) and print one ``PLAN`` JSON line."""
    for row in rows:
        flags, vocab = PLAN_MODELS[row["model"]]
        tp, dp, strategy = LAYOUTS[row["layout"]]
        flags = flags + LLAMA + ["--seq-length", str(row["seq"])]
        if row["recompute"] != "none":
            flags += ["--recompute-granularity", row["recompute"]]
        out = dict(row, tp=tp, dp=dp, strategy=strategy)
        try:
            step, params, opt_state, batch, n_params = _build(flags, vocab, tp=tp, dp=dp, strategy=strategy,
                                                               microbatches=1)
            mem, seconds = _compile_memory(step, params, opt_state, batch)
            out.update(mem, params=n_params, compile_s=seconds)
        except Exception as e:  # noqa: BLE001 - a row that fails is reported, not fatal
            out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        print("PLAN " + json.dumps(out), flush=True)


def planning_table(rows: list[dict]) -> list[str]:
    """Run the planning rows in one subprocess per device count and format the table."""
    results = []
    for devices in sorted({LAYOUTS[r["layout"]][0] * LAYOUTS[r["layout"]][1] for r in rows}):
        mine = [r for r in rows if LAYOUTS[r["layout"]][0] * LAYOUTS[r["layout"]][1] == devices]
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        env.pop("JAX_NUM_CPU_DEVICES", None)
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--planning", str(devices), "--rows",
                               json.dumps(mine)], capture_output=True, text=True, env=env, cwd=ROOT)
        got = [json.loads(line[5:]) for line in proc.stdout.splitlines() if line.startswith("PLAN ")]
        if proc.returncode != 0 or len(got) != len(mine):
            tail = (proc.stdout + proc.stderr)[-2000:]
            raise RuntimeError(f"planning on {devices} devices failed (exit {proc.returncode}):\n{tail}")
        results += got
    lines = ["| model | layout | devices | strategy | seq | recompute | arguments GB | temporaries GB | "
             "arguments + temporaries GB | fits 80 GB | compile s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (list(PLAN_MODELS).index(r["model"]), r["seq"],
                                            list(LAYOUTS).index(r["layout"]),
                                            ("none", "selective", "full").index(r["recompute"]))):
        head = (f"| {r['model']} | {r['layout']} | {r['tp'] * r['dp']} | {r['strategy']} | {r['seq']} | "
                f"{r['recompute']} |")
        if "error" in r:
            lines.append(f"{head} failed: {r['error']} | | | | |")
            continue
        fits = "yes" if r["sum"] <= 70 * GB else ("marginal" if r["sum"] <= 80 * GB else "no")
        lines.append(f"{head} {r['argument'] / GB:.1f} | {r['temp'] / GB:.1f} | {r['sum'] / GB:.1f} | {fits} | "
                     f"{r['compile_s']:.0f} |")
    params = {r["model"]: r["params"] for r in results if "params" in r}
    lines += ["", "Parameters (unpadded vocabulary 128256 padded to 128 x tp): "
              + ", ".join(f"{m} {n / 1e9:.2f}B" for m, n in params.items()) + ".", ""]
    print("\n".join(lines), flush=True)
    return lines, results


# Part 4 -------------------------------------------------------------------------------------


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def measure_peak_in_process(model, strategy: str) -> None:
    """One real step at dp 8: VmHWM reset right before it, the resident-set peak above the
    resident set before the step, against ``memory_analysis`` summed over the devices."""
    import jax

    rss0 = _status_kib("VmRSS")
    step, params, opt_state, batch, _ = _build(*model, dp=DEVICES, strategy=strategy, microbatches=MICROBATCHES,
                                               abstract=False)
    jax.block_until_ready((params, opt_state, batch))
    rss_args = _status_kib("VmRSS") - rss0
    compiled = step.lower(params, opt_state, batch).compile()
    mem = _analysis(compiled)
    deltas = []
    for _ in range(2):  # the first execution, then a second one (malloc may reuse the first one's memory)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current resident set
        before = _status_kib("VmRSS")
        params, opt_state, metrics = compiled(params, opt_state, batch)
        jax.block_until_ready((params, opt_state, metrics))
        deltas.append(1024 * (_status_kib("VmHWM") - before))
    print("PEAK " + json.dumps({"strategy": strategy, "measured_first": deltas[0], "measured_second": deltas[1],
                                "rss_after_init": 1024 * rss_args, **mem}), flush=True)


def peak_table(strategies) -> list[str]:
    rows = []
    for strategy in strategies:
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        env.pop("JAX_NUM_CPU_DEVICES", None)
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--measure-peak", strategy]
                              + (["--smoke"] if "--smoke" in sys.argv else []),
                              capture_output=True, text=True, env=env, cwd=ROOT)
        got = [json.loads(line[5:]) for line in proc.stdout.splitlines() if line.startswith("PEAK ")]
        if proc.returncode != 0 or not got:
            raise RuntimeError(f"peak measurement of {strategy} failed:\n{(proc.stdout + proc.stderr)[-2000:]}")
        r = got[0]
        est = DEVICES * (r["temp"] + r["output_not_aliased"])
        rows.append(f"| {strategy} | {DEVICES * r['argument'] / MIB:.1f} | {r['rss_after_init'] / MIB:.1f} | "
                    f"{est / MIB:.1f} | {r['measured_first'] / MIB:.1f} | {r['measured_second'] / MIB:.1f} | "
                    f"{r['measured_first'] / est:.2f} |")
        print(rows[-1], flush=True)
    return ["| strategy | 8 x arguments MiB | resident-set growth while creating params, state, batch MiB | "
            "8 x (temporaries + unaliased outputs) MiB | step's resident-set peak above its start, first step MiB | "
            "same, second step MiB | first / estimate |", "|---|---|---|---|---|---|---|", *rows, ""]


# -------------------------------------------------------------------------------------------


def main() -> None:
    """Run the parts and print (and with ``--out`` write) the report."""
    a = _args()
    from core.runtime.cpu_devices import configure_cpu_devices

    configure_cpu_devices(a.planning or DEVICES)
    if a.planning:
        plan_rows_in_process(json.loads(a.rows))
        return
    if a.measure_peak:
        measure_peak_in_process(SMOKE_MODEL if a.smoke else TIMING_MODEL, a.measure_peak)
        return
    import jax

    started = time.perf_counter()
    memory_model, timing_model = (SMOKE_MODEL, SMOKE_MODEL) if a.smoke else (MEMORY_MODEL, TIMING_MODEL)
    rounds = 1 if a.smoke else a.rounds
    command = "python " + " ".join(["bench/fsdp.py"] + sys.argv[1:])
    lines = [f"# Megatron-FSDP strategies: memory, step time, planning{' (smoke run)' if a.smoke else ''}", "",
             f"`{command}`; JAX {jax.__version__}, {DEVICES} simulated CPU devices (64 for the 64-device "
             "planning rows). Memory is XLA:CPU's `memory_analysis` of the compiled step (its buffer "
             "assignment; XLA:GPU's will differ), per device.", ""]
    parts = {int(x) for x in a.parts.split(",")}
    if 1 in parts:
        lines += ["## 1. Per-device memory by strategy and dp (abstract: nothing allocated)", ""]
        lines += memory_table(memory_model, (1, 2, 8) if a.smoke else (1, 2, 4, 8))
    if 2 in parts:
        lines += [f"## 2. Step time at dp {DEVICES} against `optim`", ""]
        lines += timing_table(timing_model, rounds, None if a.smoke else a.bucket_size)
    if 3 in parts:
        lines += ["## 3. Planning: Llama-3 shapes, micro-batch 1, abstract" if not a.smoke
                  else "## 3. Planning: tiny Llama-shaped model, micro-batch 1, abstract", ""]
        lines += planning_table(_plan_rows(a.smoke))[0]
    if 4 in parts:
        lines += ["## 4. memory_analysis against a measured resident-set peak (approximation)", ""]
        lines += peak_table(("optim_grads_params",) if a.smoke else ("optim", "optim_grads_params"))
    lines += [f"Whole run: {time.perf_counter() - started:.0f} s.", ""]
    print("\n".join(lines))
    if a.out:  # a failure or a signal leaves an earlier report intact
        from core.atomic_files import write_atomically

        write_atomically(a.out, lambda f: f.write("\n".join(lines) + "\n"), mode="w")


if __name__ == "__main__":
    main()
