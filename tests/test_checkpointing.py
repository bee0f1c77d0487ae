"""core.checkpointing in one process with 8 simulated devices: round trips, resharding on
restore, clear errors, retention and crash safety."""

import itertools
import os
import shutil
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from core import checkpointing
from core.checkpointing import (
    COMMIT_MARKER,
    CheckpointSaver,
    complete_steps,
    coordination,
    latest_step,
    latest_valid_step,
    load_metadata,
    restore_checkpoint,
    save_checkpoint,
    step_writer,
    verify_checkpoint,
    why_nothing_to_load,
)
from core.checkpointing import files as checkpoint_files
from core.checkpointing import saver as saver_module

META = {"iteration": 7, "consumed_samples": 224, "layout": {"tp": 2, "pp": 1, "dp": 4}, "seed": 1234}


def _mesh_x():
    return Mesh(np.array(jax.devices()[:8]), ("x",))


def _mesh_ab():
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))


def _values(seed=0):
    """Host values of the test state, as a nested dict."""
    rng = np.random.default_rng(seed)
    return {
        "params": {
            "w": rng.standard_normal((16, 8)).astype(np.float32),
            "b": rng.standard_normal((8,)).astype(np.float32),
            "layers": [{"k": rng.standard_normal((8, 24)).astype(np.float32)}],
        },
        "opt": {"count": 3, "host_rng": np.arange(5, dtype=np.int64)},
    }


def _shardings_saved():
    m, ab = _mesh_x(), _mesh_ab()
    return {"w": NamedSharding(m, P("x")), "b": NamedSharding(m, P()), "k": NamedSharding(ab, P("a", "b"))}


def _put(values, shardings):
    """The state as global jax arrays with the given shardings (host leaves stay as they are)."""
    p = values["params"]
    return {
        "params": {
            "w": jax.device_put(p["w"], shardings["w"]),
            "b": jax.device_put(p["b"], shardings["b"]),
            "layers": [{"k": jax.device_put(p["layers"][0]["k"], shardings["k"])}],
        },
        "opt": dict(values["opt"]),
    }


def _abstract(values, shardings):
    p = values["params"]
    sds = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
    return {
        "params": {
            "w": sds(p["w"], shardings["w"]),
            "b": sds(p["b"], shardings["b"]),
            "layers": [{"k": sds(p["layers"][0]["k"], shardings["k"])}],
        },
        "opt": {"count": 0, "host_rng": np.zeros(5, np.int64)},
    }


def _assert_state(restored, values, shardings):
    p, r = values["params"], restored["params"]
    for got, want, sharding in ((r["w"], p["w"], shardings["w"]), (r["b"], p["b"], shardings["b"]),
                                (r["layers"][0]["k"], p["layers"][0]["k"], shardings["k"])):
        assert isinstance(got, jax.Array)
        assert got.sharding.is_equivalent_to(sharding, got.ndim), (got.sharding, sharding)
        np.testing.assert_array_equal(np.asarray(got), want)
    assert int(restored["opt"]["count"]) == values["opt"]["count"]
    np.testing.assert_array_equal(restored["opt"]["host_rng"], values["opt"]["host_rng"])


@pytest.fixture
def ckdir(tmp_path):
    return str(tmp_path / "ckpt")


def _save(ckdir, step, seed=None, **kw):
    save_checkpoint(ckdir, step, _put(_values(step if seed is None else seed), _shardings_saved()),
                    {**META, "iteration": step}, **kw)


# ---------------------------------------------------------------------------------------


def test_round_trip_same_sharding(ckdir):
    values, shardings = _values(), _shardings_saved()
    save_checkpoint(ckdir, 10, _put(values, shardings), META)
    assert latest_step(ckdir) == 10
    assert os.path.isfile(os.path.join(ckdir, "10", COMMIT_MARKER))
    state, meta = restore_checkpoint(ckdir, 10, _abstract(values, shardings))
    _assert_state(state, values, shardings)
    assert meta == META
    assert load_metadata(ckdir, 10) == META
    assert load_metadata(ckdir) == META


@pytest.mark.parametrize("layout", ["columns", "replicated", "other_mesh"])
def test_restore_into_different_sharding(ckdir, layout):
    values = _values()
    save_checkpoint(ckdir, 1, _put(values, _shardings_saved()), META)
    m, ab = _mesh_x(), _mesh_ab()
    new = {
        "columns": {"w": NamedSharding(m, P(None, "x")), "b": NamedSharding(m, P("x")), "k": NamedSharding(m, P(None, "x"))},
        "replicated": {"w": NamedSharding(m, P()), "b": NamedSharding(m, P()), "k": NamedSharding(m, P())},
        "other_mesh": {"w": NamedSharding(ab, P("b", "a")), "b": NamedSharding(ab, P("a")), "k": NamedSharding(ab, P("b", "a"))},
    }[layout]
    state, meta = restore_checkpoint(ckdir, None, _abstract(values, new))
    _assert_state(state, values, new)
    assert meta == META


def test_restore_into_concrete_arrays_uses_their_sharding(ckdir):
    values = _values()
    save_checkpoint(ckdir, 1, _put(values, _shardings_saved()), META)
    m = _mesh_x()
    new = {"w": NamedSharding(m, P(None, "x")), "b": NamedSharding(m, P()), "k": NamedSharding(m, P("x"))}
    target = _put(_values(seed=99), new)  # same shapes/shardings, other values
    state, _ = restore_checkpoint(ckdir, 1, target)
    _assert_state(state, values, new)


def test_shape_mismatch_names_path_and_both_shapes(ckdir):
    values = _values()
    save_checkpoint(ckdir, 1, _put(values, _shardings_saved()), META)
    target = _abstract(values, _shardings_saved())
    target["params"]["layers"][0]["k"] = jax.ShapeDtypeStruct((8, 32), jnp.float32, sharding=NamedSharding(_mesh_x(), P()))
    with pytest.raises(ValueError, match=r"shape mismatch at 'params/layers/0/k': checkpoint \(8, 24\), target \(8, 32\)"):
        restore_checkpoint(ckdir, 1, target)


def test_structure_mismatch_names_path(ckdir):
    values = _values()
    save_checkpoint(ckdir, 1, _put(values, _shardings_saved()), META)
    extra = _abstract(values, _shardings_saved())
    extra["params"]["new_bias"] = jax.ShapeDtypeStruct((4,), jnp.float32, sharding=NamedSharding(_mesh_x(), P()))
    with pytest.raises(ValueError, match=r"checkpoint has no entry 'params/new_bias' \(target shape \(4,\)\)"):
        restore_checkpoint(ckdir, 1, extra)
    missing = _abstract(values, _shardings_saved())
    del missing["params"]["b"]
    with pytest.raises(ValueError, match=r"target has no entry 'params/b' \(checkpoint shape \(8,\)\)"):
        restore_checkpoint(ckdir, 1, missing)


def test_target_without_sharding_is_rejected(ckdir):
    values = _values()
    save_checkpoint(ckdir, 1, _put(values, _shardings_saved()), META)
    target = _abstract(values, _shardings_saved())
    target["params"]["w"] = jax.ShapeDtypeStruct((16, 8), jnp.float32)
    with pytest.raises(ValueError, match="no sharding"):
        restore_checkpoint(ckdir, 1, target)


def test_latest_step_none_and_several(ckdir):
    assert latest_step(ckdir) is None  # missing directory
    os.makedirs(ckdir)
    assert latest_step(ckdir) is None  # empty directory
    for step in (5, 20, 100):
        _save(ckdir, step, max_to_keep=None)
    assert latest_step(ckdir) == 100
    assert complete_steps(ckdir) == [5, 20, 100]
    assert load_metadata(ckdir, 20)["iteration"] == 20


@pytest.mark.parametrize("max_to_keep,kept", [(None, [1, 2, 3, 4]), (2, [3, 4]), (3, [2, 3, 4]), (1, [4])])
def test_max_to_keep(ckdir, max_to_keep, kept):
    for step in (1, 2, 3, 4):
        _save(ckdir, step, max_to_keep=max_to_keep)
    assert complete_steps(ckdir) == kept
    assert sorted(n for n in os.listdir(ckdir) if n.isdigit()) == [str(s) for s in kept]


def test_default_keeps_two(ckdir):
    for step in (1, 2, 3):
        _save(ckdir, step)
    assert complete_steps(ckdir) == [2, 3]


def test_interrupted_save_is_ignored_and_previous_checkpoint_survives(ckdir):
    _save(ckdir, 3)
    _save(ckdir, 4)
    # What a kill during a save leaves behind: orbax's tmp dir (no marker yet) ...
    tmp = os.path.join(ckdir, "5.orbax-checkpoint-tmp-1700000000000000")
    shutil.copytree(os.path.join(ckdir, "4"), tmp)
    os.remove(os.path.join(tmp, COMMIT_MARKER))
    # ... and a step dir written in place without its commit marker (e.g. a partial copy).
    partial = os.path.join(ckdir, "6")
    os.makedirs(os.path.join(partial, "state"))
    with open(os.path.join(partial, "state", "_METADATA"), "w") as fh:
        fh.write("{truncated")

    assert latest_step(ckdir) == 4
    assert complete_steps(ckdir) == [3, 4]
    state, meta = restore_checkpoint(ckdir, None, _abstract(_values(4), _shardings_saved()))
    _assert_state(state, _values(4), _shardings_saved())
    assert meta["iteration"] == 4
    with pytest.raises(FileNotFoundError, match="no complete checkpoint for step 6"):
        restore_checkpoint(ckdir, 6, _abstract(_values(4), _shardings_saved()))
    with pytest.raises(FileNotFoundError, match="step 5"):
        load_metadata(ckdir, 5)

    # The next save clears the debris; the partial "6" does not take a max_to_keep slot.
    _save(ckdir, 7)
    assert complete_steps(ckdir) == [4, 7]
    assert sorted(os.listdir(ckdir)) == ["4", "7"]
    state, _ = restore_checkpoint(ckdir, 4, _abstract(_values(4), _shardings_saved()))
    _assert_state(state, _values(4), _shardings_saved())


def test_step_must_be_newer_than_latest(ckdir):
    _save(ckdir, 5)
    for step in (5, 3):
        with pytest.raises(ValueError, match=f"cannot save step {step}.*latest checkpoint 5"):
            _save(ckdir, step)
    assert complete_steps(ckdir) == [5]


def test_missing_directory_and_no_checkpoint(ckdir):
    target = _abstract(_values(), _shardings_saved())
    with pytest.raises(FileNotFoundError, match="does not exist"):
        restore_checkpoint(ckdir, None, target)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_metadata(ckdir, 1)
    os.makedirs(ckdir)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint in"):
        restore_checkpoint(ckdir, None, target)
    _save(ckdir, 1)
    with pytest.raises(FileNotFoundError, match=r"step 2 .*complete steps: \[1\]"):
        restore_checkpoint(ckdir, 2, target)


def test_why_nothing_to_load_names_what_was_found(tmp_path):
    ckdir = str(tmp_path / "ckpt")
    assert why_nothing_to_load(tmp_path / "missing") == "no such directory"
    (tmp_path / "file").write_text("x")
    assert why_nothing_to_load(tmp_path / "file") == "not a directory"
    (tmp_path / "empty").mkdir()
    assert why_nothing_to_load(tmp_path / "empty") == "an empty directory"
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    assert why_nothing_to_load(tmp_path / "other") == "no checkpoint step directory (found ['notes.txt'])"
    (tmp_path / "other" / "7").mkdir()
    assert why_nothing_to_load(tmp_path / "other") == (
        "no complete checkpoint (skipped incomplete step directories [7]: no commit_success.txt)")
    _save(ckdir, 3)
    assert why_nothing_to_load(ckdir) is None


def _damage(path, how):
    if how == "truncate":
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    else:  # flip one byte in place: same size, different content
        with open(path, "r+b") as f:
            first = f.read(1)
            f.seek(0)
            f.write(bytes([first[0] ^ 0xFF]))


@pytest.mark.parametrize("how", ["truncate", "flip"])
def test_damaged_file_is_named_and_the_previous_checkpoint_used(ckdir, how):
    for step in (1, 2):
        _save(ckdir, step)
    assert verify_checkpoint(ckdir, 2) is None
    step_dir = os.path.join(ckdir, "2")
    files = [os.path.join(r, f) for r, _, fs in os.walk(step_dir) for f in fs if not f.startswith("integrity.json")]
    biggest = max(files, key=os.path.getsize)
    _damage(biggest, how)
    problem = verify_checkpoint(ckdir, 2)
    assert problem.startswith(biggest) and ("truncated" if how == "truncate" else "corrupted") in problem
    assert latest_valid_step(ckdir) == (1, [f"checkpoint step 2 skipped: {problem}"])
    _damage(max((os.path.join(r, f) for r, _, fs in os.walk(os.path.join(ckdir, "1")) for f in fs
                 if f != "integrity.json"), key=os.path.getsize), how)
    step, skipped = latest_valid_step(ckdir)
    assert step is None and len(skipped) == 2


def test_save_without_copy_writes_the_given_arrays(ckdir, monkeypatch):
    """copy=False (the caller's arrays are its own copies already): no second snapshot."""
    monkeypatch.setattr(saver_module, "_copy_arrays", lambda arrays: pytest.fail("copied again"))
    values, shardings = _values(4), _shardings_saved()
    CheckpointSaver(ckdir).save(4, _put(values, shardings), {**META, "iteration": 4}, copy=False)
    restored, _ = restore_checkpoint(ckdir, 4, _abstract(values, shardings))
    _assert_state(restored, values, shardings)


# ---------------------------------------------------------------------------------------
# Asynchronous saves: the background thread (writer="thread"; the writer process's tests are
# in test_checkpoint_writer.py)


def test_async_save_survives_donation_of_the_saved_arrays(ckdir):
    """An async save returns before the files are written; the next step may donate (delete)
    the saved arrays right away, and the checkpoint still holds the values of the save."""
    values, shardings = _values(3), _shardings_saved()
    state = _put(values, shardings)
    saver = CheckpointSaver(ckdir, async_save=True, writer="thread")
    saver.save(3, state, {**META, "iteration": 3})
    donate = jax.jit(lambda t: jax.tree.map(lambda x: x * 0 - 1, t), donate_argnums=0)
    jax.block_until_ready(donate(state["params"]))
    assert state["params"]["w"].is_deleted()
    saver.close()
    assert complete_steps(ckdir) == [3] and verify_checkpoint(ckdir, 3) is None
    restored, meta = restore_checkpoint(ckdir, 3, _abstract(values, shardings))
    _assert_state(restored, values, shardings)
    assert meta["iteration"] == 3


class _FailingHandler(ocp.PyTreeCheckpointHandler):
    error: Exception = OSError("No space left on device")

    def save(self, directory, *args, **kwargs):
        raise self.error


@pytest.mark.parametrize("error,expected", [(OSError("No space left on device"), "No space left"),
                                            (RuntimeError("tensorstore broke"), "RuntimeError: tensorstore broke")])
def test_async_write_error_is_raised_by_the_next_save_and_nothing_is_committed(ckdir, monkeypatch, error, expected):
    _save(ckdir, 1)
    saver = CheckpointSaver(ckdir, async_save=True, writer="thread")
    monkeypatch.setattr(_FailingHandler, "error", error)
    monkeypatch.setattr(ocp, "PyTreeCheckpointHandler", _FailingHandler)
    saver.save(2, _put(_values(2), _shardings_saved()), {"iteration": 2})  # returns: the write is in the background
    with pytest.raises(OSError, match=expected):
        saver.save(3, _put(_values(3), _shardings_saved()), {"iteration": 3})
    assert complete_steps(ckdir) == [1]
    saver.close()  # the error was reported once
    monkeypatch.undo()
    _save(ckdir, 4)  # the next save clears the failed one's tmp dir
    assert sorted(os.listdir(ckdir)) == ["1", "4"]


def test_a_saver_lists_its_directory_at_the_first_save_and_after_a_failed_one(ckdir, monkeypatch):
    """The directory check and clean-up (a listing each) run on the step loop in an async save's
    blocking part: once, then the saver knows the newest step (its own) until a save fails."""
    listings, latest_step = [], checkpointing.latest_step

    def listing(directory):
        listings.append(directory)
        return latest_step(directory)

    monkeypatch.setattr(saver_module, "latest_step", listing)
    _save(ckdir, 1)
    saver = CheckpointSaver(ckdir, async_save=True, writer="thread")
    for step in (2, 3):
        saver.save(step, _put(_values(step), _shardings_saved()), {"iteration": step})
    saver.wait()
    assert len(listings) == 2  # _save's own saver, then this one's first save
    with pytest.raises(ValueError, match="cannot save step 3.*latest checkpoint 3"):  # known without a listing
        saver.save(3, _put(_values(3), _shardings_saved()), {"iteration": 3})
    assert len(listings) == 2
    with monkeypatch.context() as m:
        m.setattr(ocp, "PyTreeCheckpointHandler", _FailingHandler)
        saver.save(4, _put(_values(4), _shardings_saved()), {"iteration": 4})
        with pytest.raises(OSError, match="No space left"):
            saver.wait()
    saver.save(5, _put(_values(5), _shardings_saved()), {"iteration": 5})  # looks again, clears step 4's tmp dir
    saver.close()
    assert len(listings) == 3 and sorted(os.listdir(ckdir)) == ["3", "5"]


def test_arrays_are_stored_uncompressed_and_compressed_checkpoints_still_load(ckdir, monkeypatch):
    """No zstd (it saved 7% of real weights' bytes for as much CPU as the rest of a write): an
    array of zeros takes its full size on disk. Checkpoints written with zstd (before
    2026-11-27) load as before."""
    zeros = jnp.zeros((256, 512), jnp.float32)
    on_disk = lambda step: sum(os.path.getsize(os.path.join(r, f))
                               for r, _, fs in os.walk(os.path.join(ckdir, str(step))) for f in fs)
    save_checkpoint(ckdir, 1, {"z": zeros}, META)
    assert on_disk(1) >= zeros.nbytes
    handler = ocp.PyTreeCheckpointHandler
    monkeypatch.setattr(ocp, "PyTreeCheckpointHandler", lambda **_: handler(use_compression=True))
    save_checkpoint(ckdir, 2, {"z": zeros + 1}, META)
    monkeypatch.undo()
    assert on_disk(2) < zeros.nbytes / 10
    target = {"z": jax.ShapeDtypeStruct(zeros.shape, zeros.dtype, sharding=zeros.sharding)}
    for step in (1, 2):
        np.testing.assert_array_equal(restore_checkpoint(ckdir, step, target)[0]["z"], zeros + step - 1)


def _save_threads():
    return [t for t in threading.enumerate() if t.name == "checkpoint-save"]


def test_async_saves_share_one_thread_that_close_or_dropping_the_saver_ends(ckdir):
    """Starting a thread waits until it runs (milliseconds on busy cores): one per saver, started
    at its first async save and ended by close() (a later save starts another) or by dropping it."""
    before = _save_threads()
    saver = CheckpointSaver(ckdir, async_save=True, writer="thread", max_to_keep=None)
    for step in (1, 2):
        saver.save(step, _put(_values(step), _shardings_saved()), {"iteration": step})
    (thread,) = [t for t in _save_threads() if t not in before]
    saver.close()
    thread.join(timeout=30)
    assert not thread.is_alive()
    saver.save(3, _put(_values(3), _shardings_saved()), {"iteration": 3})
    (thread,) = [t for t in _save_threads() if t not in before]
    saver.wait()
    del saver
    thread.join(timeout=30)
    assert not thread.is_alive() and complete_steps(ckdir) == [1, 2, 3]


def test_at_most_one_async_save_in_flight(ckdir, monkeypatch):
    """A save returns while its write goes on, the next save joins it first, close() joins the last."""
    write, active, seen = step_writer._write_step, [], []

    def slow_write(*args):
        active.append(args[1])
        seen.append(list(active))
        time.sleep(0.3)
        write(*args)
        active.remove(args[1])

    monkeypatch.setattr(saver_module, "_write_step", slow_write)
    saver = CheckpointSaver(ckdir, max_to_keep=None, async_save=True, writer="thread")
    for step in (1, 2, 3):
        saver.save(step, _put(_values(step), _shardings_saved()), {"iteration": step})
        assert complete_steps(ckdir) == list(range(1, step))  # this one is still being written
    saver.close()
    assert seen == [[1], [2], [3]] and not active
    assert complete_steps(ckdir) == [1, 2, 3] and all(verify_checkpoint(ckdir, s) is None for s in (1, 2, 3))


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="thread priorities are a Linux feature")
def test_background_writer_runs_at_the_lowest_priority_on_cpu(ckdir, monkeypatch):
    """On the CPU backend the writer thread (only it) runs at nice 19, so the steps keep the cores."""
    write, seen = step_writer._write_step, []

    def recording_write(*args):
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        write(*args)

    monkeypatch.setattr(saver_module, "_write_step", recording_write)
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    saver = CheckpointSaver(ckdir, async_save=True, writer="thread")
    saver.save(1, _put(_values(1), _shardings_saved()), {"iteration": 1})
    saver.close()
    assert seen == [max(before, checkpointing.WRITER_NICE)]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
    CheckpointSaver(ckdir).save(2, _put(_values(2), _shardings_saved()), {"iteration": 2})  # synchronous
    assert seen[-1] == before


# ---------------------------------------------------------------------------------------
# Several processes: process 0 decides where to resume


class _FakeCoordinationClient:
    """The key-value store of the jax.distributed client, in memory."""

    def __init__(self):
        self.store = {}

    def key_value_set(self, key, value):
        assert key not in self.store, f"key {key} set twice"
        self.store[key] = value

    def blocking_key_value_get(self, key, timeout_ms):
        return self.store[key]


def _as_process(monkeypatch, client, index):
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: index)
    monkeypatch.setattr(ocp.multihost, "get_jax_distributed_client", lambda: client)
    monkeypatch.setattr(coordination, "collective_ids", itertools.count(100))  # the same call on each process


def test_latest_valid_step_is_decided_by_process_0_alone(ckdir, monkeypatch):
    for step in (1, 2):
        _save(ckdir, step)
    _damage(max((os.path.join(r, f) for r, _, fs in os.walk(os.path.join(ckdir, "2")) for f in fs),
                key=os.path.getsize), "flip")
    client = _FakeCoordinationClient()
    _as_process(monkeypatch, client, 0)
    answer = latest_valid_step(ckdir)
    assert answer[0] == 1 and answer[1][0].startswith("checkpoint step 2 skipped")
    assert len(client.store) == 1
    # Process 1 reads no file (its view could even differ): it takes process 0's answer.
    _as_process(monkeypatch, client, 1)
    monkeypatch.setattr(checkpoint_files, "_crc32", lambda path: pytest.fail("process 1 checksummed a file"))
    shutil.rmtree(os.path.join(ckdir, "1"))
    assert latest_valid_step(ckdir) == answer


def test_an_error_on_process_0_reaches_the_others(ckdir, monkeypatch):
    client = _FakeCoordinationClient()
    _as_process(monkeypatch, client, 0)
    monkeypatch.setattr(checkpoint_files, "complete_steps", lambda d: [1 / 0])
    with pytest.raises(ZeroDivisionError):
        latest_valid_step(ckdir)
    _as_process(monkeypatch, client, 1)
    with pytest.raises(OSError, match="process 0 failed: ZeroDivisionError"):
        latest_valid_step(ckdir)
