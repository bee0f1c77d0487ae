"""JAX's persistent compilation cache for the launch path: a second launch of the same job
loads its compiled programs from disk instead of compiling them again.

On by default in ``launch/pretrain.py`` (``--compilation-cache-dir``, off with
``--no-compilation-cache``). Every program is cached, however fast it compiled (JAX's default
skips those under a second: a start-up compiles dozens of those). The cache is keyed by the
program, the devices, the XLA flags and the jaxlib version, so a changed model, layout or
machine compiles afresh. Only process 0 writes entries (JAX's rule); the others read them.

On the CPU backend JAX's key also holds a topology fingerprint that differs from process to
process, so in a multi-process CPU job no process but 0 would find an entry: each would compile
every program again and keep the others waiting at the first collective, and a warm cache would
gain nothing. For CPU programs :func:`enable_compilation_cache` keys that part
by what the compiled code depends on instead (device count, architecture and CPU feature flags,
so hosts of another ISA do not share entries), the same in every process. GPU keys are JAX's own
(they are process-invariant already).

``share_between_processes`` (multi-process CPU jobs, see :func:`enable_compilation_cache`) goes
one step further for a cold cache: the first process compiles each program that spans
processes and hands the binary to the others through the ``jax.distributed`` key-value store
(JAX's ``jax_share_binary_between_hosts``), instead of every process compiling it at once. On
one host the processes share its cores, so N processes compiling together take about N times
one compile. Measurements: ``bench/results/2026-11-startup-cpu.md``.
"""

from __future__ import annotations

import hashlib
import os
import platform

DEFAULT_DIR_VAR = "JAX_COMPILATION_CACHE_DIR"
"""JAX's own variable for the cache directory; when set it is the default."""


def default_cache_dir() -> str:
    """``$JAX_COMPILATION_CACHE_DIR``, else ``$XDG_CACHE_HOME/megatron_core_jax/jax`` (``~/.cache``)."""
    if os.environ.get(DEFAULT_DIR_VAR):
        return os.environ[DEFAULT_DIR_VAR]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "megatron_core_jax", "jax")


def enable_compilation_cache(directory: str, share_between_processes: bool = False) -> None:
    """Cache every compiled program under ``directory`` (created if missing).

    With ``share_between_processes`` and a multi-process job on the CPU backend, process 0
    compiles each multi-process program and the others receive its binary (module docstring).
    Not on other backends (its effect there is unknown), and not when XLA splits CPU temp
    buffers into heaps: such a program cannot be serialized
    (``core.runtime.cpu_malloc.CACHEABLE_RUN_ITERS``), and the other processes would wait for a
    binary that never comes. Call after ``jax.distributed`` has started.
    """
    import jax

    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _key_cpu_programs_alike_in_every_process()
    if share_between_processes and can_share_cpu_programs():
        jax.config.update("jax_share_binary_between_hosts", True)


def can_share_cpu_programs() -> bool:
    """Whether this job may share compiled programs between processes: several processes, on
    the CPU backend, without XLA's heap split (whose programs do not serialize)."""
    import jax

    from core.runtime.cpu_malloc import XLA_HEAP_FLAG

    heap_flag = XLA_HEAP_FLAG.split("=")[0]
    return (jax.process_count() > 1 and jax.default_backend() == "cpu"
            and heap_flag not in os.environ.get("XLA_FLAGS", ""))


def cpu_isa_fingerprint() -> str:
    """What compiled CPU code depends on: the architecture and the CPU's feature flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return f"{platform.machine()} {hashlib.sha256(flags.encode()).hexdigest()[:16]}"


def _key_cpu_programs_alike_in_every_process() -> None:
    """Replace the per-process topology part of JAX's cache key for CPU programs (see the
    module docstring); other platforms keep JAX's. A no-op where JAX's internals differ."""
    try:
        from jax._src import cache_key
    except ImportError:
        return
    original = getattr(cache_key, "_hash_accelerator_config", None)
    if original is None or getattr(original, "_mcj_cpu_invariant", False):
        return

    def hash_accelerator_config(hash_obj, accelerators):
        devices = list(accelerators.flat)
        if devices and all(d.platform == "cpu" for d in devices):
            hash_obj.update(f"cpu x{len(devices)} {cpu_isa_fingerprint()}".encode())
        else:
            original(hash_obj, accelerators)

    hash_accelerator_config._mcj_cpu_invariant = True
    cache_key._hash_accelerator_config = hash_accelerator_config
