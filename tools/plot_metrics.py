"""Loss curves as a picture, without a server: one or more ``--metrics-file`` JSONL files of
``launch/pretrain.py`` rendered to one PNG.

    python tools/plot_metrics.py run.jsonl -o loss.png
    python tools/plot_metrics.py tp2pp2.jsonl tp1pp4.jsonl --labels "tp2 pp2" "tp1 pp4" -o layouts.png

Three panels against the iteration: the training loss (solid) with the validation loss (dashed,
markers) where the file has it, the learning rate, and the throughput in tokens/s (iteration 1,
which includes compilation, left out). Every run is one colour in every panel. A file a resumed
run appended to holds some iterations twice: the last record of an iteration wins.
The PNG is written under a temporary name and renamed into place. Needs matplotlib
(``pip install matplotlib``); without it the tool says so in one line and exits with code 2.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from core.atomic_files import write_atomically  # noqa: E402
from core.training.metric_writers import is_installed, missing_package_message  # noqa: E402

PANELS = (("loss", "lm loss"), ("lr", "learning rate"), ("tokens_per_sec", "tokens/s"))
"""(record key, axis title) of each panel, top to bottom."""


def read_metrics(path: str) -> list[dict[str, Any]]:
    """The records of a metrics file, one per iteration (the last one of a repeated iteration), in
    iteration order; ``ValueError`` naming the file and line for one that is not JSON."""
    by_iteration: dict[int, dict[str, Any]] = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not a JSON object ({e.msg})") from None
            if isinstance(record, dict) and "iteration" in record:
                by_iteration[int(record["iteration"])] = record
    if not by_iteration:
        raise ValueError(f"{path}: no metrics records (a --metrics-file of launch/pretrain.py has one per logged "
                         "iteration)")
    return [by_iteration[i] for i in sorted(by_iteration)]


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    points = [(r["iteration"], r[key]) for r in records if key in r]
    if key == "tokens_per_sec":  # iteration 1's time is mostly compilation
        points = [p for p in points if p[0] != 1]
    return [p[0] for p in points], [p[1] for p in points]


def plot_runs(runs: Sequence[tuple[str, list[dict[str, Any]]]], title: str | None = None):
    """A matplotlib figure of ``runs`` (label, records): the panels of :data:`PANELS`, one line
    per run in each (plus one dashed validation line per run that has validation losses)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 7.5), dpi=100, layout="constrained")
    axes = fig.subplots(len(PANELS), 1, sharex=True)
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    for n, (label, records) in enumerate(runs):
        color = colors[n % len(colors)]
        for ax, (key, _) in zip(axes, PANELS):
            xs, ys = _series(records, key)
            if xs:
                ax.plot(xs, ys, color=color, linewidth=1.2, label=label if key != "loss" else f"{label} train")
        xs, ys = _series(records, "valid_loss")
        if xs:
            axes[0].plot(xs, ys, color=color, linestyle="--", marker="o", markersize=3, label=f"{label} validation")
    for ax, (_, name) in zip(axes, PANELS):
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize="small")
    axes[-1].set_xlabel("iteration")
    axes[1].ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    if title:
        fig.suptitle(title)
    return fig


def save_png(fig, path: str) -> None:
    """Write ``fig`` to ``path`` as a PNG, atomically (temporary name, then renamed)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    write_atomically(path, lambda f: f.write(buffer.getvalue()))


def main(argv: list[str] | None = None) -> int:
    """Parse, read, plot, write; returns the exit code (2 with one ``error:`` line for bad input)."""
    p = argparse.ArgumentParser(description="Render launch/pretrain.py metrics files (JSONL) to a PNG.")
    p.add_argument("metrics", nargs="+", help="metrics files (--metrics-file), one run each")
    p.add_argument("-o", "--output", default="metrics.png", help="the PNG to write")
    p.add_argument("--labels", nargs="+", default=None, help="a legend label per file (default: the file names)")
    p.add_argument("--title", default=None, help="a title over the panels")
    args = p.parse_args(argv)
    try:
        if not is_installed("matplotlib"):
            raise ValueError(missing_package_message("matplotlib", "tools/plot_metrics.py"))
        labels = args.labels or [os.path.splitext(os.path.basename(m))[0] for m in args.metrics]
        if len(labels) != len(args.metrics):
            raise ValueError(f"--labels gives {len(labels)} labels for {len(args.metrics)} metrics files")
        runs = [(label, read_metrics(path)) for label, path in zip(labels, args.metrics)]
        save_png(plot_runs(runs, args.title), args.output)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
