"""xlstm_jax tensor-parallel API: ring collectives, TPDense and TPAsyncDense equal dense computations."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P
from tp_harness import run_per_rank

from core import parallel_state as ps
from core.param_metadata import init_sharded_params
from core.tensor_parallel.async_collectives import (
    async_gather,
    async_gather_bidirectional,
    async_gather_split,
    async_scatter,
    async_scatter_split,
)
from core.tensor_parallel.tp_dense import TPAsyncDense, TPDense

B, F, H = 4, 16, 32


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("gather", ["uni_up", "uni_down", "bi_up", "bi_down"])
def test_ring_gathers_return_the_ring_order(tp, gather):
    state = ps.build_parallel_state(tp)
    fn = {"uni_up": lambda x: async_gather(x, "tp", True), "uni_down": lambda x: async_gather(x, "tp", False),
          "bi_up": lambda x: async_gather_bidirectional(x, "tp", True),
          "bi_down": lambda x: async_gather_bidirectional(x, "tp", False)}[gather]
    x = np.stack([np.full((3,), r, np.float32) for r in range(8)])
    (out,) = run_per_rank(state, lambda v: (jnp.stack(fn(v)),), x)
    for r in range(8):
        group, me = state.group_of(r, ("tp",)), state.group_rank(r, ("tp",))
        sign = -1 if gather.endswith("up") else 1
        want = [group[(me + sign * i) % tp] for i in range(tp)]
        assert out[r, :, 0].tolist() == want
    # The split variant: first half up, second half down.
    (split,) = run_per_rank(state, lambda v: (jnp.concatenate(async_gather_split(jnp.tile(v, 2), "tp")),), x)
    assert split.shape == (8, 2 * tp * 3)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_ring_scatter_equals_psum_scatter(tp):
    state = ps.build_parallel_state(tp)
    partial = np.random.default_rng(0).normal(size=(8, 5, 4 * tp)).astype(np.float32)

    def body(p):
        n, me = tp, lax.axis_index("tp")
        chunks = jnp.stack(jnp.split(p, n, axis=-1))
        ys = [chunks[(me + n - 1 - k) % n] for k in range(n)]  # ys[k] travels to device me + n-1-k
        ring = async_scatter(ys, "tp")
        ys_split = [jnp.concatenate([chunks[(me + n - 1 - k) % n][..., :2], chunks[(me - (n - 1 - k)) % n][..., 2:]],
                                    -1) for k in range(n)]
        return ring, async_scatter_split(ys_split, "tp"), lax.psum_scatter(p, "tp", scatter_dimension=1, tiled=True)

    ring, split, want = run_per_rank(state, body, partial)
    np.testing.assert_allclose(ring, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(split, want, rtol=1e-5, atol=1e-6)


def _init_apply(state, module, x, x_spec, y_spec):
    params, specs, _ = init_sharded_params(module.init, state.mesh, (jax.random.key(0), x), (P(), x_spec))

    def body(p, x, cot):
        y, vjp = jax.vjp(lambda p, x: module.apply(p, x), p, x)
        return (y, *vjp(cot))

    fn = jax.jit(jax.shard_map(body, mesh=state.mesh, in_specs=(specs, x_spec, y_spec),
                               out_specs=(y_spec, specs, x_spec), check_vma=False))
    return params, fn


class _Block(nn.Module):
    """gather-in dense (features split over tp) -> gelu -> scatter-out dense, xlstm style."""

    tp: int
    asynchronous: bool = False
    bidirectional: bool = True
    use_bias: bool = True

    @nn.compact
    def __call__(self, x):
        if self.asynchronous:
            up = TPAsyncDense(functools.partial(nn.Dense, features=H // self.tp), "tp", "gather",
                              use_bidirectional_gather=self.bidirectional, use_bias=self.use_bias, name="up")
            down = TPAsyncDense(functools.partial(nn.Dense, features=F // self.tp), "tp", "scatter",
                                use_bias=self.use_bias, name="down")
        else:
            up = TPDense(functools.partial(nn.Dense, features=H // self.tp), "tp", "gather", use_bias=self.use_bias,
                         name="up")
            down = TPDense(functools.partial(nn.Dense, features=F), "tp", "scatter", use_bias=self.use_bias,
                           name="down")
        return down(nn.gelu(up(x)))


def _bias(tree):
    """A dense's bias, or None when the layer has none."""
    return tree["sharded"].get("bias")


def _dense_from_sync(params, tp):
    p = jax.tree.map(np.asarray, params["params"])
    up, down = p["up"]["module"], p["down"]["module"]
    k1, k2 = up["sharded"]["kernel"], down["sharded"]["kernel"]
    b1 = np.concatenate(list(_bias(up))) if _bias(up) is not None else np.zeros(H, np.float32)
    b2 = _bias(down).sum(0) if _bias(down) is not None else np.zeros(F, np.float32)
    return np.concatenate(list(k1), 1), b1, np.concatenate(list(k2), 0), b2


def _dense_from_async(params, tp):
    p = jax.tree.map(np.asarray, params["params"])
    fb, hb = F // tp, H // tp
    w1, w2 = np.zeros((F, H), np.float32), np.zeros((H, F), np.float32)
    for d in range(tp):
        for i in range(tp):
            c = (d - i) % tp  # gather: shard i on device d multiplies the chunk of device d - i
            w1[c * fb:(c + 1) * fb, d * hb:(d + 1) * hb] = p["up"][f"shard_{i}"]["sharded"]["kernel"][d]
            e = (d + tp - 1 - i) % tp  # scatter: shard i on device d feeds device d + n-1-i
            w2[d * hb:(d + 1) * hb, e * fb:(e + 1) * fb] = p["down"][f"shard_{i}"]["sharded"]["kernel"][d]
    up, down = _bias(p["up"]["shard_0"]), _bias(p["down"]["shard_0"])
    b1 = np.concatenate(list(up)) if up is not None else np.zeros(H, np.float32)
    b2 = np.concatenate([down[(e + 1) % tp] for e in range(tp)]) if down is not None else np.zeros(F, np.float32)
    return w1, b1, w2, b2


@pytest.mark.parametrize("variant", ["sync", "async"])
def test_tp_dense_without_bias(variant):
    """xlstm_jax's ``use_bias=False``: no bias parameter anywhere, and the block equals its dense
    form without biases (tp=4)."""
    tp = 4
    state = ps.build_parallel_state(tp)
    module = _Block(tp, asynchronous=variant == "async", use_bias=False)
    x = np.random.default_rng(1).normal(size=(B, F)).astype(np.float32)
    spec = P(None, "tp")
    params, fn = _init_apply(state, module, jnp.asarray(x), spec, spec)
    names = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)]
    assert names and not [n for n in names if "bias" in n], names
    w1, b1, w2, b2 = (_dense_from_sync if variant == "sync" else _dense_from_async)(params, tp)
    assert not b1.any() and not b2.any()
    y = fn(params, x, np.zeros_like(x))[0]
    np.testing.assert_allclose(np.asarray(y), nn.gelu(x @ w1) @ w2, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("variant", ["sync", "async_bi", "async_uni"])
def test_tp_mlp_block_equals_dense(tp, variant):
    state = ps.build_parallel_state(tp)
    module = _Block(tp, asynchronous=variant != "sync", bidirectional=variant == "async_bi")
    rng = np.random.default_rng(0)
    x, cot = rng.normal(size=(B, F)).astype(np.float32), rng.normal(size=(B, F)).astype(np.float32)
    spec = P(None, "tp")
    params, fn = _init_apply(state, module, jnp.asarray(x), spec, spec)
    y, gp, gx = fn(params, x, cot)
    w1, b1, w2, b2 = (_dense_from_sync if variant == "sync" else _dense_from_async)(params, tp)
    dense = lambda w1, b1, w2, b2, x: nn.gelu(x @ w1 + b1) @ w2 + b2
    want_y, vjp = jax.vjp(dense, w1, b1, w2, b2, x)
    _close(y, want_y)
    gw1, gb1, gw2, gb2, gxx = vjp(cot)
    _close(gx, gxx)
    got = (_dense_from_sync if variant == "sync" else _dense_from_async)(gp, tp)
    _close(got[0], gw1)
    _close(got[2], gw2)
    _close(got[1], gb1)


def _close(got, want):
    """fp32 equality up to summation order, relative to the array's scale: its elements are sums
    of terms up to ~7 in size, where reordering (by tp, and by XLA's code generation: the suite
    compiles with most optimizations off) moves an element near zero by up to ~2e-5."""
    want = np.asarray(want)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * max(1.0, np.abs(want).max()))
