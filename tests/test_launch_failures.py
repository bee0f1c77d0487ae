"""How ``launch/pretrain.py`` ends a job that fails, as users run it: under ``mpirun -n 4`` with
the failure on one rank only (``tests/fail_one_rank.py`` injects it) while the others are in a
collective, at a barrier or still setting up, and in one process on a full disk.

Every case: one ``error:`` line naming what failed (and the rank, when it is not rank 0), the
exit code of its kind, no Python traceback, no native dump from the other ranks (the JAX
coordination client's fatal errors when rank 0 left first), and the job over within seconds.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from spawn_env import spawn_env

from core import checkpointing
from core.runtime.jax_backend import visible_nvidia_gpus

ROOT = Path(__file__).resolve().parents[1]
PRETRAIN = str(ROOT / "launch" / "pretrain.py")
INJECT = str(ROOT / "tests" / "fail_one_rank.py")
SMALL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--no-progress-bar", "--log-interval", "1",
         "--eval-interval", "1000", "--train-iters", "6"]
DUMPS = ("Traceback", "Check failure", "Terminating process", "Process received signal", "coordination_service",
         "Fatal Python error")


def _env():
    return spawn_env(XLA_FLAGS="--xla_cpu_multi_thread_eigen=false")


def _mpirun(script, *args, timeout=180):
    command = ["mpirun", "--oversubscribe", "-x", "XLA_FLAGS", "-n", "4", sys.executable, script, *args]
    start = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=ROOT)
    return result, time.monotonic() - start


def _one_error_line(result):
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, output
    assert not [d for d in DUMPS if d in output], output
    return errors[0]


@pytest.mark.parametrize("rank,where,code,message", [
    (2, "data", 1, "error: rank 2: OSError: [Errno 5] Input/output error: '/data/shard-00007.bin' in iteration 3 "
                   "(--debug prints the traceback)"),
    (0, "memory", 1, "error: MemoryError in iteration 3 (--debug prints the traceback)"),
    (1, "setup", 2, "error: rank 1: --data-path: this rank cannot open its data (injected)"),
    (3, "interrupt", 130, "error: rank 3: interrupted in iteration 3"),
], ids=["data-rank2", "memory-rank0", "setup-rank1", "interrupt-rank3"])
def test_a_failure_on_one_rank_ends_the_job_with_one_line(rank, where, code, message):
    result, seconds = _mpirun(INJECT, str(rank), where, *SMALL)
    assert result.returncode == code, result.stdout + result.stderr
    assert _one_error_line(result) == message
    assert seconds < 90  # compile and two steps, then seconds (it hung until killed before)


def test_an_unwritable_index_cache_ends_the_job_instead_of_hanging(tmp_path):
    """Rank 0 writes the sample-index cache while the others wait at a barrier: its failure used to
    leave them there (and print a 38-line traceback)."""
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i} " * (i % 7 + 3)}) + "\n" for i in range(300)))
    subprocess.run([sys.executable, str(ROOT / "tools" / "preprocess_data.py"), "--input", str(data),
                    "--output-prefix", str(tmp_path / "ds"), "--tokenizer-type", "ByteLevel", "--append-eod"],
                   check=True, capture_output=True, env=_env(), cwd=ROOT)
    (tmp_path / "a-file").write_text("")
    cache = tmp_path / "a-file" / "cache"
    result, seconds = _mpirun(PRETRAIN, *SMALL, "--data-path", str(tmp_path / "ds_text_document"),
                              "--data-cache-path", str(cache))
    assert result.returncode == 2
    assert _one_error_line(result) == (f"error: --data-cache-path {cache}: cannot write the sample-index cache in "
                                       f"{cache}: Not a directory; pass --data-cache-path DIR on a writable "
                                       "filesystem")
    assert seconds < 90


def test_a_layout_error_is_one_line_without_dumps_from_the_other_ranks():
    """Every rank rejects the flags; rank 0 reports and leaves last, so its coordination service
    outlives the other ranks' clients (95-123 lines of their fatal errors before)."""
    result, seconds = _mpirun(PRETRAIN, "--tensor-model-parallel-size", "3")
    assert result.returncode == 2
    assert _one_error_line(result) == ("error: world size 4 is not divisible by tensor-model-parallel-size 3 x "
                                       "pipeline-model-parallel-size 1 = 3")
    assert seconds < 60


# orbax reports a full disk to the caller and again from its threads; see core/checkpointing/orbax_failure_noise.py.
@pytest.mark.parametrize("extra", [(), ("--async-save",)], ids=["sync", "async"])
def test_a_full_disk_is_one_line_and_never_reported_as_saved(tmp_path, extra):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        flags = [*SMALL, "--train-iters", "8", "--save", str(disk / "ckpt"), "--save-interval", "2", *extra]
        result = subprocess.run([sys.executable, PRETRAIN, *flags], capture_output=True, text=True, timeout=300,
                                env=_env(), cwd=ROOT)
        assert result.returncode == 3, result.stdout + result.stderr
        assert result.stderr.count("\n") == 1, result.stderr  # the error line, nothing from orbax's threads
        assert _one_error_line(result).startswith(f"error: cannot write checkpoint 2 to {disk / 'ckpt'}: No space "
                                                  "left on device")
        assert "saved checkpoint" not in result.stdout  # the save never committed
        assert checkpointing.complete_steps(disk / "ckpt") == []
    finally:
        subprocess.run(["umount", "-l", str(disk)])


@pytest.mark.parametrize("flags,env,message", [
    (["--bogus"], {}, "error: unrecognized arguments: --bogus (--help lists the flags)"),
    ([], {"JAX_PLATFORMS": "cuda"}, "error: JAX_PLATFORMS=cuda: JAX cannot start that backend here"),
], ids=["unknown-flag", "jax-platforms-without-the-backend"])
def test_one_process_input_errors_are_one_line(flags, env, message):
    """argparse's usage of 100+ flags is not printed; a JAX_PLATFORMS whose plugin is missing used to
    end in a bare AssertionError traceback from jax.device_count()."""
    if env.get("JAX_PLATFORMS") == "cuda" and visible_nvidia_gpus():
        pytest.skip("this host has a GPU: JAX_PLATFORMS=cuda would train on it")
    result = subprocess.run([sys.executable, PRETRAIN, *flags], capture_output=True, text=True, timeout=120,
                            env={**_env(), **env}, cwd=ROOT)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and _one_error_line(result).startswith(message), result.stderr
