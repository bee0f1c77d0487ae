"""The MoE layer (core/transformer/moe) against a plain reference, and across expert-parallel layouts.

One process, 8 simulated CPU devices, float32. The reference decides the routing in numpy with
Python loops over tokens and experts (top-k, expert bias, capacity per expert column with either
drop policy) and computes the output as a loop over experts of prob-weighted dense expert MLPs, with
the Switch / sequence aux loss and z-loss written out; its gradients come from eager autodiff.

Per-rank losses are ``sum(y * w) + aux_loss + z_loss`` of the rank's tokens, so their sum over the
mesh is the reference loss when the layer pools its loss statistics over every token axis
(``batch_axes=("dp", "ep")``); a parameter's gradient is then the sum over its copies.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hlo_checks import bf16_scatter_adds
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from core import parallel_state as ps
from core.distributed.distributed_data_parallel import DistributedDataParallel
from core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from core.optimizer import get_megatron_optimizer
from core.optimizer.optimizer_config import OptimizerConfig
from core.param_metadata import init_sharded_params, param_info_tree, unbox
from core.training.train_step import make_train_step
from core.transformer.moe import GroupedMLP, MoEBlock, MoEConfig, MoELayer, SequentialMLP, get_updated_expert_bias
from core.transformer.moe import experts as experts_module
from core.transformer.moe.moe_utils import capacity_slots, permute_rows

S, B, H, F, FS, E = 4, 8, 16, 32, 24, 8
DP_AXES = ("dp", "ep")
# The programs here are tiny: XLA:CPU's backend optimisations cost more compile time than they save.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
BASE = dict(num_experts=E, moe_ffn_hidden_size=F, moe_router_topk=2, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01,
            moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True)
CONFIGS = {
    "softmax_swiglu_shared": dict(swiglu=True, moe_shared_expert_intermediate_size=FS),
    "presoftmax_gelu_nobias_fp32router_capacity_probs": dict(
        moe_router_pre_softmax=True, add_bias_linear=False, moe_router_dtype="fp32", moe_expert_capacity_factor=1.0),
    "sigmoid_expert_bias_top3_capacity_position_pad": dict(
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_topk=3,
        moe_expert_capacity_factor=1.0, moe_token_drop_policy="position", moe_pad_expert_input_to_capacity=True),
    "seq_aux_shared_swiglu": dict(moe_router_load_balancing_type="seq_aux_loss", swiglu=True,
                                  moe_shared_expert_intermediate_size=FS),
    "sigmoid_capacity_probs_pad": dict(moe_router_score_function="sigmoid", moe_expert_capacity_factor=0.5,
                                       moe_pad_expert_input_to_capacity=True),
    "capacity_position_sequential_swiglu": dict(moe_expert_capacity_factor=1.25, moe_token_drop_policy="position",
                                                moe_grouped_gemm=False, swiglu=True),
}
EXPERT_BIAS = np.linspace(-0.3, 0.3, E).astype(np.float32)


def _close(got, want, err_msg=""):
    """float32 agreement: relative 1e-5, absolute 1e-5 of the array's largest magnitude (sums of
    many products cancel)."""
    want = np.asarray(want)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=max(2e-6, 1e-5 * float(np.abs(want).max())),
                               err_msg=err_msg)


def _config(name: str, **overrides) -> MoEConfig:
    return MoEConfig(**{**BASE, **CONFIGS[name], **overrides})


@functools.cache
def _inputs():
    """Activations ``x`` and the output weights ``w`` of the test loss ``sum(y * w)``, ``[S, B, H]``."""
    rng = np.random.default_rng(42)
    return tuple(jnp.asarray(rng.normal(size=(S, B, H)), jnp.float32) for _ in range(2))


@functools.cache
def _state(ep: int = 1, tp: int = 1, devices: int = 8, cp: int = 1) -> ps.ParallelState:
    return ps.build_parallel_state(tensor_model_parallel_size=tp, expert_model_parallel_size=ep, context_parallel_size=cp,
                                   devices=jax.devices()[:devices])


def _module(cfg: MoEConfig, tp: int = 1) -> MoELayer:
    return MoELayer(cfg, H, sequence_parallel=tp > 1, batch_axes=DP_AXES)


def _x_spec(tp: int, cp: int = 1) -> P:
    """The tokens' [s, b, h] split: s over cp then tp (contiguous: the layer is position-wise), b over dp."""
    seq = tuple(a for a, n in (("cp", cp), ("tp", tp)) if n > 1)
    return P(seq or None, DP_AXES)


def _key(seed: int = 0) -> jax.Array:
    """An ``rbg`` key: XLA:CPU compiles its initialisers ~5x faster than threefry's."""
    return jax.random.key(seed, impl="rbg")


def _fast_init(module, state: ps.ParallelState, args: tuple, in_specs: tuple):
    """``init_sharded_params`` compiled with :data:`FAST_COMPILE`: ``(params, specs)``."""
    shard = lambda fn, out: jax.shard_map(fn, mesh=state.mesh, in_specs=in_specs, out_specs=out, check_vma=False)
    specs = jax.tree.map(lambda i: i.partition_spec, param_info_tree(jax.eval_shape(shard(module.init, P()), *args)))
    params = jax.jit(shard(lambda *a: unbox(module.init(*a)), specs), compiler_options=FAST_COMPILE)(*args)
    return params, specs


def _drawn_params(module, args: tuple, in_specs: tuple, seed: int = 7):
    """The module's parameter tree on one device (shapes from an abstract init), drawn in numpy:
    weights larger than Megatron's init and nonzero biases so every path matters, norm scales
    around 1, the expert bias (where enabled) :data:`EXPERT_BIAS`."""
    boxed = jax.eval_shape(jax.shard_map(module.init, mesh=_state(devices=1).mesh, in_specs=in_specs, out_specs=P(),
                                         check_vma=False), *args)
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        where = jax.tree_util.keystr(path)
        if "expert_bias" in where:
            return EXPERT_BIAS
        std = 0.1 if "bias" in where else 0.5 if "router" in where else 0.3
        return (("scale" in where) + rng.normal(size=leaf.shape) * std).astype(np.float32)

    return jax.tree_util.tree_map_with_path(draw, unbox(boxed))


@functools.cache
def _initial(name: str):
    """Global parameters of config ``name`` (:func:`_drawn_params`)."""
    return _drawn_params(_module(_config(name)), (_key(), _inputs()[0]), (P(), _x_spec(1)))


# ---------------------------------------------------------------------------------------------
# The reference: numpy routing decisions, then a loop over experts in jnp (eager autodiff)
# ---------------------------------------------------------------------------------------------
def _gates(cfg: MoEConfig, logits, selected):
    """Dense [T, E] routing probs of the selected experts (zero elsewhere), Megatron's definitions."""
    if cfg.moe_router_score_function == "softmax":
        if cfg.moe_router_pre_softmax:
            return jax.nn.softmax(logits, axis=-1) * selected
        return jax.nn.softmax(jnp.where(selected, logits, -jnp.inf), axis=-1)
    scores = jax.nn.sigmoid(logits) * selected
    if cfg.moe_router_topk > 1:
        scores = scores / (scores.sum(-1, keepdims=True) + 1e-20)
    return scores


def _aux_scores(cfg: MoEConfig, logits):
    if cfg.moe_router_score_function == "softmax":
        return jax.nn.softmax(logits, axis=-1)
    s = jax.nn.sigmoid(logits)
    return s / (s.sum(-1, keepdims=True) + 1e-20)


def _np_gates(cfg: MoEConfig, logits: np.ndarray, selected: np.ndarray) -> np.ndarray:
    """:func:`_gates` in float64 numpy (for the drop policy's ordering)."""
    if cfg.moe_router_score_function == "softmax":
        z = np.where(selected | cfg.moe_router_pre_softmax, logits, -np.inf)
        p = np.exp(z - z.max(-1, keepdims=True))
        return p / p.sum(-1, keepdims=True) * selected
    p = 1 / (1 + np.exp(-logits)) * selected
    return p / p.sum(-1, keepdims=True) if cfg.moe_router_topk > 1 else p


def _np_aux_scores(cfg: MoEConfig, logits: np.ndarray) -> np.ndarray:
    if cfg.moe_router_score_function == "softmax":
        p = np.exp(logits - logits.max(-1, keepdims=True))
    else:
        p = 1 / (1 + np.exp(-logits))
    return p / p.sum(-1, keepdims=True)


def _top(row: np.ndarray, k: int) -> list[int]:
    """The ``k`` largest entries' indices; the data must not have near-ties at the cut."""
    order = np.argsort(-row, kind="stable")
    assert row[order[k - 1]] - row[order[k]] > 1e-5, "near-tie in the test data: routing would be fragile"
    return list(order[:k])


def _decisions(cfg: MoEConfig, params, x, ranks: int = 1):
    """(selected, kept, aux-loss routing) as [T, E] bool arrays, decided in numpy with Python loops.

    Capacity is per rank, as in Megatron: ``ranks`` data-parallel ranks hold ``B / ranks``
    consecutive sequences each, and each expert keeps at most ``capacity`` of every rank's tokens."""
    p = params["params"]["router"]
    tokens = np.asarray(x, np.float64).reshape(-1, H)
    t_count, k = len(tokens), cfg.moe_router_topk
    logits = tokens @ np.asarray(p["weight"], np.float64).T
    score = logits if cfg.moe_router_score_function == "softmax" else 1 / (1 + np.exp(-logits))
    if cfg.moe_router_enable_expert_bias:
        score = score + params["moe_state"]["router"]["expert_bias"]
    selected = np.zeros((t_count, E), bool)
    for t in range(t_count):
        selected[t, _top(score[t], k)] = True
    kept = selected.copy()
    if cfg.moe_expert_capacity_factor is not None:
        capacity = math.ceil(t_count // ranks * k / E * cfg.moe_expert_capacity_factor)
        probs = _np_gates(cfg, logits, selected)
        for rank in range(ranks):
            for e in range(E):  # token t = (s, b) is t = s * B + b; the rank's tokens in their local order
                routed = [t for t in range(t_count) if selected[t, e] and (t % B) // (B // ranks) == rank]
                if cfg.moe_token_drop_policy == "probs":
                    routed.sort(key=lambda t: (-probs[t, e], t))
                for t in routed[capacity:]:
                    kept[t, e] = False
    aux_scores = _np_aux_scores(cfg, logits)
    aux_routed = np.zeros((t_count, E), bool)
    for t in range(t_count):
        aux_routed[t, _top(aux_scores[t], k)] = True
    return selected, kept, aux_routed


def _mlp(x, w1, b1, w2, b2, swiglu):
    h = x @ w1 + (0 if b1 is None else b1)
    if swiglu:
        gate, up = jnp.split(h, 2, axis=-1)
        h = jax.nn.silu(gate) * up
    else:
        h = jax.nn.gelu(h, approximate=True)
    return h @ w2 + (0 if b2 is None else b2)


def _reference_loss(cfg: MoEConfig, decisions, params, x, w):
    selected, kept, aux_routed = decisions
    p = params["params"]
    tokens = x.reshape(-1, H)
    t_count, k = tokens.shape[0], cfg.moe_router_topk
    logits = tokens @ p["router"]["weight"].T
    gates = _gates(cfg, logits, jnp.asarray(selected)) * kept
    ex = p["experts"]
    y = jnp.zeros_like(tokens)
    for e in range(E):  # every expert on every token, weighted by its gate (zero unless routed and kept)
        bias = (lambda name: ex[name][e] if name in ex else None)
        y = y + gates[:, e:e + 1] * _mlp(tokens, ex["weight1"][e], bias("bias1"), ex["weight2"][e], bias("bias2"),
                                         cfg.swiglu)
    if cfg.moe_shared_expert_intermediate_size:
        sh = p["shared_experts"]
        w1 = sh["fc1"]["weight"].reshape(-1, H).T
        b1 = sh["fc1"]["bias"].reshape(-1) if "bias" in sh["fc1"] else None
        y = y + _mlp(tokens, w1, b1, sh["fc2"]["weight"].T, sh["fc2"].get("bias"), cfg.swiglu)
    scores = _aux_scores(cfg, logits)
    coeff = cfg.moe_aux_loss_coeff * E / k
    if cfg.moe_router_load_balancing_type == "aux_loss":
        aux = coeff / t_count**2 * jnp.sum(scores.sum(0) * aux_routed.sum(0))
    else:  # per sequence (column b of the [s, b] tokens), averaged over the B sequences
        per_sequence = scores.reshape(S, B, E).sum(0) * aux_routed.reshape(S, B, E).sum(0)
        aux = coeff / S**2 * jnp.sum(per_sequence) / B
    z = cfg.moe_z_loss_coeff * jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
    y = y.reshape(x.shape)
    return jnp.sum(y * w) + aux + z, (y, aux, z)


@functools.cache
def _reference(name: str, ranks: int = 1):
    """(y, aux, z, param grads, x grad, decisions) of the reference for config ``name`` (jitted, the
    decisions baked in as constants)."""
    cfg = _config(name)
    params = jax.tree.map(jnp.asarray, _initial(name))
    x, w = _inputs()
    decisions = _decisions(cfg, _initial(name), x, ranks)
    (_, (y, aux, z)), (gp, gx) = jax.jit(jax.value_and_grad(
        lambda p, x: _reference_loss(cfg, decisions, p, x, w), argnums=(0, 1), has_aux=True),
        compiler_options=FAST_COMPILE)(params, x)
    return y, aux, z, gp, gx, decisions


# ---------------------------------------------------------------------------------------------
# The layer on a mesh: per-device outputs, local grads and aux values
# ---------------------------------------------------------------------------------------------
def _all_axes(state):
    return tuple(state.mesh.axis_names)


@functools.cache
def _layer_fn(name: str, ep: int, tp: int, devices: int, overrides: tuple = (), cp: int = 1):
    """Jitted ``(params, x, w, scale) -> (y, x grad, stacked local param grads, stacked aux)``."""
    cfg = _config(name, **dict(overrides))
    state = _state(ep, tp, devices, cp)
    module = _module(cfg, tp)
    x, _ = _inputs()
    boxed = jax.eval_shape(jax.shard_map(module.init, mesh=state.mesh, in_specs=(P(), _x_spec(tp, cp)),
                                        out_specs=P(), check_vma=False), _key(), x)
    specs = jax.tree.map(lambda i: i.partition_spec, param_info_tree(boxed))
    everywhere = P(_all_axes(state))

    def local(params, x, w, scale):
        def loss(p, x):
            y, aux = module.apply(p, x)
            return scale[0] * (jnp.sum(y * w) + aux["aux_loss"] + aux["z_loss"]), (y, aux)

        (_, (y, aux)), (gp, gx) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
        stack = lambda tree: jax.tree.map(lambda a: a[None], tree)
        return y, gx, stack(gp), stack(aux)

    xs = _x_spec(tp, cp)
    fn = jax.jit(jax.shard_map(local, mesh=state.mesh, in_specs=(specs, xs, xs, everywhere),
                               out_specs=(xs, xs, everywhere, everywhere), check_vma=False),
                 compiler_options=FAST_COMPILE)
    return fn, specs, state


@functools.cache
def _run(name: str, ep: int = 1, tp: int = 1, devices: int = 8, overrides: tuple = (), cp: int = 1):
    """The layer's outputs for config ``name`` at a layout (cached), with ``specs`` and ``state``."""
    return _run_scaled(name, ep, tp, devices, overrides, cp=cp)


def _run_scaled(name: str, ep: int = 1, tp: int = 1, devices: int = 8, overrides: tuple = (), scale=None,
                cp: int = 1):
    fn, specs, state = _layer_fn(name, ep, tp, devices, overrides, cp)
    params = jax.tree.map(lambda v, s: jax.device_put(v, NamedSharding(state.mesh, s)), _initial(name), specs)
    x, w = _inputs()
    scale = np.ones(state.world_size, np.float32) if scale is None else scale
    return fn(params, x, w, jnp.asarray(scale)), specs, state


def _assemble(stacked, spec: P, state: ps.ParallelState):
    """Sum of per-device local values ``stacked [devices, *local]`` placed where each device's shard
    sits in the global array: for a parameter's local grads, its total gradient."""
    stacked = np.asarray(stacked)
    local = stacked.shape[1:]
    axes = list(state.mesh.axis_names)
    sizes = [1] * len(local)
    for d, entry in enumerate(spec):
        for a in (entry if isinstance(entry, tuple) else (entry,)):
            if a is not None:
                sizes[d] *= state.mesh.shape[a]
    out = np.zeros([n * s for n, s in zip(local, sizes)], stacked.dtype)
    for i, coords in enumerate(np.ndindex(*state.mesh.devices.shape)):
        at = dict(zip(axes, coords))
        index = []
        for d, entry in enumerate(spec):
            names = [a for a in (entry if isinstance(entry, tuple) else (entry,)) if a is not None]
            block = 0
            for a in names:
                block = block * state.mesh.shape[a] + at[a]
            index.append(slice(block * local[d], (block + 1) * local[d]))
        index += [slice(None)] * (len(local) - len(index))
        out[tuple(index)] += stacked[i]
    return out


def _check_against_reference(name: str, out, specs, state, ranks: int = 1):
    y, gx, grads, aux = out
    ref_y, ref_aux, ref_z, ref_gp, ref_gx, _ = _reference(name, ranks)
    _close(y, ref_y, "output")
    _close(gx, ref_gx, "input grad")
    _close(np.sum(aux["aux_loss"]), ref_aux, "aux loss")
    _close(np.sum(aux["z_loss"]), ref_z, "z loss")
    assert float(ref_aux) > 0 and float(ref_z) > 0
    flat_specs = jax.tree_util.tree_leaves_with_path(specs, is_leaf=lambda s: isinstance(s, P))
    flat_grads = jax.tree.leaves(grads)
    flat_ref = jax.tree.leaves(ref_gp)
    assert len(flat_grads) == len(flat_ref) == len(flat_specs)
    for (path, spec), g, want in zip(flat_specs, flat_grads, flat_ref, strict=True):
        where = jax.tree_util.keystr(path)
        if "moe_state" in where:
            continue
        total = _assemble(g, spec, state)
        assert np.abs(want).max() > 0, where
        _close(total, want, where)


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CONFIGS))
def test_layer_equals_reference_on_one_device(name):
    out, specs, state = _run(name, devices=1)
    _check_against_reference(name, out, specs, state)
    cfg = _config(name)
    selected, kept, _ = _reference(name)[-1]
    if cfg.moe_expert_capacity_factor is not None:
        assert (selected & ~kept).any(), "the capacity test must drop tokens"
    counts = np.asarray(out[3]["tokens_per_expert"][0])
    if cfg.moe_pad_expert_input_to_capacity:
        cap = math.ceil(S * B * cfg.moe_router_topk / E * cfg.moe_expert_capacity_factor)
        np.testing.assert_array_equal(counts, cap)
    else:
        np.testing.assert_array_equal(counts, kept.sum(0))


def test_initial_experts_do_not_depend_on_ep():
    """Expert weights are drawn at their global [E, ...] shape and sliced: equal at ep=1 and ep=8."""
    one, eight = (_fast_init(GroupedMLP(E // ep, H, F, gated_linear_unit=True), _state(ep),
                             (_key(), jnp.zeros((4, H)), jnp.zeros((E // ep,), jnp.int32)), (P(), P(), P()))[0]
                  for ep in (1, 8))
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(eight), strict=True):
        assert b.sharding.spec[0] == "ep"
        np.testing.assert_array_equal(a, b)


def test_expert_bias_changes_the_selection():
    name = "sigmoid_expert_bias_top3_capacity_position_pad"
    cfg = _config(name)
    params, x = _initial(name), _inputs()[0]
    unbiased = dict(params, moe_state={"router": {"expert_bias": np.zeros(E, np.float32)}})
    assert (_decisions(cfg, params, x)[0] != _decisions(cfg, unbiased, x)[0]).any()


def test_force_load_balancing_routes_by_random_logits_with_the_gates_gradient():
    """``--moe-router-force-load-balancing`` (Megatron's benchmarking option): the top-k comes from
    random normal logits, so a gate that sends every token to expert 0 still spreads the ``T * k``
    assignments evenly; the gate's gradient is the routing's gradient at the random logits, passed
    straight through (``dW = dL/dlogits^T x``)."""
    from core.transformer.moe import moe_utils
    from core.transformer.moe.router import TopKRouter

    t, k = 4096, 2
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(t, 1, H)) + 3.0, jnp.float32)
    gate = np.zeros((E, H), np.float32)
    gate[0] = 1.0  # expert 0's logit is about 3 * H above the others' for every token
    cot = jnp.asarray(rng.normal(size=(t, k)), jnp.float32)
    mesh = _state(devices=1).mesh

    def run(cfg, weight, method=None, arg=x):
        module = TopKRouter(cfg)
        fn = lambda w, a: module.apply({"params": {"weight": w}}, a, method=method)
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False))(weight, arg)

    forced = MoEConfig(num_experts=E, moe_ffn_hidden_size=F, moe_router_topk=k, moe_router_force_load_balancing=True)
    learned = dataclasses.replace(forced, moe_router_force_load_balancing=False)
    assert np.asarray(run(learned, gate).tokens_per_expert)[0] == t  # the gate alone: all on expert 0
    counts = np.asarray(run(forced, gate).tokens_per_expert)
    assert counts.sum() == t * k and counts.max() < 1.2 * t * k / E, counts
    noise = run(forced, gate, TopKRouter._random_logits, jnp.zeros((t, E), jnp.float32))
    routed = run(forced, gate)
    want_probs, want_indices = moe_utils.topk_routing_with_score_function(noise, k)
    np.testing.assert_array_equal(routed.indices, want_indices)
    _close(routed.probs, want_probs)

    def loss(w):
        module = TopKRouter(forced)
        fn = lambda w, a: jnp.sum(module.apply({"params": {"weight": w}}, a).probs * cot)
        return jax.shard_map(fn, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False)(w, x)

    d_logits = jax.grad(lambda z: jnp.sum(moe_utils.topk_routing_with_score_function(z, k)[0] * cot))(noise)
    _close(jax.jit(jax.grad(loss))(gate), d_logits.T @ x.reshape(t, H))


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_expert_parallel_equals_one_device(ep):
    """ep ranks hold different tokens and experts (dense dp 8 = expert dp 8/ep x ep): the reference."""
    _check_against_reference("softmax_swiglu_shared", *_run("softmax_swiglu_shared", ep=ep))


@pytest.mark.parametrize("ep,first", [(2, 1), (8, 1), (4, 3)])
def test_alltoall_sends_overflowing_rows_in_a_second_exchange(monkeypatch, ep, first):
    """The dropless all-to-all first exchanges ``exchange_width`` rows per peer and the rest only
    when a rank of the group has more for some peer. The tests' few tokens fit one exchange by
    default; with a first exchange of 1 or 3 rows the second one runs and the layer (outputs, all
    grads, aux losses) still equals the reference."""
    from core.transformer.moe import token_dispatcher

    monkeypatch.setattr(token_dispatcher, "exchange_width", lambda rows, ep, width: min(first, width))
    name = "softmax_swiglu_shared"
    fn, specs, state = _layer_fn.__wrapped__(name, ep, 1, 8)  # traced afresh with the patched width
    params = jax.tree.map(lambda v, s: jax.device_put(v, NamedSharding(state.mesh, s)), _initial(name), specs)
    x, w = _inputs()
    _check_against_reference(name, fn(params, x, w, jnp.ones(state.world_size, jnp.float32)), specs, state)


def test_default_window_is_the_mean_plus_the_smaller_margin():
    from core.transformer.moe.grouped_gemm import default_window

    assert default_window(1024, 8) == 160  # mean 128: + 25% (4 sigma would be + 45)
    assert default_window(4096, 8) == 608  # mean 512: + 4 sigma (90.5), not + 128
    assert default_window(16384, 8) == 2232
    assert default_window(8, 8) == 8  # a multiple of 8, at least 8


def test_exchange_width_is_the_mean_with_a_margin_within_the_worst_case():
    from core.transformer.moe.token_dispatcher import exchange_width

    assert exchange_width(1024, 8, 512) == 160  # 1.25 x 128 rows per peer
    assert exchange_width(1024, 2, 1024) == 640
    assert exchange_width(8, 2, 8) == 8  # rounded up to 8, never above the worst case


def test_allgather_dispatcher_equals_alltoall_at_ep4():
    got = _run("softmax_swiglu_shared", ep=4, overrides=(("moe_token_dispatcher_type", "allgather"),))
    _check_against_reference("softmax_swiglu_shared", *got)
    for a, b in zip(jax.tree.leaves(got[0]), jax.tree.leaves(_run("softmax_swiglu_shared", ep=4)[0]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(b).max())))


def test_capacity_dropping_per_rank_at_ep4():
    """With a capacity factor each rank drops over its own tokens (Megatron): position policy with
    padding to capacity at ep=4 (dense dp 8, one sequence per rank), the reference deciding per rank."""
    name = "sigmoid_expert_bias_top3_capacity_position_pad"
    out, specs, state = _run(name, ep=4)
    _check_against_reference(name, out, specs, state, ranks=8)
    selected, kept, _ = _reference(name, 8)[-1]
    assert (selected & ~kept).any()


def test_tensor_sequence_parallel_with_expert_parallel_equals_reference():
    """tp=2 with sequence parallelism x ep=2 x dp=2, sequence aux loss pooled over the tp shards."""
    out, specs, state = _run("seq_aux_shared_swiglu", ep=2, tp=2)
    _check_against_reference("seq_aux_shared_swiglu", out, specs, state)


def test_context_parallel_with_expert_parallel_equals_reference():
    """cp=2 x ep=2 x dp=2 x tp=2 with SP (ep groups inside one cp index): the sequence aux loss pools
    each sequence's counts over the cp and tp shards of it, whichever ranks hold the experts."""
    out, specs, state = _run("seq_aux_shared_swiglu", ep=2, tp=2, cp=2)
    _check_against_reference("seq_aux_shared_swiglu", out, specs, state)


@pytest.mark.parametrize("implementation,window", [("windows", None), ("windows", 2), ("ragged_dot", None)])
def test_grouped_mlp_equals_sequential_loop(implementation, window):
    """GroupedMLP (the CPU's windows, with and without pass 2, and accelerators' ragged_dot) == the
    per-expert loop, outputs and grads, with empty and padding groups."""
    state = _state(devices=1)
    rng = np.random.default_rng(3)
    rows = jnp.asarray(rng.normal(size=(20, H)), jnp.float32)
    sizes = jnp.array([3, 0, 7, 2], jnp.int32)  # 12 rows in groups, 8 padding rows
    shapes = {"weight1": (4, H, 2 * F), "weight2": (4, F, H), "bias1": (4, 2 * F), "bias2": (4, H)}
    params = {"params": {k: jnp.asarray(rng.normal(size=v) * 0.3, jnp.float32) for k, v in shapes.items()}}
    outs = []
    grouped = functools.partial(GroupedMLP, window=window, implementation=implementation)
    for cls in (grouped, SequentialMLP):
        module = cls(4, H, F, gated_linear_unit=True)

        def loss(p, r, module=module):
            return jnp.sum(jnp.sin(module.apply(p, r, sizes)[:12]))

        fn = jax.shard_map(jax.value_and_grad(loss, argnums=(0, 1)), mesh=state.mesh, in_specs=(P(), P()),
                           out_specs=P(), check_vma=False)
        outs.append(jax.jit(fn, compiler_options=FAST_COMPILE)(params, rows))
    for got, want in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1]), strict=True):
        _close(got, want)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_permute_rows_equals_the_gather_and_its_gradient(k):
    """``permute_rows`` is ``x[order // k]``, and its gathered backward (each row's ``k`` copies
    summed) equals autodiff's scatter-add."""
    rng = np.random.default_rng(k)
    x = jnp.asarray(rng.normal(size=(6, 5)), jnp.float32)
    order = jnp.asarray(rng.permutation(6 * k), jnp.int32)
    g = jnp.asarray(rng.normal(size=(6 * k, 5)), jnp.float32)
    got, vjp = jax.vjp(lambda x: permute_rows(x, order, jnp.argsort(order)), x)
    want, vjp_want = jax.vjp(lambda x: x[order // k], x)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(vjp(g)[0], vjp_want(g)[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("implementation", ["ragged_dot", "windows"])
def test_grouped_gemm_implementation_flag_picks_the_experts_program(implementation):
    """``moe_grouped_gemm_implementation`` reaches ``GroupedMLP``: the layer runs that grouped GEMM
    (``ragged_dot`` also on the CPU) and equals the reference, at ep 2."""
    overrides = (("moe_grouped_gemm_implementation", implementation),)
    out, specs, state = _run("softmax_swiglu_shared", ep=2, overrides=overrides)
    _check_against_reference("softmax_swiglu_shared", out, specs, state)
    fn, specs, state = _layer_fn("softmax_swiglu_shared", 2, 1, 8, overrides)
    params = jax.tree.map(lambda v, s: jax.device_put(v, NamedSharding(state.mesh, s)), _initial("softmax_swiglu_shared"),
                          specs)
    x, w = _inputs()
    jaxpr = str(fn.trace(params, x, w, jnp.ones(state.world_size)).jaxpr)
    assert ("ragged_dot" in jaxpr) == (implementation == "ragged_dot")


@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("name,overrides", [(name, ()) for name in CONFIGS]
                         + [("softmax_swiglu_shared", (("moe_token_dispatcher_type", "allgather"),))])
def test_bf16_layer_backward_adds_no_rows_in_bf16(monkeypatch, name, overrides, ep):
    """The layer's bf16 forward + backward, as accelerators run it (``ragged_dot``), has no bf16
    scatter-add: the dispatch's and combine's permutations go back by gathers and rows read with
    repeats add their gradients in fp32. (A bf16 scatter-add made the MoE GPT of ``bench/gpu.py``
    100x slower than the dense one on an H100.)"""
    monkeypatch.setattr(experts_module, "default_grouped_implementation", lambda: "ragged_dot")
    fn, specs, state = _layer_fn(name, ep, 1, 2, overrides)
    params = jax.tree.map(lambda v, s: jax.device_put(v, NamedSharding(state.mesh, s)), _initial(name), specs)
    x, w = (a.astype(jnp.bfloat16) for a in _inputs())
    hlo = fn.lower(params, x, w, jnp.ones(state.world_size)).as_text(dialect="hlo")
    assert "scatter(" in hlo or "ragged" in hlo  # the program is the layer's
    assert not bf16_scatter_adds(hlo), bf16_scatter_adds(hlo)


@pytest.mark.parametrize("sizes,window", [((3, 0, 7, 2), None), ((3, 0, 7, 2), 2), ((0, 20, 0, 0), 4),
                                          ((5, 5, 5, 5), 8), ((0, 0, 0, 0), None), ((1, 0, 0, 11), 3),
                                          ((4, 4, 4, 4), 3), ((2, 9, 0, 9), 4)])
def test_windowed_ragged_dot_equals_ragged_dot(sizes, window):
    """The CPU grouped GEMM == ``lax.ragged_dot``: outputs and the grads of both operands, with empty
    groups, padding rows (zeros out), groups longer than the window (pass 2: one, several, or every
    group), windows not dividing them, and the window default."""
    from jax import lax

    from core.transformer.moe.grouped_gemm import windowed_ragged_dot

    rng = np.random.default_rng(sum(sizes) + (window or 0))
    lhs = jnp.asarray(rng.normal(size=(20, H)), jnp.float32)
    rhs = jnp.asarray(rng.normal(size=(len(sizes), H, F)), jnp.float32)
    cot = jnp.asarray(rng.normal(size=(20, F)), jnp.float32)
    gs = jnp.asarray(sizes, jnp.int32)
    outs = []
    for dot in (functools.partial(windowed_ragged_dot, window=window), lax.ragged_dot):
        def loss(x, w, dot=dot):
            y = dot(x, w, gs)
            return jnp.sum(y * cot), y
        outs.append(jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(lhs, rhs))
    (_, got), grads = outs[0]
    assert not np.any(np.asarray(got)[sum(sizes):])  # padding rows give zeros, as ragged_dot's
    for got, want in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1]), strict=True):
        _close(got, want)
    # GroupedMLP runs the windows on the CPU: no ragged_dot in its program.
    e = len(sizes)
    shapes = {"weight1": (e, H, F), "weight2": (e, F, H), "bias1": (e, F), "bias2": (e, H)}
    params = {"params": {name: jnp.zeros(shape, jnp.float32) for name, shape in shapes.items()}}
    fn = jax.shard_map(lambda p, x: GroupedMLP(e, H, F).apply(p, x, gs), mesh=_state(devices=1).mesh,
                       in_specs=(P(), P()), out_specs=P(), check_vma=False)
    assert "ragged_dot" not in str(jax.make_jaxpr(fn)(params, lhs))


SGD = OptimizerConfig(optimizer="sgd", lr=1.0, sgd_momentum=0.0, weight_decay=0.0, clip_grad=0.0)


def test_expert_grads_reduced_over_the_expert_data_parallel_group():
    """ep=2 x expert-dp 4: rank r's loss is scaled by 2**r. After DDP's finalize_model_grads (inside
    the fused train step, SGD with lr 1), a dense grad is the mean of all 8 ranks' local grads and
    an expert grad the sum over its 4 expert-data-parallel ranks / 8 (the dp*cp pre-scale)."""
    name, ep = "softmax_swiglu_shared", 2
    state = _state(ep)
    scale = 2.0 ** np.arange(8, dtype=np.float32)
    (_, _, grads, _), specs, _ = _run_scaled(name, ep=ep, scale=scale)
    cfg = _config(name)
    module = _module(cfg)
    ddp = DistributedDataParallel(state, DistributedDataParallelConfig(), module)
    opt = get_megatron_optimizer(SGD, [ddp])
    x, w = _inputs()
    params = ddp.init(_key(), x[:, :1])
    params = jax.tree.map(lambda v, s: jax.device_put(v, NamedSharding(state.mesh, s)), _initial(name),
                          ddp.param_specs)
    before = jax.tree.map(np.asarray, params)
    all_axes = _all_axes(state)

    def loss_fn(p, mb):
        y, aux = module.apply(p, jnp.swapaxes(mb["x"], 0, 1))
        rank_scale = 2.0 ** jax.lax.axis_index(all_axes).astype(jnp.float32)
        return rank_scale * (jnp.sum(y * jnp.swapaxes(mb["w"], 0, 1)) + aux["aux_loss"] + aux["z_loss"])

    step = make_train_step(ddp, opt, loss_fn)
    batch = {"x": jnp.swapaxes(x, 0, 1), "w": jnp.swapaxes(w, 0, 1)}
    after, _, _ = step(params, opt.init_state(params), batch)
    ranks = state.device_ranks.reshape(-1)
    flat = jax.tree_util.tree_leaves_with_path(specs, is_leaf=lambda s: isinstance(s, P))
    for (path, _), local, old, new in zip(flat, jax.tree.leaves(grads), jax.tree.leaves(before),
                                             jax.tree.leaves(after), strict=True):
        where = jax.tree_util.keystr(path)
        local = np.asarray(local)
        applied = old - np.asarray(new)  # the reduced grad (SGD, lr 1)
        if "experts" in where and "shared" not in where:
            for e in range(ep):
                group = [i for i, r in enumerate(ranks) if state.coordinates(int(r))["ep"] == e]
                assert len(group) == 4 and sorted(ranks[group].tolist()) == sorted(
                    state.group_of(int(ranks[group[0]]), ("dp",)))
                want = local[group].sum(0) / 8
                block = slice(e * local.shape[1], (e + 1) * local.shape[1])
                _close(applied[block], want, where)
        else:
            _close(applied, local.sum(0) / 8, where)


def _per_device(leaf, value_of):
    """A global array whose shard on each device is ``value_of(global value of the shard, device)``."""
    base = np.asarray(leaf)
    arrays = [jax.device_put(value_of(base[idx], d), d)
              for d, idx in leaf.sharding.addressable_devices_indices_map(leaf.shape).items()]
    return jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, arrays)


def test_broadcast_params_keeps_each_ep_ranks_experts():
    """ep=2, dp=2 (4 devices): copies made to differ per rank are re-synced from data-parallel rank 0
    (dense) and from expert-data-parallel rank 0 of the same ep rank (experts): no ep rank's experts
    are overwritten by another's."""
    state = _state(ep=2, devices=4)
    cfg = _config("softmax_swiglu_shared")
    ddp = DistributedDataParallel(state, DistributedDataParallelConfig(), _module(cfg))
    params = ddp.init(_key(), _inputs()[0][:, :1])
    ranks = {d: int(r) for d, r in zip(state.mesh.devices.flat, state.device_ranks.flat, strict=True)}
    infos = ddp.layout.infos
    leaves, treedef = jax.tree.flatten(params)
    skewed = [_per_device(leaf, lambda v, d, info=info: v + 100 * state.group_rank(
        ranks[d], ("dp",) if info.expert else state.data_parallel_axis_name))
        for leaf, info in zip(leaves, infos, strict=True)]
    assert any(info.expert for info in infos) and not all(info.expert for info in infos)
    synced = jax.tree.leaves(ddp.broadcast_params(jax.tree.unflatten(treedef, skewed)))
    for leaf, got in zip(leaves, synced, strict=True):
        want = np.asarray(leaf)
        for shard in got.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
    experts = np.asarray(params["params"]["experts"]["weight1"])
    assert not np.allclose(experts[: E // 2], experts[E // 2:])  # the two ep ranks' experts differ


def test_moe_block_is_norm_layer_residual():
    state = _state(devices=1)
    cfg = _config("softmax_swiglu_shared")
    x, _ = _inputs()
    block = MoEBlock(cfg, H, batch_axes=DP_AXES, normalization="RMSNorm")
    params = _drawn_params(block, (_key(), x), (P(), P()))
    inner = _module(cfg)

    def both(p, x):  # the block, and the layer on the block's norm, in one program
        normed = x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * p["params"]["layernorm"]["scale"]
        return block.apply(p, x), inner.apply({"params": p["params"]["moe"]}, normed)

    (out, aux), (want, want_aux) = jax.jit(jax.shard_map(both, mesh=state.mesh, in_specs=(P(), P()), out_specs=P(),
                                                         check_vma=False), compiler_options=FAST_COMPILE)(params, x)
    _close(out, x + want)
    _close(aux["aux_loss"], want_aux["aux_loss"])


def test_capacity_slots_keep_the_first_or_most_probable():
    indices = jnp.array([[0, 1], [0, 2], [0, 1], [1, 0]], jnp.int32)
    probs = jnp.array([[0.5, 0.5], [0.9, 0.1], [0.7, 0.3], [0.4, 0.6]])
    keep, slots = capacity_slots(indices, probs, 3, 2, "position")
    np.testing.assert_array_equal(keep, [[1, 1], [1, 1], [0, 1], [0, 0]])
    np.testing.assert_array_equal(slots, [[0, 0], [1, 0], [2, 1], [2, 3]])  # rank among the expert's tokens
    keep, _ = capacity_slots(indices, probs, 3, 2, "probs")
    # expert 0: probs 0.5, 0.9, 0.7, 0.6 -> keep tokens 1 and 2; expert 1: 0.5, 0.3, 0.4 -> tokens 0 and 3
    np.testing.assert_array_equal(keep, [[0, 1], [1, 1], [1, 0], [1, 0]])


def test_expert_bias_update_is_megatrons_sign_step():
    counts = jnp.array([4.0, 0.0, 2.0, 2.0])
    new = get_updated_expert_bias(counts, jnp.zeros(4), 0.1)
    np.testing.assert_allclose(new, [-0.1, 0.1, 0.0, 0.0])


BAD = [
    (dict(num_experts=6), dict(expert_model_parallel_size=4), r"--num-experts \(6\) must be divisible by "
                                                              r"--expert-model-parallel-size \(4\)"),
    (dict(moe_router_topk=9), {}, r"--moe-router-topk \(9\) must not exceed --num-experts \(8\)"),
    (dict(moe_router_score_function="relu"), {}, r"--moe-router-score-function must be one of"),
    (dict(moe_router_load_balancing_type="sinkhorn"), {}, r"--moe-router-load-balancing-type must be one of"),
    (dict(moe_token_dispatcher_type="flex"), {}, r"--moe-token-dispatcher-type must be one of"),
    (dict(moe_token_drop_policy="random"), {}, r"--moe-token-drop-policy must be one of"),
    (dict(moe_router_dtype="fp16"), {}, r"--moe-router-dtype must be one of"),
    (dict(moe_router_topk=1), {}, r"--moe-router-topk 1 with softmax scores needs --moe-router-pre-softmax"),
    (dict(moe_router_enable_expert_bias=True), {}, r"--moe-router-enable-expert-bias needs "
                                                    r"--moe-router-score-function sigmoid"),
    (dict(moe_expert_capacity_factor=1.0, moe_token_dispatcher_type="allgather"), {},
     r"--moe-expert-capacity-factor needs --moe-token-dispatcher-type alltoall"),
    (dict(moe_expert_capacity_factor=0.0), {}, r"--moe-expert-capacity-factor must be > 0"),
    (dict(moe_grouped_gemm_implementation="cublas"), {}, r"--moe-grouped-gemm-implementation must be one of"),
    (dict(moe_grouped_gemm=False, moe_grouped_gemm_implementation="windows"), {},
     r"--moe-grouped-gemm-implementation needs --moe-grouped-gemm"),
    (dict(moe_pad_expert_input_to_capacity=True), {}, r"--moe-pad-expert-input-to-capacity needs "
                                                       r"--moe-expert-capacity-factor"),
    (dict(moe_aux_loss_coeff=-1.0), {}, r"--moe-aux-loss-coeff must be >= 0"),
    (dict(moe_z_loss_coeff=-1.0), {}, r"--moe-z-loss-coeff must be >= 0"),
    (dict(moe_ffn_hidden_size=0), {}, r"--moe-ffn-hidden-size must be a positive int"),
    (dict(moe_shared_expert_intermediate_size=0), {}, r"--moe-shared-expert-intermediate-size must be a positive"),
    ({}, dict(tensor_model_parallel_size=2), r"needs --sequence-parallel"),
]


@pytest.mark.parametrize("kwargs,layout,match", BAD, ids=[m.split(" ")[0].strip("\\-r") + str(i)
                                                          for i, (_, _, m) in enumerate(BAD)])
def test_bad_config_raises_one_clear_error(kwargs, layout, match):
    cfg = dataclasses.replace(MoEConfig(**BASE), **kwargs)
    with pytest.raises(ValueError, match=match) as info:
        cfg.validate(**layout)
    assert "\n" not in str(info.value)


def test_layer_refuses_tensor_parallel_without_sequence_parallel():
    state = _state(tp=2)
    x, _ = _inputs()
    with pytest.raises(ValueError, match="needs --sequence-parallel"):
        init_sharded_params(MoELayer(MoEConfig(**BASE), H).init, state.mesh, (_key(), x), (P(), P()))
