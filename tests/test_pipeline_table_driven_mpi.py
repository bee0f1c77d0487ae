"""Table-driven interleaved 1F1B across 8 real processes (pp=4, dp=2, vpp=2)."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_pipeline_table_driven import MB, H, _loss, _reference, _stage

from core import parallel_state as ps
from core.pipeline_parallel.table_driven import forward_backward_table_driven

pytestmark = pytest.mark.mpi(min_size=8)


@pytest.mark.parametrize("vpp", [1, 2])
def test_table_driven_across_processes(vpp):
    pp, dp, m = 4, 2, 8
    state = ps.initialize_model_parallel(pipeline_model_parallel_size=pp)
    rng = np.random.default_rng(7)
    params = {"w": rng.normal(size=(pp, vpp, H, H)).astype(np.float32) / 2,
              "b": rng.normal(size=(pp, vpp, H)).astype(np.float32)}
    x = rng.normal(size=(dp, m, MB, H)).astype(np.float32)
    t = rng.normal(size=(dp, m, MB, H)).astype(np.float32)
    dspec = P(("dp", "ep"))
    put = lambda a, spec: jax.make_array_from_callback(a.shape, NamedSharding(state.mesh, spec), lambda i: a[i])

    def body(p, x, t):
        loss, g = forward_backward_table_driven(_stage, _loss, jax.tree.map(lambda a: a[0], p), x[0], t[0],
                                                num_model_chunks=vpp)
        g = jax.tree.map(lambda a: jax.lax.pmean(a, ("dp", "ep"))[None], g)
        return jax.lax.pmean(jax.lax.psum(loss, "pp"), ("dp", "ep")), g

    fn = jax.jit(jax.shard_map(body, mesh=state.mesh, in_specs=(P("pp"), dspec, dspec), out_specs=(P(), P("pp")),
                               check_vma=False))
    loss, g = fn(jax.tree.map(lambda a: put(a, P("pp")), params), put(x, dspec), put(t, dspec))
    want_loss, want_g = _reference(params, x.reshape(dp * m, MB, H), t.reshape(dp * m, MB, H), pp, vpp)
    np.testing.assert_allclose(float(loss.addressable_shards[0].data), float(want_loss), rtol=1e-5)
    stage = jax.process_index() // (8 // pp)  # pp is the major mesh axis: ranks 0-1 are stage 0, ...
    for k in ("w", "b"):
        local = np.asarray(g[k].addressable_shards[0].data)[0]
        np.testing.assert_allclose(local, np.asarray(want_g[k])[stage], rtol=1e-5, atol=1e-6)
