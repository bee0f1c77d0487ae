"""ZB-V execution (one process, 8 simulated devices): the executor equals the interleaved 1F1B
executor on a toy model (compared by virtual stage: the two place chunk 1 differently), its
buffers match the table's activation bound, and GPT pretraining with ``--pipeline-schedule zb-v``
equals one device (losses and parameters after 5 steps, in layer order) across tp/SP, dp, the
distributed optimizer, MoE with expert bias and FP8 delayed scaling; checkpoints move between
ZB-V's V placement and the interleaved one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from core import parallel_state as ps
from core.pipeline_parallel.table_driven import execute_stages
from core.pipeline_parallel.zero_bubble import build_zb_v_timeline, interleaved_1f1b_peak_live, v_stage
from core.pipeline_parallel.zero_bubble_executor import (
    build_plan,
    execute_stages_zb_v,
    live_activation_bound,
    v_stages,
)

H, MB = 4, 2


def _toy_step(p, shared, d, received, vs, last):
    """Stage 0 embeds with the shared matrix, the last stage's loss uses it again (tied); every
    stage reports its output's sum; the chunk's ``amax`` leaf receives a max-combined cotangent."""
    chunk, amax = p
    x = jnp.where(vs == 0, d["x"] @ shared["emb"], received)
    y = jnp.tanh(x @ chunk["w"] + chunk["b"] + 0.1 * vs) * amax
    loss = jnp.where(vs == last, jnp.mean((y @ shared["emb"].T - d["t"]) ** 2), 0.0)
    metrics = {"sum": jax.lax.stop_gradient(jnp.sum(y))}
    return y, (loss, {"loss": loss}), metrics


def _by_rank(per_stage: np.ndarray, stage_of) -> np.ndarray:
    """[2 pp, ...] per virtual stage -> [pp, 2, ...] per (rank, chunk) under ``stage_of``."""
    pp = per_stage.shape[0] // 2
    return np.stack([np.stack([per_stage[stage_of(r, c)] for c in range(2)]) for r in range(pp)])


@pytest.mark.parametrize("pp,m", [(2, 2), (2, 5), (4, 4), (4, 8), (4, 9)])
def test_executor_equals_interleaved_executor(pp, m):
    state = ps.build_parallel_state(pipeline_model_parallel_size=pp, devices=jax.devices()[:pp])
    rng = np.random.default_rng(pp * 10 + m)
    w = rng.normal(size=(2 * pp, H, H)).astype(np.float32) / 2
    b = rng.normal(size=(2 * pp, H)).astype(np.float32)
    amax = (1.0 + rng.random(size=(2 * pp,))).astype(np.float32)
    shared = {"emb": rng.normal(size=(H, H)).astype(np.float32)}
    data = {"x": rng.normal(size=(m, MB, H)).astype(np.float32), "t": rng.normal(size=(m, MB, H)).astype(np.float32)}
    step = lambda p, sp, d, r, vs: _toy_step(p, sp, d, r, vs, 2 * pp - 1)
    placements = {"interleaved": lambda r, c: c * pp + r, "v": lambda r, c: v_stage(pp, r, c)}

    def body(execute):
        def run(chunk, amax, shared, data):
            out = execute(step, data, (jax.tree.map(lambda a: a[0], chunk), amax[0]), shared, num_model_chunks=2,
                          stage_metrics=True, chunk_grad_combine=("sum", "max"),
                          microbatch_group_size_per_vp_stage=m)  # interleaved 1F1B's any-m grouping
            lift = lambda tree: jax.tree.map(lambda a: a[None], tree)
            return lift((jnp.stack([d["loss"] for d in out[0]]), out[1], out[2],
                         jnp.stack([d["sum"] for d in out[4]])))

        return jax.jit(jax.shard_map(run, mesh=state.mesh, in_specs=(P("pp"), P("pp"), P(), P()),
                                     out_specs=P("pp"), check_vma=False))

    results = {}
    for name, execute in (("interleaved", execute_stages), ("v", execute_stages_zb_v)):
        place = placements[name]
        chunk = {"w": _by_rank(w, place), "b": _by_rank(b, place)}
        results[name] = jax.device_get(body(execute)(chunk, _by_rank(amax, place), shared, data))
    ref, zb = list(results["interleaved"]), list(results["v"])
    ref_losses, zb_losses = ref[0].reshape(pp, m), zb[0].reshape(pp, m)
    # The loss stage is rank pp - 1's chunk 1 interleaved, rank 0's chunk 1 in the V.
    np.testing.assert_allclose(zb_losses[0], ref_losses[pp - 1], rtol=1e-6)
    assert np.any(ref_losses[pp - 1] != 0) and not np.any(zb_losses[1:])
    for name, fix in (("interleaved", ref), ("v", zb)):  # chunk grads back to virtual-stage order
        place = placements[name]
        fix[1] = jax.tree.map(lambda a, place=place: np.stack([a[r, c] for s in range(2 * pp) for r in range(pp)
                                                               for c in range(2) if place(r, c) == s]), fix[1])
        fix[2] = jax.tree.map(lambda a: a.sum(0), fix[2])  # shared grads: each rank has its stages' share
    jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6), ref[1:], zb[1:])
    assert np.any(np.asarray(ref[2]["emb"]) != 0)
