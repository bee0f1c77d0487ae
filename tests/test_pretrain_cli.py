"""``launch/pretrain.py`` as users run it: ``mpirun -n N python launch/pretrain.py ...``.

Real processes (spawned from the single-process level): the default run learns, bad input
fails fast with one line from rank 0, a killed run resumes with identical losses, NaN stops.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from spawn_env import spawn_env

ROOT = Path(__file__).resolve().parents[1]
PRETRAIN = str(ROOT / "launch" / "pretrain.py")
SMALL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--no-progress-bar", "--log-interval", "1",
         "--eval-interval", "1000"]


def _env():
    # These jobs train for tens of iterations: their time is running programs, not compiling them,
    # and XLA's optimizations (which tests/run.sh turns off for the rest of the suite) pay here.
    return spawn_env(XLA_FLAGS="--xla_cpu_multi_thread_eigen=false", JAX_DISABLE_MOST_OPTIMIZATIONS="0")


def _mpirun(n):
    return ["mpirun", "--oversubscribe", "-x", "XLA_FLAGS", "-n", str(n), sys.executable, PRETRAIN]


def _run(n, flags, timeout=600):
    return subprocess.run(_mpirun(n) + flags, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=ROOT)


def _session_pids(sid):
    """The live (not zombie) processes of session ``sid``."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] not in ("Z", "X"):  # fields 3 and 6 of /proc/PID/stat: state, session
            pids.append(int(stat.parent.name))
    return pids


def _kill_session(sid):
    """SIGKILL every process of session ``sid`` (mpirun and the ranks it forked, which it puts in
    their own process groups, so ``killpg`` alone would leave them running)."""
    for pid in _session_pids(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _losses(path):
    return {r["iteration"]: r["loss"] for r in map(json.loads, Path(path).read_text().splitlines()) if "loss" in r}


def test_help_lists_megatron_flags():
    out = subprocess.run([sys.executable, PRETRAIN, "--help"], capture_output=True, text=True, env=_env()).stdout
    for flag in ["--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                 "--virtual-pipeline-model-parallel-size", "--sequence-parallel", "--use-distributed-optimizer",
                 "--overlap-grad-reduce", "--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length",
                 "--micro-batch-size", "--global-batch-size", "--train-iters", "--lr", "--min-lr",
                 "--lr-warmup-iters", "--lr-decay-style", "--weight-decay", "--clip-grad", "--seed", "--bf16",
                 "--data-path", "--save", "--load", "--save-interval", "--no-load-optim", "--no-save-optim",
                 "--finetune", "--ckpt-step", "--exit-on-missing-checkpoint", "--exit-interval",
                 "--exit-duration-in-mins", "--exit-signal-handler", "--exit-signal", "--eval-interval", "--eval-iters",
                 "--log-interval", "--metrics-file", "--normalization", "--swiglu", "--group-query-attention",
                 "--num-query-groups", "--disable-bias-linear", "--rotary-base", "--rotary-percent",
                 "--attention-dropout", "--hidden-dropout", "--init-method-std", "--make-vocab-size-divisible-by",
                 "--use-rope-scaling", "--rope-scaling-factor", "--kv-channels", "--add-qkv-bias", "--qk-layernorm",
                 "--tensorboard-dir", "--tensorboard-log-interval", "--tensorboard-queue-size",
                 "--log-timers-to-tensorboard", "--log-memory-to-tensorboard", "--log-validation-ppl-to-tensorboard",
                 "--no-log-learning-rate-to-tensorboard", "--no-log-loss-scale-to-tensorboard", "--wandb-project",
                 "--wandb-exp-name", "--wandb-save-dir", "--timing-log-level", "--timing-log-option"]:
        assert flag in out


@pytest.mark.parametrize("flags,message", [
    (["--tensor-model-parallel-size", "3"], "world size 8 is not divisible by tensor-model-parallel-size 3"),
    (["--data-path", "/nonexistent/corpus.txt"], "--data-path /nonexistent/corpus.txt: no such file or directory"),
    (["--ffn-hidden-size", "0"], "--ffn-hidden-size must be >= 1, got 0"),
], ids=["world", "data", "ffn"])  # each spawns 8 processes; the other checks run in-process (test_model_arguments.py)
def test_bad_input_one_line_nonzero_exit_fast(flags, message):
    start = time.monotonic()
    result = _run(8, flags, timeout=120)
    assert time.monotonic() - start < 60
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr  # rank 0 only
    assert message in errors[0]
    assert "Traceback" not in result.stderr + result.stdout


def test_default_run_learns_below_unigram_entropy(tmp_path):
    """The default job (tp=2, pp=2, dp=2 under mpirun -n 8, 100 iterations)."""
    metrics = tmp_path / "metrics.jsonl"
    result = _run(8, ["--metrics-file", str(metrics), "--no-progress-bar"], timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "layout tp=2 pp=2 dp=2" in result.stdout
    assert "[Gloo]" not in result.stdout
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    for key in ["iteration", "loss", "lr", "grad_norm", "tokens_per_sec", "step_time_s"]:
        assert key in records[-1]
    assert records[-1]["iteration"] == 100
    entropy = float(result.stdout.split("unigram entropy ")[-1].split()[0])
    valid = [r["valid_loss"] for r in records if "valid_loss" in r]
    assert valid[-1] < entropy - 0.5, (valid, entropy)
    assert records[-1]["loss"] < entropy - 0.3


def _rank_pids(sid):
    """The training processes (not mpirun / prterun) of session ``sid``."""
    pids = []
    for pid in _session_pids(sid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if PRETRAIN.encode() in cmdline and b"python" in os.path.basename(cmdline[0]):
            pids.append(pid)
    return pids


KILL_FLAGS = SMALL + ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "1",
                      "--use-distributed-optimizer", "--train-iters", "12"]
# CI runs trial 0; MCJ_KILL_TRIALS=20 runs twenty (each about 1.5 min on 2 cores).
KILL_TRIALS = range(int(os.environ.get("MCJ_KILL_TRIALS", "1")))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    path = tmp_path_factory.mktemp("full") / "full.jsonl"
    full = _run(4, KILL_FLAGS + ["--metrics-file", str(path)])
    assert full.returncode == 0, full.stderr[-3000:]
    return _losses(path)


@pytest.mark.parametrize("trial", KILL_TRIALS)
def test_killed_rank_stops_the_job_and_the_run_resumes_with_identical_losses(tmp_path, uninterrupted, trial):
    """SIGKILL one rank of an --async-save run (trial 0: rank 3 right after the first checkpoint;
    others: a random rank, after a random checkpoint plus up to 2 s, so some land mid-step or
    mid-save): the other ranks are gone within 60 s with a message naming the dead one, the
    checkpoint writer processes within 10 s more (none outlives its rank), no step
    directory is left half-written, and --load continues the uninterrupted curve bit for bit."""
    rng = random.Random(trial)
    after_step, delay, victim = (3, 0.0, 3) if trial == 0 else (rng.choice((3, 6)), rng.uniform(0, 2), rng.randrange(4))
    flags = KILL_FLAGS + ["--save-interval", "3"]
    ckpt, log = tmp_path / "ckpt", open(tmp_path / "killed.log", "w")
    proc = subprocess.Popen(_mpirun(4) + flags + ["--save", str(ckpt), "--async-save",
                                                  "--metrics-file", str(tmp_path / "a.jsonl")],
                            env=_env(), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 600
    while not (ckpt / str(after_step) / "commit_success.txt").exists() and proc.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(delay)
    ranks = sorted(_rank_pids(proc.pid))
    if proc.poll() is None:
        assert len(ranks) == 4, ranks
        killed_at = time.monotonic()
        os.kill(ranks[victim], signal.SIGKILL)
        try:
            rc = proc.wait(timeout=60)
            stopped = time.monotonic()
            while _session_pids(proc.pid) and time.monotonic() - stopped < 10:
                time.sleep(0.1)
            left = _session_pids(proc.pid)  # checkpoint writer processes included
        finally:
            _kill_session(proc.pid)
        assert rc != 0 and time.monotonic() - killed_at < 60
        assert not left, f"processes outlived the job: {left}"
        assert "signal 9" in " ".join((tmp_path / "killed.log").read_text().split())
    else:  # the run ended before the kill (possible for late random points)
        assert proc.returncode == 0
    steps = [d for d in ckpt.iterdir() if d.name.isdigit()]
    assert steps and all((d / "commit_success.txt").exists() for d in steps), steps  # only complete ones
    resumed = _run(4, flags + ["--save", str(ckpt), "--load", str(ckpt), "--metrics-file", str(tmp_path / "b.jsonl")])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    if "resumed from" not in resumed.stdout:  # nothing was left to do
        assert proc.returncode == 0
        return
    start = int(resumed.stdout.split("resumed from")[1].split("iteration")[1].split()[0])
    assert start in (3, 6, 9, 12), start
    after = _losses(tmp_path / "b.jsonl")
    assert sorted(after) == list(range(start + 1, 13))
    assert {i: uninterrupted[i] for i in after} == after  # bit-identical


def test_nan_loss_stops_and_keeps_last_checkpoint(tmp_path):
    from core.checkpointing import latest_step

    ckpt = tmp_path / "ckpt"
    result = _run(2, SMALL + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1",
                              "--lr", "1e30", "--lr-warmup-iters", "0", "--train-iters", "10", "--save", str(ckpt),
                              "--save-interval", "1"])
    assert result.returncode == 3
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "iteration 2: loss is nan" in errors[0], result.stderr
    assert latest_step(str(ckpt)) == 1


def test_layout_follows_the_devices_not_the_processes(tmp_path):
    """2 processes x 4 devices each (as one host with 2 ranks of 4 GPUs): the world is the 8
    devices, the defaults give tp=2 pp=2 dp=2 and the run trains with the layout it prints; the
    coordinator port comes from JAX_COORDINATOR_PORT; gloo's connection lines are not printed."""
    metrics = tmp_path / "m.jsonl"
    cmd = ["mpirun", "--oversubscribe", "-x", "XLA_FLAGS", "-x", "JAX_NUM_CPU_DEVICES=4", "-x",
           "JAX_COORDINATOR_PORT=47213", "-n", "2", sys.executable, PRETRAIN]
    result = subprocess.run(cmd + SMALL + ["--train-iters", "3", "--metrics-file", str(metrics)], capture_output=True,
                            text=True, timeout=600, env=_env(), cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 processes, 8 cpu devices, layout tp=2 pp=2 dp=2, 2 microbatches of 2" in result.stdout
    assert "[Gloo]" not in result.stdout + result.stderr  # gloo's connection lines (core/runtime/gloo_chatter.py)
    assert sorted(_losses(metrics)) == [1, 2, 3]


def test_bf16_run_learns(tmp_path):
    """``--bf16`` end to end on the CPU (bf16 compute, fp32 params and optimizer): the loss falls."""
    metrics = tmp_path / "m.jsonl"
    flags = SMALL + ["--bf16", "--train-iters", "30", "--lr", "3e-3", "--metrics-file", str(metrics)]
    result = subprocess.run([sys.executable, PRETRAIN, *flags], capture_output=True, text=True, timeout=600,
                            env=_env(), cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "bf16 2048^2 matmul, measured" in result.stdout  # MFU against the compute dtype's peak
    losses = _losses(metrics)
    assert len(losses) == 30 and losses[30] < losses[1] - 1.0, losses


@pytest.mark.parametrize("user_devices", [None, "1"])
def test_plain_python_single_process(tmp_path, user_devices):
    """``python launch/pretrain.py`` (no mpirun): one process, tp=pp=1, one CPU device per core
    (as many as the default global batch of 16 divides), or the user's JAX_NUM_CPU_DEVICES."""
    metrics = tmp_path / "m.jsonl"
    env = _env() if user_devices is None else dict(_env(), JAX_NUM_CPU_DEVICES=user_devices)
    (tmp_path / "ckpt" / "4").mkdir(parents=True)  # an interrupted save: no commit marker
    flags = ["--train-iters", "5", "--log-interval", "5", "--metrics-file", str(metrics), "--load", str(tmp_path / "ckpt")]
    result = subprocess.run([sys.executable, PRETRAIN, *flags], capture_output=True, text=True, timeout=300, env=env,
                            cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (f"WARNING: --load {tmp_path / 'ckpt'}: no complete checkpoint (skipped incomplete step directories [4]: "
            "no commit_success.txt); starting from random initialization") in result.stdout
    cores = len(os.sched_getaffinity(0))
    devices = int(user_devices or max(n for n in range(1, cores + 1) if 16 % (4 * n) == 0))
    assert f"1 processes, {devices} cpu devices, layout tp=1 pp=1 dp={devices}" in result.stdout
    assert sorted(_losses(metrics)) == [1, 5]  # logged at iteration 1 and every --log-interval
    if user_devices is not None:  # Megatron's --exit-on-missing-checkpoint: the same --load is an error instead
        result = subprocess.run([sys.executable, PRETRAIN, *flags, "--exit-on-missing-checkpoint"], capture_output=True,
                                text=True, timeout=300, env=env, cwd=ROOT)
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert (f"error: --load {tmp_path / 'ckpt'}: no complete checkpoint (skipped incomplete step directories "
                "[4]: no commit_success.txt) (--exit-on-missing-checkpoint)") in result.stderr.splitlines()


def _catches(pid, signum):
    """Whether process ``pid`` has a handler installed for ``signum`` (``SigCgt`` in /proc/PID/status)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(mask >> (signum - 1) & 1)


def test_sigterm_to_one_rank_saves_and_stops_every_rank_and_the_run_resumes(tmp_path, uninterrupted):
    """Megatron's --exit-signal-handler under mpirun, the signal sent to rank 2 only (a scheduler
    signals every rank, maybe not at once): every rank stops at the same iteration, the checkpoint
    there is committed (by the writer processes, which the job's signals must not end), the job
    exits 0, and --load continues the uninterrupted curve bit for bit."""
    ckpt = tmp_path / "ckpt"
    flags = KILL_FLAGS + ["--save", str(ckpt), "--async-save", "--exit-signal-handler",
                          "--metrics-file", str(tmp_path / "a.jsonl")]
    with open(tmp_path / "run.log", "w") as log:
        proc = subprocess.Popen(_mpirun(4) + flags, env=_env(), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        ranks = []  # SIGTERM is caught once jax.distributed is initialized (JAX's preemption service)
        while (len(ranks) < 4 or not all(_catches(pid, signal.SIGTERM) for pid in ranks)) and proc.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.05)
            ranks = sorted(_rank_pids(proc.pid))
        assert proc.poll() is None and len(ranks) == 4, (tmp_path / "run.log").read_text()[-3000:]
        os.kill(ranks[2], signal.SIGTERM)
        rc = proc.wait(timeout=120)
        left = _session_pids(proc.pid)
    finally:
        _kill_session(proc.pid)
    out = (tmp_path / "run.log").read_text()
    assert rc == 0, out[-3000:]
    assert not left, f"processes outlived the job: {left}"
    stopped = int(out.split("> exiting at iteration ")[1].split(":")[0])
    assert f"> exiting at iteration {stopped}: SIGTERM received (--exit-signal-handler); checkpoint {stopped} " \
           f"saved to {ckpt}" in out
    assert stopped < 12 and [int(d.name) for d in ckpt.iterdir() if d.name.isdigit()] == [stopped]
    resumed = _run(4, KILL_FLAGS + ["--save", str(ckpt), "--load", str(ckpt), "--metrics-file",
                                    str(tmp_path / "b.jsonl")])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = _losses(tmp_path / "b.jsonl")
    assert sorted(after) == list(range(stopped + 1, 13))
    assert {i: uninterrupted[i] for i in after} == after  # bit-identical
