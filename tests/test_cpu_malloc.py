"""``core.cpu_malloc``: which settings are applied, and the one-time re-exec in a real process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from core.cpu_malloc import OPT_OUT_VAR, TUNABLE, is_glibc_linux, malloc_settings_update

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SCRIPT = f"""
import json, os, sys
sys.path.insert(0, {ROOT!r})
print("start", flush=True)
from core.cpu_malloc import reexec_with_malloc_settings
reexec_with_malloc_settings()
print(json.dumps({{"argv": sys.argv[1:], "tunables": os.environ.get("GLIBC_TUNABLES")}}))
"""


def test_update_adds_tunable_keeps_user_tunables_and_respects_opt_out():
    assert malloc_settings_update({}) == {"GLIBC_TUNABLES": TUNABLE}
    other = "glibc.malloc.arena_max=2"
    assert malloc_settings_update({"GLIBC_TUNABLES": other}) == {"GLIBC_TUNABLES": f"{other}:{TUNABLE}"}
    assert malloc_settings_update({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) == {}
    assert malloc_settings_update({OPT_OUT_VAR: "0"}) == {}


def _run(tmp_path, extra_env: dict[str, str]) -> tuple[list[str], dict]:
    script = tmp_path / "child.py"
    script.write_text(_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", OPT_OUT_VAR)}
    env.update(extra_env)
    out = subprocess.run([sys.executable, "-u", str(script), "--flag", "a b"], env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout.splitlines()
    return out[:-1], json.loads(out[-1])


@pytest.mark.skipif(not is_glibc_linux(), reason="glibc only")
def test_reexec_applies_settings_once_and_keeps_arguments(tmp_path):
    before, result = _run(tmp_path, {})
    assert before == ["start", "start"]  # ran twice: the original and the re-executed image
    assert result["argv"] == ["--flag", "a b"]
    assert result["tunables"] == TUNABLE


def test_reexec_skipped_when_opted_out_or_already_set(tmp_path):
    before, result = _run(tmp_path, {OPT_OUT_VAR: "0"})
    assert before == ["start"] and result["tunables"] is None
    before, result = _run(tmp_path, {"GLIBC_TUNABLES": TUNABLE})
    assert before == ["start"] and result["tunables"] == TUNABLE
