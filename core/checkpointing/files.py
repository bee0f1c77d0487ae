"""Finding and checking checkpoints on disk: step directories, the commit marker, the integrity
records, the newest intact step, a checkpoint's metadata. Plain filesystem reads: no collective,
any process may call them.

A checkpoint directory holds one directory per step::

    <directory>/<step>/state/   the pytree (orbax's PyTree handler: OCDBT, uncompressed; each
                                process writes only its own shards)
    <directory>/<step>/meta/    a JSON-able dict (iteration, consumed samples, layout, seed...)
    <directory>/<step>/integrity.json  size and CRC-32 of every other file of the step
    <directory>/<step>/commit_success.txt

A step counts as complete only when the commit marker is there. Files damaged after the save (a
truncated copy, a bad disk) are found by :func:`verify_checkpoint` against ``integrity.json``;
:func:`latest_valid_step` skips such steps, naming the damaged file.
"""

from __future__ import annotations

import json
import os
import uuid
import zlib

import orbax.checkpoint as ocp
from etils import epath

from core.checkpointing.coordination import from_process_0

STATE_ITEM = "state"
META_ITEM = "meta"
# Orbax's commit marker: written inside the tmp dir right before the rename (or, on object
# stores, into the final dir as the very last write).
COMMIT_MARKER = "commit_success.txt"
DEFAULT_MAX_TO_KEEP = 2

ASYNC_WRITERS = ("process", "thread")
"""What may write an asynchronous save (:class:`CheckpointSaver`'s ``writer``)."""
# Size and CRC-32 of every file of a step, written by process 0 right before the commit marker.
INTEGRITY_FILE = "integrity.json"


# ---------------------------------------------------------------------------------------
# Finding complete checkpoints (plain filesystem reads: no collective, any process may call)
# ---------------------------------------------------------------------------------------


def _step_dir(directory: str | os.PathLike, step: int) -> str:
    return os.path.join(os.fspath(directory), str(step))


def _is_complete(step_dir: str) -> bool:
    return os.path.isfile(os.path.join(step_dir, COMMIT_MARKER))


def complete_steps(directory: str | os.PathLike) -> list[int]:
    """Sorted steps of the complete (committed) checkpoints in ``directory``; [] if none or missing."""
    if not os.path.isdir(directory):
        return []
    # Tmp dirs ("<step>.orbax-checkpoint-tmp-<ts>") are not all digits, so they never match.
    return sorted(
        int(name) for name in os.listdir(directory)
        if name.isdigit() and _is_complete(_step_dir(directory, int(name)))
    )


def _incomplete_step_dirs(directory: str) -> list[str]:
    if not os.path.isdir(directory):
        return []
    return [
        _step_dir(directory, int(name)) for name in os.listdir(directory)
        if name.isdigit() and os.path.isdir(_step_dir(directory, int(name)))
        and not _is_complete(_step_dir(directory, int(name)))
    ]


def incomplete_steps(directory: str | os.PathLike) -> list[int]:
    """Sorted steps whose directory has no commit marker (a save that did not finish: never
    loaded, and removed by the next save into ``directory``); [] if none or no directory."""
    return sorted(int(os.path.basename(path)) for path in _incomplete_step_dirs(os.fspath(directory)))


def latest_step(directory: str | os.PathLike) -> int | None:
    """The newest complete checkpoint step in ``directory``; None if there is none (or no directory)."""
    steps = complete_steps(directory)
    return steps[-1] if steps else None


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            crc = zlib.crc32(block, crc)
    return crc


def _file_record(step_dir: str) -> dict[str, list[int]]:
    """``{relative path: [size, crc32]}`` of every file of a step directory."""
    record = {}
    for root, _, files in os.walk(step_dir):
        for name in files:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, step_dir)
            if not rel.startswith(INTEGRITY_FILE):  # the record itself and its tmp file
                record[rel] = [os.path.getsize(path), _crc32(path)]
    return record


def _write_integrity(step_dir: str) -> None:
    tmp = os.path.join(step_dir, INTEGRITY_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(_file_record(step_dir), f, sort_keys=True)
    os.replace(tmp, os.path.join(step_dir, INTEGRITY_FILE))


def verify_checkpoint(directory: str | os.PathLike, step: int) -> str | None:
    """None when every file of ``step`` has the size and CRC-32 it was written with (or the step
    has no integrity record); else one phrase naming the first damaged file."""
    step_dir = _step_dir(os.path.abspath(directory), step)
    record_path = os.path.join(step_dir, INTEGRITY_FILE)
    if not os.path.isfile(record_path):
        return None
    try:
        with open(record_path) as f:
            record = json.load(f)
    except (OSError, ValueError) as e:
        return f"{record_path} is unreadable ({e})"
    for rel, (size, crc) in sorted(record.items()):
        path = os.path.join(step_dir, rel)
        if not os.path.isfile(path):
            return f"{path} is missing"
        if os.path.getsize(path) != size:
            return f"{path} has {os.path.getsize(path)} bytes, {size} were written (truncated)"
        if _crc32(path) != crc:
            return f"{path} differs from what was written (CRC-32 mismatch: corrupted)"
    return None


def _find_latest_valid(directory: str | os.PathLike) -> tuple[int | None, list[str]]:
    skipped = []
    for step in reversed(complete_steps(directory)):
        problem = verify_checkpoint(directory, step)
        if problem is None:
            return step, skipped
        skipped.append(f"checkpoint step {step} skipped: {problem}")
    return None, skipped


def latest_valid_step(directory: str | os.PathLike) -> tuple[int | None, list[str]]:
    """The newest complete step whose files are intact (None if none), and one line for each
    newer complete step skipped because a file is damaged.

    Collective when there are several processes: process 0 alone reads and checksums the
    files and hands its answer to the others (through the coordination service), so every
    process resumes from the same step at the cost of one read of the checkpoint."""
    step, skipped = from_process_0("latest_valid_step", lambda: _find_latest_valid(directory))
    return step, list(skipped)


def step_problem(directory: str | os.PathLike, step: int) -> str | None:
    """Why step ``step`` of ``directory`` cannot be loaded (one phrase: not there, incomplete, or
    the first damaged file), or None when it is complete and intact. Collective as
    :func:`latest_valid_step`: process 0 alone reads the files."""

    def check() -> str | None:
        steps = complete_steps(directory)
        if step not in steps:
            found = steps if os.path.isdir(directory) else "no such directory"
            return f"no complete checkpoint {step} (complete checkpoints: {found})"
        return verify_checkpoint(directory, step)

    return from_process_0("step_problem", check)


def new_run_id() -> str:
    """A new identifier for a training run, the same on every process (process 0 draws it; a
    collective). Checkpoints record it, a resume keeps it, so a ``--save`` directory can tell
    its own run's checkpoints from another run's."""
    return from_process_0("run_id", lambda: uuid.uuid4().hex[:12])


def why_nothing_to_load(directory: str | os.PathLike) -> str | None:
    """Why ``directory`` holds no loadable checkpoint (one phrase naming what was found and
    skipped), or None when it holds one. For the warning before training starts from scratch."""
    directory = os.fspath(directory)
    if latest_step(directory) is not None:
        return None
    if not os.path.exists(directory):
        return "no such directory"
    if not os.path.isdir(directory):
        return "not a directory"
    incomplete = sorted(int(os.path.basename(p)) for p in _incomplete_step_dirs(directory))
    if incomplete:
        return f"no complete checkpoint (skipped incomplete step directories {incomplete}: no {COMMIT_MARKER})"
    entries = sorted(os.listdir(directory))
    return "an empty directory" if not entries else f"no checkpoint step directory (found {entries[:5]})"


def _require_step(directory: str, step: int | None) -> int:
    """``step`` (or the latest one when None), checked to be a complete checkpoint."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"checkpoint directory {directory!r} does not exist")
    if step is None:
        step = latest_step(directory)
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint in {directory!r}")
        return step
    if not _is_complete(_step_dir(directory, step)):
        raise FileNotFoundError(
            f"no complete checkpoint for step {step} in {directory!r} "
            f"(complete steps: {complete_steps(directory)})"
        )
    return step


def load_metadata(directory: str | os.PathLike, step: int | None = None) -> dict:
    """The metadata dict saved with ``step`` (the latest complete step when None)."""
    directory = os.path.abspath(directory)
    step = _require_step(directory, step)
    # Handler-level read: unlike a CheckpointManager it has no barriers, so any process may call it.
    path = epath.Path(_step_dir(directory, step)) / META_ITEM
    return dict(ocp.JsonCheckpointHandler().restore(path, args=ocp.args.JsonRestore()))
