"""How many JAX devices a CPU process exposes: one per core of its share of the host.

XLA's CPU runtime runs one program's operations mostly one after another: large matmuls use
every core, but the many small ops of a training step (attention blocks, LayerNorms, slices)
keep only part of them busy. Several CPU devices in one process run their programs side by side,
so a process that owns k cores trains faster as k data-parallel devices (each device's share of
the batch, gradients all-reduced inside the process) than as one device
(``bench/results/2026-11-cpu-tuning.md``, CPU devices). The results do not change (data
parallelism is layout-invariant), only the speed.

:func:`cpu_devices_per_process` chooses the count before JAX starts (``JAX_NUM_CPU_DEVICES``
when the user set it), :func:`configure_cpu_devices` applies it. Nothing changes when JAX will
run on an accelerator: only the CPU backend reads the setting.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from core.runtime.cpu_threads import threads_per_process
from core.runtime.jax_backend import jax_runs_on_cpu

ENV_VAR = "JAX_NUM_CPU_DEVICES"
"""JAX's own variable for ``jax_num_cpu_devices``; when set, the user's count is kept."""


def cpu_devices_per_process(fits: Callable[[int], bool] = lambda n: True) -> int:
    """The CPU devices this process should expose.

    ``JAX_NUM_CPU_DEVICES`` when set; 1 when JAX will not run on the CPU; otherwise the largest
    ``n`` up to this process's cores (its share of the host, :func:`threads_per_process`) for
    which ``fits(n)`` holds (the training layout must divide), and 1 when none does.
    """
    if os.environ.get(ENV_VAR):
        return int(os.environ[ENV_VAR])
    if not jax_runs_on_cpu():
        return 1
    return next((n for n in range(threads_per_process(), 1, -1) if fits(n)), 1)


def configure_cpu_devices(n: int) -> None:
    """Make JAX's CPU backend expose ``n`` devices in this process (before it starts; nothing is
    set when JAX will not run on the CPU)."""
    if not jax_runs_on_cpu():
        return
    os.environ[ENV_VAR] = str(n)
    import sys

    if "jax" in sys.modules:  # JAX read the variable at import: update its config as well
        sys.modules["jax"].config.update("jax_num_cpu_devices", n)
