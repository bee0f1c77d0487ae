"""The launch path's persistent compilation cache (core/training/compilation_cache.py)."""

import subprocess
import sys
from pathlib import Path

from spawn_env import spawn_env

from core.training import compilation_cache

ROOT = Path(__file__).resolve().parents[1]


def test_default_directory(monkeypatch):
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/x/y")
    assert compilation_cache.default_cache_dir() == "/x/y"
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "/c")
    assert compilation_cache.default_cache_dir() == "/c/megatron_core_jax/jax"


def test_cpu_isa_fingerprint_is_stable():
    a, b = compilation_cache.cpu_isa_fingerprint(), compilation_cache.cpu_isa_fingerprint()
    assert a == b and len(a.split()) == 2


def _launch(cache_dir, n=2, share=False):
    env = spawn_env()
    out = subprocess.run(["mpirun", "--oversubscribe", "-n", str(n), sys.executable, str(ROOT / "tests" / "cache_probe.py"),
                          str(cache_dir), *(["share"] if share else [])], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return sorted(line for line in out.stdout.splitlines() if line.endswith(("hit", "miss")))


def test_every_process_of_a_second_cpu_launch_reads_the_cache(tmp_path):
    """Process 0 writes the entries; in the next launch every process finds them (JAX's own CPU
    key differs per process, so processes other than 0 used to compile everything again)."""
    assert _launch(tmp_path)[0] == "0 compiled miss"  # (process 1 may find what process 0 just wrote)
    assert _launch(tmp_path) == ["0 received hit", "1 received hit"]


def test_shared_programs_compile_once_per_job(tmp_path):
    """With sharing on a cold cache, process 0 compiles the SPMD program and process 1 receives the
    binary (JAX's ``jax_share_binary_between_hosts``: through the key-value store, or from the
    cache when process 0 has written it by then) instead of compiling it too."""
    assert [line.split()[:2] for line in _launch(tmp_path, share=True)] == [["0", "compiled"], ["1", "received"]]
