"""Run a function per device inside shard_map with per-rank inputs (shared by TP tests)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P


def run_per_rank(state, fn, *per_rank):
    """``per_rank[k][r]`` is rank r's k-th input; returns fn's outputs as arrays indexed by rank."""
    names = state.mesh.axis_names
    nd = len(names)
    order = state.device_ranks.ravel()

    def to_grid(a):
        a = np.asarray(a)
        return a[order].reshape(state.device_ranks.shape + a.shape[1:])

    def wrapped(*xs):
        out = fn(*[x.reshape(x.shape[nd:]) for x in xs])
        return jax.tree.map(lambda o: jnp.asarray(o).reshape((1,) * nd + jnp.shape(o)), out)

    out = jax.jit(jax.shard_map(wrapped, mesh=state.mesh, in_specs=P(*names), out_specs=P(*names),
                                check_vma=False))(*[to_grid(a) for a in per_rank])

    def from_grid(o):
        o = np.asarray(o).reshape((-1,) + o.shape[nd:])
        result = np.empty_like(o)
        result[order] = o
        return result

    return jax.tree.map(from_grid, out)


def value_and_input_grad(fn, x, cotangent):
    """Forward output of fn(x) and the VJP with ``cotangent`` (inside shard_map)."""
    out, vjp = jax.vjp(fn, x)
    return out, vjp(cotangent)[0]


def dense_parallel_mlp(params, x):
    """Single-device equivalent of ``core.transformer.mlp.ParallelMLP`` on global params."""
    p = params["params"]
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    h = (x - mean) / jnp.sqrt(var + 1e-6) * p["layernorm"]["scale"] + p["layernorm"]["bias"]
    h = jax.nn.gelu(h @ p["fc1"]["weight"].T + p["fc1"]["bias"])
    return x + h @ p["fc2"]["weight"].T + p["fc2"]["bias"]
