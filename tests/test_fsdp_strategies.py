"""Megatron-FSDP's sharding strategies (``--use-megatron-fsdp --data-parallel-sharding-strategy``):
``no_shard``, ``optim`` and ``optim_grads`` train the GPT as one device does (loss, grad norm and
params after 3 steps, fp32: rtol 1e-5 on loss and grad norm, params within rtol 1e-4 / atol 1e-5;
``optim_grads`` also at cp2 dp4, MoE ep2 dp4 and with two distributed-optimizer instances),
``optim_grads`` equals ``optim`` (grad norm rtol 1e-6, params rtol 1e-5 / atol 1e-6), ``optim`` is exactly
the distributed optimizer, ``optim_grads`` keeps no full-size gradient
accumulator across microbatches, and bad values are refused in one line."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pretrain_harness import layout_trainer

from core import parallel_state as ps
from core.distributed.distributed_data_parallel import DistributedDataParallel
from core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from core.optimizer import OptimizerConfig, get_megatron_optimizer
from core.training.arguments import ArgumentError, parse_args, validate_args
from core.training.run_config import pretrain_config
from core.training.train_step import make_train_step

STEPS = 3
STRATEGIES = ("no_shard", "optim", "optim_grads")
# (tp, global batch, extra flags): 4 microbatches of 2 samples per data-parallel rank.
LAYOUTS = {"dp8": (1, 64, ()), "tp2_dp4_sp": (2, 32, ("--sequence-parallel",))}


def fsdp_flags(strategy: str) -> tuple[str, ...]:
    return ("--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy)


def run(tp: int, devices: list, extra: tuple) -> tuple[list[dict], list[np.ndarray]]:
    """(metrics records, params as host arrays) after ``STEPS`` steps."""
    trainer = layout_trainer(tp, 1, devices, STEPS, extra)
    records = [trainer.step() for _ in range(STEPS)]
    return records, [np.asarray(x) for x in jax.tree.leaves(trainer.params)]


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def layout(request):
    """(name, tp, flags, single-device run) of one layout."""
    tp, batch, extra = LAYOUTS[request.param]
    flags = ("--global-batch-size", str(batch), *extra)
    return request.param, tp, flags, run(1, [jax.local_devices()[0]], flags)


@pytest.fixture(scope="module")
def runs():
    return {}


def strategy_run(runs: dict, layout: tuple, strategy: str):
    name, tp, flags, _ = layout
    if (name, strategy) not in runs:
        runs[name, strategy] = run(tp, jax.devices(), flags + fsdp_flags(strategy))
    return runs[name, strategy]


def assert_params_close(actual: list[np.ndarray], expected: list[np.ndarray], rtol: float, atol: float) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        if a.shape != e.shape:  # vocabulary padding differs by tp: compare the real rows
            assert a.shape[1:] == e.shape[1:]
            n = min(a.shape[0], e.shape[0])
            a, e = a[:n], e[:n]
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategy_matches_single_device(layout, runs, strategy):
    (records, params), (ref_records, ref_params) = strategy_run(runs, layout, strategy), layout[3]
    np.testing.assert_allclose([r["loss"] for r in records], [r["loss"] for r in ref_records], rtol=1e-5)
    np.testing.assert_allclose([r["grad_norm"] for r in records], [r["grad_norm"] for r in ref_records], rtol=1e-5)
    assert_params_close(params, ref_params, rtol=1e-4, atol=1e-5)


def test_optim_grads_equals_optim(layout, runs):
    (records, params), (optim_records, optim_params) = strategy_run(runs, layout, "optim_grads"), \
        strategy_run(runs, layout, "optim")
    np.testing.assert_allclose([r["grad_norm"] for r in records], [r["grad_norm"] for r in optim_records],
                               rtol=1e-6)
    assert_params_close(params, optim_params, rtol=1e-5, atol=1e-6)


def test_optim_is_the_distributed_optimizer(layout, runs):
    name, tp, flags, _ = layout
    records, params = run(tp, jax.devices(), flags + ("--use-distributed-optimizer",))
    optim_records, optim_params = strategy_run(runs, layout, "optim")
    assert [r["loss"] for r in records] == [r["loss"] for r in optim_records]
    for a, b in zip(params, optim_params, strict=True):
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------------------------
# Memory: optim_grads holds shard-sized accumulators only
# ---------------------------------------------------------------------------------------------

class Deep(nn.Module):
    """8 dense layers of 256 x 256 (2 MiB of fp32 params), much more than a microbatch's activations."""

    @nn.compact
    def __call__(self, x):
        for i in range(8):
            x = jnp.tanh(nn.Dense(256, name=f"layer_{i:02d}")(x))
        return x


def compiled_memory(strategy: str) -> tuple[int, int]:
    """(temp bytes of the compiled step at dp 8 with 4 microbatches and one bucket per layer, local
    param bytes)."""
    state = ps.build_parallel_state()
    module = Deep()
    # One bucket per layer: each microbatch's flat bucket copy (what is reduce-scattered) is one
    # layer, not the whole model (with one bucket it costs as much as the accumulator it replaces).
    config = DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy,
                                           bucket_size=70_000)
    ddp = DistributedDataParallel(state, config, module)
    params = ddp.init(jax.random.key(0), jnp.ones((2, 256)))
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-3), [ddp])
    opt_state = optimizer.init_state(params)

    def loss_fn(p, batch):
        err = (module.apply(p, batch[0]) - batch[1]) ** 2
        return jnp.sum(err), jnp.asarray(err.size, jnp.float32), {}

    step = make_train_step(ddp, optimizer, loss_fn, num_microbatches=4)
    x = np.ones((64, 256), np.float32)
    analysis = step.lower(params, opt_state, ddp.shard_batch((x, x))).compile().memory_analysis()
    return analysis.temp_size_in_bytes, sum(p.size * p.dtype.itemsize for p in jax.tree.leaves(params))


def test_optim_grads_keeps_no_full_size_grad_accumulator():
    optim, param_bytes = compiled_memory("optim")
    optim_grads, _ = compiled_memory("optim_grads")
    # optim carries a full-size fp32 accumulator through the scan (measured: optim_grads' temp is
    # about 0.5 x param bytes below; with the per-microbatch reduce-scatter disabled, equal).
    assert optim_grads < optim - 0.25 * param_bytes, (optim_grads, optim, param_bytes)


# ---------------------------------------------------------------------------------------------
# Configuration and flags
# ---------------------------------------------------------------------------------------------

def test_config_properties_and_defaults():
    assert DistributedDataParallelConfig().data_parallel_sharding_strategy == "no_shard"  # Megatron's default
    cases = {("no_shard", False): (False, False), ("optim", False): (True, False), ("optim_grads", False): (True, True),
             ("optim", True): (True, False), ("optim_grads", True): (True, True),
             ("optim_grads_params", False): (False, False), ("optim_grads_params", True): (False, False)}
    for (strategy, distopt), expected in cases.items():
        config = DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy,
                                               use_distributed_optimizer=distopt)
        assert (config.shards_optimizer_state, config.reduce_scatter_per_microbatch) == expected
        assert config.shards_params == (strategy == "optim_grads_params")
    assert DistributedDataParallelConfig(use_distributed_optimizer=True).shards_optimizer_state


@pytest.mark.parametrize("kwargs, message", [
    ({"use_megatron_fsdp": True, "data_parallel_sharding_strategy": "zero2"}, "must be one of no_shard, optim"),
    ({"use_megatron_fsdp": True, "data_parallel_sharding_strategy": "optim_grads_params",
      "check_for_large_grads": True}, "never holds"),
    ({"data_parallel_sharding_strategy": "optim_grads"}, "needs use_megatron_fsdp=True"),
    ({"use_megatron_fsdp": True, "use_distributed_optimizer": True}, "contradicts data_parallel_sharding_strategy"),
    ({"use_megatron_fsdp": True, "data_parallel_sharding_strategy": "optim_grads", "check_for_large_grads": True},
     "never holds"),
])
def test_config_refuses(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as error:
        DistributedDataParallelConfig(**kwargs)
    assert "\n" not in str(error.value)


ONE_MODEL_PARALLEL = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
                      "--micro-batch-size", "2"]


def test_hsdp_config_and_flags_are_accepted():
    config = DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params",
                                           use_distributed_optimizer=True, num_distributed_optimizer_instances=2)
    assert config.shards_params and not config.shards_optimizer_state
    args = parse_args(["--use-megatron-fsdp", "--use-distributed-optimizer", "--num-distributed-optimizer-instances",
                       "2", *ONE_MODEL_PARALLEL])
    assert validate_args(args, 8).num_distributed_optimizer_instances == 2  # the mesh gets the outer axis
    args = parse_args(["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim", "--use-distributed-optimizer",
                       "--num-distributed-optimizer-instances", "2", *ONE_MODEL_PARALLEL])
    assert validate_args(args, 8).num_distributed_optimizer_instances == 1  # sub-group collectives on today's mesh


def test_flags_map_onto_the_ddp_config():
    args = parse_args(["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads",
                       *ONE_MODEL_PARALLEL])
    validate_args(args, 8)
    ddp = pretrain_config(args).ddp
    assert (ddp.use_megatron_fsdp, ddp.data_parallel_sharding_strategy, ddp.reduce_scatter_per_microbatch) == \
        (True, "optim_grads", True)
    plain = parse_args([*ONE_MODEL_PARALLEL])
    validate_args(plain, 8)  # the strategy's default (optim_grads_params) is read only with --use-megatron-fsdp
    assert pretrain_config(plain).ddp.data_parallel_sharding_strategy == "no_shard"


@pytest.mark.parametrize("flags, message", [
    (["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "zero2"],
     "--data-parallel-sharding-strategy must be one of"),
    (["--use-megatron-fsdp", "--use-distributed-optimizer", "--num-distributed-optimizer-instances", "8",
      "--context-parallel-size", "2"],
     "data-parallel size / expert-model-parallel-size = 4 (the data-parallel mesh axis HSDP splits into instances) "
     "is not divisible by --num-distributed-optimizer-instances 8"),
    (["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim", "--no-fsdp-reshard-after-forward"],
     "--no-fsdp-reshard-after-forward needs --use-megatron-fsdp"),
    (["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "no_shard", "--use-distributed-optimizer"],
     "no_shard contradicts --use-distributed-optimizer"),
])
def test_flags_refuse_in_one_line(flags, message):
    args = parse_args(flags + [*ONE_MODEL_PARALLEL])
    with pytest.raises(ArgumentError) as error:
        validate_args(args, 8)
    assert message in str(error.value) and "\n" not in str(error.value)


# optim_grads in the other layouts (each against one device; optim_grads_params's are in
# tests/test_fsdp_params.py): (tp, layout-only flags, model flags).
MORE_LAYOUTS = {
    "cp2_dp4": (1, ("--context-parallel-size", "2"), ()),
    "ep2_dp4_moe": (1, ("--expert-model-parallel-size", "2"), ("--num-experts", "4", "--moe-router-topk", "2")),
    "partial_instances_2x4": (1, ("--num-distributed-optimizer-instances", "2"), ()),
}


@pytest.mark.parametrize("name", sorted(MORE_LAYOUTS))
def test_optim_grads_in_more_layouts_matches_single_device(name):
    tp, layout_flags, model_flags = MORE_LAYOUTS[name]
    flags = ("--global-batch-size", "32", *model_flags)
    records, params = run(tp, jax.devices(), flags + layout_flags + fsdp_flags("optim_grads"))
    ref_records, ref_params = run(1, [jax.local_devices()[0]], flags)
    np.testing.assert_allclose([r["loss"] for r in records], [r["loss"] for r in ref_records], rtol=1e-5)
    np.testing.assert_allclose([r["grad_norm"] for r in records], [r["grad_norm"] for r in ref_records], rtol=1e-5)
    assert_params_close(params, ref_params, rtol=1e-4, atol=1e-5)
