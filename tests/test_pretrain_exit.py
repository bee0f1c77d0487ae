"""Megatron's early exits (one process, 2 simulated devices): ``--exit-signal-handler``,
``--exit-duration-in-mins`` and ``--exit-interval`` save a checkpoint and stop the run at the
iteration where the cause is seen, and the run resumes from that checkpoint with the
uninterrupted losses bit for bit. (Under ``mpirun``, with SIGTERM sent to one rank:
``tests/test_pretrain_cli.py``; the agreement's collective: ``tests/test_exit_conditions_mpi.py``.)"""

import os
import signal

import jax
import pytest
from pretrain_harness import TINY

from core import checkpointing
from core import parallel_state as ps
from core.training.arguments import parse_args, validate_args
from core.training.exit_conditions import DURATION_ELAPSED, SIGNAL_RECEIVED
from core.training.pretrainer import Pretrainer
from core.training.run_config import pretrain_config

ITERS = 8


def _trainer(*extra):
    args = parse_args(TINY + ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
                              "--train-iters", str(ITERS), "--log-interval", "100", *extra])
    layout = validate_args(args, 2)
    return Pretrainer(pretrain_config(args), layout, ps.build_parallel_state(1, 1, devices=jax.devices()[:2]))


@pytest.fixture(scope="module")
def uninterrupted():
    return {r["iteration"]: r["loss"] for r in _trainer("--log-interval", "1").train()}


@pytest.mark.parametrize("exit_signal", ["SIGTERM", "SIGUSR1"])
def test_a_signal_saves_stops_and_the_run_resumes_identically(tmp_path, uninterrupted, exit_signal):
    ckpt = str(tmp_path / "ckpt")
    before = signal.getsignal(getattr(signal, exit_signal))
    a = _trainer("--exit-signal-handler", "--exit-signal", exit_signal, "--save", ckpt, "--log-interval", "1")
    assert signal.getsignal(getattr(signal, exit_signal)) is not before  # caught from the trainer's creation
    dispatch = a.dispatch_step

    def dispatch_and_signal():  # the signal arrives while iteration 3 runs
        pending = dispatch()
        if a.iteration == 3:
            os.kill(os.getpid(), getattr(signal, exit_signal))
        return pending

    a.dispatch_step = dispatch_and_signal
    losses = {r["iteration"]: r["loss"] for r in a.train()}
    assert a.iteration == 3 and a.exit_conditions.reason == SIGNAL_RECEIVED
    assert a.exit_conditions.describe() == f"{exit_signal} received (--exit-signal-handler)"
    assert checkpointing.complete_steps(ckpt) == [3]
    assert signal.getsignal(getattr(signal, exit_signal)) is before  # given back after train()
    b = _trainer("--load", ckpt, "--save", ckpt, "--log-interval", "1")
    assert b.load(ckpt) and b.iteration == 3
    losses.update({r["iteration"]: r["loss"] for r in b.train()})
    assert losses == uninterrupted


def test_the_time_budget_saves_and_stops(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    a = _trainer("--exit-duration-in-mins", "1e-9", "--save", ckpt)
    records = a.train()
    assert a.iteration == 1 and records[-1]["iteration"] == 1  # elapsed before the first check
    assert a.exit_conditions.reason == DURATION_ELAPSED and checkpointing.complete_steps(ckpt) == [1]
    assert "minutes elapsed (--exit-duration-in-mins)" in a.exit_conditions.describe()
    plain = _trainer()  # neither flag: nothing to check, nothing dispatched for it
    assert plain.exit_conditions is None


def test_exit_interval_stops_at_the_next_multiple_and_saves(tmp_path):
    """Megatron's --exit-interval: the next iteration divisible by it, also after a resume."""
    ckpt = str(tmp_path / "ckpt")
    a = _trainer("--exit-interval", "3", "--save", ckpt)
    a.train()
    assert a.iteration == 3 and checkpointing.complete_steps(ckpt) == [3]
    b = _trainer("--exit-interval", "3", "--save", ckpt)
    assert b.load(ckpt)
    b.train()
    assert b.iteration == 6 and checkpointing.complete_steps(ckpt) == [3, 6]


def test_the_handler_needs_a_known_signal_and_the_main_thread():
    import threading

    from core.training.exit_conditions import ExitConditions

    mesh = ps.build_parallel_state(1, 1, devices=jax.devices()[:1]).mesh
    with pytest.raises(ValueError, match=r"exit signal must be one of \['SIGINT', 'SIGTERM', 'SIGUSR1', 'SIGUSR2'\]"):
        ExitConditions(mesh, "SIGHUP")
    errors = []

    def make():
        try:
            ExitConditions(mesh, "SIGUSR2")
        except RuntimeError as e:
            errors.append(str(e))

    thread = threading.Thread(target=make)
    thread.start()
    thread.join()
    assert errors == ["--exit-signal-handler: SIGUSR2 can be caught by the main thread only; create and train the "
                      "trainer there"]
