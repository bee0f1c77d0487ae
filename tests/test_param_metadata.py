"""Parameter metadata survives init, is readable as ParamInfo, and unboxes cleanly."""

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from core.param_metadata import ParamInfo, param_info_tree, unbox, with_parallel_metadata


class _Toy(nn.Module):
    @nn.compact
    def __call__(self, x):
        w = self.param("w", with_parallel_metadata(nn.initializers.ones, ("tp", None)), (4, 3))
        b = self.param("b", with_parallel_metadata(nn.initializers.zeros, (None,), sequence_parallel=True), (3,))
        e = self.param("e", with_parallel_metadata(nn.initializers.ones, (None, "tp"), shared_embedding=True), (3, 3))
        plain = self.param("plain", nn.initializers.ones, (3,))
        return x @ w + b + plain + e.sum()


def test_param_info_tree_reads_declared_metadata():
    variables = _Toy().init(jax.random.key(0), jnp.ones((2, 4)))
    info = param_info_tree(variables)["params"]
    assert info["w"] == ParamInfo(P("tp", None))
    assert info["w"].tensor_model_parallel and info["w"].partition_dim == 0
    assert info["b"].sequence_parallel and not info["b"].tensor_model_parallel
    assert info["e"].shared_embedding and info["e"].partition_dim == 1
    assert info["plain"] == ParamInfo(P()) and info["plain"].partition_dim is None
    assert nn.get_partition_spec(variables)["params"]["w"] == P("tp", None)


def test_unbox_gives_plain_arrays_that_apply():
    variables = _Toy().init(jax.random.key(0), jnp.ones((2, 4)))
    plain = unbox(variables)
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(plain))
    out = _Toy().apply(variables, jnp.ones((2, 4)))
    assert out.shape == (2, 3) and float(out[0, 0]) == 4.0 + 0.0 + 1.0 + 9.0
