"""Train a small MLP the xlstm_jax way (FSDP + tensor + pipeline parallelism) and check it equals one device.

Run it in one process (8 simulated CPU devices) or in 8 processes::

    python examples/xlstm_style_fsdp.py
    mpirun --oversubscribe -n 8 python examples/xlstm_style_fsdp.py [--tp 2 --pp 2 --steps 5]

The code follows the xlstm_jax / JAX-scaling-tutorial API on this package's mesh
(:mod:`core.parallel_state`, axes ``"pp", "dp", "ep", "cp", "tp"``):

* every MLP block is wrapped in :func:`~core.distributed.data_parallel.shard_module_params`:
  its kernels are stored sharded over ``"dp"`` (FSDP) and all-gathered on use, their gradients
  reduce-scattered;
* inside a block, :class:`~core.tensor_parallel.tp_dense.TPDense` splits the hidden features
  over ``"tp"`` (``gather`` in, ``scatter`` out), so activations between blocks are split over
  ``"tp"`` along the features;
* the blocks are cut into ``pp`` stages run as a GPipe pipeline
  (:class:`~core.pipeline_parallel.gpipe.PipelineModule`, stage parameters stacked over ``"pp"``
  by ``ModelParallelismWrapper``);
* the train step is the tutorial's: a :class:`~core.distributed.single_gpu.TrainState` carrying
  the key, dropout keys from :func:`~core.distributed.array_utils.fold_rng_over_axis`,
  :func:`~core.distributed.single_gpu.accumulate_gradients` over minibatches,
  :func:`~core.distributed.data_parallel.sync_gradients`, optax, all inside
  ``jax.jit(jax.shard_map(...))``.

Layout invariance. The loss is written so that its gradient is exact in every layout: each
device computes the squared error of its rows and its slice of the output features, divided
by its local row count times the full feature count, and only on the last pipeline stage;
summed over ``"tp"`` this is the mean over the device's rows, and ``sync_gradients`` (or the
FSDP reduce-scatter, which averages) takes the mean over ``"dp"``. Every parameter lives in a
``TPDense`` (split over ``"tp"``) and in a stage (split over ``"pp"``), so no gradient needs a
sum over those axes; the scatter-side dense has no bias (per-rank biases would be summed in
the forward pass and each trained with the full gradient). With dropout off, the run equals
the same network trained on one device without any sharding (:func:`train_single_device`,
started from the sharded run's initial parameters) to fp32 rounding: :data:`TOLERANCE`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from core import parallel_state as ps  # noqa: E402
from core.distributed.array_utils import fold_rng_over_axis  # noqa: E402
from core.distributed.data_parallel import shard_module_params, sync_gradients  # noqa: E402
from core.distributed.single_gpu import Batch, Metrics, TrainState, accumulate_gradients  # noqa: E402
from core.param_metadata import unbox  # noqa: E402
from core.pipeline_parallel.gpipe import PipelineModule  # noqa: E402
from core.tensor_parallel.tp_dense import ModelParallelismWrapper, TPDense  # noqa: E402

DP, TP, PIPE = ps.DP_AXIS, ps.TP_AXIS, ps.PP_AXIS
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
"""Sharded run vs one device (fp32): losses and final parameters, ``np.testing.assert_allclose``."""


@dataclasses.dataclass(frozen=True)
class Config:
    """Model, data and optimiser of the example (small enough to run quickly on a CPU)."""

    features: int = 16
    """Input = output width; split over ``tp`` between blocks."""
    hidden: int = 64
    """Hidden width of every block; split over ``tp``."""
    num_layers: int = 2
    """MLP blocks in total, cut into ``pp`` equal stages."""
    global_batch: int = 32
    """Rows per step over all data-parallel ranks."""
    num_minibatches: int = 2
    """Gradient-accumulation steps per device (``accumulate_gradients``)."""
    num_microbatches: int = 2
    """Pipeline microbatches per minibatch."""
    learning_rate: float = 0.05
    """SGD learning rate."""
    momentum: float = 0.9
    """SGD momentum. A linear optimiser keeps the comparison tight: equal gradients give equal
    updates to fp32 rounding, where Adam's first steps (``g / |g|``) would turn rounding noise
    in near-zero gradients into full-size updates."""
    dropout_rate: float = 0.0
    """Dropout after every hidden activation; the single-device check needs 0."""
    fsdp_min_weight_size: int = 2**7
    """Parameters with more elements (per tp/pp shard) are sharded over ``dp``."""
    use_scan: bool = False
    """Accumulate gradients with ``lax.scan`` instead of an unrolled loop."""
    seed: int = 0
    """Seed of the parameters, the dropout keys and the data."""


@dataclasses.dataclass
class TrainResult:
    """The outcome of :func:`train` or :func:`train_single_device`, as host numpy values."""

    losses: np.ndarray
    """Mean loss of every step (before that step's update)."""
    params: dict
    """Final parameters in the single-device layout (:class:`PlainMLP`)."""
    init_params: dict
    """Initial parameters in the single-device layout."""
    param_specs: Any = None
    """:func:`train` only: the ``PartitionSpec`` of every parameter of the sharded network."""


# ---------------------------------------------------------------------------------------
# The model: sharded and single-device forms of the same network
# ---------------------------------------------------------------------------------------


class TPBlock(nn.Module):
    """Residual MLP block with tensor parallelism: ``x + down(dropout(gelu(up(x))))``.

    ``x`` holds this tp rank's slice of the features; ``up`` all-gathers it and computes this
    rank's slice of the hidden units, ``down`` computes a partial output and reduce-scatters it
    back to feature slices.
    """

    config: Config
    """Widths and dropout rate."""

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        """Apply the block to ``x`` of shape ``[batch, features / tp]``."""
        tp = lax.axis_size(TP)
        h = TPDense(functools.partial(nn.Dense, features=self.config.hidden // tp), TP, "gather", name="up")(x)
        h = nn.Dropout(self.config.dropout_rate)(nn.gelu(h), deterministic=not train)
        # Each rank's kernel sees hidden / tp inputs: scale its init by tp ** -0.5 (the tutorial's
        # adjustment) so the summed output has the fan-in of the full layer.
        y = TPDense(functools.partial(nn.Dense, features=self.config.features), TP, "scatter", use_bias=False,
                    kernel_init_adjustment=tp ** -0.5, name="down")(h)
        return x + y


class Stage(nn.Module):
    """One pipeline stage: ``num_layers / pp`` blocks, each stored FSDP-sharded over ``dp``."""

    config: Config
    """Widths, depth and FSDP threshold."""
    train: bool = False
    """Apply dropout."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Apply this stage's blocks."""
        block = shard_module_params(TPBlock, axis_name=DP, min_weight_size=self.config.fsdp_min_weight_size)
        for i in range(self.config.num_layers // lax.axis_size(PIPE)):
            x = block(self.config, name=f"block_{i}")(x, self.train)
        return x


class PipelinedMLP(nn.Module):
    """The sharded network: ``pp`` stages (parameters stacked over ``pp``) run as a GPipe pipeline."""

    config: Config
    """Model configuration."""

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        """Output on the last pipeline stage (zeros on the others), split over ``tp`` like ``x``."""
        stage = functools.partial(ModelParallelismWrapper, model_axis_name=PIPE,
                                  module_fn=functools.partial(Stage, config=self.config, train=train), name="stage")
        return PipelineModule(model_axis_name=PIPE, num_microbatches=self.config.num_microbatches,
                              module_fn=stage, name="pipeline")(x)


class PlainBlock(nn.Module):
    """The block for one device: ``x + down(dropout(gelu(up(x))))`` with plain ``nn.Dense`` layers."""

    config: Config
    """Widths and dropout rate."""

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        """Apply the block to ``x`` of shape ``[batch, features]``."""
        h = nn.Dense(self.config.hidden, name="up")(x)
        h = nn.Dropout(self.config.dropout_rate)(nn.gelu(h), deterministic=not train)
        return x + nn.Dense(self.config.features, use_bias=False, name="down")(h)


class PlainMLP(nn.Module):
    """The same network for one device: ``num_layers`` blocks ``block_0 ... block_{L-1}`` in sequence."""

    config: Config
    """Model configuration."""

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        """Apply all blocks."""
        for i in range(self.config.num_layers):
            x = PlainBlock(self.config, name=f"block_{i}")(x, train)
        return x


def to_single_device(params: Any, config: Config, tp: int, pp: int) -> dict:
    """Convert the sharded network's ``params`` collection (global arrays or numpy) to :class:`PlainMLP`'s.

    Stage ``s``'s ``block_i`` becomes ``block_{s * num_layers / pp + i}``; the tp shards are
    concatenated in rank order: ``up``'s kernel and bias along the hidden units (columns),
    ``down``'s kernel along its input rows. FSDP sharding is invisible in global arrays.
    """
    stage = unbox(params)["pipeline"]["stage"]["sharded"]
    dense = lambda tree: tree["module"]["sharded"] if tp > 1 else tree["Dense_0"]
    join = lambda a, axis: np.concatenate(list(a), axis=axis) if tp > 1 else a
    per_stage = config.num_layers // pp
    plain = {}
    for s in range(pp):
        for i in range(per_stage):
            up, down = dense(stage[f"block_{i}"]["up"]), dense(stage[f"block_{i}"]["down"])
            plain[f"block_{s * per_stage + i}"] = {
                "up": {"kernel": join(np.asarray(up["kernel"])[s], 1), "bias": join(np.asarray(up["bias"])[s], 0)},
                "down": {"kernel": join(np.asarray(down["kernel"])[s], 0)},
            }
    return plain


# ---------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------


def make_optimizer(config: Config) -> optax.GradientTransformation:
    """SGD with momentum (the same transformation for the sharded run and the reference)."""
    return optax.sgd(config.learning_rate, momentum=config.momentum)


def make_data(config: Config, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """``steps`` batches of a fixed regression task: inputs ``[steps, B, F]``, targets ``sin(x W)``."""
    rng = np.random.default_rng(config.seed)
    w = rng.normal(size=(config.features, config.features)) / np.sqrt(config.features)
    x = rng.normal(size=(steps, config.global_batch, config.features))
    return x.astype(np.float32), np.sin(x @ w).astype(np.float32)


def _loss_fn(params: Any, apply_fn: Any, batch: Batch, rng: jax.Array) -> tuple[jax.Array, Metrics]:
    """The sharded loss (see the module docstring): this device's part of the global mean squared error."""
    dropout_rng = fold_rng_over_axis(rng, (PIPE, DP, TP))  # other data, features and layers: other masks
    y = apply_fn({"params": params}, batch.inputs, train=True, rngs={"dropout": dropout_rng})
    rows, features = batch.inputs.shape[0], batch.labels.shape[-1] * lax.axis_size(TP)
    last_stage = lax.axis_index(PIPE) == lax.axis_size(PIPE) - 1
    sq = jnp.where(last_stage, jnp.sum((y - batch.labels) ** 2), 0.0)
    count = jnp.where(last_stage & (lax.axis_index(TP) == 0), rows, 0)
    return sq / (rows * features), {"loss": (sq / features, count)}


def _plain_loss_fn(params: Any, apply_fn: Any, batch: Batch, rng: jax.Array) -> tuple[jax.Array, Metrics]:
    """The single-device loss: mean squared error over the rows and features of the minibatch."""
    y = apply_fn({"params": params}, batch.inputs, train=True, rngs={"dropout": rng})
    rows, features = batch.labels.shape
    sq = jnp.sum((y - batch.labels) ** 2)
    return sq / (rows * features), {"loss": (sq / features, jnp.asarray(rows))}


def _check_layout(config: Config, tp: int, pp: int, world: int) -> int:
    """The data-parallel size of ``tp`` x ``pp`` on ``world`` devices; ValueError naming what does not divide."""
    if world % (tp * pp):
        raise ValueError(f"tp={tp} x pp={pp} does not divide the {world} devices")
    dp = world // (tp * pp)
    rows = dp * config.num_minibatches * config.num_microbatches
    problems = [f"global_batch {config.global_batch} is not divisible by dp x minibatches x microbatches = {rows}"
                ] if config.global_batch % rows else []
    problems += [f"{name} {value} is not divisible by {by_name}={by}" for name, value, by_name, by in (
        ("features", config.features, "tp", tp), ("hidden", config.hidden, "tp", tp),
        ("num_layers", config.num_layers, "pp", pp)) if value % by]
    if problems:
        raise ValueError("; ".join(problems))
    return dp


def _log(message: str) -> None:
    if jax.process_index() == 0:
        print(message, flush=True)


def train(tp: int = 2, pp: int = 2, steps: int = 5, config: Config = Config(), verbose: bool = False) -> TrainResult:
    """Train :class:`PipelinedMLP` for ``steps`` steps on all devices (all processes), tp x pp x dp.

    Must be called by every process of a multi-process job. Returns the losses and the
    initial and final parameters gathered to the host, in the single-device layout.
    """
    state_ps = ps.build_parallel_state(tp, pp)
    dp = _check_layout(config, tp, pp, state_ps.world_size)
    mesh, axes = state_ps.mesh, state_ps.mesh.axis_names
    model, tx = PipelinedMLP(config), make_optimizer(config)
    inputs, labels = make_data(config, steps)
    put = lambda a, spec: jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda idx: a[idx])
    batch_spec = Batch(inputs=P(DP, TP), labels=P(DP, TP))  # rows over dp, features over tp, replicated over pp
    batches = [Batch(inputs=put(inputs[i], P(DP, TP)), labels=put(labels[i], P(DP, TP))) for i in range(steps)]
    key = put(np.asarray(jax.random.key_data(jax.random.key(config.seed))), P())

    def init(key_data: jax.Array, x: jax.Array) -> TrainState:
        init_rng, state_rng = jax.random.split(jax.random.wrap_key_data(key_data))
        params = model.init({"params": init_rng}, x, train=False)["params"]
        return TrainState.create(apply_fn=model.apply, params=params, tx=tx, rng=state_rng)

    init_sharded = lambda specs: jax.shard_map(init, mesh=mesh, in_specs=(P(), P(DP, TP)), out_specs=specs,
                                               check_vma=False)
    state_specs = nn.get_partition_spec(jax.eval_shape(init_sharded(P()), key, batches[0].inputs))
    state = jax.jit(init_sharded(state_specs))(key, batches[0].inputs)

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        rng, step_rng = jax.random.split(state.rng)
        grads, metrics = accumulate_gradients(state, batch, step_rng, config.num_minibatches, _loss_fn,
                                              use_scan=config.use_scan)
        grads = sync_gradients(grads, axes)
        state = state.apply_gradients(grads=grads, rng=rng)
        return state, jax.tree.map(lambda m: lax.psum(m, axes), metrics)

    step_fn = jax.jit(jax.shard_map(train_step, mesh=mesh, in_specs=(state_specs, batch_spec),
                                    out_specs=(state_specs, P()), check_vma=False), donate_argnums=0)
    # One program copies the whole parameter tree to every device; each process reads its copy.
    replicate = jax.jit(lambda tree: tree, out_shardings=NamedSharding(mesh, P()))
    gather = lambda tree: jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), replicate(tree))
    init_params = to_single_device(gather(state.params), config, tp, pp)
    if verbose:
        _log(f"mesh {dict(mesh.shape)}: FSDP over dp={dp}, TPDense over tp={tp}, GPipe over pp={pp} "
             f"({config.num_microbatches} microbatches), {config.num_minibatches} minibatches per device")
    losses = []
    for i, batch in enumerate(batches):
        start = time.perf_counter()
        state, metrics = step_fn(state, batch)
        total, count = (float(v.addressable_data(0)) for v in metrics["loss"])  # replicated (out_specs P())
        losses.append(total / count)
        if verbose:
            _log(f"step {i + 1}/{steps}  loss {losses[-1]:.6f}  ({time.perf_counter() - start:.2f} s)")
    return TrainResult(np.asarray(losses), to_single_device(gather(state.params), config, tp, pp), init_params,
                       state_specs.params)


def train_single_device(init_params: dict, steps: int = 5, config: Config = Config()) -> TrainResult:
    """Train :class:`PlainMLP` from ``init_params`` on this process's first device, no sharding.

    Full batches (no gradient accumulation, no pipeline): the plain gradient of the mean
    squared error, the same data, optimiser and key as :func:`train`.
    """
    model, tx = PlainMLP(config), make_optimizer(config)
    inputs, labels = make_data(config, steps)
    with jax.default_device(jax.local_devices()[0]):
        _, state_rng = jax.random.split(jax.random.key(config.seed))
        state = TrainState.create(apply_fn=model.apply, params=jax.tree.map(jnp.asarray, init_params), tx=tx,
                                  rng=state_rng)

        @jax.jit
        def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
            rng, step_rng = jax.random.split(state.rng)
            grads, metrics = accumulate_gradients(state, batch, step_rng, 1, _plain_loss_fn)
            return state.apply_gradients(grads=grads, rng=rng), metrics

        losses = []
        for i in range(steps):
            state, metrics = train_step(state, Batch(inputs=jnp.asarray(inputs[i]), labels=jnp.asarray(labels[i])))
            total, count = metrics["loss"]
            losses.append(float(total) / float(count))
        params = jax.tree.map(np.asarray, state.params)
    return TrainResult(np.asarray(losses), params, jax.tree.map(np.asarray, init_params))


def compare(sharded: TrainResult, single: TrainResult) -> tuple[float, float]:
    """Assert the two runs agree within :data:`TOLERANCE`; returns the largest loss and parameter differences."""
    np.testing.assert_allclose(sharded.losses, single.losses, **TOLERANCE, err_msg="loss trajectory")
    flat_a = jax.tree_util.tree_leaves_with_path(sharded.params)
    flat_b = jax.tree.leaves(single.params)
    for (path, a), b in zip(flat_a, flat_b, strict=True):
        np.testing.assert_allclose(a, b, **TOLERANCE, err_msg=f"final parameter {jax.tree_util.keystr(path)}")
    param_diff = max(float(np.max(np.abs(a - b))) for (_, a), b in zip(flat_a, flat_b, strict=True))
    return float(np.max(np.abs(sharded.losses - single.losses))), param_diff


def check(tp: int = 2, pp: int = 2, steps: int = 5, config: Config = Config(), verbose: bool = False
          ) -> tuple[TrainResult, TrainResult | None]:
    """Train sharded (tp x pp x dp) and on one device from the same start; assert they match.

    Every process trains the sharded network; process 0 alone then trains the single-device
    reference and compares (the others return ``None`` for it: the gathered results are the
    same on every process). Raises ``AssertionError`` (numpy's message names the step or
    parameter) when they differ by more than :data:`TOLERANCE`, ``ValueError`` for a layout
    the devices or sizes do not fit.
    """
    if config.dropout_rate:
        raise ValueError("the single-device check needs dropout_rate=0 (dropout masks depend on the layout)")
    sharded = train(tp, pp, steps, config, verbose=verbose)
    if jax.process_index() != 0:
        return sharded, None
    single = train_single_device(sharded.init_params, steps, config)
    loss_diff, param_diff = compare(sharded, single)
    if verbose:
        _log(f"matches single device: {steps} losses (max diff {loss_diff:.1e}) and final parameters "
             f"(max diff {param_diff:.1e}) within rtol={TOLERANCE['rtol']:g}, atol={TOLERANCE['atol']:g} (fp32)")
    return sharded, single


# ---------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------


def _setup_jax(num_cpu_devices: int) -> None:
    """Before JAX starts: under mpirun, ``jax.distributed`` (one device per process unless
    ``JAX_NUM_CPU_DEVICES`` says otherwise); in one process, ``num_cpu_devices`` simulated CPU devices."""
    if ps.mpi_world_size_from_env() > 1:
        ps.initialize_distributed()
    elif not os.environ.get("JAX_NUM_CPU_DEVICES"):
        from core.runtime.cpu_devices import configure_cpu_devices

        configure_cpu_devices(num_cpu_devices)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the flags, train, check against one device (unless dropout is on); returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default 2 when it fits)")
    parser.add_argument("--pp", type=int, default=None, help="pipeline stages (default 2 when it fits)")
    parser.add_argument("--steps", type=int, default=5, help="training steps")
    parser.add_argument("--scan", action="store_true", help="accumulate gradients with lax.scan")
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="dropout rate; > 0 trains without the single-device check")
    parser.add_argument("--cpu-devices", type=int, default=8, help="simulated CPU devices in one process")
    args = parser.parse_args(argv)
    _setup_jax(args.cpu_devices)
    world = jax.device_count()
    tp = args.tp or (2 if world % 2 == 0 else 1)
    pp = args.pp or (2 if world % (2 * tp) == 0 else 1)
    if jax.process_index() != 0:  # gloo prints connection chatter on every rank; errors stay on stderr
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    config = Config(use_scan=args.scan, dropout_rate=args.dropout)
    _log(f"{jax.process_count()} process(es), {world} {jax.devices()[0].platform} devices")
    if args.dropout:
        train(tp, pp, args.steps, config, verbose=True)
        _log(f"trained with dropout {args.dropout} (no single-device check: the masks depend on the layout)")
    else:
        check(tp, pp, args.steps, config, verbose=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
