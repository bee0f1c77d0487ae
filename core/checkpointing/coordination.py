"""Barriers and broadcasts between the processes of a checkpoint save or restore, through the
``jax.distributed`` client's coordination service (its barrier and key-value store), never
through a device collective: the background writer runs them while the main thread dispatches
training steps, whose collectives must be issued in the same order on every process."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from typing import Any

import jax
import orbax.checkpoint as ocp

# Barriers and broadcasts go through the jax.distributed client's coordination service (its
# barrier and key-value store), never through a device collective: the background writer runs
# them while the main thread dispatches training steps, whose collectives must be issued in
# the same order on every process.
COORDINATION_TIMEOUT_MS = 3600 * 1000
collective_ids = itertools.count()  # every process makes the same collective calls in the same order


def call_key(call_id: int, name: str) -> str:
    """The coordination-service key ``name`` (no slashes) of collective call ``call_id``."""
    return f"megatron_core_jax/checkpointing/{call_id}/{name}"


def unique_key(name: str) -> str:
    """A coordination-service key no other call of this run uses (``name``: no slashes)."""
    return call_key(next(collective_ids), name)


def barrier(key: str) -> None:
    """Wait for every process at ``key`` (unique per call: from :func:`unique_key`)."""
    if jax.process_count() > 1:
        ocp.multihost.get_barrier_sync_fn()(key=key, timeout_ms=COORDINATION_TIMEOUT_MS)


def from_process_0(name: str, compute: Callable[[], Any]) -> Any:
    """``compute()`` run on process 0 only, its (JSON-able) result handed to every process.
    An exception on process 0 is raised on every process (as ``OSError`` on the others)."""
    if jax.process_count() == 1:
        return compute()
    client = ocp.multihost.get_jax_distributed_client()
    key = unique_key(name)
    if jax.process_index() == 0:
        try:
            value = compute()
        except Exception as e:
            client.key_value_set(key, json.dumps({"error": f"{type(e).__name__}: {e}"}))
            raise
        client.key_value_set(key, json.dumps({"value": value}))
        return value
    answer = json.loads(client.blocking_key_value_get(key, COORDINATION_TIMEOUT_MS))
    if "error" in answer:
        raise OSError(f"process 0 failed: {answer['error']}")
    return answer["value"]
