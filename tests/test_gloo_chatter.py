"""gloo's connection lines kept off stdout (core/runtime/gloo_chatter.py): the filter drops exactly
those lines, forwards the rest at once (partial lines too), and drains what a process wrote before
``os._exit``. The launcher's own run is checked in tests/test_pretrain_cli.py."""

import os
import select
import subprocess
import sys
import time
from pathlib import Path

from spawn_env import spawn_env

from core.runtime.gloo_chatter import FILTER_SOURCE

ROOT = Path(__file__).resolve().parents[1]
CHATTER = b"[Gloo] Rank 0 is connected to 7 peer ranks. Expected number of connected peer ranks is : 7\n"


def _filter():
    return subprocess.Popen([sys.executable, "-I", "-S", "-c", FILTER_SOURCE], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)


def _read_within(proc, seconds=10.0) -> bytes:
    ready, _, _ = select.select([proc.stdout], [], [], seconds)
    return os.read(proc.stdout.fileno(), 65536) if ready else b""


def test_the_filter_drops_only_the_connection_lines_whatever_the_chunks():
    proc = _filter()
    pieces = [b"> 8 processes\n", CHATTER[:3], CHATTER[3:20], CHATTER[20:] + b" iteration 1 |",
              b" loss 5.4\n[Gloo] something else\n", CHATTER + b"[Glo", b"bal] not gloo\n", b"[", b"x\n",
              CHATTER, b"> done\n"]
    for piece in pieces:
        proc.stdin.write(piece)
        proc.stdin.flush()
        time.sleep(0.02)
    out, _ = proc.communicate(timeout=30)
    assert out == b"> 8 processes\n iteration 1 | loss 5.4\n[Gloo] something else\n[Global] not gloo\n[x\n> done\n"


def test_a_partial_line_is_forwarded_before_its_newline():
    proc = _filter()
    try:
        proc.stdin.write(b" iteration 1/10 |")
        proc.stdin.flush()
        assert _read_within(proc) == b" iteration 1/10 |"
        proc.stdin.write(b"\n[Gl")  # a line that could still be chatter: held until it cannot
        proc.stdin.flush()
        assert _read_within(proc) == b"\n"
        assert _read_within(proc, 0.3) == b""
        proc.stdin.write(b"ue]\n")
        proc.stdin.flush()
        assert _read_within(proc) == b"[Glue]\n"
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


PROGRAM = """
import os, sys
from core.runtime.gloo_chatter import filter_gloo_chatter
print(filter_gloo_chatter(), flush=True)
os.write(1, {chatter!r})
print("after", end="")
sys.stdout.flush()
os._exit(0)
"""


def test_a_process_behind_the_filter_loses_nothing_at_os_exit_and_the_setting_keeps_the_lines():
    program = PROGRAM.format(chatter=CHATTER)
    quiet = subprocess.run([sys.executable, "-c", program], capture_output=True, env=spawn_env(), cwd=ROOT,
                           timeout=60)
    assert quiet.stdout == b"True\nafter", quiet.stderr
    loud = subprocess.run([sys.executable, "-c", program], capture_output=True, cwd=ROOT, timeout=60,
                          env=spawn_env(MCJ_GLOO_LOGS="1"))
    assert loud.stdout == b"False\n" + CHATTER + b"after", loud.stderr
