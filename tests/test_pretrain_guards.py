"""Loss-curve guards of ``launch/pretrain.py`` (one process, simulated devices):
``--check-for-nan-in-loss-and-grad`` names the parameters and ranks of a NaN gradient, and
``--check-for-spiky-loss`` skips the update of a step whose loss jumps above the recent ones (also
with Megatron-FSDP ``optim_grads_params``); a
full disk stops the run with one line and keeps the previous checkpoint."""

import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pretrain_harness import TINY

from core import checkpointing
from core import parallel_state as ps
from core.checkpointing.checkpointer import CheckpointError
from core.training.arguments import parse_args, validate_args
from core.training.pretrainer import Pretrainer, TrainingError
from core.training.run_config import pretrain_config

ONE = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"]


def _trainer(*extra):
    args = parse_args([*TINY, *ONE, "--num-layers", "2", "--train-iters", "40", *extra])
    layout = validate_args(args, 2)
    return Pretrainer(pretrain_config(args), layout, ps.build_parallel_state(1, 1, devices=jax.devices()[:2]))


def _poison(params):
    """A NaN in one element of the final norm's weight."""
    leaves, treedef = jax.tree.flatten(params)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    i = next(i for i, p in enumerate(paths) if "final" in p and "scale" in p)
    leaves[i] = leaves[i].at[0].set(jnp.nan)
    return jax.tree.unflatten(treedef, leaves), paths[i]


# orbax closes its save's event loop on the first ENOSPC while tensorstore's other writes still
# report theirs to it ("Event loop is closed", unraisable); the error itself is raised as tested.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_full_disk_is_one_clear_error_and_the_previous_checkpoint_stays(tmp_path):
    # A tmpfs with room for one checkpoint (needs mount rights, as root in CI).
    disk = tmp_path / "disk"
    disk.mkdir()
    t = _trainer()
    t.step()
    t.save(str(tmp_path / "probe"))
    size = sum(f.stat().st_size for f in (tmp_path / "probe").rglob("*") if f.is_file())
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(size * 1.5)}", "tmpfs", str(disk)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        t.step()
        t.save(str(disk / "ckpt"))
        t.step()
        with pytest.raises(CheckpointError, match=r"cannot write checkpoint 3 to .*No space left on device.*"
                                                  r"the earlier checkpoints are intact"):
            t.save(str(disk / "ckpt"))
        assert checkpointing.latest_valid_step(disk / "ckpt") == (2, [])
    finally:
        subprocess.run(["umount", "-l", str(disk)])


@pytest.mark.parametrize("strategy", [(), ("--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                                            "optim_grads_params")], ids=["ddp", "optim_grads_params"])
def test_spiky_loss_skips_the_update_and_a_nan_gradient_is_named(strategy):
    # One trainer with both checks (one compile): first a spike, then a NaN. Under ZeRO-3 the
    # parameters are sharded over the two ranks; the checks see the same values.
    t = _trainer("--check-for-spiky-loss", "--spiky-loss-factor", "1.5", "--check-for-nan-in-loss-and-grad",
                 *strategy)
    losses = [t.step()["loss"] for _ in range(12)]
    kept = jax.tree.map(np.asarray, t.params)
    t.params = jax.tree.map(lambda x: x * 30.0 if x.ndim == 2 else x, t.params)  # logits blow up
    spiked = jax.tree.map(np.asarray, t.params)
    record = t.step()
    assert record["skipped"] and record["loss"] > 1.5 * max(losses)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, t.params), spiked)  # no update
    t.params = jax.tree.map(jnp.asarray, kept)
    record = t.step()
    assert "skipped" not in record and record["loss"] < 1.5 * max(losses)

    t.params, poisoned = _poison(t.params)
    with pytest.raises(TrainingError) as err:
        t.step()
    message = str(err.value)
    assert message.startswith("iteration 15: loss is nan") and "stopping, the last checkpoint is kept" in message
    n = len(jax.tree.leaves(t.params))  # every parameter's gradient is NaN on both ranks; ten pairs named
    assert f"NaN or Inf in local gradients ({2 * n} param/rank pairs)" in message
    assert f"rank 0: params{poisoned}" in message


def test_spiky_loss_factor_must_exceed_one():
    from core.training.arguments import ArgumentError

    with pytest.raises(ArgumentError, match="--spiky-loss-factor must be > 1, got 1.0"):
        validate_args(parse_args([*TINY, *ONE, "--spiky-loss-factor", "1.0"]), 2)


def test_a_write_error_names_the_os_reason_even_mid_message():
    # tensorstore can report ENOSPC mid-message, before a long JSON spec that the one-line cut drops.
    from core.checkpointing.checkpointer import write_error_line as _write_error

    error = ValueError('RESOURCE_EXHAUSTED: Error writing "x/.zarray": Failed to write 9 bytes to file 25: No space '
                       'left on device [os_error_code=\'28\'] ' + '{"spec": 0} ' * 100)
    assert _write_error(error).startswith("No space left on device: RESOURCE_EXHAUSTED: Error writing")
    assert len(_write_error(error)) < 450
    assert _write_error(ValueError("short")) == "short"
