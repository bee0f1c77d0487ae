"""Summarise a ``jax.profiler`` trace (``--profile``'s ``*.xplane.pb``) into the table a
performance review starts from: device time per category (matmuls, attention, collectives,
copies, elementwise/fusions), the idle share of the traced window (host gaps), the top ops and,
with the step's optimized HLO (``--hlo``), the source of each op and the time per source.

``python -m core.training.profile_summary TRACE_DIR`` prints it (markdown). On a GPU the device
planes' kernel events are counted (``/device:GPU:N``, stream lines); on the CPU the XLA thunks of
the host plane (events with an ``hlo_op``).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys

CATEGORIES = ("matmul", "attention", "collective", "copy/transpose", "elementwise/fusion", "other")
"""Categories in report order."""

_RULES = (  # first match wins; names are lower-cased kernel names and HLO op names
    ("attention", ("sdpa", "fmha", "flash", "cudnn", "attention")),
    ("collective", ("nccl", "all-reduce", "all_reduce", "all-gather", "all_gather", "reduce-scatter",
                    "reduce_scatter", "all-to-all", "all_to_all", "collective-permute", "collective_permute")),
    ("matmul", ("gemm", "xmma", "nvjet", "cutlass", "wgmma", "cublas", "dot", "matmul", "ragged")),
    ("copy/transpose", ("copy", "transpose", "memcpy", "memset", "dynamic-update-slice", "dynamic_update_slice")),
    ("elementwise/fusion", ("fusion", "reduce", "loop_", "input_", "triton", "convert", "add", "multiply",
                            "select", "broadcast", "exp", "log", "tanh", "scatter", "gather", "concatenate")),
)


def categorize(name: str, hlo_op: str = "") -> str:
    """The category of a device event from its kernel name and HLO op (``CATEGORIES``)."""
    for text in (name.lower(), hlo_op.lower()):
        for category, needles in _RULES:
            if any(n in text for n in needles):
                return category
    return "other"


_HLO_OP = re.compile(r'^\s*(?:ROOT )?%([\w.\-]+) = [^\n]*?metadata=\{op_name="([^"]*)"', re.M)
_WRAPPER = re.compile(r"^(jit\(.*\)|while|body|eval_jaxpr|jvp\(.*\)|transpose\(.*\)|shard_map|closed_call|"
                      r"checkpoint|remat.*|cond|branch_\d+|pjit|custom_vjp_call.*|custom_jvp_call.*)$")


def source_of(op_name: str) -> str:
    """A readable source of an HLO instruction from its ``op_name`` metadata: JAX's wrapper
    segments (``jit(...)``, ``while/body``, ``jvp(...)``, ...) dropped, the last four kept, and
    ``(bwd)`` when it belongs to the backward (a ``transpose(...)``)."""
    op_name = max(op_name.split(";"), key=len)  # fused ops name several sources: the fullest
    parts = [p for p in op_name.split("/") if p and not _WRAPPER.match(p)]
    return "/".join(parts[-4:]) + (" (bwd)" if "transpose(" in op_name else "")


def hlo_sources(hlo_text: str) -> dict[str, str]:
    """Each instruction of an HLO dump (``XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text``,
    the ``*after_optimizations.txt`` file) by its kernel name (``loop_add_fusion.52`` runs as
    ``loop_add_fusion_52``) to :func:`source_of` its metadata."""
    return {_kernel_key(name): source_of(op) for name, op in _HLO_OP.findall(hlo_text)}


def _kernel_key(name: str) -> str:
    return re.sub(r"_kernel\d*$", "", name.replace(".", "_").replace("-", "_"))


def read_hlo(path: str) -> str:
    """The text of an HLO dump (plain or gzipped)."""
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return f.read()


def trace_file(path: str) -> str:
    """The ``*.xplane.pb`` at ``path``, or the newest one under the directory ``path``."""
    if os.path.isfile(path):
        return path
    files = sorted(glob.glob(os.path.join(path, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    if not files:
        raise FileNotFoundError(f"no *.xplane.pb under {path}")
    return files[-1]


def _device_events(space) -> tuple[list[tuple[str, str, float, float]], str]:
    """``(name, hlo_op, start_ns, duration_ns)`` of the device's op events and where they came from."""
    planes = [p for p in space.planes if p.name.startswith("/device:") and "TPU" not in p.name]
    events, source = [], ""
    for plane in planes[:1]:  # one device: every GPU of a data-parallel step runs the same program
        lines = [ln for ln in plane.lines if ln.name.startswith("Stream")]
        if not lines:
            lines = [ln for ln in plane.lines if ln.name == "XLA Ops"]
        source = f"{plane.name}: " + ", ".join(ln.name for ln in lines)
        for line in lines:
            for e in line.events:
                stats = dict(e.stats)
                events.append((e.name, str(stats.get("hlo_op", "")), e.start_ns, e.duration_ns))
    if events:
        return events, source
    for plane in space.planes:  # the CPU: XLA thunks on the client's threads
        if plane.name == "/host:CPU":
            for line in plane.lines:
                for e in line.events:
                    stats = dict(e.stats)
                    if "hlo_op" in stats:
                        events.append((str(stats["hlo_op"]), str(stats["hlo_op"]), e.start_ns, e.duration_ns))
            source = "/host:CPU: XLA thunks"
    return events, source


def _busy_ns(events: list[tuple[str, str, float, float]]) -> float:
    """Length of the union of the events' intervals (the device is busy when any stream is)."""
    busy, end = 0.0, -1.0
    for _, _, start, duration in sorted(events, key=lambda e: e[2]):
        stop = start + duration
        if stop <= end:
            continue
        busy += stop - max(start, end)
        end = stop
    return busy


def summarize(path: str, steps: int = 1, top: int = 10, hlo_text: str | None = None) -> dict:
    """Device time of the trace at ``path`` (a file or a directory holding one), per ``steps``
    traced steps: ``window_ms`` (first event start to last event end), ``busy_ms`` and
    ``idle_share`` (host gaps), ``categories`` (ms and share of the summed op time) and the
    ``top`` ops by time (name, HLO op, category, count, ms). With the step's optimized HLO
    (``hlo_text``) each op also gets its ``source`` (:func:`hlo_sources`; kernels XLA did not
    name after an instruction, such as cuBLAS's, get none) and ``sources`` sums the time per
    source (the ``top`` largest)."""
    from jax.profiler import ProfileData

    trace = trace_file(path)
    events, source = _device_events(ProfileData.from_file(trace))
    if not events:
        raise ValueError(f"{trace}: no device op events found")
    window = max(s + d for _, _, s, d in events) - min(s for _, _, s, _ in events)
    busy = _busy_ns(events)
    total = sum(d for *_, d in events)
    per_op: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for name, hlo_op, _, duration in events:
        entry = per_op[(name, hlo_op)]
        entry[0] += 1
        entry[1] += duration
    category = {op: categorize(*op) for op in per_op}
    per_cat: dict[str, float] = collections.defaultdict(float)
    for op, (_, t) in per_op.items():
        per_cat[category[op]] += t
    ms = lambda ns: ns / 1e6 / steps
    ops = sorted(per_op.items(), key=lambda kv: -kv[1][1])[:top]
    sources = hlo_sources(hlo_text) if hlo_text else {}
    source_of_op = lambda n, h: sources.get(_kernel_key(n)) or sources.get(_kernel_key(h), "")
    summary = {"trace": trace, "source": source, "steps": steps, "events": len(events), "window_ms": ms(window),
               "busy_ms": ms(busy), "idle_share": 1 - busy / window if window else 0.0, "op_ms": ms(total),
               "categories": {c: {"ms": ms(per_cat[c]), "share": per_cat[c] / total}
                              for c in CATEGORIES if per_cat[c]},
               "top": [{"name": n[:90], "hlo_op": h[:60], "category": category[(n, h)], "count": c // steps,
                        "ms": ms(t), "share": t / total, "source": source_of_op(n, h)} for (n, h), (c, t) in ops]}
    if sources:
        per_source: dict[str, float] = collections.defaultdict(float)
        for (n, h), (_, t) in per_op.items():
            per_source[source_of_op(n, h) or f"({category[(n, h)]}: no HLO name)"] += t
        summary["sources"] = [{"source": k, "ms": ms(t), "share": t / total}
                              for k, t in sorted(per_source.items(), key=lambda kv: -kv[1])[:top]]
    return summary


def markdown(summary: dict) -> str:
    """The summary as two markdown tables (categories; top ops)."""
    s = summary
    lines = [f"Trace: {s['steps']} step(s), {s['events']} device events ({s['source']}); per step: window "
             f"{s['window_ms']:.1f} ms, device busy {s['busy_ms']:.1f} ms, "
             f"idle (host gaps) {100 * s['idle_share']:.1f}%, "
             f"summed op time {s['op_ms']:.1f} ms.", "", "| category | ms/step | share of op time |", "|---|---|---|"]
    lines += [f"| {c} | {v['ms']:.2f} | {100 * v['share']:.1f}% |" for c, v in s["categories"].items()]
    lines += ["", "| op (kernel) | HLO op | category | count/step | ms/step | share | source |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| `{t['name']}` | `{t['hlo_op']}` | {t['category']} | {t['count']} | {t['ms']:.2f} | "
              f"{100 * t['share']:.1f}% | {t['source']} |" for t in s["top"]]
    if s.get("sources"):
        lines += ["", "| source (HLO op metadata) | ms/step | share |", "|---|---|---|"]
        lines += [f"| {t['source']} | {t['ms']:.2f} | {100 * t['share']:.1f}% |" for t in s["sources"]]
    return "\n".join(lines)


def describe_planes(path: str, top: int = 5) -> str:
    """Every plane and line of the trace with its event count and summed ms, and the ``top``
    events of each line by time: the raw view, for a trace whose layout the summary misreads."""
    from jax.profiler import ProfileData

    out = []
    for plane in ProfileData.from_file(trace_file(path)).planes:
        out.append(f"plane {plane.name}")
        for line in plane.lines:
            events = [(e.name, e.duration_ns, sorted(dict(e.stats))) for e in line.events]
            if not events:
                continue
            out.append(f"  line {line.name}: {len(events)} events, {sum(e[1] for e in events) / 1e6:.2f} ms")
            per_name: dict[str, float] = collections.defaultdict(float)
            for name, duration, _ in events:
                per_name[name] += duration
            for name, duration in sorted(per_name.items(), key=lambda kv: -kv[1])[:top]:
                out.append(f"    {duration / 1e6:9.2f} ms  {name[:100]}")
            out.append(f"    stats: {events[0][2][:12]}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """CLI: print the markdown summary of a trace (``--json`` for the dict)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="a *.xplane.pb file or a directory holding one (--profile-dir)")
    p.add_argument("--steps", type=int, default=1, help="steps the trace holds (per-step figures)")
    p.add_argument("--top", type=int, default=10, help="ops listed")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--raw", action="store_true", help="print every plane and line of the trace instead")
    p.add_argument("--hlo", default=None, help="the step's optimized HLO dump (text or .gz): each op's source")
    a = p.parse_args(argv)
    if a.raw:
        print(describe_planes(a.trace))
        return 0
    summary = summarize(a.trace, a.steps, a.top, read_hlo(a.hlo) if a.hlo else None)
    print(json.dumps(summary) if a.json else markdown(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
