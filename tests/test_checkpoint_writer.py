"""core.checkpointing.writer_process in one process with 8 simulated devices: asynchronous saves written by
a writer process (the default on Linux) hold what was saved, whatever the training process
does to its arrays meanwhile; errors and a dead writer reach the next save; the writer runs at
the lowest priority on the CPU and never outlives its training process.

The writers' own ``jax.distributed`` job (several processes) is exercised under mpirun by
``test_checkpointing_mpi.py`` and the kill trials of ``test_pretrain_cli.py``."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from core.checkpointing import CheckpointSaver, complete_steps, restore_checkpoint, verify_checkpoint
from core.checkpointing import writer_process as checkpoint_writer

pytestmark = pytest.mark.skipif(not checkpoint_writer.available(), reason="the writer process needs Linux")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _mesh():
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))


def _state(seed, rows=16):
    """Sharded and replicated fp32/bf16 arrays, an optax state (a NamedTuple), host leaves."""
    rng = np.random.default_rng(seed)
    mesh = _mesh()
    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
    w = rng.standard_normal((rows, 8)).astype(np.float32)
    return {
        "params": {"w": put(w, "a", "b"), "b": put(jnp.asarray(rng.standard_normal(8), jnp.bfloat16))},
        "opt": optax.ScaleByAdamState(count=put(np.int32(seed)), mu={"w": put(w * 2, None, "b")},
                                      nu={"w": put(w * 3, "a")}),
        "host": np.arange(seed, seed + 5, dtype=np.int64),
        "iteration": seed,
    }


def _target(state, spec=None):
    """Abstract leaves of ``state``: its own shardings, or all replicated (``spec=P()``)."""
    def leaf(x):
        if not isinstance(x, jax.Array):
            return x
        sharding = x.sharding if spec is None else NamedSharding(_mesh(), spec)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(leaf, state)


def _assert_equal(restored, expected):
    got, want = jax.tree.leaves(restored), jax.tree.leaves(jax.tree.map(np.asarray, expected))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), w)
        assert np.asarray(g).dtype == w.dtype


def _running(pid):
    """Whether ``pid`` is a live process (a zombie is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_writer_process_holds_what_was_saved_while_the_arrays_are_donated(tmp_path):
    directory = str(tmp_path / "ckpt")
    state = _state(3)
    expected = jax.tree.map(lambda x: np.asarray(x) if isinstance(x, jax.Array) else x, state)
    saver = CheckpointSaver(directory, async_save=True)
    assert saver.writer == "process"
    saver.save(3, state, {"iteration": 3})
    donate = jax.jit(lambda t: jax.tree.map(lambda x: x * 0 - 1, t), donate_argnums=0)
    jax.block_until_ready(donate(state["params"]["w"]))
    assert state["params"]["w"].is_deleted()
    pid = saver._process.pid
    saver.close()
    assert not _running(pid)  # close() stops the writer
    assert complete_steps(directory) == [3] and verify_checkpoint(directory, 3) is None
    restored, meta = restore_checkpoint(directory, 3, _target(_state(3)))
    _assert_equal(restored, expected)
    assert isinstance(restored["opt"], optax.ScaleByAdamState) and meta == {"iteration": 3}
    replicated = {"params": {"w": _target(_state(3), P())["params"]["w"]}}
    w, _ = restore_checkpoint(directory, 3, replicated, partial=True)  # any layout, as a synchronous save
    np.testing.assert_array_equal(np.asarray(w["params"]["w"]), expected["params"]["w"])


def test_one_writer_serves_the_saves_one_at_a_time_and_its_buffer_grows(tmp_path):
    directory = str(tmp_path / "ckpt")
    saver = CheckpointSaver(directory, max_to_keep=None, async_save=True)
    pids = []
    for step, rows in ((1, 16), (2, 16), (3, 1 << 16)):  # step 3: 2 MiB per array, a larger buffer
        saver.save(step, _state(step, rows), {"iteration": step})
        assert set(range(1, step)) <= set(complete_steps(directory))  # the previous save was waited for
        pids.append(saver._process.pid)
    saver.wait()
    phases = saver.write_phases  # the last save, timed on this side
    assert set(phases) == {"plan", "snapshot", "to_host", "shared_buffer", "writer", "thread_cpu"}
    assert phases["writer"] > 0 and phases["shared_buffer"] > 0 and min(phases.values()) >= 0
    assert CheckpointSaver(str(tmp_path / "other")).write_phases == {}  # no writer process yet
    saver.save(4, {"host": np.arange(3), "iteration": 4}, {"iteration": 4})  # no device array at all
    saver.close()
    assert len(set(pids)) == 1
    assert complete_steps(directory) == [1, 2, 3, 4] and all(verify_checkpoint(directory, s) is None
                                                             for s in (1, 2, 3, 4))
    np.testing.assert_array_equal(restore_checkpoint(directory, 4, {"host": np.zeros(3, np.int64), "iteration": 0})
                                  [0]["host"], np.arange(3))
    for step, rows in ((1, 16), (3, 1 << 16)):
        restored, _ = restore_checkpoint(directory, step, _target(_state(step, rows)))
        _assert_equal(restored, _state(step, rows))


def test_pinned_host_staging_saves_the_same_values(tmp_path):
    # GPUs stage the device-to-host copies in pinned host memory (orbax's default there); the
    # CPU backend has such a memory too, so the path runs here, forced.
    assert CheckpointSaver(str(tmp_path / "a")).pinned_host_transfer is False  # the CPU default
    state = _state(5)
    sources = [s.data for s in state["params"]["w"].addressable_shards[:2]]
    staged = checkpoint_writer._to_host(sources, pinned_host=True)
    assert [x.sharding.memory_kind for x in staged] == ["pinned_host"] * 2
    np.testing.assert_array_equal(np.asarray(staged[1]), np.asarray(sources[1]))
    assert checkpoint_writer._to_host(sources, pinned_host=False) == sources
    for pinned in (True, False):
        directory = str(tmp_path / f"pinned_{pinned}")
        saver = CheckpointSaver(directory, async_save=True, pinned_host_transfer=pinned)
        saver.save(5, state, {"iteration": 5})
        saver.close()
        restored, _ = restore_checkpoint(directory, 5, _target(_state(5)))
        _assert_equal(restored, state)
        assert verify_checkpoint(directory, 5) is None


class _Unreadable:
    def __array__(self, *args, **kwargs):
        raise RuntimeError("RESOURCE_EXHAUSTED: pinned host memory")


@pytest.mark.parametrize("when", ["staging", "reading"])
def test_a_failed_pinned_staging_falls_back_to_pageable_copies(tmp_path, monkeypatch, caplog, when):
    def refuse(*args, **kwargs):
        raise RuntimeError("RESOURCE_EXHAUSTED: pinned host memory")

    state = _state(5)
    directory = str(tmp_path / "ckpt")
    saver = CheckpointSaver(directory, async_save=True, pinned_host_transfer=True)
    if when == "staging":
        monkeypatch.setattr(jax, "device_put", refuse)  # the save stages through jax.device_put only
    else:  # the staged copies fail when read (an allocation failure reported asynchronously)
        to_host = checkpoint_writer._to_host
        monkeypatch.setattr(checkpoint_writer, "_to_host", lambda sources, pinned_host: [_Unreadable()] * len(sources)
                            if pinned_host else to_host(sources, pinned_host))
    saver.save(5, state, {"iteration": 5})
    saver.wait()
    monkeypatch.undo()
    assert saver._process.pinned_host_transfer is False and "pageable memory from now on" in caplog.text
    saver.close()
    restored, _ = restore_checkpoint(directory, 5, _target(_state(5)))
    _assert_equal(restored, _state(5))


def test_a_writer_error_is_raised_by_the_next_save_and_the_writer_goes_on(tmp_path):
    directory = str(tmp_path / "ckpt")
    saver = CheckpointSaver(directory, async_save=True)
    saver.save(1, _state(1), {"iteration": 1})
    pid = saver._process.pid
    saver.save(2, {**_state(2), "host": np.array(["not", "storable"])}, {"iteration": 2})  # orbax refuses str
    with pytest.raises(ValueError, match="Unsupported data type"):
        saver.save(3, _state(3), {"iteration": 3})
    assert complete_steps(directory) == [1]
    saver.save(3, _state(3), {"iteration": 3})
    saver.close()
    assert complete_steps(directory) == [1, 3] and saver.writer == "process" and not _running(pid)


def test_a_killed_writer_is_reported_and_the_next_save_starts_a_new_one(tmp_path):
    directory = str(tmp_path / "ckpt")
    saver = CheckpointSaver(directory, async_save=True)
    saver.save(1, _state(1), {"iteration": 1})
    saver.wait()
    first = saver._process.pid
    os.kill(first, signal.SIGKILL)
    saver.save(2, _state(2), {"iteration": 2})
    with pytest.raises(OSError, match=rf"checkpoint writer process {first} ended \(signal 9\)"):
        saver.wait()
    saver.save(3, _state(3), {"iteration": 3})
    second = saver._process.pid
    saver.close()
    assert second != first and complete_steps(directory) == [1, 3]
    restored, _ = restore_checkpoint(directory, 3, _target(_state(3)))
    _assert_equal(restored, _state(3))


def test_the_writer_outlives_the_signals_a_job_receives(tmp_path):
    """A scheduler's warning signal (or Ctrl-C's SIGINT) reaches the whole job, writers included:
    each must outlive it to write the checkpoint that --exit-signal-handler then saves."""
    directory = str(tmp_path / "ckpt")
    saver = CheckpointSaver(directory, async_save=True)
    saver.save(1, _state(1), {"iteration": 1})
    saver.wait()
    pid = saver._process.pid
    for number in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
        os.kill(pid, number)
    saver.save(2, _state(2), {"iteration": 2})
    saver.wait()
    assert saver._process.pid == pid and saver._process.alive
    saver.close()
    assert complete_steps(directory) == [1, 2]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the priority is lowered on the CPU backend only")
def test_the_writer_runs_at_the_lowest_priority_on_cpu(tmp_path):
    saver = CheckpointSaver(str(tmp_path / "ckpt"), async_save=True)
    before = os.getpriority(os.PRIO_PROCESS, 0)
    saver.save(1, _state(1), {"iteration": 1})
    saver.wait()
    assert os.getpriority(os.PRIO_PROCESS, saver._process.pid) == max(before, checkpoint_writer.WRITER_NICE)
    assert os.getpriority(os.PRIO_PROCESS, 0) == before  # the training process keeps its own
    saver.close()


def test_the_writer_dies_with_its_training_process(tmp_path):
    """A training process killed with SIGKILL (no cleanup runs) takes its writer along."""
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {ROOT!r})
        import jax, jax.numpy as jnp
        from core.checkpointing import CheckpointSaver
        saver = CheckpointSaver({str(tmp_path / "ckpt")!r}, async_save=True)
        saver.save(1, {{"w": jnp.ones(4)}}, {{}})
        saver.wait()
        print(saver._process.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1"}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    pid = int(run.stdout.split()[-1])
    deadline = time.monotonic() + 20
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(pid)
