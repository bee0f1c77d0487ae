"""Table-driven Megatron 1F1B / interleaved 1F1B: loss and grads equal the non-pipelined model,
and the slot table has Megatron's bubble."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from core import parallel_state as ps
from core.pipeline_parallel.table_driven import execute_stages, forward_backward_table_driven
from core.pipeline_parallel.timeline import build_timeline

H, MB = 4, 2


def _stage(p, x):
    return jnp.tanh(x @ p["w"] + p["b"])


def _loss(y, t):
    return jnp.mean((y - t) ** 2)


def _reference(params, x, t, pp, vpp):
    """Virtual stage vs = c * pp + r uses params[r, c]; mean microbatch loss and grads."""
    def f(params):
        def one(xm, tm):
            for vs in range(pp * vpp):
                xm = _stage(jax.tree.map(lambda a: a[vs % pp, vs // pp], params), xm)
            return _loss(xm, tm)
        return jnp.mean(jax.vmap(one)(x, t))
    return jax.value_and_grad(f)(params)


@pytest.mark.parametrize("pp,dp", [(2, 1), (4, 1), (2, 2), (4, 2)])
@pytest.mark.parametrize("mult", [1, 2, 4])
@pytest.mark.parametrize("vpp", [1, 2])
def test_table_driven_equals_non_pipelined(pp, dp, mult, vpp):
    m = pp * mult
    state = ps.build_parallel_state(pipeline_model_parallel_size=pp, devices=jax.devices()[:pp * dp])
    rng = np.random.default_rng(pp * 100 + dp * 10 + mult + vpp)
    params = {"w": rng.normal(size=(pp, vpp, H, H)).astype(np.float32) / 2,
              "b": rng.normal(size=(pp, vpp, H)).astype(np.float32)}
    x = rng.normal(size=(dp, m, MB, H)).astype(np.float32)
    t = rng.normal(size=(dp, m, MB, H)).astype(np.float32)

    def body(p, x, t):
        loss, g = forward_backward_table_driven(_stage, _loss, jax.tree.map(lambda a: a[0], p), x[0], t[0],
                                                num_model_chunks=vpp)
        g = jax.tree.map(lambda a: jax.lax.pmean(a, ("dp", "ep"))[None], g)  # DDP's share, by hand
        return jax.lax.pmean(jax.lax.psum(loss, "pp"), ("dp", "ep")), g

    dspec = P(("dp", "ep"))
    loss, g = jax.jit(jax.shard_map(body, mesh=state.mesh, in_specs=(P("pp"), dspec, dspec),
                                    out_specs=(P(), P("pp")), check_vma=False))(params, x, t)
    want_loss, want_g = _reference(params, x.reshape(dp * m, MB, H), t.reshape(dp * m, MB, H), pp, vpp)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
    for k in ("w", "b"):
        np.testing.assert_allclose(g[k], want_g[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pp,vpp", [(2, 2), (4, 1)])
@pytest.mark.parametrize("forward_only", [False, True])
def test_stage_metrics_sum_every_virtual_stage(pp, vpp, forward_only):
    # Each virtual stage reports its output's sum in its own row of a [pp * vpp] vector (and in a
    # scalar): per microbatch, on every rank, the rows are each stage's value and the scalar their sum.
    # The losses and grads are those of the run without stage metrics.
    m, nvs = 2 * pp, pp * vpp
    state = ps.build_parallel_state(pipeline_model_parallel_size=pp, devices=jax.devices()[:pp])
    rng = np.random.default_rng(pp + 10 * vpp)
    params = {"w": rng.normal(size=(pp, vpp, H, H)).astype(np.float32) / 2,
              "b": rng.normal(size=(pp, vpp, H)).astype(np.float32)}
    x = rng.normal(size=(m, MB, H)).astype(np.float32)

    def stage_step(with_metrics):
        def step(p, _shared, d, received, vs):
            y = _stage(p, jnp.where(vs == 0, d, received))
            loss = jnp.where(vs == nvs - 1, _loss(y, d), 0.0)
            if not with_metrics:
                return y, (loss, {"loss": loss})
            s = jax.lax.stop_gradient(jnp.sum(y))
            return y, (loss, {"loss": loss}), {"sum": s, "rows": jnp.zeros(nvs).at[vs].set(s)}
        return step

    def body(p, x):
        p = jax.tree.map(lambda a: a[0], p)
        kw = dict(num_model_chunks=vpp, forward_only=forward_only)
        losses, g, _, _, metrics = execute_stages(stage_step(True), x, p, stage_metrics=True, **kw)
        plain, g_plain, _, _ = execute_stages(stage_step(False), x, p, **kw)
        stack = lambda ds, k: jnp.stack([d[k] for d in ds])[None]
        out = (stack(losses, "loss"), stack(plain, "loss"), stack(metrics, "sum"), stack(metrics, "rows"))
        if not forward_only:
            out += tuple(jax.tree.map(lambda a: a[None], (g, g_plain)))
        return out

    n_out = 4 if forward_only else 6
    out = jax.jit(jax.shard_map(body, mesh=state.mesh, in_specs=(P("pp"), P()), out_specs=(P("pp"),) * n_out,
                                check_vma=False))(params, x)
    loss, plain, sums, rows = out[:4]
    np.testing.assert_array_equal(loss, plain)
    if not forward_only:
        jax.tree.map(np.testing.assert_array_equal, out[4], out[5])
    want = []
    for xm in x:  # virtual stage vs = c * pp + r uses params[r, c]
        h, per_stage = xm, []
        for vs in range(nvs):
            h = _stage(jax.tree.map(lambda a: a[vs % pp, vs // pp], params), h)
            per_stage.append(float(jnp.sum(h)))
        want.append(per_stage)
    want = np.asarray(want)
    for r in range(pp):  # every rank holds the whole model's values
        np.testing.assert_allclose(rows[r], want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(sums[r], want.sum(1), rtol=1e-5, atol=1e-5)


def test_stage_metrics_needs_the_third_item():
    state = ps.build_parallel_state(pipeline_model_parallel_size=2, devices=jax.devices()[:2])

    def body(p, x):
        step = lambda p, _s, d, r, vs: (_stage(p, d), (jnp.sum(d), {}))
        return execute_stages(step, x, jax.tree.map(lambda a: a[0], p), stage_metrics=True)[0]

    params = {"w": jnp.zeros((2, 1, H, H)), "b": jnp.zeros((2, 1, H))}
    with pytest.raises(ValueError, match="stage_step must return 3 items"):
        jax.jit(jax.shard_map(body, mesh=state.mesh, in_specs=(P("pp"), P()), out_specs=P(),
                              check_vma=False))(params, jnp.zeros((2, MB, H)))


@pytest.mark.parametrize("pp,vpp,m", [(2, 1, 4), (4, 1, 4), (4, 1, 16), (4, 2, 8), (4, 2, 16), (2, 2, 4)])
def test_slot_table_has_megatrons_bubble(pp, vpp, m):
    timeline = build_timeline(m, pp, vpp)
    ratio = (pp - 1) / (vpp * m)  # Megatron: bubble time / ideal compute time
    assert timeline.bubble_fraction() == pytest.approx(ratio / (1 + ratio))
    # Stashed inputs stay O(pp) per chunk, not O(M).
    assert timeline.buffer_size <= 2 * pp


def test_ring_buffer_does_not_grow_with_microbatches():
    sizes = {m: build_timeline(m, 4, 1).buffer_size for m in (4, 8, 16, 32)}
    assert len(set(sizes.values())) == 1, sizes


@pytest.mark.parametrize("vpp", [1, 2])
def test_compiled_temp_memory_does_not_grow_with_microbatches(vpp):
    pp = 4
    small, large = _temp_bytes(2 * pp, pp, "table_driven", vpp), _temp_bytes(8 * pp, pp, "table_driven", vpp)
    assert large <= 1.1 * small, (small, large)


def _temp_bytes(m, pp, schedule, vpp=1):
    """Compiled temp memory of one forward-backward step with ``m`` microbatches: ``schedule`` is
    ``"table_driven"`` (``vpp`` model chunks per rank) or ``"gpipe"``."""
    state = ps.build_parallel_state(pipeline_model_parallel_size=pp, devices=jax.devices()[:pp])
    hid = 64
    chunks = (vpp,) if schedule == "table_driven" else ()  # the executor takes [num_model_chunks, ...] params
    params = {"w": jnp.zeros((pp, *chunks, hid, hid)), "b": jnp.zeros((pp, *chunks, hid))}
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

    def table_driven(p, x):
        # The targets are the input (an argument): a jnp.zeros_like(x) target would be materialised,
        # [M, ...] of temp memory.
        return forward_backward_table_driven(_stage, _loss, p, x, x, num_model_chunks=vpp)

    fn = gpipe if schedule == "gpipe" else table_driven

    def body(p, x):
        loss, g = fn(jax.tree.map(lambda a: a[0], p), x)
        return loss, jax.tree.map(lambda a: a[None], g)

    compiled = jax.jit(jax.shard_map(body, mesh=state.mesh, in_specs=(P("pp"), P()), out_specs=(P(), P("pp")),
                                     check_vma=False)).lower(params, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_1f1b_memory_flat_in_microbatches_gpipe_grows():
    pp = 2
    f_small, f_big = _temp_bytes(pp, pp, "table_driven"), _temp_bytes(8 * pp, pp, "table_driven")
    g_small, g_big = _temp_bytes(pp, pp, "gpipe"), _temp_bytes(8 * pp, pp, "gpipe")
    act = 16 * 64 * 4  # one microbatch activation in bytes
    # 1F1B: ring buffers of timeline.buffer_size inputs whatever M; GPipe stores every slot's activations.
    assert f_big - f_small < 2 * act, (f_small, f_big)
    assert g_big - g_small >= 6 * pp * act, (g_small, g_big)
