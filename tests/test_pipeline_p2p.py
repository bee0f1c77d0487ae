"""p2p_communication helpers move tensors one stage forward / backward, zeros at the ends."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from core import parallel_state as ps
from core.pipeline_parallel import p2p_communication as p2p


def test_send_forward_recv_backward_moves_one_stage():
    pp = 4
    state = ps.build_parallel_state(pipeline_model_parallel_size=pp, devices=jax.devices()[:pp])

    def body(x):
        stage = jax.lax.axis_index("pp").astype(jnp.float32)
        inp, out_grad = p2p.send_forward_recv_backward(x + stage, 10 * (x + stage))
        return inp, out_grad

    x = jnp.zeros((pp, 3))
    inp, og = jax.jit(jax.shard_map(body, mesh=state.mesh, in_specs=P("pp"), out_specs=(P("pp"), P("pp")),
                                    check_vma=False))(x)
    np.testing.assert_array_equal(np.asarray(inp)[:, 0], [0, 0, 1, 2])      # from stage i-1; stage 0 gets zeros
    np.testing.assert_array_equal(np.asarray(og)[:, 0], [10, 20, 30, 0])    # from stage i+1; last gets zeros
