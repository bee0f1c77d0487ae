"""What a training run prints and records: Megatron-like log lines, a progress bar, a metrics
file, and the peak memory per device (rank 0 writes)."""

from __future__ import annotations

import json
import resource
import sys
from typing import Any, TextIO

import jax


def memory_per_device_bytes() -> int:
    """Peak memory of this process's first device: XLA's allocator stats on GPU, else the
    process's peak resident set divided by its local devices (CPU has no device allocator)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"])
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    return rss // max(1, jax.local_device_count())


def _moe_text(record: dict[str, Any]) -> str:
    """`` | moe aux loss: ... | moe z loss: ... | expert load max/mean: ...`` when the record has them."""
    if "moe_aux_loss" not in record:
        return ""
    load = ", ".join(f"{v:.2f}" for v in record["moe_expert_load"])
    return (f" | moe aux loss: {record['moe_aux_loss']:.6E} | moe z loss: {record['moe_z_loss']:.6E} | "
            f"expert load max/mean: [{load}]")


class TrainingLogger:
    """Rank-0 output of a run: progress bar, log lines, JSON metrics (other ranks stay silent)."""

    def __init__(self, total_iters: int, start_iter: int, metrics_file: str | None, progress_bar: bool,
                 stream: TextIO | None = None):
        self.is_writer = jax.process_index() == 0
        self.stream = stream or sys.stdout
        self.metrics = open(metrics_file, "a") if (metrics_file and self.is_writer) else None
        self.bar = None
        if self.is_writer and progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total_iters, initial=start_iter, desc="training", unit="it", file=sys.stderr,
                            dynamic_ncols=True, leave=False)

    def print(self, line: str) -> None:
        """One line on rank 0 (written around the progress bar)."""
        if not self.is_writer:
            return
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def advance(self) -> None:
        """Tick the progress bar (one iteration dispatched)."""
        if self.bar is not None:
            self.bar.update(1)

    def set_loss(self, loss: float) -> None:
        """Show the latest loss read back on the progress bar."""
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)

    def log_iteration(self, record: dict[str, Any], train_iters: int) -> None:
        """A Megatron-style line for one logged iteration, and its JSON record."""
        r = record
        self.print(
            f" iteration {r['iteration']:8d}/{train_iters:8d} | consumed samples: {r['consumed_samples']:10d} | "
            f"elapsed time per iteration (ms): {1000 * r['step_time_s']:.1f} | learning rate: {r['lr']:.6E} | "
            f"lm loss: {r['loss']:.6E} | grad norm: {r['grad_norm']:.3f} | tokens/s: {r['tokens_per_sec']:.0f} | "
            f"model TFLOP/s/device: {r['tflops_per_device']:.4f} | MFU: {100 * r['mfu']:.1f}% | "
            f"mem/device (MiB): {r['memory_per_device_bytes'] / 2**20:.0f}" + _moe_text(r))
        self.write_metrics(record)

    def write_metrics(self, record: dict[str, Any]) -> None:
        """Append one JSON object to the metrics file."""
        if self.metrics is not None:
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()

    def close(self) -> None:
        """Close the bar and the metrics file."""
        if self.bar is not None:
            self.bar.close()
        if self.metrics is not None:
            self.metrics.close()
