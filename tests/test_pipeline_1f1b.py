"""1F1B SPMD executor: loss and stage-parameter grads equal the non-pipelined model (fp32)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from core import parallel_state as ps
from core.pipeline_parallel.one_f_one_b import forward_backward_1f1b

H, MB = 4, 2


def _stage(p, x):
    return jnp.tanh(x @ p["w"] + p["b"])


def _loss(y, t):
    return jnp.mean((y - t) ** 2)


def _reference(params, x, t):
    """Mean microbatch loss of the stages applied in sequence, and its grads."""
    def f(params):
        def one(xm, tm):
            for s in range(params["w"].shape[0]):
                xm = _stage(jax.tree.map(lambda a: a[s], params), xm)
            return _loss(xm, tm)
        return jnp.mean(jax.vmap(one)(x, t))
    return jax.value_and_grad(f)(params)


@pytest.mark.parametrize("pp,dp", [(2, 1), (4, 1), (2, 2), (4, 2)])
@pytest.mark.parametrize("mult", [1, 2, 4])
def test_1f1b_equals_non_pipelined(pp, dp, mult):
    m = pp * mult
    state = ps.build_parallel_state(pipeline_model_parallel_size=pp, devices=jax.devices()[:pp * dp])
    rng = np.random.default_rng(pp * 100 + dp * 10 + mult)
    params = {"w": rng.normal(size=(pp, H, H)).astype(np.float32) / 2, "b": rng.normal(size=(pp, H)).astype(np.float32)}
    # dp replicas each get m microbatches; the global loss is the mean over all dp * m.
    x = rng.normal(size=(dp, m, MB, H)).astype(np.float32)
    t = rng.normal(size=(dp, m, MB, H)).astype(np.float32)

    def body(p, x, t):
        p = jax.tree.map(lambda a: a[0], p)
        loss, g = forward_backward_1f1b(_stage, _loss, p, x[0], t[0], axis_name="pp")
        # Data-parallel averaging (DDP's job) done by hand here.
        g = jax.tree.map(lambda a: jax.lax.pmean(a, ("dp", "ep"))[None], g)
        loss = jax.lax.pmean(jax.lax.psum(loss, "pp"), ("dp", "ep"))
        return loss, g

    dspec = P(("dp", "ep"))
    loss, g = jax.jit(jax.shard_map(body, mesh=state.mesh, in_specs=(P("pp"), dspec, dspec),
                                    out_specs=(P(), P("pp")), check_vma=False))(params, x, t)
    want_loss, want_g = _reference(params, x.reshape(dp * m, MB, H), t.reshape(dp * m, MB, H))
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
    for k in ("w", "b"):
        np.testing.assert_allclose(g[k], want_g[k], rtol=1e-5, atol=1e-6)


def _temp_bytes(m, pp, schedule):
    """Compiled temp memory of one forward-backward step with ``m`` microbatches."""
    state = ps.build_parallel_state(pipeline_model_parallel_size=pp, devices=jax.devices()[:pp])
    hid = 64
    params = {"w": jnp.zeros((pp, hid, hid)), "b": jnp.zeros((pp, hid))}
    x = jnp.zeros((m, 16, hid))

    def gpipe(p, x):
        # GPipe: autodiff of the forward scan keeps every slot's activations.
        def loss(p):
            def step(carry, inp):
                stage = jax.lax.axis_index("pp")
                h = jnp.where(stage == 0, inp, carry)
                h = _stage(p, h)
                out = jnp.where(stage == pp - 1, h, 0.0)
                return jax.lax.ppermute(h, "pp", [(i, (i + 1) % pp) for i in range(pp)]), out
            xs = jnp.concatenate([x, jnp.zeros((pp - 1,) + x.shape[1:])])
            _, outs = jax.lax.scan(step, jnp.zeros_like(x[0]), xs)
            return jnp.mean(outs[pp - 1:] ** 2)
        return jax.value_and_grad(loss)(p)

    def one_f_one_b(p, x):
        return forward_backward_1f1b(_stage, lambda y, t: jnp.mean((y - t) ** 2), p, x, jnp.zeros_like(x))

    fn = gpipe if schedule == "gpipe" else one_f_one_b

    def body(p, x):
        loss, g = fn(jax.tree.map(lambda a: a[0], p), x)
        return loss, jax.tree.map(lambda a: a[None], g)

    compiled = jax.jit(jax.shard_map(body, mesh=state.mesh, in_specs=(P("pp"), P()), out_specs=(P(), P("pp")),
                                     check_vma=False)).lower(params, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_1f1b_memory_flat_in_microbatches_gpipe_grows():
    pp = 2
    f_small, f_big = _temp_bytes(pp, pp, "1f1b"), _temp_bytes(8 * pp, pp, "1f1b")
    g_small, g_big = _temp_bytes(pp, pp, "gpipe"), _temp_bytes(8 * pp, pp, "gpipe")
    act = 16 * 64 * 4  # one microbatch activation in bytes
    # 1F1B: the stash is 2 pp - 1 inputs whatever M; GPipe stores every slot's activations.
    assert f_big - f_small < 2 * act, (f_small, f_big)
    assert g_big - g_small >= 6 * pp * act, (g_small, g_big)


@pytest.mark.parametrize("pp,dp", [(2, 1), (4, 1), (2, 2), (4, 2)])
@pytest.mark.parametrize("mult", [1, 2, 4])
def test_interleaved_layout_equals_non_pipelined(pp, dp, mult):
    from core.pipeline_parallel.one_f_one_b import forward_backward_interleaved

    vpp, m = 2, pp * mult
    state = ps.build_parallel_state(pipeline_model_parallel_size=pp, devices=jax.devices()[:pp * dp])
    rng = np.random.default_rng(pp * 100 + dp * 10 + mult)
    # Virtual stage v = c * pp + r: sequential params [V, ...]; rank r holds [c*pp + r for c].
    seq = {"w": rng.normal(size=(pp * vpp, H, H)).astype(np.float32) / 2,
           "b": rng.normal(size=(pp * vpp, H)).astype(np.float32)}
    per_rank = jax.tree.map(lambda a: a.reshape((vpp, pp) + a.shape[1:]).swapaxes(0, 1), seq)  # [pp, vpp, ...]
    x = rng.normal(size=(dp, m, MB, H)).astype(np.float32)
    t = rng.normal(size=(dp, m, MB, H)).astype(np.float32)

    def body(p, x, t):
        p = jax.tree.map(lambda a: a[0], p)
        loss, g = forward_backward_interleaved(_stage, _loss, p, x[0], t[0], num_model_chunks=vpp)
        g = jax.tree.map(lambda a: jax.lax.pmean(a, ("dp", "ep"))[None], g)
        return jax.lax.pmean(jax.lax.psum(loss, "pp"), ("dp", "ep")), g

    dspec = P(("dp", "ep"))
    loss, g = jax.jit(jax.shard_map(body, mesh=state.mesh, in_specs=(P("pp"), dspec, dspec),
                                    out_specs=(P(), P("pp")), check_vma=False))(per_rank, x, t)
    want_loss, want_g = _reference(seq, x.reshape(dp * m, MB, H), t.reshape(dp * m, MB, H))
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
    for k in ("w", "b"):
        got = np.asarray(g[k]).swapaxes(0, 1).reshape(want_g[k].shape)
        np.testing.assert_allclose(got, want_g[k], rtol=1e-5, atol=1e-6)
