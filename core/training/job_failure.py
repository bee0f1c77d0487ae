"""How a job ends on an error: one ``error:`` line, every process gone within seconds, no dumps.

A multi-process JAX job has two ways to end badly. A process that fails alone leaves the
others blocked in a collective or a barrier, waiting for it forever (the launcher only ends
the job when a process exits). And when process 0 exits first, the coordination service it
hosts goes with it: every other process's JAX client then aborts with a native fatal error,
about 30 lines of stack dump each, burying the one line that said what went wrong.

:class:`JobFailure` ends a job so that neither happens, whatever the rank that failed and
whatever the others are doing:

* The process that failed claims the report through the coordination service's key-value
  store (an atomic counter), prints ``error: <message>`` (``error: rank N: ...`` from a rank
  other than 0) and publishes the exit code under :data:`ABORT_KEY`. When several processes
  fail together (a flag every rank rejects, a checkpoint write that fails everywhere), only
  the first claim prints; the other ranks give process 0 a moment to claim first, so an
  error every rank meets is reported once, without a rank in it.
* Every process runs a watcher thread (:meth:`JobFailure.start_watcher`) that waits on that
  key; when it appears, a process other than 0 exits at once, quietly, with the published
  code, even while its main thread is blocked in a collective.
* Process 0 exits last: it waits up to :data:`PROCESS_0_LINGER_S` for the launcher to end the
  job (``mpirun`` ends every process as soon as one exits non-zero), so the coordination
  service outlives every client and nothing dumps.

Without ``jax.distributed`` (one process, or before it is started) the error is printed by
rank 0 (every rank reached the same verdict from the same inputs) and the process exits.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import traceback
from typing import NoReturn

ABORT_KEY = "megatron_core_jax/job_failure/exit_code"
"""Coordination-service key holding the exit code once a failure has been reported."""
_CLAIM_KEY = "megatron_core_jax/job_failure/claims"
PROCESS_0_GRACE_S = 1.0
"""How long a failing process other than 0 waits for process 0's report before claiming it."""
PROCESS_0_LINGER_S = 10.0
"""How long process 0 waits for the launcher to end the job before exiting itself."""
_REPORT_WAIT_S = 10.0  # a process that lost the claim waits this long for the winner's report
_POLL_MS = 1000


def _distributed_client():
    """The ``jax.distributed`` client when this is a started multi-process job, else None."""
    if "jax" not in sys.modules:
        return None
    import jax

    if not jax.distributed.is_initialized():
        return None
    import orbax.checkpoint as ocp

    return ocp.multihost.get_jax_distributed_client()


def _exit(code: int) -> NoReturn:
    # os._exit: no atexit handlers, so no jax.distributed shutdown barrier waiting for ranks that
    # are gone, and no MPI_Finalize waiting for ranks that are blocked.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class JobFailure:
    """Reports a failure of this process and ends the job (see the module docstring).

    ``rank``: this process's rank (from the launcher's environment, known before JAX starts).
    ``debug``: print the Python traceback before the error line.
    """

    def __init__(self, rank: int, debug: bool = False):
        self.rank = rank
        """This process's rank."""
        self.debug = debug
        """Print the traceback of a failure before its error line."""
        self._watcher: threading.Thread | None = None
        self._stop = threading.Event()

    def start_watcher(self) -> None:
        """Start the thread that ends this process when another one has reported a failure
        (a no-op without ``jax.distributed``, or when already started). It is stopped at the
        interpreter's exit, before ``jax.distributed``'s own shutdown."""
        client = _distributed_client()
        if client is None or self._watcher is not None:
            return
        self._watcher = threading.Thread(target=self._watch, args=(client,), name="job-failure-watcher", daemon=True)
        self._watcher.start()
        # Registered after jax.distributed's shutdown hook, so it runs first (atexit is last-in,
        # first-out). A daemon thread still inside the client's blocking call when the
        # interpreter finalizes aborts the process ("FATAL: exception not rethrown").
        atexit.register(self.stop_watcher)

    def stop_watcher(self) -> None:
        """Stop the watcher thread (it returns within one poll, about a second)."""
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=2 * _POLL_MS / 1000)
            self._watcher = None

    def _watch(self, client) -> None:
        while not self._stop.is_set():
            code = self._published_code(client, _POLL_MS)
            if code is not None:
                self._leave(code)

    @staticmethod
    def _published_code(client, timeout_ms: int) -> int | None:
        """The exit code published under :data:`ABORT_KEY`, or None if none appears within ``timeout_ms``."""
        try:
            return int(client.blocking_key_value_get(ABORT_KEY, timeout_ms))
        except Exception:  # noqa: BLE001 (the client raises its runtime error on a timeout)
            return None

    def _leave(self, code: int) -> NoReturn:
        if self.rank == 0:
            time.sleep(PROCESS_0_LINGER_S)  # the launcher ends the job once another process has exited
        _exit(code)

    def fail(self, code: int, message: str, error: BaseException | None = None) -> NoReturn:
        """Print ``error: message`` once for the whole job (with the traceback of ``error`` under
        :attr:`debug`) and end this process with ``code``; never returns."""
        if self.debug and error is not None:
            traceback.print_exception(error)
        client = _distributed_client()
        if client is None:
            if self.rank == 0:
                print(f"error: {message}", file=sys.stderr, flush=True)
            else:
                time.sleep(2.0)  # the launcher ends the job at the first exit: rank 0 prints first
            _exit(code)
        if self.rank != 0:
            reported = self._published_code(client, int(PROCESS_0_GRACE_S * 1000))
            if reported is not None:
                self._leave(reported)
        if client.key_value_increment(_CLAIM_KEY, 1) == 1:
            where = "" if self.rank == 0 else f"rank {self.rank}: "
            print(f"error: {where}{message}", file=sys.stderr, flush=True)
            client.key_value_set(ABORT_KEY, str(code))
            self._leave(code)
        reported = self._published_code(client, int(_REPORT_WAIT_S * 1000))
        self._leave(code if reported is None else reported)
