"""Which backend JAX will run on, answered before JAX starts.

The CPU-only settings (``core/runtime/cpu_malloc.py``, ``core/runtime/cpu_threads.py``, ``core/runtime/cpu_devices.py``)
must be applied before JAX starts its backend, and only when that backend is the CPU: a malloc
that never returns memory, a heap-split XLA flag or narrowed thread affinity would change a GPU
run. The answer comes from the environment and the device nodes, not from JAX:

* ``JAX_PLATFORMS`` (or the older ``JAX_PLATFORM_NAME``) set: its first platform decides;
* otherwise JAX picks an accelerator when its plugin is installed and a device is visible:
  NVIDIA (``/dev/nvidia<N>`` nodes, minus ``CUDA_VISIBLE_DEVICES=""``/``-1``), AMD
  (``/dev/kfd``, minus ``ROCR_VISIBLE_DEVICES``/``HIP_VISIBLE_DEVICES`` empty) or TPU
  (``libtpu`` and ``/dev/accel<N>`` or ``/dev/vfio``); else the CPU.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from collections.abc import Mapping

_HIDDEN = ("", "-1")  # CUDA_VISIBLE_DEVICES values that hide every GPU


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def visible_nvidia_gpus(environ: Mapping[str, str] | None = None) -> int:
    """NVIDIA GPUs this process may use: ``CUDA_VISIBLE_DEVICES``'s entries when set, else the
    ``/dev/nvidia<N>`` device nodes (0 on a machine without the driver)."""
    environ = os.environ if environ is None else environ
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    nodes = len(glob.glob("/dev/nvidia[0-9]*"))
    if visible is None:
        return nodes
    if visible.strip() in _HIDDEN or not nodes:
        return 0
    return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])


def _amd_gpu_visible(environ: Mapping[str, str]) -> bool:
    hidden = any(environ.get(var, "x").strip() in _HIDDEN for var in ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"))
    return os.path.exists("/dev/kfd") and not hidden


def _tpu_visible() -> bool:
    return bool(glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"))


def accelerator_visible(environ: Mapping[str, str] | None = None) -> bool:
    """Whether JAX would find an accelerator: its plugin installed and one of its devices visible."""
    environ = os.environ if environ is None else environ
    gpu_plugin = _installed("jax_plugins")
    if gpu_plugin and (visible_nvidia_gpus(environ) > 0 or _amd_gpu_visible(environ)):
        return True
    return _installed("libtpu") and _tpu_visible()


def jax_runs_on_cpu(environ: Mapping[str, str] | None = None) -> bool:
    """Whether JAX will pick its CPU backend (see the module docstring). Does not start JAX."""
    environ = os.environ if environ is None else environ
    platforms = (environ.get("JAX_PLATFORMS") or environ.get("JAX_PLATFORM_NAME") or "").strip()
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    return not accelerator_visible(environ)
