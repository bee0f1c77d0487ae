"""core.checkpointing across 8 real processes (one device each): arrays sharded over the
processes are saved collectively and restored into other shardings."""

import os
import shutil
import tempfile

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from core.checkpointing import (
    COMMIT_MARKER,
    CheckpointSaver,
    complete_steps,
    latest_step,
    latest_valid_step,
    load_metadata,
    restore_checkpoint,
    save_checkpoint,
    step_problem,
)

pytestmark = pytest.mark.mpi(min_size=8)


@pytest.fixture
def shared_dir():
    """One checkpoint directory for all ranks: made on rank 0, path broadcast over MPI."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    path = comm.bcast(tempfile.mkdtemp(prefix="ckpt_mpi_") if comm.rank == 0 else None, root=0)
    yield os.path.join(path, "ckpt")
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


def _global(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _make(values, sharding):
    """A global array from host values that every process holds (only its shards are used)."""
    return jax.make_array_from_callback(values.shape, sharding, lambda idx: values[idx])


def _check_local(arr, values, sharding):
    assert arr.sharding.is_equivalent_to(sharding, arr.ndim), (arr.sharding, sharding)
    assert arr.addressable_shards, "every process owns a shard"
    for shard in arr.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), values[shard.index])


def test_save_sharded_over_processes_restore_resharded(shared_dir):
    assert jax.process_count() == 8 and jax.device_count() == 8
    devices = np.array(jax.devices())
    mx = Mesh(devices, ("x",))
    mab = Mesh(devices.reshape(2, 4), ("a", "b"))
    w, k = _global((16, 8), 0), _global((8, 24), 1)
    saved = {"w": NamedSharding(mx, P("x")), "k": NamedSharding(mab, P("a", "b"))}
    meta = {"iteration": 3, "consumed_samples": 96, "layout": {"dp": 8}, "seed": 5}
    state = {"params": {"w": _make(w, saved["w"]), "k": _make(k, saved["k"])}, "step": 3, "host": np.arange(4)}

    save_checkpoint(shared_dir, 3, state, meta)
    assert latest_step(shared_dir) == 3
    assert load_metadata(shared_dir, 3) == meta

    for new in ({"w": NamedSharding(mx, P(None, "x")), "k": NamedSharding(mx, P())},
                {"w": NamedSharding(mab, P("b", "a")), "k": NamedSharding(mab, P(None, ("a", "b")))}):
        target = {"params": {"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=new["w"]),
                             "k": jax.ShapeDtypeStruct(k.shape, k.dtype, sharding=new["k"])},
                  "step": 0, "host": np.zeros(4, np.int64)}
        restored, got_meta = restore_checkpoint(shared_dir, None, target)
        _check_local(restored["params"]["w"], w, new["w"])
        _check_local(restored["params"]["k"], k, new["k"])
        assert int(restored["step"]) == 3
        np.testing.assert_array_equal(restored["host"], np.arange(4))
        assert got_meta == meta


def test_incomplete_step_and_retention_across_processes(shared_dir):
    from mpi4py import MPI

    mesh = Mesh(np.array(jax.devices()), ("x",))
    sharding = NamedSharding(mesh, P("x"))
    for step in (1, 2):
        save_checkpoint(shared_dir, step, {"w": _make(_global((8, 16), step), sharding)}, {"iteration": step})
    if jax.process_index() == 0:  # a step dir without the commit marker, as from a partial copy
        os.makedirs(os.path.join(shared_dir, "9", "state"))
    MPI.COMM_WORLD.barrier()
    assert latest_step(shared_dir) == 2
    save_checkpoint(shared_dir, 10, {"w": _make(_global((8, 16), 10), sharding)}, {"iteration": 10})
    assert complete_steps(shared_dir) == [2, 10]
    assert os.path.isfile(os.path.join(shared_dir, "10", COMMIT_MARKER))
    target = {"w": jax.ShapeDtypeStruct((8, 16), np.float32, sharding=NamedSharding(mesh, P(None, "x")))}
    restored, meta = restore_checkpoint(shared_dir, 2, target)
    _check_local(restored["w"], _global((8, 16), 2), target["w"].sharding)
    assert meta == {"iteration": 2}


def test_async_saves_commit_in_the_background_and_process_0_picks_the_resume_step(shared_dir):
    """Async saves on 8 processes while every process keeps dispatching collectives (the
    writers' barriers must not interleave with them), then a damaged newest step: every
    process gets process 0's answer."""
    from mpi4py import MPI

    mesh = Mesh(np.array(jax.devices()), ("x",))
    sharding = NamedSharding(mesh, P("x"))
    total = jax.jit(lambda a: a.sum(), out_shardings=NamedSharding(mesh, P()))
    saver = CheckpointSaver(shared_dir, max_to_keep=2, async_save=True)
    for step in (1, 2, 3):
        w = _make(_global((8, 16), step), sharding)
        saver.save(step, {"w": w}, {"iteration": step})
        for _ in range(5):  # cross-process collectives while the save is in flight
            assert np.isclose(float(total(w)), _global((8, 16), step).sum(), rtol=1e-5)
    saver.close()
    assert complete_steps(shared_dir) == [2, 3]
    assert latest_valid_step(shared_dir) == (3, [])
    target = {"w": jax.ShapeDtypeStruct((8, 16), np.float32, sharding=NamedSharding(mesh, P(None, "x")))}
    restored, meta = restore_checkpoint(shared_dir, 3, target)
    _check_local(restored["w"], _global((8, 16), 3), target["w"].sharding)
    assert meta == {"iteration": 3}
    if jax.process_index() == 0:  # damage the newest step: truncate its biggest file
        step_dir = os.path.join(shared_dir, "3")
        biggest = max((os.path.join(r, f) for r, _, fs in os.walk(step_dir) for f in fs if f != "integrity.json"),
                      key=os.path.getsize)
        with open(biggest, "r+b") as f:
            f.truncate(os.path.getsize(biggest) // 2)
    MPI.COMM_WORLD.barrier()
    step, skipped = latest_valid_step(shared_dir)
    assert step == 2 and len(skipped) == 1 and "truncated" in skipped[0]
    assert MPI.COMM_WORLD.allgather((step, skipped)) == [(step, skipped)] * 8
    # --ckpt-step's check, also process 0's answer on every process
    problems = [step_problem(shared_dir, s) for s in (2, 3, 4)]
    assert problems[0] is None and "truncated" in problems[1]
    assert problems[2] == "no complete checkpoint 4 (complete checkpoints: [2, 3])"
    assert MPI.COMM_WORLD.allgather(problems) == [problems] * 8
