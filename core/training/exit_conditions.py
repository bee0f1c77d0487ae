"""Megatron's early exits: ``--exit-signal-handler`` (a signal, SIGTERM by default, as a cluster
scheduler sends before it ends a job) and ``--exit-duration-in-mins`` (a time budget). Either
makes the run save a checkpoint and stop, so a preempted or time-limited job loses nothing.

Every process must stop at the same iteration (a process that saves while the others dispatch
steps would hang them), but a signal may reach one process only, or each at a different moment:

* SIGTERM in a multi-process job: JAX's preemption service has caught it since
  ``jax.distributed.initialize`` (its handler replaces any other), and
  ``multihost_utils.reached_preemption_sync_point`` names the same iteration on every process,
  agreed through the coordination service; called every iteration, it costs nothing until then.
* Another signal, or one process: a Python handler (installed from the trainer's creation on)
  sets a flag.
* The flag and the time budget, with several processes: each iteration every process contributes
  its own reasons to a max over all devices (a tiny jitted collective, dispatched after the step,
  in the same order on every process), and acts on the previous iteration's answer: that
  collective ran right after the previous step, which the loop waits for anyway, so the check
  adds no host synchronisation of its own. One process acts at once.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from core.training.arguments import EXIT_SIGNALS

SIGNALS = {name: getattr(signal, name) for name in EXIT_SIGNALS}
"""The signals ``--exit-signal`` may name (Megatron's choices), by name."""

SIGNAL_RECEIVED, DURATION_ELAPSED = 1, 2
"""The reasons, as bits of :attr:`ExitConditions.reason`."""


def _jax_catches_sigterm() -> bool:
    """Whether JAX's preemption service handles SIGTERM in this job (several processes, the
    service on: ``jax_enable_preemption_service``)."""
    return jax.process_count() > 1 and bool(getattr(jax.config, "jax_enable_preemption_service", False))


class ExitConditions:
    """When to stop a run early, decided alike on every process (see the module docstring).

    ``signal_name``: the signal to act on (a key of :data:`SIGNALS`), or None. ``duration_s``:
    stop once this many seconds have passed since the object was made, or None."""

    def __init__(self, mesh: Any, signal_name: str | None = None, duration_s: float | None = None):
        if signal_name is not None and signal_name not in SIGNALS:
            raise ValueError(f"exit signal must be one of {sorted(SIGNALS)}, not {signal_name!r}")
        self.signal_name = signal_name
        """The signal acted on, or None."""
        self.duration_s = duration_s
        """The time budget in seconds, or None."""
        self.start = time.monotonic()
        """Where the time budget counts from (``time.monotonic()``)."""
        self.received = False
        """Whether this process's own handler caught the signal."""
        self.reason = 0
        """The agreed reasons to stop (bits: :data:`SIGNAL_RECEIVED`, :data:`DURATION_ELAPSED`); 0 until then."""
        self._jax_sigterm = signal_name == "SIGTERM" and _jax_catches_sigterm()
        self._own_handler = signal_name is not None and not self._jax_sigterm
        self._previous_handler: Any = None
        self._multi_process = jax.process_count() > 1
        if self._multi_process and (self._own_handler or duration_s is not None):
            axes = tuple(mesh.axis_names)
            self._sharding = NamedSharding(mesh, P(axes))
            self._size = mesh.devices.size
            self._max = jax.jit(jax.shard_map(lambda x: jax.lax.pmax(x, axes), mesh=mesh, in_specs=P(axes),
                                              out_specs=P()))
        self._pending: Any = None
        self.install()

    def install(self) -> None:
        """Catch the signal with this object's handler (main thread only; a no-op where JAX's
        preemption service catches it, or when already installed)."""
        if not self._own_handler or self._previous_handler is not None:
            return
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(f"--exit-signal-handler: {self.signal_name} can be caught by the main thread only; "
                               "create and train the trainer there")
        self._previous_handler = signal.signal(SIGNALS[self.signal_name], self._caught)

    def uninstall(self) -> None:
        """Give the signal its previous handler back (the end of training)."""
        if self._previous_handler is not None:
            signal.signal(SIGNALS[self.signal_name], self._previous_handler)
            self._previous_handler = None

    def _caught(self, signum: int, frame: Any) -> None:
        self.received = True

    def local_reason(self) -> int:
        """This process's own reasons to stop now (bits; 0: none), JAX's preemption notice aside."""
        elapsed = self.duration_s is not None and time.monotonic() - self.start >= self.duration_s
        return (SIGNAL_RECEIVED if self.received else 0) | (DURATION_ELAPSED if elapsed else 0)

    def poll(self, iteration: int) -> int:
        """Called once per iteration by every process, after dispatching step ``iteration``: the
        reasons to stop there, the same on every process (0: go on). Sets :attr:`reason`."""
        reason = 0
        if self._jax_sigterm and multihost_utils.reached_preemption_sync_point(iteration):
            reason |= SIGNAL_RECEIVED
        if not self._multi_process:
            reason |= self.local_reason()
        elif self._own_handler or self.duration_s is not None:
            if self._pending is not None:  # the previous iteration's agreement
                reason |= int(np.asarray(self._pending.addressable_data(0))[0])
            local = np.full((1,), self.local_reason(), np.int32)
            self._pending = self._max(jax.make_array_from_callback((self._size,), self._sharding, lambda _: local))
        self.reason = reason
        return reason

    def describe(self) -> str:
        """The agreed reasons in words (for the exit line)."""
        said = []
        if self.reason & SIGNAL_RECEIVED:
            said.append(f"{self.signal_name} received (--exit-signal-handler)")
        if self.reason & DURATION_ELAPSED:
            said.append(f"{self.duration_s / 60:g} minutes elapsed (--exit-duration-in-mins)")
        return " and ".join(said)
