"""Megatron API: get_forward_backward_func, no-pipelining and 1F1B equal the non-pipelined model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from core import parallel_state as ps
from core.pipeline_parallel import schedules

H, MB = 4, 2


def _stage(p, x):
    return jnp.tanh(x @ p["w"] + p["b"])


def _forward_step(per_token):
    def forward_step_func(data, model):
        out = model(data["x"])

        def loss_func(y):
            err = (y - data["t"]) ** 2
            if per_token:
                return jnp.sum(err), jnp.asarray(err.size, jnp.float32), {"lm loss": jnp.mean(err)}
            return jnp.mean(err), {"lm loss": jnp.mean(err)}
        return out, loss_func
    return forward_step_func


def _reference(params, x, t, per_token):
    def f(params):
        def one(xm, tm):
            for s in range(params["w"].shape[0]):
                xm = _stage(jax.tree.map(lambda a: a[s], params), xm)
            return jnp.sum((xm - tm) ** 2) if per_token else jnp.mean((xm - tm) ** 2)
        losses = jax.vmap(one)(x, t)
        return jnp.sum(losses) if per_token else jnp.mean(losses), losses
    return jax.value_and_grad(f, has_aux=True)(params)


def _data(pp, m, seed=0):
    rng = np.random.default_rng(seed)
    params = {"w": rng.normal(size=(pp, H, H)).astype(np.float32) / 2, "b": rng.normal(size=(pp, H)).astype(np.float32)}
    x = rng.normal(size=(m, MB, H)).astype(np.float32)
    t = rng.normal(size=(m, MB, H)).astype(np.float32)
    return params, x, t


def test_get_forward_backward_func_picks_by_state():
    for pp, vpp, want in [(1, None, schedules.forward_backward_no_pipelining),
                          (2, None, schedules.forward_backward_pipelining_without_interleaving),
                          (2, 2, schedules.forward_backward_pipelining_with_interleaving)]:
        state = ps.build_parallel_state(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                                        devices=jax.devices()[:pp])
        assert schedules.get_forward_backward_func(state) is want


def _no_pipelining(per_token, forward_only=False, m=3):
    """(losses, grads, num_tokens) of the no-pipelining schedule on ``m`` microbatches, and the data."""
    params, x, t = _data(1, m)
    it = iter([{"x": x[i], "t": t[i]} for i in range(m)])
    out = schedules.forward_backward_no_pipelining(
        forward_step_func=_forward_step(per_token), data_iterator=it, model=(_stage, jax.tree.map(lambda a: a[0], params)),
        num_microbatches=m, seq_length=MB, micro_batch_size=1, forward_only=forward_only)
    return out, (params, x, t)


@pytest.mark.parametrize("per_token", [False, True])
def test_no_pipelining_equals_reference(per_token):
    (losses, grads, ntok), (params, x, t) = _no_pipelining(per_token)
    (_, per_mb), want = _reference(params, x, t, per_token)
    assert len(losses) == 3
    if per_token:
        np.testing.assert_allclose(ntok, x.size)
    for k in ("w", "b"):
        np.testing.assert_allclose(grads[k], want[k][0], rtol=1e-5, atol=1e-6)


def test_no_pipelining_forward_only_returns_the_losses():
    (losses, grads, ntok), (params, x, t) = _no_pipelining(False, forward_only=True)
    (_, per_mb), _ = _reference(params, x, t, False)
    assert grads is None and ntok is None
    np.testing.assert_allclose([d["lm loss"] for d in losses], per_mb, rtol=1e-6)


def _wide_stage(p, x):
    for _ in range(4):  # four layers whose [rows, 8 hid] activations dwarf the [rows, hid] data
        x = jnp.tanh(jnp.tanh(x @ p["up"]) @ p["down"])
    return x


def _no_pipelining_temp_bytes(m, rows=256, hid=32):
    params = {"up": jnp.zeros((hid, 8 * hid)), "down": jnp.zeros((8 * hid, hid))}

    def step(p, x):
        it = iter([{"x": x[i], "t": x[i]} for i in range(m)])
        return schedules.forward_backward_no_pipelining(
            forward_step_func=_forward_step(False), data_iterator=it, model=(_wide_stage, p), num_microbatches=m)[1]

    return jax.jit(step).lower(params, jnp.zeros((m, rows, hid))).compile().memory_analysis().temp_size_in_bytes


def test_no_pipelining_activation_memory_is_one_microbatch():
    """Gradient accumulation, as Megatron's loop: temp memory does not grow with the microbatch
    count beyond the stacked data (all microbatches at once, a ``vmap``, measured 7.4 -> 29.5 MiB
    for 4 -> 16 microbatches; one at a time 1.4 MiB both)."""
    small, large = _no_pipelining_temp_bytes(4), _no_pipelining_temp_bytes(16)
    data = 256 * 32 * 4  # one microbatch's input, bytes
    assert large - small <= 12 * 3 * data, (small, large)


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("mult", [1, 2])
@pytest.mark.parametrize("per_token,forward_only", [(False, False), (True, False), (False, True)])
def test_1f1b_megatron_api_equals_reference(pp, mult, per_token, forward_only):
    m = pp * mult
    state = ps.build_parallel_state(pipeline_model_parallel_size=pp, devices=jax.devices()[:pp])
    params, x, t = _data(pp, m, seed=pp + mult)
    fb = schedules.get_forward_backward_func(state)

    def body(p, x, t):
        p = jax.tree.map(lambda a: a[0], p)
        it = iter([{"x": x[i], "t": t[i]} for i in range(m)])
        losses, grads, ntok = fb(forward_step_func=_forward_step(per_token), data_iterator=it, model=(_stage, p),
                                 num_microbatches=m, seq_length=MB, micro_batch_size=1, forward_only=forward_only)
        lm = jax.lax.psum(jnp.stack([d["lm loss"] for d in losses]), "pp")  # only the last stage is non-zero
        grads = jax.tree.map(lambda a: a[None], grads if grads is not None else p)
        return lm, grads, jax.lax.psum(ntok if ntok is not None else 0.0, "pp")

    lm, g, ntok = jax.jit(jax.shard_map(body, mesh=state.mesh, in_specs=(P("pp"), P(), P()),
                                        out_specs=(P(), P("pp"), P()), check_vma=False))(params, x, t)
    (_, per_mb), want = _reference(params, x, t, per_token)
    want_lm = per_mb / (MB * H) if per_token else per_mb
    np.testing.assert_allclose(lm, want_lm, rtol=1e-5, atol=1e-6)
    if per_token:
        np.testing.assert_allclose(ntok, x.size)
    for k in ("w", "b"):
        np.testing.assert_allclose(g[k], params[k] if forward_only else want[k], rtol=1e-5, atol=1e-6)


def _reference_interleaved(params, x, t, per_token, pp, vpp):
    """Virtual stage vs = c * pp + r uses chunk c of rank r."""
    def f(params):
        def one(xm, tm):
            for vs in range(pp * vpp):
                xm = _stage(jax.tree.map(lambda a: a[vs % pp, vs // pp], params), xm)
            return jnp.sum((xm - tm) ** 2) if per_token else jnp.mean((xm - tm) ** 2)
        losses = jax.vmap(one)(x, t)
        return jnp.sum(losses) if per_token else jnp.mean(losses), losses
    return jax.value_and_grad(f, has_aux=True)(params)


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("mult", [1, 2])
@pytest.mark.parametrize("per_token,forward_only", [(False, False), (True, False), (False, True)])
def test_interleaved_megatron_api_equals_reference(pp, mult, per_token, forward_only):
    m, vpp = pp * mult, 2
    state = ps.build_parallel_state(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                                    devices=jax.devices()[:pp])
    rng = np.random.default_rng(pp + mult)
    params = {"w": rng.normal(size=(pp, vpp, H, H)).astype(np.float32) / 2,
              "b": rng.normal(size=(pp, vpp, H)).astype(np.float32)}
    x = rng.normal(size=(m, MB, H)).astype(np.float32)
    t = rng.normal(size=(m, MB, H)).astype(np.float32)
    fb = schedules.get_forward_backward_func(state)
    assert fb is schedules.forward_backward_pipelining_with_interleaving

    def body(p, x, t):
        chunks = [(_stage, jax.tree.map(lambda a, c=c: a[0, c], p)) for c in range(vpp)]  # Megatron's list
        it = iter([{"x": x[i], "t": t[i]} for i in range(m)])
        losses, grads, ntok = fb(forward_step_func=_forward_step(per_token), data_iterator=[it], model=chunks,
                                 num_microbatches=m, seq_length=MB, micro_batch_size=1, forward_only=forward_only)
        lm = jax.lax.psum(jnp.stack([d["lm loss"] for d in losses]), "pp")
        grads = jnp.zeros(()) if grads is None else jax.tree.map(lambda *a: jnp.stack(a)[None], *grads)
        return lm, grads, jax.lax.psum(ntok if ntok is not None else 0.0, "pp")

    gspec = P() if forward_only else P("pp")
    lm, g, ntok = jax.jit(jax.shard_map(body, mesh=state.mesh, in_specs=(P("pp"), P(), P()),
                                        out_specs=(P(), gspec, P()), check_vma=False))(params, x, t)
    (_, per_mb), want = _reference_interleaved(params, x, t, per_token, pp, vpp)
    np.testing.assert_allclose(lm, per_mb / (MB * H) if per_token else per_mb, rtol=1e-5, atol=1e-6)
    if per_token:
        np.testing.assert_allclose(ntok, x.size)
    if not forward_only:
        for k in ("w", "b"):
            np.testing.assert_allclose(g[k], want[k], rtol=1e-5, atol=1e-6)
