"""Build, cache and register the C++ CPU kernels in ``csrc/`` as XLA FFI targets.

A kernel source is compiled on first use with the system C++ compiler (``$CXX``, else ``g++``
or ``c++``) against jaxlib's FFI headers, for this CPU (``-march=native``). The library is
cached in ``$MCJ_KERNEL_CACHE``, else ``~/.cache/megatron_core_jax``, else a per-user temp dir,
under a key of the source, the jaxlib version and the CPU's feature flags, and written
atomically, so concurrent ranks may race to build it. Where a kernel cannot be built the
caller falls back to plain XLA ops after one warning.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import jax
import jaxlib

SOURCE_DIR = Path(__file__).parent / "csrc"
"""Where the kernel sources live (shipped as package data)."""

_FLAGS = ("-O3", "-march=native", "-std=c++17", "-fopenmp-simd", "-ffp-contract=fast", "-fPIC", "-shared", "-w")


def _cache_dir() -> Path:
    """``$MCJ_KERNEL_CACHE``, else ``~/.cache/megatron_core_jax``, else a per-user temp dir."""
    configured = os.environ.get("MCJ_KERNEL_CACHE")
    if configured:
        return Path(configured)
    home = Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "megatron_core_jax"
    try:
        home.mkdir(parents=True, exist_ok=True)
        if os.access(home, os.W_OK):
            return home
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"megatron_core_jax-{os.getuid()}"


def _cpu_flags() -> bytes:
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        return b""


def compile_kernel(source: Path, target: Path) -> None:
    """Build ``source`` into the shared library ``target`` atomically; RuntimeError on failure."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++/c++) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    cmd = [compiler, *_FLAGS, f"-I{jax.ffi.include_dir()}", str(source), "-o", tmp]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
        os.chmod(tmp, 0o755)  # mkstemp's 0600 would keep other users of a shared cache out
        os.replace(tmp, target)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"compiling {source.name} failed: {e.stderr[-2000:]}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def register_kernels(source_name: str, targets: tuple[tuple[str, str], ...], switch: str) -> bool:
    """Build (or reuse) ``csrc/<source_name>`` and register each ``(ffi target, symbol)`` pair on
    CPU; False, with one warning, when that is impossible or the env var ``switch`` is ``0``."""
    if os.environ.get(switch, "1") == "0" or not sys.platform.startswith("linux"):
        return False
    source = SOURCE_DIR / source_name
    # -march=native: the build is only valid on this kind of CPU (a shared cache dir may serve
    # several hosts), so the key covers the CPU's feature flags and the build flags too.
    key = hashlib.sha256(source.read_bytes() + jaxlib.__version__.encode() + _cpu_flags()
                         + " ".join(_FLAGS).encode()).hexdigest()[:16]
    target = _cache_dir() / f"{source.stem}_{key}.so"
    try:
        if not target.exists():
            compile_kernel(source, target)
        lib = ctypes.CDLL(str(target))
        for name, symbol in targets:
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:
        warnings.warn(f"{source_name} kernel unavailable, using XLA ops: {e}", stacklevel=3)
        return False
    return True
