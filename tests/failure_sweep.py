"""A sweep of bad and edge inputs against ``launch/pretrain.py`` and ``tools/preprocess_data.py``,
as a new user would try them: each case runs the command (one process, or ``mpirun -n 4``) and
checks what the user sees and what is left on disk.

    python tests/failure_sweep.py [--only SUBSTRING] [--out DIR]

A case passes when the exit code is the expected one, a failure prints exactly one ``error:``
line (a success none), no Python traceback or native dump reaches the output, the command ends
within its time limit, and the case's own check of the files holds (an earlier dataset or
checkpoint intact, nothing half-written). One line per case, then a summary; exits non-zero if
any case fails. Not part of the suite (about 10 minutes on 2 cores): its pieces are tested there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_launch_failures import DUMPS, INJECT, PRETRAIN, ROOT  # noqa: E402
from test_launch_failures import SMALL as LAUNCH_SMALL  # noqa: E402

PREPROCESS = str(ROOT / "tools" / "preprocess_data.py")
SMALL = [*LAUNCH_SMALL, "--train-iters", "4"]  # argparse keeps the last value


@dataclass
class Case:
    """One input and what it must give."""

    name: str
    """Short name (``--only`` matches it)."""
    command: Callable[[Path], list[str]]
    """The command line, given the case's work directory."""
    code: int
    """The expected exit code (0: the input is fine, or its problem is only a warning)."""
    expect: str = ""
    """Text the output must contain (the error line's gist, or a warning)."""
    setup: Callable[[Path], None] | None = None
    """Prepares the work directory (datasets, checkpoints)."""
    check: Callable[[Path], str | None] | None = None
    """What must hold on disk afterwards: None, or what is wrong."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables."""
    interrupt_after: str | None = None
    """Send SIGINT to the command once its output shows this text (and :attr:`interrupt_delay_s` passed)."""
    interrupt_delay_s: float = 0.0
    """Seconds between that text and the signal."""
    limit_s: float = 120.0
    """The most seconds the command may take."""


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false",
           "JAX_PLATFORMS": "cpu", **extra}
    env.pop("JAX_NUM_CPU_DEVICES", None)
    if os.getuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    if extra.get("JAX_PLATFORMS") == "":
        env.pop("JAX_PLATFORMS")
    return env


def one(*flags: str) -> Callable[[Path], list[str]]:
    """``python launch/pretrain.py SMALL flags`` (``{w}`` in a flag is the work directory)."""
    return lambda w: [sys.executable, PRETRAIN, *SMALL, *(f.format(w=w) for f in flags)]


def mpi(*flags: str, script: str = PRETRAIN, small: bool = True) -> Callable[[Path], list[str]]:
    """The same under ``mpirun -n 4``."""
    return lambda w: ["mpirun", "--oversubscribe", "-x", "XLA_FLAGS", "-n", "4", sys.executable, script,
                      *(SMALL if small else []), *(f.format(w=w) for f in flags)]


def preprocess(*flags: str) -> Callable[[Path], list[str]]:
    """``python tools/preprocess_data.py flags``."""
    return lambda w: [sys.executable, PREPROCESS, *(f.format(w=w) for f in flags)]


def _write_jsonl(path: Path, n: int = 300, bad_line: bytes | None = None) -> None:
    with open(path, "wb") as f:
        for i in range(n):
            f.write((json.dumps({"text": f"document {i} " * (i % 7 + 3)}) + "\n").encode())
        if bad_line is not None:
            f.write(bad_line)


def dataset(w: Path) -> None:
    """A ByteLevel dataset ``w/good_text_document`` from 300 documents, and its fingerprint."""
    _write_jsonl(w / "docs.jsonl")
    subprocess.run([sys.executable, PREPROCESS, "--input", str(w / "docs.jsonl"), "--output-prefix", str(w / "good"),
                    "--tokenizer-type", "ByteLevel", "--append-eod"], check=True, capture_output=True)
    _write_jsonl(w / "bad.jsonl", bad_line=b'{"text": broken\n')
    _write_jsonl(w / "latin1.jsonl", bad_line=b'{"text": "caf\xe9"}\n')
    _write_jsonl(w / "big.jsonl", n=400_000)
    (w / "fingerprint").write_text(json.dumps(_files(w, "good_text_document")))


def _files(w: Path, stem: str) -> dict[str, str]:
    return {p.name: p.read_bytes().hex()[:64] + str(p.stat().st_size) for p in sorted(w.glob(stem + "*"))
            if p.is_file()}


def dataset_intact(w: Path) -> str | None:
    """The dataset made by :func:`dataset` is byte-for-byte as it was, with no temporary files."""
    if _files(w, "good_text_document") != json.loads((w / "fingerprint").read_text()):
        return "the existing dataset changed"
    leftovers = [p.name for p in w.glob(".tmp-*")]
    return f"temporary files left: {leftovers}" if leftovers else None


def checkpoints(*extra: str, iters: int = 4, into: str = "ck") -> Callable[[Path], None]:
    """A run saving every 2 iterations into ``w/ck`` (``extra``: its flags)."""
    def make(w: Path) -> None:
        subprocess.run([sys.executable, PRETRAIN, *SMALL, "--train-iters", str(iters), "--save", str(w / into),
                        "--save-interval", "2", *extra], check=True, capture_output=True, env=_env({}))
        if into == "ck":
            (w / "steps").write_text(json.dumps(sorted(os.listdir(w / "ck"))))
    return make


def steps_kept(w: Path) -> str | None:
    """The checkpoints made by :func:`checkpoints` are all still there."""
    now, before = sorted(os.listdir(w / "ck")), json.loads((w / "steps").read_text())
    missing = [s for s in before if s not in now]
    return f"checkpoints deleted: {missing}" if missing else None


def small_disk(w: Path) -> None:
    """A 300 KiB tmpfs at ``w/disk`` (room for one small checkpoint at most)."""
    (w / "disk").mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", str(w / "disk")], check=True)


def read_only_data(w: Path) -> None:
    """The dataset of :func:`dataset` on a read-only filesystem at ``w/ro``."""
    dataset(w)
    (w / "ro").mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(w / "ro")], check=True)
    for p in w.glob("good_text_document.*"):
        shutil.copy(p, w / "ro" / p.name)
    subprocess.run(["mount", "-o", "remount,ro", str(w / "ro")], check=True)


def nothing_half_written(relative: str) -> Callable[[Path], str | None]:
    """No step directory under ``w/relative`` lacks its commit marker (a failed or interrupted
    save leaves only its temporary directory, which the next save removes)."""
    def check(w: Path) -> str | None:
        ck = w / relative
        if not ck.exists():
            return None
        incomplete = [n for n in os.listdir(ck) if n.isdigit() and not (ck / n / "commit_success.txt").exists()]
        return f"uncommitted step directories: {incomplete}" if incomplete else None
    return check


CASES = [
    # -- flags: values Megatron refuses or that no layout can use ------------------------------------------------
    Case("lr-min-above-lr", one("--lr", "1e-4", "--min-lr", "1e-2"), 2, "--min-lr 0.01 is above --lr 0.0001"),
    Case("warmup-past-decay", one("--lr-warmup-iters", "4", "--lr-decay-iters", "2"), 2,
         "--lr-warmup-iters 4 does not end before the decay"),
    Case("decay-iters-0", one("--lr-decay-iters", "0"), 2, "--lr-decay-iters must be >= 1"),
    Case("negative-lr", one("--lr", "-1"), 2, "--lr must be >= 0"),
    Case("beta1-1", one("--adam-beta1", "1"), 2, "--adam-beta1 must be in [0, 1)"),
    Case("beta2-negative", one("--adam-beta2", "-0.1"), 2, "--adam-beta2 must be in [0, 1)"),
    Case("weight-decay-negative", one("--weight-decay", "-0.1"), 2, "--weight-decay must be >= 0"),
    Case("clip-negative", one("--clip-grad", "-1"), 2, "--clip-grad must be >= 0"),
    Case("lower-lr-alone", one("--lr", "1e-5"), 0, "> done"),
    Case("unknown-flag", one("--bogus"), 2, "unrecognized arguments: --bogus"),
    Case("not-a-number", one("--lr", "abc"), 2, "invalid float value: 'abc'"),
    Case("bad-choice", one("--normalization", "BatchNorm"), 2, "invalid choice: 'BatchNorm'"),
    Case("micro-batch-0", one("--micro-batch-size", "0"), 2, "--micro-batch-size must be >= 1"),
    Case("global-batch-indivisible", one("--global-batch-size", "7"), 2, "global-batch-size 7 is not divisible"),
    Case("heads-indivisible", one("--hidden-size", "30"), 2, "not divisible"),
    Case("layers-vs-pp", one("--num-layers", "3", "--pipeline-model-parallel-size", "2"), 2, "not divisible"),
    Case("train-iters-0", one("--train-iters", "0"), 2, "--train-iters must be >= 1"),
    Case("save-interval-without-save", one("--save-interval", "2"), 2, "--save-interval needs --save DIR"),
    Case("finetune-without-load", one("--finetune"), 2, "--finetune needs --load DIR"),
    Case("spiky-factor-1", one("--spiky-loss-factor", "1"), 2, "--spiky-loss-factor must be > 1"),
    Case("dropout-1", one("--attention-dropout", "1"), 2, "--attention-dropout must be in [0, 1)"),
    Case("experts-vs-ep", one("--num-experts", "3", "--expert-model-parallel-size", "2"), 2, "--num-experts (3)"),
    Case("moe-flag-without-experts", one("--moe-router-topk", "2"), 2, "need --num-experts"),
    Case("cp-indivisible-seq", one("--context-parallel-size", "2", "--seq-length", "30"), 2, "--seq-length 30"),
    Case("profile-steps", one("--profile", "--profile-step-start", "5", "--profile-step-end", "2"), 2,
         "--profile-step-start 5"),
    Case("moe-layer-freq", one("--moe-layer-freq", "every other"), 2, "--moe-layer-freq"),
    # -- data -----------------------------------------------------------------------------------------------------
    Case("data-path-missing", one("--data-path", "{w}/nope"), 2, "no such file or directory"),
    Case("data-path-with-bin", one("--data-path", "{w}/good_text_document.bin"), 2,
         "give the dataset prefix", setup=dataset),
    Case("data-split-empty", one("--data-path", "{w}/good_text_document", "--split", "0,0,0"), 2, "--split",
         setup=dataset),
    Case("data-vocab-too-small", one("--data-path", "{w}/good_text_document", "--tokenizer-type", "NullTokenizer",
                                     "--vocab-size", "10"), 2, "token ids up to", setup=dataset),
    Case("data-truncated-bin", one("--data-path", "{w}/trunc_text_document"), 2, "trunc_text_document",
         setup=lambda w: (dataset(w), shutil.copy(w / "good_text_document.idx", w / "trunc_text_document.idx"),
                          (w / "trunc_text_document.bin").write_bytes(
                              (w / "good_text_document.bin").read_bytes()[:100]))),
    Case("eod-flags-on-text", one("--reset-position-ids"), 2, "need indexed data"),
    Case("data-cache-uncreatable", one("--data-path", "{w}/good_text_document", "--data-cache-path", "{w}/docs.jsonl/c"),
         2, "--data-cache-path", setup=dataset),
    Case("data-read-only-fs", one("--data-path", "{w}/ro/good_text_document"), 2,
         "Read-only file system; pass --data-cache-path", setup=read_only_data),
    Case("tokenizer-model-missing", one("--tokenizer-type", "HuggingFaceTokenizer"), 2, "--tokenizer-model"),
    Case("preprocess-bad-line-keeps-dataset", preprocess("--input", "{w}/bad.jsonl", "--output-prefix", "{w}/good",
                                                        "--tokenizer-type", "ByteLevel"), 1, "bad.jsonl:301",
         setup=dataset, check=dataset_intact),
    Case("preprocess-bad-line-2-workers", preprocess("--input", "{w}/bad.jsonl", "--output-prefix", "{w}/good",
                                                    "--tokenizer-type", "ByteLevel", "--workers", "2"), 1,
         "bad.jsonl:301", setup=dataset, check=dataset_intact),
    Case("preprocess-non-utf8", preprocess("--input", "{w}/latin1.jsonl", "--output-prefix", "{w}/good",
                                           "--tokenizer-type", "ByteLevel"), 1, "latin1.jsonl:301: not UTF-8",
         setup=dataset, check=dataset_intact),
    Case("preprocess-ctrl-c", preprocess("--input", "{w}/big.jsonl", "--output-prefix", "{w}/good",
                                         "--tokenizer-type", "ByteLevel", "--log-interval", "20000", "--workers",
                                         "2"), 130, "interrupted", setup=dataset, check=dataset_intact,
         interrupt_after="Processed 20000"),
    Case("preprocess-unwritable-output", preprocess("--input", "{w}/docs.jsonl", "--output-prefix",
                                                    "{w}/docs.jsonl/x", "--tokenizer-type", "ByteLevel"), 1,
         "is a file, not a directory", setup=dataset),
    Case("preprocess-missing-input", preprocess("--input", "{w}/nope.jsonl", "--output-prefix", "{w}/x",
                                                "--tokenizer-type", "ByteLevel"), 2, "no such file"),
    # -- checkpoints ----------------------------------------------------------------------------------------------
    Case("save-into-other-models-dir", one("--hidden-size", "64", "--train-iters", "6", "--save", "{w}/ck",
                                           "--save-interval", "2"), 2, "of a different model: hidden_size=32 (now 64)",
         setup=checkpoints(), check=steps_kept),
    Case("save-into-another-runs-dir", one("--train-iters", "10", "--load", "{w}/a", "--save", "{w}/ck",
                                           "--save-interval", "2"), 2, "of another run of this model",
         setup=lambda w: (checkpoints()(w), checkpoints(iters=6, into="a")(w)), check=steps_kept),
    Case("load-other-model", one("--hidden-size", "64", "--load", "{w}/ck"), 2, "holds a different model",
         setup=checkpoints()),
    Case("resume-other-seed", one("--train-iters", "6", "--load", "{w}/ck", "--save", "{w}/ck", "--seed", "7"), 2,
         "--seed 7 differs", setup=checkpoints(), check=steps_kept),
    Case("train-iters-reached", one("--load", "{w}/ck", "--save", "{w}/ck"), 0, "nothing to train",
         setup=checkpoints(), check=steps_kept),
    Case("new-run-into-newer-save", one("--train-iters", "2", "--save", "{w}/ck", "--save-interval", "2"), 2,
         "already holds checkpoint 4", setup=checkpoints(), check=steps_kept),
    Case("incomplete-step-named", one("--train-iters", "6", "--load", "{w}/ck", "--save", "{w}/ck",
                                      "--save-interval", "2"), 0, "step directory 6 has no commit marker",
         setup=lambda w: (checkpoints()(w), (w / "ck" / "6").mkdir())),
    Case("ckpt-step-missing", one("--load", "{w}/ck", "--ckpt-step", "3"), 2, "no complete checkpoint 3",
         setup=checkpoints()),
    Case("damaged-checkpoint", one("--load", "{w}/ck", "--train-iters", "6"), 0, "skipped",
         setup=lambda w: (checkpoints()(w), _truncate_largest(w / "ck" / "4"))),
    Case("save-is-a-file", one("--save", "{w}/docs"), 2, "--save", setup=lambda w: (w / "docs").write_text("")),
    Case("exit-on-missing", one("--load", "{w}/none", "--exit-on-missing-checkpoint"), 2, "--exit-on-missing"),
    Case("full-disk-sync", one("--train-iters", "6", "--save", "{w}/disk/ck", "--save-interval", "2"), 3,
         "No space left on device", setup=small_disk, check=nothing_half_written("disk/ck")),
    Case("full-disk-async", one("--train-iters", "8", "--save", "{w}/disk/ck", "--save-interval", "2",
                                "--async-save"), 3, "cannot write checkpoint 2", setup=small_disk,
         check=nothing_half_written("disk/ck")),
    Case("ctrl-c-during-save", one("--hidden-size", "256", "--num-layers", "4", "--train-iters", "40", "--save",
                                   "{w}/ck2", "--save-interval", "2", "--log-interval", "1"), 130,
         "interrupted while saving checkpoint", interrupt_after="iteration        2/", interrupt_delay_s=0.3,
         check=nothing_half_written("ck2")),
    # -- platforms --------------------------------------------------------------------------------------------------
    Case("jax-platforms-cuda", one(), 2, "JAX_PLATFORMS=cuda", env={"JAX_PLATFORMS": "cuda"}),
    Case("jax-platforms-bogus", one(), 2, "JAX_PLATFORMS=bogus", env={"JAX_PLATFORMS": "bogus"}),
    # -- mpirun -n 4 ---------------------------------------------------------------------------------------------
    Case("mpi-tp3", mpi("--tensor-model-parallel-size", "3"), 2, "world size 4 is not divisible"),
    Case("mpi-pp4-2-layers", mpi("--pipeline-model-parallel-size", "4"), 2, "not divisible"),
    Case("mpi-cp3", mpi("--context-parallel-size", "3"), 2, "context-parallel-size 3"),
    Case("mpi-gbs", mpi("--global-batch-size", "6"), 2, "global-batch-size 6 is not divisible"),
    Case("mpi-bad-flag", mpi("--bogus"), 2, "unrecognized arguments"),
    Case("mpi-min-lr", mpi("--lr", "1e-4", "--min-lr", "1e-2"), 2, "--min-lr 0.01 is above"),
    Case("mpi-data-read-only-fs", mpi("--data-path", "{w}/ro/good_text_document"), 2, "Read-only file system",
         setup=read_only_data),
    Case("mpi-rank2-data-oserror", mpi("2", "data", *SMALL, script=INJECT, small=False), 1,
         "error: rank 2: OSError: [Errno 5]"),
    Case("mpi-rank0-memory", mpi("0", "memory", *SMALL, script=INJECT, small=False), 1, "error: MemoryError"),
    Case("mpi-rank1-setup", mpi("1", "setup", *SMALL, script=INJECT, small=False), 2, "error: rank 1:"),
    Case("mpi-rank3-ctrl-c", mpi("3", "interrupt", *SMALL, script=INJECT, small=False), 130, "interrupted"),
    Case("mpi-save-other-model", mpi("--hidden-size", "64", "--save", "{w}/ck", "--save-interval", "2"), 2,
         "of a different model", setup=checkpoints(), check=steps_kept),
]


def _truncate_largest(step_dir: Path) -> None:
    victim = max((p for p in step_dir.rglob("*") if p.is_file() and p.name != "integrity.json"),
                 key=lambda p: p.stat().st_size)
    with open(victim, "r+b") as f:
        f.truncate(1)


def _run(case: Case, w: Path) -> tuple[int, str, float]:
    start = time.monotonic()
    process = subprocess.Popen(case.command(w), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=_env(case.env), cwd=w, start_new_session=True)
    output = []
    try:
        for line in process.stdout:
            output.append(line)
            if case.interrupt_after and case.interrupt_after in line:
                time.sleep(case.interrupt_delay_s)
                os.kill(process.pid, signal.SIGINT)
                case = Case(case.name, case.command, case.code)  # once
            if time.monotonic() - start > case.limit_s:
                break
        process.wait(timeout=max(1.0, case.limit_s - (time.monotonic() - start)))
    except subprocess.TimeoutExpired:
        pass
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return -9, "".join(output), time.monotonic() - start
    return process.returncode, "".join(output), time.monotonic() - start


def verdict(case: Case, code: int, output: str, seconds: float, w: Path) -> str | None:
    """None when the case passes, else what is wrong."""
    if code == -9:
        return f"still running after {case.limit_s:.0f} s (killed)"
    if code != case.code:
        return f"exit code {code}, expected {case.code}"
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    if len(errors) != (1 if case.code else 0):
        return f"{len(errors)} error lines"
    dumps = [d for d in DUMPS if d in output]
    if dumps:
        return f"output holds {dumps}"
    if case.expect and case.expect not in output:
        return f"output lacks {case.expect!r}"
    return case.check(w) if case.check else None


def main() -> int:
    """Run the cases; print one line each and a summary."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="run the cases whose name contains this")
    parser.add_argument("--out", default=None, help="keep each case's work directory and output here")
    args = parser.parse_args()
    failed = 0
    cases = [c for c in CASES if args.only in c.name]
    for case in cases:
        w = Path(tempfile.mkdtemp(prefix=f"sweep-{case.name}-", dir=args.out))
        try:
            if case.setup:
                case.setup(w)
            code, output, seconds = _run(case, w)
            problem = verdict(case, code, output, seconds, w)
            (w / "output.txt").write_text(output)
            error = next((line for line in output.splitlines() if line.startswith("error:")), "")
            print(f"{'ok  ' if problem is None else 'FAIL'} {case.name:36s} exit {code:3d} {seconds:5.1f} s  "
                  f"{problem or error[:110] or case.expect}", flush=True)
            failed += problem is not None
        finally:
            for mount in ("disk", "ro"):
                if (w / mount).is_dir():
                    subprocess.run(["umount", "-l", str(w / mount)], capture_output=True)
            if args.out is None:
                shutil.rmtree(w, ignore_errors=True)
    print(f"{len(cases) - failed} of {len(cases)} cases pass")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
