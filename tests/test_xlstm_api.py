"""xlstm_jax / JAX-tutorial helpers (core/distributed/array_utils.py, single_gpu.py) and the
example examples/xlstm_style_fsdp.py, which must equal one device in every layout."""

import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from core import parallel_state as ps
from core.distributed.array_utils import fold_rng_over_axis, split_array_over_mesh, stack_params, unstack_params
from core.distributed.single_gpu import (
    Batch,
    TrainState,
    accumulate_gradients,
    accumulate_gradients_loop,
    accumulate_gradients_scan,
)

ROOT = Path(__file__).resolve().parents[1]


sys.path.insert(0, str(ROOT / "examples"))  # examples/ is not a package


def _load_example():
    """examples/xlstm_style_fsdp.py as a module."""
    import xlstm_style_fsdp

    return xlstm_style_fsdp


def _per_device(state, fn, *args, in_specs=()):
    """Run ``fn`` on every device; returns its output stacked in global-rank order (dim 0)."""
    every = P(tuple(state.mesh.axis_names))
    out = jax.jit(jax.shard_map(lambda *a: fn(*a)[None], mesh=state.mesh, in_specs=tuple(in_specs),
                                out_specs=every, check_vma=False))(*args)
    return np.asarray(out)


# ---------------------------------------------------------------------------------------
# array_utils
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("axes", ["dp", "tp", ("dp", "tp"), ("pp", "dp", "tp")])
def test_fold_rng_over_axis_gives_each_device_its_own_key(axes):
    """Distinct keys along ``axes``, equal keys across the other axes, and exactly
    ``fold_in(key, lax.axis_index(axes))`` (for a tuple: the linear index, first axis major)."""
    state = ps.build_parallel_state(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    key = jax.random.key(3)
    got = _per_device(state, lambda k: jax.random.key_data(fold_rng_over_axis(k, axes)), key, in_specs=(P(),))
    names = (axes,) if isinstance(axes, str) else axes
    want = [np.asarray(jax.random.key_data(jax.random.fold_in(key, state.group_rank(r, names)))) for r in range(8)]
    np.testing.assert_array_equal(got, np.stack(want))
    group_size = int(np.prod([state.mesh.shape[a] for a in names]))
    assert len({tuple(k) for k in got}) == group_size
    for group in state.groups(names):  # each group along the axes: all keys differ
        assert len({tuple(got[r]) for r in group}) == len(group)


def test_split_array_over_mesh_keeps_this_devices_chunk():
    state = ps.build_parallel_state(tensor_model_parallel_size=4)
    x = np.arange(3 * 8, dtype=np.float32).reshape(3, 8)
    got = _per_device(state, lambda v: split_array_over_mesh(v, "tp", 1), x, in_specs=(P(),))
    for r in range(8):
        i = state.group_rank(r, ("tp",))
        np.testing.assert_array_equal(got[r], x[:, 2 * i:2 * i + 2])
    same = _per_device(state, lambda v: split_array_over_mesh(v, "pp", 1), x, in_specs=(P(),))
    np.testing.assert_array_equal(same, np.broadcast_to(x, (8, 3, 8)))  # axis of size 1: unchanged
    with pytest.raises(ValueError, match="cannot split dimension 0 of size 3"):
        _per_device(state, lambda v: split_array_over_mesh(v, "tp", 0), x, in_specs=(P(),))


def test_stack_and_unstack_params_round_trip():
    """``stack_params`` adds a size-1 dim partitioned over the axis (masked except one rank on
    request), ``unstack_params`` removes it; the global array stacks every rank's value."""
    state = ps.build_parallel_state(tensor_model_parallel_size=4)
    params = {"w": jnp.ones((2, 3)), "b": nn.Partitioned(jnp.ones((4,)), ("dp",))}

    def body(p):
        r = jax.lax.axis_index("tp").astype(jnp.float32)
        p = jax.tree.map(lambda v: v * (r + 1), p)
        return stack_params(p, "tp"), stack_params(p, "tp", axis=1, mask_except=2), unstack_params(
            stack_params(p, "tp"), "tp")

    shapes = jax.eval_shape(jax.shard_map(body, mesh=state.mesh, in_specs=P(), out_specs=P(), check_vma=False),
                            params)
    stacked, masked, back = shapes
    assert stacked["w"].names == ("tp", None, None) and stacked["w"].value.shape == (1, 2, 3)
    assert stacked["b"].names == ("tp", "dp") and masked["w"].names == (None, "tp", None)
    assert not isinstance(back["w"], nn.Partitioned) and back["w"].shape == (2, 3)
    assert back["b"].names == ("dp",)

    specs = nn.get_partition_spec(shapes)
    out = jax.jit(jax.shard_map(body, mesh=state.mesh, in_specs=P(), out_specs=specs, check_vma=False))(params)
    w, wm = np.asarray(out[0]["w"].value), np.asarray(out[1]["w"].value)
    np.testing.assert_array_equal(w[:, 0, 0], [1, 2, 3, 4])  # rank r's value is r + 1
    np.testing.assert_array_equal(wm[0, :, 0], [0, 0, 3, 0])  # masked except tp rank 2


# ---------------------------------------------------------------------------------------
# single_gpu: TrainState and gradient accumulation
# ---------------------------------------------------------------------------------------


class _DropoutMlp(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.tanh(nn.Dense(16)(x))
        x = nn.Dropout(0.5)(x, deterministic=not train)
        return nn.Dense(3)(x)


def _mean_loss(train):
    def loss_fn(params, apply_fn, batch, rng):
        y = apply_fn({"params": params}, batch.inputs, train=train, rngs={"dropout": rng})
        err = jnp.sum((y - batch.labels) ** 2, axis=-1)
        return jnp.mean(err), {"loss": (jnp.sum(err), batch.inputs.shape[0]), "max": (jnp.max(err),)}

    return loss_fn


def _state_and_batch(rows=32):
    model = _DropoutMlp()
    rng = np.random.default_rng(0)
    batch = Batch(inputs=jnp.asarray(rng.normal(size=(rows, 5)), jnp.float32),
                  labels=jnp.asarray(rng.normal(size=(rows, 3)), jnp.float32))
    params = model.init(jax.random.key(0), batch.inputs, train=False)["params"]
    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1), rng=jax.random.key(1))
    return state, batch


@pytest.mark.parametrize("use_scan", [False, True])
@pytest.mark.parametrize("num_minibatches", [1, 4])
def test_accumulated_gradients_equal_the_full_batch_gradient(num_minibatches, use_scan):
    """Mean loss, no dropout: the average of the minibatch gradients is the full-batch
    gradient (fp32, 1e-6); ``(sum, count)`` metrics are summed over the minibatches."""
    state, batch = _state_and_batch()
    loss_fn = _mean_loss(train=False)
    grads, metrics = jax.jit(lambda s, b: accumulate_gradients(s, b, jax.random.key(2), num_minibatches, loss_fn,
                                                               use_scan=use_scan))(state, batch)
    full_grad = jax.jit(lambda p, b: jax.value_and_grad(loss_fn, has_aux=True)(p, state.apply_fn, b,
                                                                               jax.random.key(2)))
    (_, full_metrics), full = full_grad(state.params, batch)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), grads, full)
    np.testing.assert_allclose(metrics["loss"][0], full_metrics["loss"][0], rtol=1e-6)
    assert int(metrics["loss"][1]) == 32


def test_loop_and_scan_accumulation_agree_with_dropout():
    state, batch = _state_and_batch()
    rng = jax.random.key(7)
    run = lambda fn, train=True: jax.jit(lambda s, b: fn(s, b, rng, 2, _mean_loss(train)))(state, batch)
    (g_loop, m_loop), (g_scan, m_scan) = run(accumulate_gradients_loop), run(accumulate_gradients_scan)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), (g_loop, m_loop),
                 (g_scan, m_scan))
    # Dropout is really on: the gradient differs from the deterministic one.
    g_det, _ = run(accumulate_gradients_loop, train=False)
    assert not np.allclose(g_loop["Dense_1"]["kernel"], g_det["Dense_1"]["kernel"])


@pytest.mark.parametrize("use_scan", [False, True])
def test_each_minibatch_gets_the_documented_key(use_scan):
    """Minibatch ``i`` is called with ``jax.random.split(rng, n)[i]``: the gradient of row ``i``
    of ``p`` is that minibatch's dropout mask / n, so the masks are read back and compared."""
    n, rows_per, width = 4, 2, 64
    batch = Batch(inputs=jnp.arange(n * rows_per), labels=jnp.zeros(n * rows_per))
    state = TrainState.create(apply_fn=None, params={"p": jnp.zeros((n, width))}, tx=optax.sgd(1.0),
                              rng=jax.random.key(0))

    def loss_fn(params, apply_fn, minibatch, rng):
        mask = jax.random.bernoulli(rng, 0.5, (width,)).astype(jnp.float32)
        which = jax.nn.one_hot(minibatch.inputs[0] // rows_per, n)  # this minibatch's index
        loss = jnp.sum(which[:, None] * params["p"] * mask[None])
        return loss, {"calls": (jnp.ones(()),)}

    rng = jax.random.key(11)
    grads, metrics = jax.jit(lambda s, b: accumulate_gradients(s, b, rng, n, loss_fn, use_scan=use_scan))(state, batch)
    masks = np.asarray(grads["p"]) * n
    want = np.stack([np.asarray(jax.random.bernoulli(k, 0.5, (width,)), np.float32)
                     for k in jax.random.split(rng, n)])
    np.testing.assert_array_equal(masks, want)
    assert len({tuple(m) for m in masks}) == n  # every minibatch drew a different mask
    assert float(metrics["calls"][0]) == n


def test_train_state_carries_rng_through_apply_gradients():
    state, batch = _state_and_batch()
    assert state.rng is not None and any(
        getattr(leaf, "dtype", None) == state.rng.dtype for leaf in jax.tree.leaves(state))  # a pytree leaf

    @jax.jit
    def step(state, batch):
        rng, step_rng = jax.random.split(state.rng)
        grads, _ = accumulate_gradients(state, batch, step_rng, 2, _mean_loss(train=True))
        return state.apply_gradients(grads=grads, rng=rng), rng

    new, rng = step(state, batch)
    assert int(new.step) == 1
    np.testing.assert_array_equal(jax.random.key_data(new.rng), jax.random.key_data(rng))
    assert not np.array_equal(jax.random.key_data(new.rng), jax.random.key_data(state.rng))
    assert not np.allclose(new.params["Dense_0"]["kernel"], state.params["Dense_0"]["kernel"])
    newer, _ = step(new, batch)  # and on: a different key every step
    assert not np.array_equal(jax.random.key_data(newer.rng), jax.random.key_data(new.rng))


# ---------------------------------------------------------------------------------------
# The example: sharded training equals one device
# ---------------------------------------------------------------------------------------


def test_example_script_trains_and_matches_single_device(capsys):
    """``python examples/xlstm_style_fsdp.py`` in one process (its ``main``, 8 simulated devices):
    tp=2 x pp=2 x dp=2, one line per step, then the single-device verdict (fp32 rtol=atol=1e-5)."""
    ex = _load_example()
    assert ex.main(["--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "mesh {'pp': 2, 'dp': 2, 'ep': 1, 'cp': 1, 'tp': 2}" in out
    assert [line.split()[1] for line in out.splitlines() if line.startswith("step ")] == ["1/3", "2/3", "3/3"]
    assert "matches single device" in out and "rtol=1e-05, atol=1e-05" in out


def test_example_pure_fsdp_with_scan_equals_single_device():
    """dp=8 (tp=pp=1) with ``lax.scan`` accumulation: losses and final parameters equal one
    device within the example's tolerance, the kernels stored sharded over dp, the loss falling."""
    ex = _load_example()
    config = ex.Config(use_scan=True)
    sharded, single = ex.check(1, 1, steps=3, config=config)
    assert ex.TOLERANCE == {"rtol": 1e-5, "atol": 1e-5}
    assert sharded.losses[-1] < sharded.losses[0]
    specs = jax.tree_util.tree_leaves_with_path(sharded.param_specs, is_leaf=lambda s: isinstance(s, P))
    kernels = [s for path, s in specs if "kernel" in jax.tree_util.keystr(path)]
    assert len(kernels) == 2 * config.num_layers and all("dp" in s for s in kernels), specs
    assert not np.allclose(single.params["block_0"]["up"]["kernel"], single.init_params["block_0"]["up"]["kernel"])
