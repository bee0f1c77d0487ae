"""``core.runtime.cpu_malloc``: which settings are applied, and the one-time re-exec in a real process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from core.runtime.cpu_malloc import (
    KEEP_FREED_TUNABLES,
    OPT_OUT_VAR,
    XLA_HEAP_FLAG,
    is_glibc_linux,
    malloc_settings_update,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SCRIPT = f"""
import json, os, sys
sys.path.insert(0, {ROOT!r})
print("start", flush=True)
from core.runtime.cpu_malloc import reexec_with_malloc_settings
reexec_with_malloc_settings()
print(json.dumps({{"argv": sys.argv[1:], "tunables": os.environ.get("GLIBC_TUNABLES"),
                  "xla_flags": os.environ.get("XLA_FLAGS")}}))
"""


KEEP = ":".join(KEEP_FREED_TUNABLES)


def test_update_adds_tunables_and_the_xla_heap_flag():
    assert malloc_settings_update({}) == {"GLIBC_TUNABLES": KEEP, "XLA_FLAGS": XLA_HEAP_FLAG}
    assert "arena_max" not in KEEP  # every thread keeps its own arena
    for tunable in ("glibc.malloc.mmap_max=0", "hugetlb=1", "glibc.malloc.trim_threshold=68719476736",
                    "glibc.malloc.top_pad=67108864"):
        assert tunable in KEEP


def test_update_without_the_heap_split():
    """Short runs with the compilation cache: tunables only (XLA cannot cache a split program)."""
    assert malloc_settings_update({}, split_heaps=False) == {"GLIBC_TUNABLES": KEEP}


def test_update_adds_the_xla_heap_flag_to_the_users_flags():
    update = malloc_settings_update({"XLA_FLAGS": "--xla_cpu_foo=1", "GLIBC_TUNABLES": KEEP})
    assert update == {"XLA_FLAGS": f"--xla_cpu_foo=1 {XLA_HEAP_FLAG}"}
    mine = "--xla_multiheap_size_constraint_per_heap=-1"
    assert malloc_settings_update({"XLA_FLAGS": mine, "GLIBC_TUNABLES": KEEP}) == {}


def test_update_keeps_user_tunables_and_respects_opt_out():
    other = "glibc.malloc.tcache_count=100"
    flag = {"XLA_FLAGS": XLA_HEAP_FLAG}
    assert malloc_settings_update({"GLIBC_TUNABLES": other}) == {"GLIBC_TUNABLES": f"{other}:{KEEP}", **flag}
    mine = "glibc.malloc.hugetlb=0:glibc.malloc.mmap_max=65536"
    assert malloc_settings_update({"GLIBC_TUNABLES": mine})["GLIBC_TUNABLES"].split(":") == [
        "glibc.malloc.hugetlb=0", "glibc.malloc.mmap_max=65536", *KEEP_FREED_TUNABLES[2:]]
    assert malloc_settings_update({"GLIBC_TUNABLES": KEEP, **flag}) == {}
    # a user's arena count is kept alongside the settings
    update = malloc_settings_update({"GLIBC_TUNABLES": "glibc.malloc.arena_max=1", **flag})
    assert update == {"GLIBC_TUNABLES": f"glibc.malloc.arena_max=1:{KEEP}"}
    assert malloc_settings_update({OPT_OUT_VAR: "0"}) == {}


def _run(tmp_path, extra_env: dict[str, str]) -> tuple[list[str], dict]:
    script = tmp_path / "child.py"
    script.write_text(_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "XLA_FLAGS", OPT_OUT_VAR)}
    env.update(extra_env)
    out = subprocess.run([sys.executable, "-u", str(script), "--flag", "a b"], env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout.splitlines()
    return out[:-1], json.loads(out[-1])


@pytest.mark.skipif(not is_glibc_linux(), reason="glibc only")
def test_reexec_applies_settings_once_and_keeps_arguments(tmp_path):
    before, result = _run(tmp_path, {})
    assert before == ["start", "start"]  # ran twice: the original and the re-executed image
    assert result["argv"] == ["--flag", "a b"]
    assert result["tunables"] == KEEP and result["xla_flags"] == XLA_HEAP_FLAG


def test_reexec_skipped_off_the_cpu(tmp_path):
    """A run JAX will start on a GPU keeps glibc's defaults and gets no XLA heap flag."""
    before, result = _run(tmp_path, {"JAX_PLATFORMS": "cuda"})
    assert before == ["start"] and result["tunables"] is None and result["xla_flags"] is None


def test_reexec_skipped_when_opted_out_or_already_set(tmp_path):
    before, result = _run(tmp_path, {OPT_OUT_VAR: "0"})
    assert before == ["start"] and result["tunables"] is None and result["xla_flags"] is None
    before, result = _run(tmp_path, {"GLIBC_TUNABLES": KEEP})  # only the XLA flag missing: no re-exec
    assert before == ["start"] and result["tunables"] == KEEP and result["xla_flags"] == XLA_HEAP_FLAG
