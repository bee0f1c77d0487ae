"""Tensor-parallel layers at tp in {1, 2, 4, 8} equal the dense single-device layer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from tp_harness import dense_parallel_mlp

from core import parallel_state as ps
from core.distributed.finalize_model_grads import allreduce_model_parallel_grads
from core.param_metadata import init_sharded_params
from core.tensor_parallel.fast_vjp import gelu, linear
from core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from core.transformer.mlp import ParallelMLP

S, B, H, F, V = 8, 2, 16, 32, 24
TPS = [1, 2, 4, 8]


def _init(state, module, x, x_spec):
    return init_sharded_params(module.init, state.mesh, (jax.random.key(0), x), (P(), x_spec))


def run_layer(tp, module, x, x_spec, cot, y_spec, output=lambda out: out[0]):
    """Global params, output, param grads (after finalize's tp sums) and input grad."""
    state = ps.build_parallel_state(tp)
    params, specs, infos = _init(state, module, x, x_spec)

    def body(params, x, cot):
        y, vjp = jax.vjp(lambda p, x: output(module.apply(p, x)), params, x)
        gp, gx = vjp(cot)
        leaves, treedef = jax.tree.flatten(gp)
        info_leaves = jax.tree.leaves(infos, is_leaf=lambda i: hasattr(i, "partition_spec"))
        gp = jax.tree.unflatten(treedef, allreduce_model_parallel_grads(leaves, info_leaves, state))
        return y, gp, gx

    fn = jax.jit(jax.shard_map(body, mesh=state.mesh, in_specs=(specs, x_spec, y_spec),
                               out_specs=(y_spec, specs, x_spec), check_vma=False))
    y, gp, gx = fn(params, x, cot)
    to_np = lambda t: jax.tree.map(np.asarray, t)
    return to_np(params), to_np(y), to_np(gp), np.asarray(gx)


def _check(got, want):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, np.asarray(b), rtol=1e-5, atol=1e-5), got, want)


def _check_against(dense, params, x, cot, y, gp, gx):
    """Output, param grads and input grad equal those of ``dense`` on the global params."""
    want_y, vjp = jax.vjp(dense, params, x)
    want_gp, want_gx = vjp(cot)
    _check(y, want_y)
    _check(gp, want_gp)
    _check(gx, want_gx)


def _linear(p, x):
    return x @ p["params"]["weight"].T + p["params"]["bias"]


def _data(*shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("mode", ["plain", "gather_output", "sequence_parallel", "skip_bias_add"])
def test_column_parallel_linear(tp, mode):
    module = ColumnParallelLinear(H, F, gather_output=mode == "gather_output",
                                  sequence_parallel=mode == "sequence_parallel", skip_bias_add=mode == "skip_bias_add")
    x, cot = _data(S, B, H), _data(S, B, F, seed=1)
    x_spec = P("tp") if mode == "sequence_parallel" else P()
    y_spec = P() if mode == "gather_output" else P(None, None, "tp")
    output = (lambda out: out[0] + out[1]) if mode == "skip_bias_add" else (lambda out: out[0])
    params, y, gp, gx = run_layer(tp, module, jnp.asarray(x), x_spec, jnp.asarray(cot), y_spec, output)
    # tp-invariant init: the same weights as at tp=1.
    ref_params = run_layer(1, module, jnp.asarray(x), P(), jnp.asarray(cot), y_spec if tp > 1 else y_spec, output)[0]
    _check(params, ref_params)
    _check_against(_linear, params, x, cot, y, gp, gx)


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("mode", ["plain", "input_is_parallel", "sequence_parallel"])
def test_row_parallel_linear(tp, mode):
    module = RowParallelLinear(F, H, input_is_parallel=mode != "plain", sequence_parallel=mode == "sequence_parallel")
    x, cot = _data(S, B, F), _data(S, B, H, seed=1)
    x_spec = P() if mode == "plain" else P(None, None, "tp")
    y_spec = P("tp") if mode == "sequence_parallel" else P()
    params, y, gp, gx = run_layer(tp, module, jnp.asarray(x), x_spec, jnp.asarray(cot), y_spec)
    _check_against(_linear, params, x, cot, y, gp, gx)


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("reduce_scatter", [False, True])
def test_vocab_parallel_embedding(tp, reduce_scatter):
    module = VocabParallelEmbedding(V, H, reduce_scatter_embeddings=reduce_scatter)
    ids = np.random.default_rng(0).integers(0, V, size=(B, S)).astype(np.int32)
    cot = _data(S, B, H, seed=1) if reduce_scatter else _data(B, S, H, seed=1)
    state = ps.build_parallel_state(tp)
    params, specs, _ = _init(state, module, jnp.asarray(ids), P())
    y_spec = P("tp") if reduce_scatter else P()

    def body(params, ids, cot):
        y, vjp = jax.vjp(lambda p: module.apply(p, ids), params)
        return y, vjp(cot)[0]

    y, gp = jax.jit(jax.shard_map(body, mesh=state.mesh, in_specs=(specs, P(), y_spec), out_specs=(y_spec, specs),
                                  check_vma=False))(params, ids, cot)
    dense = lambda p: p["params"]["weight"][ids].swapaxes(0, 1) if reduce_scatter else p["params"]["weight"][ids]
    want_y, vjp = jax.vjp(dense, jax.tree.map(np.asarray, params))
    _check(np.asarray(y), want_y)
    _check(jax.tree.map(np.asarray, gp), vjp(cot)[0])
    if tp > 1:
        _check(jax.tree.map(np.asarray, params), jax.tree.map(np.asarray, _init(ps.build_parallel_state(1), module,
                                                                                jnp.asarray(ids), P())[0]))


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_parallel_mlp_block_equals_dense_block(tp, sequence_parallel):
    module = ParallelMLP(H, F, sequence_parallel=sequence_parallel)
    x, cot = _data(S, B, H), _data(S, B, H, seed=1)
    spec = P("tp") if sequence_parallel else P()
    params, y, gp, gx = run_layer(tp, module, jnp.asarray(x), spec, jnp.asarray(cot), spec, output=lambda out: out)

    _check_against(dense_parallel_mlp, params, x, cot, y, gp, gx)


def test_indivisible_sizes_raise():
    state = ps.build_parallel_state(4)
    with pytest.raises(ValueError, match="18 is not divisible by 4"):
        _init(state, ColumnParallelLinear(H, 18), jnp.zeros((S, B, H)), P())


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_parallel_mlp_dropout_is_layout_independent(tp, sequence_parallel):
    """With dropout on, tp=k (with or without SP) gives the tp=1 output and grads exactly."""
    module = ParallelMLP(H, F, sequence_parallel=sequence_parallel, hidden_dropout=0.3, deterministic=False)
    x, cot = _data(S, B, H), _data(S, B, H, seed=1)
    spec = P("tp") if sequence_parallel else P()
    key = jax.random.key(3)
    runs = {}
    for t, sp_spec in ((1, P()), (tp, spec)):
        mod = module if t == tp else ParallelMLP(H, F, hidden_dropout=0.3, deterministic=False)
        state = ps.build_parallel_state(t)
        params, specs, infos = _init(state, mod, jnp.asarray(x), sp_spec)

        def body(p, x, cot, mod=mod, state=state, infos=infos):
            y, vjp = jax.vjp(lambda p, x: mod.apply(p, x, rngs={"dropout": key}), p, x)
            gp, gx = vjp(cot)
            leaves, treedef = jax.tree.flatten(gp)
            info_leaves = jax.tree.leaves(infos, is_leaf=lambda i: hasattr(i, "partition_spec"))
            return y, jax.tree.unflatten(treedef, allreduce_model_parallel_grads(leaves, info_leaves, state)), gx

        fn = jax.jit(jax.shard_map(body, mesh=state.mesh, in_specs=(specs, sp_spec, sp_spec),
                                   out_specs=(sp_spec, specs, sp_spec), check_vma=False))
        runs[t] = jax.tree.map(np.asarray, fn(params, jnp.asarray(x), jnp.asarray(cot)))
    assert 0.2 < float(np.mean((runs[1][0] - x) == 0)) < 0.4  # about 30 % of the block output dropped
    _check(runs[tp], runs[1])


@pytest.mark.parametrize("in_features, out_features", [(24, 8), (8, 24), (16, 16)])
def test_linear_gradients_equal_plain_matmul(in_features, out_features):
    """``linear``'s hand-written VJP (either operand transposed first, with and without bias)
    equals autodiff of ``x @ w.T + b``."""
    kx, kw, kg = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(kx, (5, 3, in_features))
    w = jax.random.normal(kw, (out_features, in_features))
    cot = jax.random.normal(kg, (5, 3, out_features))
    b = jax.random.normal(kg, (out_features,))
    grads = lambda f, *args: jax.jit(lambda c: jax.vjp(f, *args)[1](c))(cot)
    ref = lambda x, w, b=0.0: jnp.einsum("sbi,oi->sbo", x, w) + b
    for args in [(x, w), (x, w, b)]:
        for got, want in zip(grads(linear, *args), grads(ref, *args), strict=True):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(linear(x, w, b)), np.asarray(ref(x, w, b)), rtol=1e-5, atol=1e-5)


def test_gelu_value_and_gradient_equal_autodiff():
    """The hand-written tanh-GELU VJP equals autodiff of ``jax.nn.gelu(approximate=True)``."""
    x = jnp.linspace(-6.0, 6.0, 1001).reshape(7, 143)
    cot = jax.random.normal(jax.random.key(0), x.shape)
    ref = lambda x: jax.nn.gelu(x, approximate=True)
    np.testing.assert_array_equal(np.asarray(gelu(x)), np.asarray(ref(x)))
    got, want = (jax.jit(lambda c, f=f: jax.vjp(f, x)[1](c)[0])(cot) for f in (gelu, ref))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
