"""Pretraining checkpoints across layouts (one process, 8 simulated devices): the same layout
resumes bit-identically; any other layout (tp, pp, vpp, dp, cp, distributed optimizer on or off)
loads parameters and optimizer state (resharded) and continues within 1e-5 of the original
layout; old per-device optimizer checkpoints load only into their own layout; a damaged
checkpoint is refused naming the file."""

import json
import os
import shutil

import jax
import numpy as np
import pytest
from pretrain_harness import TINY

from core import checkpointing
from core import parallel_state as ps
from core.checkpointing import saver
from core.checkpointing.checkpointer import CheckpointError
from core.checkpointing.layer_order import from_layer_order, map_layer_leaves, to_layer_order
from core.optimizer import distrib_optimizer
from core.training.arguments import parse_args, validate_args
from core.training.pretrainer import Pretrainer
from core.training.run_config import pretrain_config

LATER = 5  # iterations run after the resume


def _trainer(tp, pp, *extra, devices=8):
    args = parse_args(TINY + ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
                              "--train-iters", "8", *extra])
    layout = validate_args(args, devices)
    state = ps.build_parallel_state(tp, pp, layout.virtual_pipeline_model_parallel_size,
                                    context_parallel_size=layout.context_parallel_size,
                                    devices=jax.devices()[:devices])
    return Pretrainer(pretrain_config(args), layout, state)


def _host(tree):
    return jax.tree.map(np.asarray, tree)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("ckpt"))
    # Saved in the background: the next steps run (and donate the params) while it is written.
    a = _trainer(2, 2, "--use-distributed-optimizer", "--async-save")
    for _ in range(3):
        a.step()
    a.save(directory)
    later = [a.step()["loss"] for _ in range(LATER)]
    a.finish_saving()
    return directory, later


def test_same_layout_resumes_exactly(saved):
    directory, later = saved
    b = _trainer(2, 2, "--use-distributed-optimizer")
    assert b.load(directory)
    assert b.iteration == 3 and b.data.sampler.consumed_samples == 3 * 16
    assert [b.step()["loss"] for _ in range(LATER)] == later


def test_a_save_copies_the_state_once_and_the_copy_outlives_the_next_step(tmp_path, monkeypatch):
    """checkpoint_state() is one jitted program's new arrays: the next step donates the
    trainer's own and the copy keeps the values; Pretrainer.save makes no second snapshot, and
    waits for the save in flight before it makes its copy (one copy in device memory at a time)."""
    t = _trainer(1, 1, "--use-distributed-optimizer", devices=2)
    t.step()
    state, meta = t.checkpointer.checkpoint_state(t.training_state())
    own, before = jax.tree.leaves(t.params), jax.tree.map(np.array, t.params)  # host copies, no views
    t.step()
    assert all(x.is_deleted() for x in own)  # the step donated the trainer's arrays
    assert not any(x.is_deleted() for x in jax.tree.leaves(state)) and meta["iteration"] == 1
    jax.tree.map(np.testing.assert_array_equal, _host(state["params"]), before)
    monkeypatch.setattr(saver, "_copy_arrays", lambda arrays: pytest.fail("copied a second time"))
    t.save(str(tmp_path / "ckpt"))
    assert checkpointing.complete_steps(tmp_path / "ckpt") == [2]
    calls, wait, copy = [], t.checkpointer._saver.wait, t.checkpointer.checkpoint_state  # the previous save's copy first
    monkeypatch.setattr(t.checkpointer._saver, "wait", lambda: calls.append("wait") or wait())
    monkeypatch.setattr(t.checkpointer, "checkpoint_state", lambda state: calls.append("copy") or copy(state))
    t.step()
    t.save(str(tmp_path / "ckpt"))
    assert calls[:2] == ["wait", "copy"] and checkpointing.complete_steps(tmp_path / "ckpt") == [2, 3]


def test_a_saves_copy_takes_one_dp_th_of_params_and_optimizer_state_per_device():
    """At dp 8 with the distributed optimizer each device holds 1/8 of the Adam state; the save's
    copy (params + the optimizer state's global form) is split over dp too, not whole on every
    device, and the global form still converts back exactly."""
    t = _trainer(1, 1, "--use-distributed-optimizer")
    t.step()
    state, _ = t.checkpointer.checkpoint_state(t.training_state())
    device = jax.devices()[0]
    on_device = lambda tree: sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
                                 if s.device == device)
    whole = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))
    for part in ("params", "opt_state"):
        assert on_device(state[part]) < 0.15 * whole(state[part]), part
    assert on_device(state["opt_state"]) < 1.1 * on_device(t.opt_state)
    back = t.optimizer.state_from_global(state["opt_state"])
    jax.tree.map(np.testing.assert_array_equal, _host(back), _host(t.opt_state))


def test_converting_the_optimizer_state_holds_about_one_param_at_a_time(monkeypatch):
    """The save's copy program converts the state in groups of params up to the largest one's
    size (at least 4 MiB, here lowered to nothing), one after the other, and the load's
    conversion one param after the other: their temporaries stay near the largest param (its
    whole Adam moment while it is reduce-scattered, or gathered with its positions in the
    shard), not the whole optimizer state on every rank, which converting whole buckets at once
    held (1.9 and 2.7 MB here against a largest param of 0.26 MB)."""
    monkeypatch.setattr(distrib_optimizer, "CONVERT_GROUP_MIN_ELEMENTS", 0)
    t = _trainer(1, 1, "--use-distributed-optimizer")
    state, _ = t.checkpointer.checkpoint_state(t.training_state())
    largest = max(x.nbytes for x in jax.tree.leaves(t.params))
    assert sum(x.nbytes for x in jax.tree.leaves(state["opt_state"])) > 6 * largest
    save = t.checkpointer._checkpoint_copy.lower(t.params, t.opt_state, t.model_state).compile().memory_analysis()
    assert save.temp_size_in_bytes < 1.5 * largest
    t.optimizer.state_from_global(state["opt_state"])
    load = t.optimizer.conversion_program("from_global").lower(state["opt_state"]).compile().memory_analysis()
    assert load.temp_size_in_bytes < 2.5 * largest


# (tp, pp, devices, extra) of the chunked conversions: tp 2 x pp 4; dp 8 in two instances
# of the partial distributed optimizer; dp 1 (no storage split: chunks of the last dimension); experts
# (their reduction over expert-data-parallel ranks only). Two layers where pp allows: the chunks'
# slices are traced and compiled one by one, and twice the layers took twice the time.
CHUNKED = [
    (2, 2, 8, ()),
    (1, 1, 8, ("--num-distributed-optimizer-instances", "2", "--num-layers", "2")),
    (2, 4, 8, ()),
    (1, 1, 8, ("--num-experts", "4", "--expert-model-parallel-size", "2", "--num-layers", "2")),
]


@pytest.mark.parametrize("tp,pp,devices,extra", CHUNKED, ids=["tp2pp2dp2", "dp8-instances2", "tp2pp4dp1", "dp8-ep2"])
def test_converting_in_chunks_gives_the_same_state_and_bounds_the_temporaries(monkeypatch, tp, pp, devices, extra):
    """With chunks of at most 2048 elements (the default, 16M, is larger than any parameter here)
    the save's and the load's conversions go in whole rows and in parts of rows, and give exactly
    the state of converting each parameter whole. A load's temporaries are then about two chunks
    (the gathered values and their positions) instead of two whole parameters; a save's (with more
    than one data-parallel rank: at dp 1 the pieces are the leaves) shrink too."""
    t = _trainer(tp, pp, "--use-distributed-optimizer", *extra, devices=devices)
    t.step()
    whole = t.optimizer.state_to_global(t.opt_state)
    temps = lambda: (t.optimizer.conversion_program("to_global").lower(t.opt_state).compile().memory_analysis().temp_size_in_bytes,
                     t.optimizer.conversion_program("from_global").lower(whole).compile().memory_analysis().temp_size_in_bytes)
    t.optimizer.state_from_global(whole)
    save_whole, load_whole = temps()
    limit = 2048
    monkeypatch.setattr(distrib_optimizer, "CONVERT_CHUNK_ELEMENTS", limit)
    monkeypatch.setattr(distrib_optimizer, "CONVERT_GROUP_MIN_ELEMENTS", 0)
    t.optimizer._programs.clear()  # rebuilt with the chunks
    _, _, splits = t.optimizer._storage_splits()
    opt = t.optimizer.inner
    chunks = [distrib_optimizer._chunks(shape, splits[i], limit) for s in opt.specs
              for i, shape in zip(s.leaves, s.shapes, strict=True)]
    assert any(len(c) > 1 and c[1][2:] == (0, view[2]) for view, c in chunks)  # whole rows
    # Parts of rows where a row is larger than a chunk: with a split (dp > 1) its dimension's blocks.
    assert any(c[0][3] < view[2] for view, c in chunks) == (t.layout.data_parallel_size > 1)
    chunked = t.optimizer.state_to_global(t.opt_state)
    jax.tree.map(np.testing.assert_array_equal, _host(chunked), _host(whole))
    jax.tree.map(np.testing.assert_array_equal, _host(t.optimizer.state_from_global(chunked)), _host(t.opt_state))
    save, load = temps()
    assert load <= 3 * 4 * limit < load_whole, (load, load_whole)
    assert save < save_whole if t.layout.data_parallel_size > 1 else save == save_whole, (save, save_whole)


def test_a_vpp_save_puts_the_layers_in_checkpoint_order_in_its_one_program(tmp_path):
    """At vpp 2 the copy program itself reshapes the stacked layers to ``[1, L, ...]``, each
    sharded like its parameter (dim 1 over pp) and over dp; a vpp-1 trainer loads exactly
    those values."""
    vpp = ("--virtual-pipeline-model-parallel-size", "2")
    a = _trainer(2, 2, *vpp, "--use-distributed-optimizer")
    a.step()
    state, _ = a.checkpointer.checkpoint_state(a.training_state())
    paths = a.ddp.param_paths
    for p, x, param in zip(paths, jax.tree.leaves(state["params"]), jax.tree.leaves(a.params)):
        assert x.shape[:2] == ((1, 4) if "layers" in p else param.shape[:2])
        assert x.sharding.spec == a.ddp.checkpoint_sharding(param).spec  # the param's, split over dp too
    reference = {"params": a.params, "opt_state": a.optimizer.state_to_global(a.opt_state)}
    reference = _host(map_layer_leaves(to_layer_order, reference, paths))
    jax.tree.map(np.testing.assert_array_equal, _host(state), reference)
    a.save(str(tmp_path))
    b = _trainer(2, 2, "--use-distributed-optimizer")
    assert b.load(str(tmp_path))
    loaded = {"params": b.params, "opt_state": b.optimizer.state_to_global(b.opt_state)}
    jax.tree.map(np.testing.assert_array_equal, _host(loaded), reference)


# (tp, pp, devices, extra): saved at tp2 pp2 dp2 with the distributed optimizer.
OTHER_LAYOUTS = [
    (1, 1, 1, ()),
    (1, 1, 8, ("--use-distributed-optimizer",)),
    (2, 1, 8, ()),
    (2, 2, 8, ("--virtual-pipeline-model-parallel-size", "2")),
    (1, 4, 8, ("--use-distributed-optimizer",)),
    (2, 1, 8, ("--context-parallel-size", "2", "--use-distributed-optimizer")),
    (1, 1, 8, ("--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2")),
    (1, 1, 1, ("--use-distributed-optimizer",)),
]


@pytest.mark.parametrize("tp,pp,devices,extra", OTHER_LAYOUTS,
                         ids=["1x1x1", "1x1x8-do", "2x1x4", "2x2x2-vpp2", "1x4x2-do", "2x1xcp2x2-do",
                              "1x1x8-do-instances2", "1x1x1-do"])
def test_other_layout_resumes_with_the_optimizer_state(saved, tp, pp, devices, extra):
    directory, later = saved
    b = _trainer(tp, pp, *extra, devices=devices)
    assert b.load(directory) and b.iteration == 3
    np.testing.assert_allclose([b.step()["loss"] for _ in range(LATER)], later, rtol=1e-5)
    if b.layout.virtual_pipeline_model_parallel_size:
        # Saving from vpp 2 writes the inverse of what this load read (checkpoint layer order).
        paths, state = b.ddp.param_paths, {"params": b.params, "opt_state": b.optimizer.state_to_global(b.opt_state)}
        flat = map_layer_leaves(to_layer_order, state, paths)
        assert {x.shape[:2] for p, x in zip(paths, jax.tree.leaves(flat["params"])) if "layers" in p} == {(1, 4)}
        back = map_layer_leaves(lambda x: from_layer_order(x, 2), flat, paths)
        jax.tree.map(np.testing.assert_array_equal, _host(back), _host(state))


@pytest.fixture(scope="module")
def old_format(saved, tmp_path_factory):
    """A checkpoint as written before the layout-independent format: the device-local state of the
    distributed optimizer, layers stacked by their vpp, no format marker."""
    directory, _ = saved
    a = _trainer(2, 2, "--use-distributed-optimizer")
    a.load(directory)
    meta = {k: v for k, v in checkpointing.load_metadata(directory).items() if k != "optimizer_format"}
    old = str(tmp_path_factory.mktemp("old"))
    checkpointing.save_checkpoint(old, a.iteration, {"params": a.params, "opt_state": a.opt_state}, meta)
    return old, jax.tree.map(np.asarray, a.params)


def test_old_per_device_optimizer_format_loads_only_into_its_layout(saved, old_format):
    _, later = saved
    old, params = old_format
    same = _trainer(2, 2, "--use-distributed-optimizer")
    assert same.load(old)
    assert [same.step()["loss"] for _ in range(LATER)] == later
    other = _trainer(1, 4)
    with pytest.raises(CheckpointError, match=r"per device \(the format before 'global-v1'\).*"
                                            r"tensor_model_parallel_size=2, pipeline_model_parallel_size=2.*"
                                            r"now \(tensor_model_parallel_size=1, pipeline_model_parallel_size=4.*"
                                            r"--no-load-optim"):
        other.load(old)
    assert other.load(old, load_optimizer=False)
    jax.tree.map(np.testing.assert_array_equal, _host(other.params), params)


def test_old_format_into_another_virtual_pipeline_size_is_refused(old_format):
    b = _trainer(2, 2, "--virtual-pipeline-model-parallel-size", "2")
    with pytest.raises(CheckpointError, match="virtual-pipeline-model-parallel-size None, now 2"):
        b.load(old_format[0], load_optimizer=False)


def test_unwritable_save_directory_is_a_clear_error(saved, tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=f"--save {tmp_path / 'file' / 'ckpt'}: cannot create or write"):
        _trainer(1, 1, "--save", str(tmp_path / "file" / "ckpt"))


def test_damaged_checkpoint_is_refused_naming_the_file(saved, tmp_path):
    directory, _ = saved
    copy = str(tmp_path / "copy")
    shutil.copytree(directory, copy)
    files = [os.path.join(r, f) for r, _, fs in os.walk(copy) for f in fs if not f.startswith("integrity.json")]
    victim = max(files, key=os.path.getsize)
    with open(victim, "r+b") as f:
        f.truncate(1)
    b = _trainer(2, 2, "--use-distributed-optimizer")
    with pytest.raises(CheckpointError, match=f"no intact checkpoint \\(checkpoint step 3 skipped: {victim} has 1 bytes"):
        b.load(copy)


def test_megatron_load_flags_ckpt_step_and_finetune_and_a_save_directory_ahead(tmp_path):
    """``--ckpt-step`` loads that checkpoint; ``--finetune`` the parameters only, from iteration 0
    at the start of the data with a fresh optimizer state; a run whose ``--save`` holds a newer
    checkpoint stops before its first step (its saves could not be newer)."""
    directory = str(tmp_path / "ckpt")
    a = _trainer(1, 1, "--use-distributed-optimizer", devices=2)
    a.step(), a.step()
    a.save(directory)
    params_2 = _host(a.params)
    a.step()
    a.save(directory)
    params_3 = _host(a.params)
    b = _trainer(1, 1, "--use-distributed-optimizer", devices=2)
    fresh_opt_state = _host(b.opt_state)
    assert b.load(directory, step=2) and (b.iteration, b.data.sampler.consumed_samples) == (2, 2 * 16)
    jax.tree.map(np.testing.assert_array_equal, _host(b.params), params_2)
    with pytest.raises(CheckpointError, match=r"--ckpt-step 5: no complete checkpoint 5 \(complete checkpoints: "
                                            r"\[2, 3\]\)"):
        b.load(directory, step=5)
    c = _trainer(1, 1, "--use-distributed-optimizer", devices=2)
    assert c.load(directory, finetune=True) and (c.iteration, c.data.sampler.consumed_samples) == (0, 0)
    jax.tree.map(np.testing.assert_array_equal, _host(c.params), params_3)
    jax.tree.map(np.testing.assert_array_equal, _host(c.opt_state), fresh_opt_state)
    assert np.isfinite(c.step()["loss"]) and c.iteration == 1
    copy = str(tmp_path / "copy")  # a damaged checkpoint asked for by step is refused, naming the file
    shutil.copytree(directory, copy)
    victim = max((os.path.join(r, f) for r, _, fs in os.walk(os.path.join(copy, "2")) for f in fs
                  if f != "integrity.json"), key=os.path.getsize)
    with open(victim, "r+b") as f:
        f.truncate(1)
    with pytest.raises(CheckpointError, match=f"--ckpt-step 2: {victim} has 1 bytes"):
        b.load(copy, step=2)
    d = _trainer(1, 1, "--use-distributed-optimizer", "--save", directory, devices=2)
    with pytest.raises(CheckpointError, match=f"--save {directory} already holds checkpoint 3, newer than this "
                                            r"run's start \(iteration 0\)"):
        d.train()
    assert d.iteration == 0 and checkpointing.complete_steps(directory) == [2, 3]
    damaged = str(tmp_path / "damaged")  # resumed from 2 past a damaged 3 in the same directory: said so
    shutil.copytree(directory, damaged)
    victim = max((os.path.join(r, f) for r, _, fs in os.walk(os.path.join(damaged, "3")) for f in fs
                  if f != "integrity.json"), key=os.path.getsize)
    with open(victim, "r+b") as f:
        f.truncate(1)
    e = _trainer(1, 1, "--use-distributed-optimizer", "--load", damaged, "--save", damaged, devices=2)
    assert e.load(damaged) and e.iteration == 2 and len(e.checkpointer.skipped_checkpoints) == 1
    with pytest.raises(CheckpointError, match=f"--save {damaged} holds checkpoint 3, newer than iteration 2 this run "
                                            f"resumed from, but damaged \\(skipped at --load\\): move it out"):
        e.train()


def test_no_save_optim_checkpoint_holds_the_params_only(tmp_path):
    directory = str(tmp_path / "ckpt")
    a = _trainer(1, 1, "--use-distributed-optimizer", "--no-save-optim", devices=2)
    a.step()
    assert set(a.checkpointer.checkpoint_state(a.training_state())[0]) == {"params"}  # no optimizer state gathered
    a.save(directory)
    assert checkpointing.load_metadata(directory)["optimizer_saved"] is False
    b = _trainer(1, 1, "--use-distributed-optimizer", devices=2)
    with pytest.raises(CheckpointError, match="saved without its optimizer state \\(--no-save-optim\\): pass "
                                            "--no-load-optim"):
        b.load(directory)
    assert b.load(directory, load_optimizer=False) and b.iteration == 1
    jax.tree.map(np.testing.assert_array_equal, _host(b.params), _host(a.params))


def test_a_save_directory_of_another_model_is_refused_before_the_first_step(tmp_path):
    """``--save`` pointing at another model's checkpoints: its keep-last-2 rotation used to delete
    them (exit 0, no warning). Now the run stops before its first step, naming both shapes."""
    other = str(tmp_path / "other")
    a = _trainer(1, 1, "--hidden-size", "32", devices=2)
    a.step(), a.step()
    a.save(other)
    b = _trainer(1, 1, "--save", other, "--save-interval", "1", devices=2)
    with pytest.raises(CheckpointError, match=f"--save {other} holds checkpoint 2 of a different model: "
                                            r"hidden_size=32 \(now 64\): this run's saves would rotate it away"):
        b.train()
    assert b.iteration == 0 and checkpointing.complete_steps(other) == [2]
    assert b.checkpointer.foreign_checkpoint(other).startswith("checkpoint 2 of a different model")
    same = _trainer(1, 1, "--hidden-size", "32", devices=2)  # the same model, another run
    assert same.checkpointer.foreign_checkpoint(other, other_runs=False) is None
    assert same.checkpointer.foreign_checkpoint(other) == f"checkpoint 2 of another run of this model (run {a.checkpointer.run_id}, this run " \
                                             f"{same.checkpointer.run_id})"
    assert same.load(other) and same.checkpointer.foreign_checkpoint(other) is None  # a resume is that run: its own checkpoints


def test_a_save_directory_of_another_run_of_the_model_is_refused(tmp_path):
    """Run A resumed from its own checkpoint but saving into run B's directory (the same model,
    older steps): the rotation would delete B's checkpoints. Checkpoints written before run ids
    (no ``run_id`` in their metadata) are checked by their model only."""
    mine, theirs = str(tmp_path / "mine"), str(tmp_path / "theirs")
    b = _trainer(1, 1, devices=2)
    b.step()
    b.save(theirs)
    a = _trainer(1, 1, devices=2)
    a.step(), a.step()
    a.save(mine)
    resumed = _trainer(1, 1, "--save", theirs, devices=2)
    assert resumed.load(mine) and resumed.checkpointer.run_id == a.checkpointer.run_id != b.checkpointer.run_id
    with pytest.raises(CheckpointError, match=f"--save {theirs} holds checkpoint 1 of another run of this model "
                                            f"\\(run {b.checkpointer.run_id}, this run {a.checkpointer.run_id}\\): this run's saves would "
                                            "rotate it away"):
        resumed.check_save_directory()
    meta = os.path.join(theirs, "1", checkpointing.META_ITEM, "metadata")
    with open(meta) as f:
        record = json.load(f)
    del record["run_id"]
    with open(meta, "w") as f:
        json.dump(record, f)
    resumed.check_save_directory()  # no run id recorded: the same model is enough


def test_a_resume_with_another_seed_is_refused_and_a_finetune_is_not(tmp_path):
    directory = str(tmp_path / "ckpt")
    a = _trainer(1, 1, devices=2)
    a.step()
    a.save(directory)
    b = _trainer(1, 1, "--seed", "7", devices=2)
    with pytest.raises(CheckpointError, match=f"--seed 7 differs from the seed of checkpoint 1 in {directory} "
                                            r"\(1234\): .* Pass --seed 1234 to resume, or --finetune"):
        b.load(directory)
    assert b.load(directory, finetune=True) and b.iteration == 0


def test_incomplete_steps_are_listed(tmp_path):
    directory = tmp_path / "ckpt"
    (directory / "4").mkdir(parents=True)
    (directory / "6").mkdir()
    (directory / "6" / checkpointing.COMMIT_MARKER).write_text("")
    (directory / "8").mkdir()
    assert checkpointing.incomplete_steps(directory) == [4, 8]
    assert checkpointing.complete_steps(directory) == [6]
    assert checkpointing.incomplete_steps(tmp_path / "missing") == []
