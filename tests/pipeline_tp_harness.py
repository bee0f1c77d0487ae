"""Table-driven (interleaved) 1F1B x tensor-parallel MLP stages x data parallelism vs the non-pipelined
model (shared by the single-process and the mpirun tests)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from core import parallel_state as ps
from core.pipeline_parallel.table_driven import forward_backward_table_driven
from core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region

H, F, MB = 4, 8, 2


def _tp_stage(p, x):
    """Residual MLP, column-parallel w1 and row-parallel w2 (Megatron's f / g mappings)."""
    h = jnp.tanh(copy_to_tensor_model_parallel_region(x) @ p["w1"])
    return x + reduce_from_tensor_model_parallel_region(h @ p["w2"])


def _dense_stage(p, x):
    return x + jnp.tanh(x @ p["w1"]) @ p["w2"]


def _loss(y, t):
    return jnp.mean((y - t) ** 2)


def run_and_compare(pp: int, tp: int, m: int, seed: int = 0, vpp: int = 1) -> tuple[np.ndarray, np.ndarray, dict, dict]:
    """Returns (loss, reference loss, grads, reference grads) as host numpy, on every process.

    Runs ``forward_backward_table_driven`` (Megatron's exact order) with ``vpp`` model chunks per
    rank: chunk c of rank r is virtual stage c * pp + r.
    """
    state = ps.build_parallel_state(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    dp = len(jax.devices()) // (pp * tp)
    rng = np.random.default_rng(seed)
    params = {"w1": rng.normal(size=(pp, vpp, H, F)).astype(np.float32) / 2,
              "w2": rng.normal(size=(pp, vpp, F, H)).astype(np.float32) / 2}
    x = rng.normal(size=(m, dp * MB, H)).astype(np.float32)
    t = rng.normal(size=(m, dp * MB, H)).astype(np.float32)
    pspecs = {"w1": P("pp", None, None, "tp"), "w2": P("pp", None, "tp", None)}
    dspec = P(None, ("dp", "ep"))

    def put(a, spec):
        return jax.make_array_from_callback(a.shape, NamedSharding(state.mesh, spec), lambda idx: a[idx])

    def body(p, x, t):
        p = jax.tree.map(lambda a: a[0], p)  # this rank's [vpp, ...] chunks
        loss, g = forward_backward_table_driven(_tp_stage, _loss, p, x, t, num_model_chunks=vpp)
        g = jax.tree.map(lambda a: jax.lax.pmean(a, ("dp", "ep"))[None], g)
        return jax.lax.pmean(jax.lax.psum(loss, "pp"), ("dp", "ep")), g

    loss, g = jax.jit(jax.shard_map(body, mesh=state.mesh, in_specs=(pspecs, dspec, dspec),
                                    out_specs=(P(), pspecs), check_vma=False))(
        {k: put(v, pspecs[k]) for k, v in params.items()}, put(x, dspec), put(t, dspec))
    loss = np.asarray(multihost_utils.process_allgather(loss, tiled=True))
    g = {k: np.asarray(multihost_utils.process_allgather(v, tiled=True)) for k, v in g.items()}

    def reference(params):
        def one(xm, tm):
            for vs in range(pp * vpp):
                xm = _dense_stage(jax.tree.map(lambda a, vs=vs: a[vs % pp, vs // pp], params), xm)
            return _loss(xm, tm)
        # Each dp rank's slice is its own microbatch loss; the global objective is their mean.
        xs = x.reshape(m, dp, MB, H).transpose(1, 0, 2, 3).reshape(dp * m, MB, H)
        ts = t.reshape(m, dp, MB, H).transpose(1, 0, 2, 3).reshape(dp * m, MB, H)
        return jnp.mean(jax.vmap(one)(xs, ts))

    with jax.default_device(jax.local_devices()[0]):
        want_loss, want_g = jax.value_and_grad(reference)(params)
    return loss, np.asarray(want_loss), g, {k: np.asarray(v) for k, v in want_g.items()}
