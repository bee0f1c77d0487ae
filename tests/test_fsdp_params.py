"""Megatron-FSDP ``optim_grads_params`` (ZeRO-3): parameters, gradients and optimizer state sharded
over data parallelism, each unit gathered right before use.

* Equivalence: 5 steps of the GPT in each layout (dp8; tp2 dp4 with SP; pp2 vpp2 dp4; tp2 pp2
  vpp2 dp2 with SP; cp2 dp4;
  MoE ep2 dp4; with --scan-layers, full and selective recompute, and the gathered copy kept from
  the forward) equal one device (fp32: loss and grad norm rtol 1e-5, params rtol 1e-4 / atol 1e-5);
  bf16 (compute and gathers) equals one device's bf16 run within bf16's rounding (loss rtol 2e-3,
  grad norm 1e-2).
* HSDP (``--num-distributed-optimizer-instances 2`` at dp 8: two instances of 4 contiguous ranks;
  and MoE ep2 dp4): equals one device with the same tolerances; the parameters are split over the inner ``"dp"``
  axis only and replicated over the outer ``"dpo"`` one, whose slices are Megatron's intra-instance
  groups; an instance count that does not divide the data-parallel axis is refused.
* What is sharded: every parameter the rule can split lives split over the data-parallel axes,
  its optimizer state too; the compiled step's arguments are at most 1.1 x (params + Adam state)
  / 8 per device, its temporaries are below the ``optim`` strategy's by more than a copy of the
  params (no full-size gradients), and keeping the gathered copies from the forward costs more
  than re-gathering them.
* The gathers travel in the compute dtype and the grads are reduce-scattered in fp32
  (``grad_reduce_in_fp32``); initialisation never holds the whole model on a device.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hlo_checks import scheduled_ops
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from pretrain_harness import cached_by_flags, layout_trainer

from core import parallel_state as ps
from core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from core.megatron_fsdp import fully_shard, fully_shard_model, fully_shard_optimizer
from core.models.gpt import GPTModel
from core.optimizer.optimizer_config import OptimizerConfig
from core.training.arguments import model_config, parse_args
from core.training.train_step import make_train_step

STEPS = 5
ZERO3 = ("--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params")
MOE = ("--num-experts", "4", "--moe-router-topk", "2")
# name: (tp, pp, layout-only flags, model flags shared with the one-device reference)
LAYOUTS = {
    "dp8": (1, 1, (), ()),
    "dp8_scan": (1, 1, (), ("--scan-layers",)),
    "dp8_full_recompute": (1, 1, (), ("--recompute-granularity", "full")),
    "dp8_selective_recompute_scan": (1, 1, (), ("--recompute-granularity", "selective", "--scan-layers")),
    "dp8_keep_gathered": (1, 1, ("--no-fsdp-reshard-after-forward",), ()),
    "tp2_dp4_sp": (2, 1, (), ("--sequence-parallel",)),
    "pp2_vpp2_dp4": (1, 2, ("--virtual-pipeline-model-parallel-size", "2"), ()),
    "tp2_pp2_vpp2_dp2_sp": (2, 2, ("--virtual-pipeline-model-parallel-size", "2"), ("--sequence-parallel",)),
    "cp2_dp4": (1, 1, ("--context-parallel-size", "2"), ("--untie-embeddings-and-output-weights",)),
    "ep2_dp4_moe": (1, 1, ("--expert-model-parallel-size", "2"), MOE),
}


def _run(tp: int, pp: int, devices: list, flags: tuple) -> tuple[list[dict], list[np.ndarray]]:
    trainer = layout_trainer(tp, pp, devices, STEPS, ("--global-batch-size", "32", *flags))
    records = [trainer.step() for _ in range(STEPS)]
    return records, [np.asarray(x) for x in jax.tree.leaves(trainer.params)]


@pytest.fixture(scope="module")
def references():
    """One-device runs by model flags (computed on first use)."""
    return cached_by_flags(lambda flags: _run(1, 1, [jax.local_devices()[0]], flags))


def assert_same_training(actual, expected, loss_rtol=1e-5, norm_rtol=1e-5, params_rtol=1e-4, params_atol=1e-5,
                         params_mean_atol=None):
    (records, params), (ref_records, ref_params) = actual, expected
    np.testing.assert_allclose([r["loss"] for r in records], [r["loss"] for r in ref_records], rtol=loss_rtol)
    np.testing.assert_allclose([r["grad_norm"] for r in records], [r["grad_norm"] for r in ref_records],
                               rtol=norm_rtol)
    for a, e in zip(params, ref_params, strict=True):
        if a.shape != e.shape and a.shape[2:] == e.shape[2:] and a.shape[0] * a.shape[1] == e.shape[0] * e.shape[1]:
            a = a.reshape(e.shape)  # layers stacked [vpp, L / vpp, ...]: layer l at [l // (L/vpp), l % (L/vpp)]
        n = min(a.shape[0], e.shape[0])  # vocabulary padding differs by tp: compare the real rows
        np.testing.assert_allclose(a[:n], e[:n], rtol=params_rtol, atol=params_atol)
        if params_mean_atol is not None:
            assert np.mean(np.abs(a[:n] - e[:n])) < params_mean_atol


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_optim_grads_params_matches_single_device(name, references):
    tp, pp, layout_flags, model_flags = LAYOUTS[name]
    actual = _run(tp, pp, jax.devices(), layout_flags + model_flags + ZERO3)
    assert_same_training(actual, references(model_flags))


def test_bf16_matches_single_device_bf16(references):
    actual = _run(1, 1, jax.devices(), ("--bf16",) + ZERO3)
    # bf16 products summed in another order (8 ranks' partial grads reduced in fp32): loss within
    # 2e-3, grad norm within 1e-2 (measured 0.3%). Adam turns a near-zero grad's rounding into a
    # different step of up to lr (3e-3), so elements may differ by up to a few steps (measured
    # 3e-3) while the mean difference stays below half a step (measured 7e-4).
    assert_same_training(actual, references(("--bf16",)), loss_rtol=2e-3, norm_rtol=1e-2, params_rtol=0,
                         params_atol=1e-2, params_mean_atol=1.5e-3)


HSDP = ("--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2")


@pytest.mark.parametrize("name", ["dp8", "ep2_dp4_moe"])
def test_hsdp_matches_single_device_and_shards_inside_an_instance(name, references):
    _, _, layout_flags, model_flags = LAYOUTS[name]
    flags = ("--global-batch-size", "32", *layout_flags, *model_flags, *HSDP, *ZERO3)
    trainer = layout_trainer(1, 1, jax.devices(), STEPS, flags)
    assert dict(trainer.state.mesh.shape)["dpo"] == 2
    specs = {jax.tree_util.keystr(k): x.sharding.spec for k, x in jax.tree_util.tree_flatten_with_path(trainer.params)[0]}
    axes = {a for spec in specs.values() for a in jax.tree.leaves(tuple(spec))}
    assert "dp" in axes and "dpo" not in axes, specs  # split inside an instance, replicated across
    if name == "dp8":  # the inner dp axis: 4 ranks of one instance
        assert dict(trainer.state.mesh.shape)["dp"] == 4
        assert specs["['embedding']['word_embeddings']['weight']"] == P(None, "dp")
    records = [trainer.step() for _ in range(STEPS)]
    actual = records, [np.asarray(x) for x in jax.tree.leaves(trainer.params)]
    assert_same_training(actual, references(model_flags))


def test_hsdp_outer_axis_slices_are_megatron_intra_instance_groups():
    state = ps.build_parallel_state(devices=jax.devices(), num_distributed_optimizer_instances=2)
    assert state.mesh.axis_names == ("pp", "dpo", "dp", "ep", "cp", "tp")
    assert state.data_parallel_outer_axis_name == ("dpo",)
    assert state.data_parallel_axis_name == ("dpo", "dp", "ep") and state.replica_size(expert=False) == 8
    # Megatron's dp-cp group [0..7] in two instances of contiguous ranks; the instances' copies of a
    # shard (the inter groups ranks[j::4]) lie along the outer axis.
    assert sorted(state.groups(("dp", "ep", "cp"))) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert sorted(state.groups(("dpo",))) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert ps.build_parallel_state(devices=jax.devices()).data_parallel_outer_axis_name == ()
    with pytest.raises(ValueError, match=r"instances=3 does not divide the data-parallel axis: data_parallel_size 8"):
        ps.build_parallel_state(devices=jax.devices(), num_distributed_optimizer_instances=3)
    with pytest.raises(ValueError, match=r"data_parallel_size 8 / expert_model_parallel_size 4 = 2"):
        ps.build_parallel_state(expert_model_parallel_size=4, devices=jax.devices(),
                                num_distributed_optimizer_instances=4)


def test_hsdp_needs_a_parallel_state_with_the_same_instances():
    from core.distributed.distributed_data_parallel import DistributedDataParallel

    config = DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params",
                                           num_distributed_optimizer_instances=2)
    model = GPTModel(model_config(parse_args(MEMORY_MODEL)), ps.build_parallel_state())
    with pytest.raises(ValueError, match="instances=2 needs a parallel state built with the same number, got 1"):
        DistributedDataParallel(ps.build_parallel_state(), config, model)


# ---------------------------------------------------------------------------------------------
# What is sharded, and the compiled step's memory
# ---------------------------------------------------------------------------------------------

MEMORY_MODEL = ["--num-layers", "8", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "32",
                "--vocab-size", "255", "--scan-layers"]


def _compiled(strategy: str, extra: tuple = (), keep_gathered: bool = False, bf16: bool = False):
    """(memory_analysis of the step at dp 8 with 4 microbatches, params, opt_state, lowered step),
    all abstract (nothing allocated)."""
    args = parse_args(MEMORY_MODEL + list(extra) + (["--bf16"] if bf16 else []))
    state = ps.build_parallel_state()
    model = GPTModel(model_config(args), state)
    config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, fsdp_reshard_after_forward=not keep_gathered)
    ddp, optimizer = fully_shard(model, OptimizerConfig(lr=1e-3), state=state, zero_dp_strategy=strategy,
                                 ddp_config=config)
    params = ddp.init(jax.random.key(0), jnp.zeros((1, 32), jnp.int32), abstract=True)
    opt_state = optimizer.init_state(params)
    step = make_train_step(ddp, optimizer, model.loss_fn, num_microbatches=4)
    sharding = NamedSharding(state.mesh, P("dp"))
    batch = {k: jax.ShapeDtypeStruct((32, 32), jnp.int32, sharding=sharding) for k in ("tokens", "labels")}
    lowered = step.lower(params, opt_state, batch)
    return lowered.compile().memory_analysis(), params, opt_state, lowered


@pytest.fixture(scope="module")
def zero3():
    return _compiled("optim_grads_params")


def _bytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _local_bytes(tree) -> int:
    return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * jnp.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(tree))


def test_params_and_optimizer_state_are_sharded_over_data_parallelism(zero3):
    _, params, opt_state, _ = zero3
    specs = {jax.tree_util.keystr(k): x.sharding.spec for k, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    # fc1 [vpp, L, ffn / tp, h]: h over dp; the word embedding [V / tp, h]: h over dp.
    assert specs["['layers']['mlp']['fc1']['weight']"] == P(None, "pp", "tp", "dp")
    assert specs["['embedding']['word_embeddings']['weight']"] == P("tp", "dp")
    unsharded = [k for k, spec in specs.items() if "dp" not in jax.tree.leaves(tuple(spec))]
    # Only the column-parallel biases stay whole: their one dimension is split over tp already.
    assert all("bias" in k for k in unsharded), unsharded
    total = _bytes(params) + _bytes(opt_state)
    assert _local_bytes(params) + _local_bytes(opt_state) <= 1.1 * total / 8


def test_compiled_step_holds_shards_not_copies(zero3):
    memory, params, opt_state, _ = zero3
    optim, _, _, _ = _compiled("optim")
    param_bytes = _bytes(params)
    state_bytes = param_bytes + _bytes(opt_state)  # params + Adam moments (fp32 params: no masters)
    batch_bytes = 2 * 32 * 32 * 4 // 8
    assert memory.argument_size_in_bytes <= 1.1 * state_bytes / 8 + batch_bytes, (memory, state_bytes)
    # optim keeps whole params and a whole fp32 gradient accumulator; ZeRO-3 only shards of both
    # and about two layers' gathered params (one running, one gathered ahead) and one layer's
    # grads.
    assert memory.temp_size_in_bytes < optim.temp_size_in_bytes - param_bytes, (memory, optim, param_bytes)


def test_keeping_gathered_params_from_the_forward_costs_memory(zero3):
    memory, params, _, _ = zero3
    kept, _, _, _ = _compiled("optim_grads_params", keep_gathered=True)
    layer_bytes = _bytes(params["layers"]) / 8
    # Every layer's gathered weights live from its forward to its backward (the scan stacks them);
    # re-gathering holds about two layers' (the one running and the one gathered ahead).
    assert kept.temp_size_in_bytes > memory.temp_size_in_bytes + 4 * layer_bytes, (kept, memory)


def test_bf16_gathers_in_bf16_and_reduces_grads_in_fp32():
    _, _, _, lowered = _compiled("optim_grads_params", bf16=True)
    text = lowered.as_text()
    gathers = [line for line in text.splitlines() if "all_gather" in line]
    scatters = [line for line in text.splitlines() if "reduce_scatter" in line]
    assert gathers and scatters
    layer_gathers = [g for g in gathers if "bf16" in g.split("->")[-1]]
    # The layers and the head gather their compute copy; only the embedding table (read in fp32 so
    # its backward scatter-adds in fp32) travels in fp32.
    assert len(layer_gathers) >= len(gathers) - 2, gathers
    assert all("bf16" not in s.split("->")[-1] for s in scatters), scatters


def test_schedule_gathers_ahead_and_reduce_scatters_per_layer(zero3):
    """In the compiled step (``--scan-layers``), the forward layer loop issues the next layer's
    gathers before the current layer's matmuls, and the backward layer loop regathers the layer
    its matmuls read and reduce-scatters each of the layer's sharded grads inside its own iteration
    (before the previous layer's backward). XLA:CPU keeps this program order; on GPUs
    the latency-hiding scheduler must still overlap them (a GPU profile confirms it)."""
    _, params, _, lowered = zero3
    loops = {name: ops for name, ops in scheduled_ops(lowered.compile().as_text()).items()
             if "dot" in ops and ("all-gather" in ops or "reduce-scatter" in ops) and "while" not in ops}
    sharded = sum(1 for x in jax.tree.leaves(params["layers"]) if "dp" in jax.tree.leaves(tuple(x.sharding.spec)))
    forward = [ops for ops in loops.values() if "reduce-scatter" not in ops]
    backward = [ops for ops in loops.values() if ops.count("reduce-scatter") >= sharded]
    assert len(forward) == 1 and len(backward) == 1, loops
    (forward,), (backward,) = forward, backward
    assert forward.count("all-gather") == sharded and forward.index("dot") > max(
        i for i, op in enumerate(forward) if op == "all-gather"), forward
    # The backward regathers only the parameters its matmuls read (not the norms' whose residuals
    # it keeps anyway), each before the matmul that needs it.
    assert 0 < backward.count("all-gather") <= sharded and backward.index("all-gather") < len(backward) - 1, backward


def test_entry_points_refuse_bad_values():
    state = ps.build_parallel_state()
    model = GPTModel(model_config(parse_args(MEMORY_MODEL)), state)
    with pytest.raises(ValueError, match="zero_dp_strategy must be 0-3"):
        fully_shard_model(model, state=state, zero_dp_strategy=4)
    with pytest.raises(ValueError, match="zero_dp_strategy must be 0-3"):
        fully_shard_model(model, state=state, zero_dp_strategy="zero3")
    plain = fully_shard_model(model, state=state, zero_dp_strategy="no_shard")
    assert plain.ddp_config.use_megatron_fsdp and not plain.ddp_config.shards_params
    from core.distributed.distributed_data_parallel import DistributedDataParallel

    with pytest.raises(ValueError, match="needs a model from fully_shard_model"):
        fully_shard_optimizer(DistributedDataParallel(state, DistributedDataParallelConfig(), model),
                              OptimizerConfig(lr=1e-3))


def test_module_without_unit_gathers_is_refused():
    import flax.linen as nn

    from core.distributed.distributed_data_parallel import DistributedDataParallel

    config = DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params")
    ddp = DistributedDataParallel(ps.build_parallel_state(), config, nn.Dense(8))
    with pytest.raises(TypeError, match="needs a module that gathers its parameters unit by unit"):
        ddp.init(jax.random.key(0), jnp.ones((2, 8)))


def test_logits_of_sharded_params_equal_one_device():
    config = model_config(parse_args(MEMORY_MODEL))
    state = ps.build_parallel_state()
    model = GPTModel(config, state)
    ddp = fully_shard_model(model, state=state)
    params = ddp.init(jax.random.key(0), jnp.zeros((1, 32), jnp.int32))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 255, (8, 32)), jnp.int32)
    one = GPTModel(config, ps.build_parallel_state(devices=jax.devices()[:1]))
    expected = one.global_logits(jax.tree.map(np.asarray, params), tokens)
    np.testing.assert_allclose(model.global_logits(params, tokens), expected, rtol=1e-5, atol=1e-5)
