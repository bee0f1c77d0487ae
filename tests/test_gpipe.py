"""GPipe (xlstm_jax API): output and gradients equal the stages applied in sequence."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from core import parallel_state as ps
from core.param_metadata import init_sharded_params
from core.pipeline_parallel.gpipe import PipelineModule
from core.tensor_parallel.tp_dense import ModelParallelismWrapper

H = 8


class _Stage(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.tanh(nn.Dense(H)(x))


def _model(m):
    stage = functools.partial(ModelParallelismWrapper, model_axis_name="pp", module_fn=_Stage, name="stage")
    return PipelineModule(model_axis_name="pp", num_microbatches=m, module_fn=stage)


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("mult", [1, 2, 4])
def test_gpipe_equals_sequential_stages(pp, mult):
    m = pp * mult
    state = ps.build_parallel_state(pipeline_model_parallel_size=pp)
    model = _model(m)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2 * m, H)).astype(np.float32)
    cot = rng.normal(size=(2 * m, H)).astype(np.float32)
    params, specs, _ = init_sharded_params(model.init, state.mesh, (jax.random.key(0), x), (P(), P()))

    def body(p, x, cot):
        y, vjp = jax.vjp(lambda p, x: model.apply(p, x), p, x)
        gp, gx = vjp(cot)
        return y[None], gp, gx[None]

    stacked = P(("pp", "dp", "ep", "cp", "tp"))
    y, gp, gx = jax.jit(jax.shard_map(body, mesh=state.mesh, in_specs=(specs, P(), P()),
                                      out_specs=(stacked, specs, stacked), check_vma=False))(params, x, cot)
    kernels = np.asarray(params["params"]["stage"]["sharded"]["Dense_0"]["kernel"])
    biases = np.asarray(params["params"]["stage"]["sharded"]["Dense_0"]["bias"])

    def sequential(k, b, x):
        for s in range(pp):
            x = jnp.tanh(x @ k[s] + b[s])
        return x

    want, vjp = jax.vjp(sequential, kernels, biases, x)
    gk, gb, gxx = vjp(cot)
    y, gx = np.asarray(y), np.asarray(gx)
    devices_per_stage = 8 // pp
    last = [(pp - 1) * devices_per_stage + i for i in range(devices_per_stage)]  # pp is the major mesh axis
    for d in range(8):
        np.testing.assert_allclose(y[d], want if d in last else 0.0, rtol=1e-5, atol=1e-6)
    # Stage 0 receives the input gradient (stage 0 consumed x).
    np.testing.assert_allclose(gx[0], gxx, rtol=1e-5, atol=1e-6)
    # Weight grads sum over every microbatch: summation order differs by XLA version (1.2e-6 seen).
    np.testing.assert_allclose(np.asarray(gp["params"]["stage"]["sharded"]["Dense_0"]["kernel"]), gk, rtol=1e-5, atol=5e-6)
    np.testing.assert_allclose(np.asarray(gp["params"]["stage"]["sharded"]["Dense_0"]["bias"]), gb, rtol=1e-5, atol=5e-6)
