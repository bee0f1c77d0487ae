"""``core.training.exit_conditions`` under ``mpirun``: a signal caught by one process (its own
handler: a signal other than SIGTERM) or a time budget spent on one process stops every process
at the same iteration, one after the one where it was seen. (SIGTERM, which JAX's preemption
service handles in a multi-process job, is tested through ``launch/pretrain.py`` in
``tests/test_pretrain_cli.py``: its notice would stay with these pytest processes.)"""

import os
import signal

import jax
import pytest

from core import parallel_state as ps
from core.training.exit_conditions import DURATION_ELAPSED, SIGNAL_RECEIVED, ExitConditions

pytestmark = pytest.mark.mpi(min_size=8)


def _stop_iteration(exits, cause_at, cause):
    """Poll iterations 1, 2, ... as a training loop does (a step between polls); on rank 3,
    ``cause()`` at iteration ``cause_at``. Returns the first iteration with a reason."""
    step = jax.jit(lambda x: x * 2)
    x = jax.numpy.ones(4)
    for iteration in range(1, 50):
        x = step(x)
        if jax.process_index() == 3 and iteration == cause_at:
            cause()
        if exits.poll(iteration):
            return iteration
    return None


@pytest.mark.parametrize("kind", ["signal", "duration"])
def test_one_process_stops_every_process_at_the_same_iteration(kind):
    from mpi4py import MPI

    mesh = ps.build_parallel_state(2, 2).mesh  # tp2 pp2 dp2 over the 8 processes
    if kind == "signal":
        exits = ExitConditions(mesh, "SIGUSR1")
        cause, expected = (lambda: os.kill(os.getpid(), signal.SIGUSR1)), SIGNAL_RECEIVED
    else:
        exits = ExitConditions(mesh, duration_s=3600.0)
        cause, expected = (lambda: setattr(exits, "start", exits.start - 7200)), DURATION_ELAPSED
    try:
        stopped = _stop_iteration(exits, 5, cause)
    finally:
        exits.uninstall()
    assert stopped == 6 and exits.reason == expected  # agreed one iteration after rank 3 saw it
    assert MPI.COMM_WORLD.allgather((stopped, exits.reason)) == [(6, expected)] * 8
    assert jax.process_index() == 3 or exits.local_reason() == 0  # the others learnt it from the collective
