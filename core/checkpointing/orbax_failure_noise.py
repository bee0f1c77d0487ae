"""Keep orbax's aftermath of a failed checkpoint write off stderr.

When a write fails (a full disk, a quota, a read-only filesystem) orbax raises the error to its
caller, which :mod:`core.checkpointing` turns into one line, and then its background machinery
reports the same failure again, many times over: orbax's signalling threads log it with a
traceback each (``ERROR:absl: ... _SignalingThread.run() raised an exception``), asyncio logs
each of tensorstore's failed write tasks when it is garbage-collected (``Task exception was never
retrieved``), and once orbax has closed the save's event loop, every write still in flight
reports to the closed loop as an unraisable ``RuntimeError('Event loop is closed')``: hundreds
of lines for one full disk, around the one line that names the cause.

:func:`silence` drops exactly those reports (by logger and message, or exception and message);
every other log record and unraisable exception goes where it went before.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

_ORBAX_THREAD_FAILURE = "_SignalingThread.run() raised an exception"
_UNRETRIEVED_TASK = "Task exception was never retrieved"


class _DropOrbaxRepeats(logging.Filter):
    """Drops orbax's own repeats of an error it raises to the caller anyway."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.name == "absl":
            return _ORBAX_THREAD_FAILURE not in message
        if record.name == "asyncio" and message.startswith(_UNRETRIEVED_TASK):
            return "orbax" not in message
        return True


def _is_closed_loop_report(unraisable: Any) -> bool:
    return isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"


def silence() -> None:
    """Install the filters (once per process; idempotent)."""
    previous = sys.unraisablehook
    if getattr(previous, "drops_closed_loop_reports", False):
        return

    def hook(unraisable: Any) -> None:
        if not _is_closed_loop_report(unraisable):
            previous(unraisable)

    hook.drops_closed_loop_reports = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook
    for name in ("absl", "asyncio"):
        logging.getLogger(name).addFilter(_DropOrbaxRepeats())
