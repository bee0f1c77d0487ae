"""``DistributedDataParallel``: a flax module trained data-parallel over the global mesh.

The work happens in one jitted ``shard_map`` program per training step
(:meth:`DistributedDataParallel.make_train_step`): forward/backward over the microbatches
(``lax.scan``; grads accumulate and are reduced once per step, Megatron's ``no_sync``
semantics), ``finalize_model_grads`` (model-parallel sums, then one collective per bucket),
global-norm clipping, the (distributed) optimizer step and the parameter all-gather. No host
round trip inside a step.

Megatron's method names are kept as a PyTorch-style facade over the same pure functions,
for code written against Megatron's loop (``zero_grad_buffer``, ``no_sync``,
``start_grad_sync``/``finish_grad_sync``, ``scale_gradients``, ``start_param_sync``,
``broadcast_params``); each call is its own jitted program, so prefer the fused step.

State layout: parameters are global arrays sharded as their metadata says (tensor-parallel
dims over ``"tp"``, replicated over data parallelism); optimizer state, grad buffers and
per-device flags are *device-local* values, stored as global arrays with a leading axis of
one entry per device (spec ``P(all mesh axes)``).

Parameter order: buffers are laid out in reverse "model order", taken as the flattened
parameter tree order (``jax.tree`` sorts dict keys, so name layers with zero-padded indices
to make it the forward order). It only affects which grads share a bucket, not results.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from core import parallel_state
from core.distributed.array_utils import fold_rng_over_axis
from core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from core.distributed.finalize_model_grads import finalize_model_grads, nonfinite_flags
from core.distributed.param_and_grad_buffer import build_buffer_specs, flatten_to_buckets, unflatten_from_buckets
from core.distributed.spiky_loss import check_spiky_loss
from core.distributed.storage_split import StorageSplit
from core.optimizer.distrib_optimizer import DistributedOptimizer, optimizer_state_bytes
from core.optimizer.optimizer_config import OptimizerConfig
from core.parallel_state import ParallelState
from core.param_metadata import init_sharded_params
from core.pipeline_parallel.utils import split_microbatches

LossFn = Callable[[Any, Any], jax.Array]
ForwardBackwardFn = Callable[[Any, Any], tuple[Any, jax.Array, jax.Array]]


class DistributedDataParallel:
    """Megatron's ``DistributedDataParallel(config, ddp_config, module)`` for a flax linen module.

    ``config`` is the :class:`~core.parallel_state.ParallelState` (None: the default one);
    ``optimizer`` an optax transformation or an :class:`OptimizerConfig`; ``disable_bucketing``
    puts every parameter of a buffer in one bucket whatever ``ddp_config.bucket_size`` says
    (Megatron's flag, used for all model chunks but the first with interleaved pipelining).

    Two ways to train: the fused step (:meth:`make_train_step`, one program per step) and
    Megatron's loop over this object as a stateful facade (``model.zero_grad_buffer()``,
    ``get_forward_backward_func()(..., model=[model])``, ``finalize_model_grads([model],
    num_tokens)``, :meth:`optimizer_step`); the facade keeps its current parameters in
    :attr:`params`.
    """

    def __init__(
        self,
        config: ParallelState | None,
        ddp_config: DistributedDataParallelConfig,
        module: nn.Module,
        optimizer: optax.GradientTransformation | OptimizerConfig | None = None,
        learning_rate: float | optax.Schedule | None = None,
        disable_bucketing: bool = False,
    ):
        self.state = config if config is not None else parallel_state.get_parallel_state()
        self.ddp_config = ddp_config
        self.module = module
        self.optimizer_spec = optimizer if optimizer is not None else OptimizerConfig()
        self.learning_rate = learning_rate
        self.disable_bucketing = disable_bucketing
        self.finalize_model_grads_func: Callable | None = None
        """Megatron's ``config.finalize_model_grads_func``: when set, the schedules call it as
        ``finalize_model_grads_func([model], num_tokens)`` after the backward (``num_tokens`` the
        global token count of a per-token loss, else None), as Megatron's schedules do."""
        self.num_tokens = None
        """Global token count of the last :meth:`run_forward_backward` with a per-token loss."""
        self.params = None
        """The facade's current parameters: set by :meth:`init`, :meth:`optimizer_step` and
        :meth:`load_state_dict`, read by the schedules when this object is their ``model``."""
        self._is_last_microbatch = True
        self._grad_buffers = None
        self._reduced = None
        self._metadata = None
        self._programs: dict[Any, Callable] = {}
        self._traced: dict[Any, dict] = {}

    # -- layout ----------------------------------------------------------------------------
    @property
    def mesh(self):
        """The global mesh."""
        return self.state.mesh

    @property
    def local_spec(self) -> P:
        """Spec of device-local values stored with a leading per-device axis."""
        return P(tuple(self.mesh.axis_names))

    @property
    def batch_spec(self) -> P:
        """Batches are split along dim 0 over data parallelism."""
        return P(self.state.data_parallel_axis_name)

    def batch_specs(self, batch: Any, sequence_axis: str | None = None) -> Any:
        """Partition spec of every leaf of ``batch``: dim 0 over data parallelism and, with
        ``sequence_axis`` (context parallelism's ``"cp"``), dim 1 of every leaf of two or more
        dims (``[b, s]`` tokens, labels, masks, positions) over that axis; 1-d leaves (per-sample
        values such as dropout seeds) are split over data parallelism only."""
        dp = self.state.data_parallel_axis_name
        if sequence_axis is None:
            return jax.tree.map(lambda _: P(dp), batch)
        return jax.tree.map(lambda x: P(dp, sequence_axis) if len(x.shape) >= 2 else P(dp), batch)

    def _require_init(self):
        if self._metadata is None:
            raise RuntimeError("call DistributedDataParallel.init(rng, *sample_inputs) first")
        return self._metadata

    def _shard_map(self, f, in_specs, out_specs):
        return jax.shard_map(f, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    def _program(self, key: Any, build: Callable[[], Callable]) -> Callable:
        """The facade's jitted program for ``key``, built once (a new closure per call would make
        ``jax.jit`` retrace and recompile every call)."""
        if key not in self._programs:
            self._programs[key] = build()
        return self._programs[key]

    def _to_local(self, tree):
        return jax.tree.map(lambda x: x[0], tree)

    def _from_local(self, tree):
        return jax.tree.map(lambda x: x[None], tree)

    # -- init ------------------------------------------------------------------------------
    def init(self, rng: jax.Array, *sample_inputs: Any) -> Any:
        """Initialise parameters (global arrays) from one microbatch's local-shaped sample inputs.

        Reads the parameters' parallel metadata, builds the buffers and the optimizer.
        """
        in_specs = (P(),) * (1 + len(sample_inputs))
        params, specs_tree, info_tree = init_sharded_params(self.module.init, self.mesh, (rng, *sample_inputs),
                                                            in_specs)
        leaves, treedef = jax.tree.flatten(params)
        infos = jax.tree.leaves(info_tree, is_leaf=lambda x: hasattr(x, "partition_spec"))
        local_shapes = [tuple(self._local_shape(x.shape, i.partition_spec)) for x, i in zip(leaves, infos, strict=True)]
        dp = self.state.replica_size(expert=False)
        specs = build_buffer_specs(
            local_shapes, [x.dtype for x in leaves], infos,
            data_parallel_size=self.ddp_config.intra_instance_size(dp, self.state.replica_size(expert=True)),
            bucket_size=None if self.disable_bucketing else self.ddp_config.effective_bucket_size(dp),
            use_distributed_optimizer=self.ddp_config.use_distributed_optimizer,
            grad_reduce_in_fp32=self.ddp_config.grad_reduce_in_fp32,
            pad_buckets_for_high_nccl_busbw=self.ddp_config.pad_buckets_for_high_nccl_busbw,
        )
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
        optimizer = DistributedOptimizer(self.optimizer_spec, specs, infos, self.state, self.ddp_config,
                                         self.learning_rate)
        leaf_specs = jax.tree.leaves(specs_tree, is_leaf=lambda x: isinstance(x, P))
        self._metadata = {
            "treedef": treedef, "infos": infos, "specs": specs, "param_specs": specs_tree, "paths": paths,
            "optimizer": optimizer,
            "opt_specs": optimizer.state_specs(leaf_specs, self.local_spec),
            "shapes": [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in leaves],
        }
        self.params = params
        return params

    def _local_shape(self, shape, spec):
        out = list(shape)
        for d, entry in enumerate(spec):
            for a in (entry if isinstance(entry, tuple) else (entry,)):
                if a is not None:
                    out[d] //= self.mesh.shape[a]
        return out

    @property
    def param_specs(self) -> Any:
        """Partition spec of every parameter (the tree of ``shard_map`` in/out specs)."""
        return self._require_init()["param_specs"]

    @property
    def buffer_specs(self):
        """The gradient buffers (dtype keys, members, bucket layouts)."""
        return self._require_init()["specs"]

    @property
    def param_paths(self) -> list[str]:
        """Tree path of every parameter (flattened order)."""
        return self._require_init()["paths"]

    def init_optimizer(self, params: Any) -> Any:
        """Optimizer state: split like the params when replicated; device-local when distributed
        (each dp rank holds only its shards)."""
        meta = self._require_init()
        opt = meta["optimizer"]
        fn = lambda p: opt.state_from_local(opt.init(jax.tree.leaves(p)))
        return jax.jit(self._shard_map(fn, (meta["param_specs"],), meta["opt_specs"]))(params)

    # -- the layout-independent optimizer state (checkpoints) ------------------------------
    def _global_opt_specs(self) -> Any:
        meta = self._require_init()
        leaf_specs = jax.tree.leaves(meta["param_specs"], is_leaf=lambda x: isinstance(x, P))
        return meta["optimizer"].global_state_specs(leaf_specs)

    def _storage_splits(self) -> tuple[Any, Any, tuple[StorageSplit, ...]]:
        """``(shapes, specs, splits)`` of the global form as this DDP holds it: global shapes; the
        global form's specs, each parameter-shaped leaf also split over the data-parallel axes
        (dp, cp, and ep where the leaf is not split over it already) along its last dimension
        that is not split yet and divides evenly (a leaf without one stays whole on every rank);
        and that split per parameter (:class:`~core.distributed.storage_split.StorageSplit`).
        So the global form takes 1/dp of the state per device, as the distributed optimizer's
        shards do, not all of it."""
        def build() -> tuple[Any, Any, tuple[StorageSplit, ...]]:
            meta = self._require_init()
            opt = meta["optimizer"]
            fn = lambda p: opt.state_to_global(opt.init(jax.tree.leaves(p)))
            params = jax.tree.unflatten(meta["treedef"], meta["shapes"])
            shapes = jax.eval_shape(jax.jit(self._shard_map(fn, (meta["param_specs"],), self._global_opt_specs())),
                                    params)
            leaf_specs = jax.tree.leaves(meta["param_specs"], is_leaf=lambda x: isinstance(x, P))
            splits = tuple(StorageSplit.choose(x.shape, spec, self.state)
                           for x, spec in zip(meta["shapes"], leaf_specs, strict=True))
            return shapes, opt.global_state_specs([split.spec for split in splits]), splits

        return self._program("storage_splits", build)

    def checkpoint_sharding(self, param: jax.Array) -> NamedSharding:
        """The sharding of a checkpoint's copy of ``param``: its own, also split over the
        data-parallel axes as the optimizer state's global form is (:meth:`_storage_splits`),
        so a save's copy of the params takes 1/dp of them per device."""
        return NamedSharding(self.mesh, StorageSplit.choose(param.shape, param.sharding.spec, self.state).spec)

    def optimizer_state_to_global(self, opt_state: Any) -> Any:
        """The optimizer state in a form that does not depend on the data-parallel layout or on
        the distributed optimizer: the replicated optimizer's state (fp32 masters, Adam moments
        of the parameters' global shapes; step counts). Each leaf is split like its parameter
        and over the data-parallel ranks (:meth:`_storage_splits`); distributed shards go
        straight into those blocks, a group of parameters after the other (about the largest
        parameter's state in temporaries, not the whole state). What checkpoints store."""
        meta = self._require_init()
        opt = meta["optimizer"]
        _, specs, splits = self._storage_splits()
        fn = lambda s: opt.state_to_global(opt.state_to_local(s), splits)
        return self._program("opt_to_global", lambda: jax.jit(self._shard_map(
            fn, (meta["opt_specs"],), specs)))(opt_state)

    def optimizer_state_from_global(self, global_state: Any) -> Any:
        """Inverse of :meth:`optimizer_state_to_global` into this DDP's layout (each data-parallel
        rank copies its shards out of the leaves when distributed, one leaf after the other),
        from a state written in any layout."""
        meta = self._require_init()
        opt = meta["optimizer"]
        _, specs, splits = self._storage_splits()
        fn = lambda s: opt.state_from_local(opt.state_from_global(s, splits))
        return self._program("opt_from_global", lambda: jax.jit(self._shard_map(
            fn, (specs,), meta["opt_specs"])))(global_state)

    def optimizer_state_global_abstract(self) -> Any:
        """``jax.ShapeDtypeStruct`` tree (global shapes, shardings on this mesh) of
        :meth:`optimizer_state_to_global`'s value: the restore target of a checkpoint."""
        shapes, specs, _ = self._storage_splits()
        place = lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(self.mesh, spec))
        return jax.tree.map(place, shapes, specs)

    # -- the fused step --------------------------------------------------------------------
    def make_train_step(self, loss_fn: LossFn | None, num_microbatches: int = 1, *, per_token_loss: bool = False,
                        forward_backward: ForwardBackwardFn | None = None, with_rng: bool = False,
                        sequence_axis: str | None = None, loss_metrics: bool = False,
                        model_state_specs: Any = None, update_model_state: Callable | None = None):
        """Jitted ``step(params, opt_state, batch) -> (params, opt_state, metrics)``.

        ``loss_fn(params, microbatch)`` runs inside ``shard_map`` on local shapes and returns the
        microbatch's mean loss, or ``(loss_sum, num_tokens)`` with ``per_token_loss``. The batch
        is a pytree of global arrays whose dim 0 (the global batch) is split over data
        parallelism and then into ``num_microbatches``. Metrics: ``loss`` (global mean),
        ``grad_norm`` (before clipping), ``nonfinite`` (device-local per-param flags),
        ``skipped`` (update skipped because of a NaN/Inf grad, or a large grad or a spiky loss when
        those checks are on; then also ``large_grads`` / ``spiky_loss`` and ``recent_max_loss``).

        The step's ``lower(params, opt_state, batch, ...)`` returns its program lowered without
        running it (``jax.jit``'s ``Lowered``: its HLO text, ``compile().memory_analysis()``).

        ``params`` and ``opt_state`` are donated, updated in place as Megatron's optimizer
        does (without it every step allocates and writes a second copy of the parameters;
        about 1-2% of a step on CPU): use the returned values, and copy the inputs first
        (``jax.tree.map(jnp.copy, params)``) to keep the old ones.

        ``forward_backward(params, local_batch) -> (grads, loss, num_tokens)`` replaces the
        microbatch loop (e.g. a pipeline schedule, which splits microbatches itself); its grads
        follow the same loss-normalisation contract and ``loss`` is this rank's mean loss.

        ``with_rng``: the step is ``step(params, opt_state, batch, rng)`` and the loss function
        gets a key, ``loss_fn(params, microbatch, rng)`` (``forward_backward(params, batch,
        rng)``): ``rng`` folded over the data-parallel (x context-parallel) axes and then with
        the microbatch index, so every data-parallel rank and microbatch draws its own dropout
        masks while tensor-parallel ranks share theirs (fold over ``"tp"`` inside for more).

        ``sequence_axis`` (context parallelism: ``"cp"``): dim 1 of the batch's ``[b, s, ...]``
        leaves is also split over this mesh axis (:meth:`batch_specs`), so each rank's loss
        function sees its ``[b/dp, s/cp]`` shard. The grads are still averaged over data x context
        parallelism, so the loss function must return ``cp`` times its share of the microbatch loss
        (as :func:`core.models.gpt.gpt_layers.language_model_loss` does).

        ``loss_metrics`` (without ``per_token_loss``): ``loss_fn`` returns ``(loss, metrics)``, a
        dict of arrays identical over tp and pp (e.g. the MoE aux losses); metrics ``"model"``
        holds them averaged over the microbatches and the data-parallel ranks. A
        ``forward_backward`` returns them, already averaged over its microbatches, as a fourth
        element (``(grads, loss, num_tokens, metrics)``).

        ``model_state_specs`` (with ``loss_metrics`` and ``update_model_state``): the model also has
        non-trainable state (e.g. the MoE expert biases), a pytree of global arrays split as these
        specs say, which is not a parameter (no gradient, optimizer or checkpoint shard of its own).
        The step is ``step(params, opt_state, batch, model_state[, rng]) -> (params, opt_state,
        metrics, model_state)``; the loss function gets it as ``loss_fn(params, microbatch[, rng],
        model_state=...)`` (``forward_backward(params, batch[, rng], model_state=...)``), and after
        the optimizer step ``update_model_state(model_state, local_metrics)`` (inside ``shard_map``)
        returns the new state from this rank's model metrics, averaged over its microbatches only.
        """
        meta = self._require_init()
        if (loss_fn is None) == (forward_backward is None):
            raise ValueError("make_train_step needs exactly one of loss_fn and forward_backward")
        if loss_metrics and per_token_loss:
            raise ValueError("loss_metrics needs a loss without per_token_loss")
        with_state = model_state_specs is not None
        if with_state and (update_model_state is None or not loss_metrics):
            raise ValueError("model_state_specs needs update_model_state and loss_metrics")
        step = self._step_body(loss_fn, num_microbatches, per_token_loss, forward_backward, loss_metrics,
                               update_model_state if with_state else None)
        state_specs = (model_state_specs,) if with_state else ()
        metric_specs = {"loss": P(), "grad_norm": P(), "nonfinite": self.local_spec, "skipped": P()}
        if loss_metrics:
            metric_specs["model"] = P()
        if self.ddp_config.check_for_large_grads:
            metric_specs["large_grads"] = self.local_spec
        if self.ddp_config.check_for_spiky_loss:
            metric_specs.update(spiky_loss=P(), recent_max_loss=P())
        programs: dict[Any, Callable] = {}

        def program(batch):
            # One program per batch structure: the specs follow the leaves' ranks (see batch_specs).
            key = (jax.tree.structure(batch), tuple(len(x.shape) for x in jax.tree.leaves(batch)))
            if key not in programs:
                in_specs = (meta["param_specs"], meta["opt_specs"], self.batch_specs(batch, sequence_axis)) \
                    + state_specs + ((P(),) if with_rng else ())
                fn = self._shard_map(step, in_specs, (meta["param_specs"], meta["opt_specs"], metric_specs)
                                     + state_specs)
                programs[key] = jax.jit(fn, donate_argnums=(0, 1))
            return programs[key]

        dp = self.state.data_parallel_size
        seq_split = self.mesh.shape[sequence_axis] if sequence_axis is not None else 1

        def check(batch, rest):
            if len(rest) != int(with_rng) + int(with_state):
                args = ", ".join(["params", "opt_state", "batch"] + ["model_state"] * with_state + ["rng"] * with_rng)
                raise TypeError(f"this train step takes ({args}) (make_train_step's with_rng={with_rng}, "
                                f"model_state_specs {'given' if with_state else 'None'})")
            for leaf in jax.tree.leaves(batch):
                if leaf.shape[0] % (dp * num_microbatches):
                    raise ValueError(
                        f"global batch {leaf.shape[0]} is not divisible by data_parallel_size ({dp}) x "
                        f"num_microbatches ({num_microbatches})")
                if seq_split > 1 and leaf.ndim >= 2 and leaf.shape[1] % seq_split:
                    raise ValueError(f"sequence length {leaf.shape[1]} is not divisible by the {sequence_axis!r} "
                                     f"axis size ({seq_split})")

        def train_step(params, opt_state, batch, *rest):
            check(batch, rest)
            out = program(batch)(params, opt_state, batch, *rest)
            self.params = out[0]  # the donated input is gone; the facade follows the step
            return out

        def lower(params, opt_state, batch, *rest) -> jax.stages.Lowered:
            """The step's program for these arguments, lowered and not run (``jax.jit``'s
            ``lower``: ``.as_text()``, ``.compile().memory_analysis()``); nothing is donated."""
            check(batch, rest)
            return program(batch).lower(params, opt_state, batch, *rest)

        train_step.lower = lower
        return train_step

    def _microbatch_grads(self, loss_fn, params, batch, num_microbatches, per_token_loss, rng=None,
                          loss_metrics=False):
        """Accumulated local grads, summed loss and token count over the microbatches (and with
        ``loss_metrics`` the mean of ``loss_fn``'s metrics, a fourth element)."""
        grad_dtype = jnp.float32 if self.ddp_config.grad_reduce_in_fp32 else None
        m = num_microbatches
        mbs = (split_microbatches(batch, m), jnp.arange(m))

        def one(mb_index):
            mb, index = mb_index
            args = (mb,) if rng is None else (mb, jax.random.fold_in(rng, index))
            if per_token_loss:
                (loss, tokens), g = jax.value_and_grad(lambda p: loss_fn(p, *args), has_aux=True)(params)
            elif loss_metrics:
                scaled = lambda p: (lambda r: (r[0] / m, jax.tree.map(lambda v: v / m, r[1])))(loss_fn(p, *args))
                (loss, extra), g = jax.value_and_grad(scaled, has_aux=True)(params)
                g = jax.tree.map(lambda x: x.astype(grad_dtype or x.dtype), g)
                return g, loss, jnp.zeros((), jnp.float32), extra
            else:
                loss, g = jax.value_and_grad(lambda p: loss_fn(p, *args) / m)(params)
                tokens = jnp.zeros((), jnp.float32)
            g = jax.tree.map(lambda x: x.astype(grad_dtype or x.dtype), g)
            return g, loss, jnp.asarray(tokens, jnp.float32)

        def add(carry, mb):
            return jax.tree.map(jnp.add, carry, one(mb)), None

        first = jax.tree.map(lambda x: x[0], mbs)
        if m == 1:
            return one(first)
        zero = jax.tree.map(jnp.zeros_like, jax.eval_shape(one, first))
        if self.ddp_config.overlap_grad_reduce:
            # Unroll the last microbatch so each bucket's collective can start during its backward.
            acc, _ = lax.scan(add, zero, jax.tree.map(lambda x: x[:-1], mbs))
            acc, _ = add(acc, jax.tree.map(lambda x: x[-1], mbs))
        else:
            acc, _ = lax.scan(add, zero, mbs)
        return acc

    def _step_body(self, loss_fn, num_microbatches, per_token_loss, forward_backward=None, loss_metrics=False,
                   update_model_state=None):
        meta = self._require_init()
        state, ddp_config, opt = self.state, self.ddp_config, meta["optimizer"]
        dp_axes = state.data_parallel_with_context_axis_name

        def body(params, opt_state, batch, *rest):
            if update_model_state is None:
                return step(params, opt_state, batch, loss_fn, forward_backward, *rest)[:3]
            model_state, *rng = rest
            # The state is a closed-over input: no gradient flows to it and no optimizer sees it.
            bind = lambda f: None if f is None else (lambda *a: f(*a, model_state=model_state))
            new_params, new_opt, metrics, local_metrics = step(params, opt_state, batch, bind(loss_fn),
                                                               bind(forward_backward), *rng)
            return new_params, new_opt, metrics, update_model_state(model_state, local_metrics)

        def step(params, opt_state, batch, loss_fn, forward_backward, *rng):
            opt_state = opt.state_to_local(opt_state)
            rng = tuple(fold_rng_over_axis(r, dp_axes) for r in rng)  # () or the rank's key
            local_metrics = None
            if loss_metrics and forward_backward is None:
                grads, loss, tokens, local_metrics = self._microbatch_grads(
                    loss_fn, params, batch, num_microbatches, per_token_loss, *(rng or (None,)), loss_metrics=True)
            elif forward_backward is None:
                grads, loss, tokens = self._microbatch_grads(loss_fn, params, batch, num_microbatches, per_token_loss,
                                                             *rng)
            else:
                grads, loss, tokens, *fb_metrics = forward_backward(params, batch, *rng)
                local_metrics = fb_metrics[0] if loss_metrics else None
                grad_dtype = jnp.float32 if ddp_config.grad_reduce_in_fp32 else None
                grads = jax.tree.map(lambda g: g.astype(grad_dtype or g.dtype), grads)
            model_metrics = None if local_metrics is None else \
                jax.tree.map(lambda v: lax.pmean(v, dp_axes), local_metrics)
            leaves = jax.tree.leaves(params)
            grad_leaves = jax.tree.leaves(grads)
            reduced = finalize_model_grads(grad_leaves, meta["infos"], meta["specs"], ddp_config, state,
                                           num_tokens=tokens if per_token_loss else None)
            # A NaN/Inf in any rank's grads makes the global grad norm non-finite on every rank:
            # the skip needs no collective of its own, and the per-param flags that name the
            # culprits are computed only when it happens.
            if per_token_loss:
                mean_loss = lax.psum(loss, dp_axes) / jnp.maximum(lax.psum(tokens, dp_axes), 1.0)
            else:
                mean_loss = lax.pmean(loss, dp_axes)
            large, skip, extra = None, None, {}
            if ddp_config.check_for_large_grads:  # local grads, before any collective (Megatron)
                opt_state, large, skip = opt.check_large_grads(opt_state, grad_leaves)
                extra["large_grads"] = jax.tree.map(lambda x: x[None], large)
            if ddp_config.check_for_spiky_loss:  # the global mean loss: the same verdict on every rank
                tracker, spiky, recent_max = check_spiky_loss(opt_state["spiky_loss"], mean_loss,
                                                              ddp_config.spiky_loss_factor)
                opt_state = {**opt_state, "spiky_loss": tracker}
                skip = spiky if skip is None else skip | spiky
                extra.update(spiky_loss=spiky, recent_max_loss=recent_max)
            new_leaves, new_opt, grad_norm, skipped = opt.step(
                opt_state, reduced, leaves, skip_nonfinite=ddp_config.check_for_nan_in_grad, skip=skip)
            flags = lax.cond(skipped, nonfinite_flags, lambda g: jnp.zeros(len(g), bool), grad_leaves)
            new_params = jax.tree.unflatten(meta["treedef"], [new_leaves[i] for i in range(len(leaves))])
            metrics = {"loss": mean_loss, "grad_norm": grad_norm, "nonfinite": flags[None], "skipped": skipped,
                       **extra}
            if model_metrics is not None:
                metrics["model"] = model_metrics
            return new_params, opt.state_from_local(new_opt), metrics, local_metrics

        return body

    def check_nonfinite(self, metrics: dict[str, Any]) -> None:
        """Raise ``FloatingPointError`` naming params and ranks if the step saw a NaN/Inf grad, or
        (``check_for_large_grads``) ``LargeGradientError`` naming rank, bucket, norm and params if
        it saw an unexpectedly large local grad norm.

        Params and optimizer state were left untouched by that step (the update was skipped).
        """
        if not bool(metrics["skipped"]):
            return
        if bool(metrics.get("spiky_loss", False)) and np.isfinite(float(metrics["grad_norm"])):
            return  # skipped for a spiky loss, reported by the caller; nothing is NaN
        from jax.experimental import multihost_utils

        from core.distributed.grad_sync import LargeGradientError, large_grads_message

        flags = np.asarray(multihost_utils.process_allgather(metrics["nonfinite"], tiled=True))
        ranks = self.state.device_ranks.reshape(-1)
        bad = [(int(ranks[d]), self.param_paths[i]) for d, i in zip(*np.nonzero(flags), strict=True)]
        if not bad and "large_grads" in metrics:
            report = {k: np.asarray(multihost_utils.process_allgather(v, tiled=True))
                      for k, v in metrics["large_grads"].items()}
            if report["flags"].any():
                raise LargeGradientError(large_grads_message(report, self.buffer_specs, self.param_paths, ranks))
        if not bad:
            raise FloatingPointError(
                "the global gradient norm is not finite (its float32 sum of squares overflowed) although "
                "every local gradient is; the update was skipped, parameters and optimizer state are unchanged.")
        names = "; ".join(f"rank {r}: params{p}" for r, p in bad[:10])
        raise FloatingPointError(
            f"NaN or Inf in local gradients ({len(bad)} param/rank pairs): {names}. "
            "The update was skipped; parameters and optimizer state are unchanged."
        )

    def optimizer_state_bytes_per_device(self, opt_state: Any) -> int:
        """Optimizer-state bytes one device holds (masters + optax state)."""
        local = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.sharding.shard_shape(x.shape), x.dtype), opt_state)
        return optimizer_state_bytes(local)

    # -- Megatron's facade -----------------------------------------------------------------
    def zero_grad_buffer(self) -> None:
        """Zero the (device-local) grad buffers before a new step's microbatches."""
        meta = self._require_init()
        fn = lambda: self._from_local(tuple(
            tuple(jnp.zeros(n, jnp.dtype(s.key.grad_dtype)) for n in s.bucket_sizes()) for s in meta["specs"]))
        self._grad_buffers = self._program("zero", lambda: jax.jit(self._shard_map(fn, (), self.local_spec)))()
        self._reduced = None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Microbatches inside accumulate without reducing (Megatron's ``no_sync``)."""
        self._is_last_microbatch = False
        try:
            yield
        finally:
            self._is_last_microbatch = True

    def backward(self, loss_fn: LossFn, params: Any, microbatch: Any, scale: float = 1.0) -> jax.Array:
        """Add ``scale * grad(loss_fn)`` of one (global) microbatch to the grad buffers; return the loss.

        Outside :meth:`no_sync` this also starts the grad sync, as Megatron's hooks do on the
        last microbatch. Model-parallel sums (``finalize_model_grads``) apply to the buffers'
        params at sync time.
        """
        meta = self._require_init()
        if self._grad_buffers is None:
            self.zero_grad_buffer()

        def fn(params, buffers, mb):
            loss, g = jax.value_and_grad(lambda p: loss_fn(p, mb) * scale)(params)
            return self._add_to_buffers(buffers, g), lax.pmean(loss, self.state.data_parallel_with_context_axis_name)

        self._grad_buffers, loss = self._program(("backward", loss_fn, scale), lambda: jax.jit(self._shard_map(
            fn, (meta["param_specs"], self.local_spec, self.batch_spec), (self.local_spec, P()))))(
            params, self._grad_buffers, microbatch)
        self._after_backward()
        return loss

    def _add_to_buffers(self, buffers: Any, grads: Any) -> Any:
        """Inside ``shard_map``: the device-local grad buffers plus ``grads`` (a params-shaped tree)."""
        leaves = jax.tree.leaves(grads)
        new = tuple(tuple(b + a.astype(b.dtype) for b, a in zip(bs, flatten_to_buckets(leaves, s), strict=True))
                    for s, bs in zip(self._require_init()["specs"], self._to_local(buffers), strict=True))
        return self._from_local(new)

    def _after_backward(self) -> None:
        """Megatron's hooks after grads reached the buffers: start the sync unless in ``no_sync``."""
        self._reduced = None  # a finished sync no longer covers the buffers
        if self._is_last_microbatch:
            self.start_grad_sync()

    def scale_gradients(self, scaling_factor: float | jax.Array) -> None:
        """Multiply the gradients by ``scaling_factor``: the accumulating buffers and, once the
        sync has run (:meth:`finish_grad_sync`, or :meth:`backward` outside :meth:`no_sync`),
        the reduced gradients :meth:`optimizer_step` reads, as Megatron scales its buffers after
        ``finish_grad_sync`` for per-token loss normalisation."""
        scale = lambda b: b * jnp.asarray(scaling_factor, b.dtype)
        if self._grad_buffers is not None:
            self._grad_buffers = jax.tree.map(scale, self._grad_buffers)
        if self._reduced is not None:
            self._reduced = jax.tree.map(scale, self._reduced)

    def per_token_scale(self, num_tokens: float | jax.Array) -> jax.Array:
        """The factor that turns the synced gradients into per-token ones: the sync averaged
        over the ``dp*cp`` data-parallel ranks, so undo that and divide by ``num_tokens``, the
        global token count (what ``finalize_model_grads([model], num_tokens)`` applies)."""
        dp_cp = self.state.data_parallel_size * self.state.context_parallel_size
        return dp_cp / jnp.maximum(jnp.asarray(num_tokens, jnp.float32), 1.0)

    def start_grad_sync(self) -> None:
        """Reduce the grad buffers over data parallelism (plus finalize's model-parallel sums)."""
        meta = self._require_init()
        def fn(buffers):
            buffers = self._to_local(buffers)
            leaves: dict[int, jax.Array] = {}
            for spec, bs in zip(meta["specs"], buffers, strict=True):
                leaves.update(unflatten_from_buckets(bs, spec))
            grad_leaves = [leaves[i] for i in range(len(leaves))]
            return self._from_local(finalize_model_grads(grad_leaves, meta["infos"], meta["specs"],
                                                         self.ddp_config, self.state))

        sync = self._program("sync", lambda: jax.jit(self._shard_map(fn, (self.local_spec,), self.local_spec)))
        self._reduced = sync(self._grad_buffers)

    def finish_grad_sync(self) -> Any:
        """Wait for (start if needed) the grad sync; return the reduced buckets (or shards)."""
        if self._reduced is None:
            self.start_grad_sync()
        return self._reduced

    def optimizer_step(self, params: Any, opt_state: Any) -> tuple[Any, Any, jax.Array]:
        """Clip and step with the synced grads; gathers params (``start_param_sync``) when sharded."""
        meta = self._require_init()
        reduced = self.finish_grad_sync()

        opt = meta["optimizer"]

        def fn(params, opt_state, reduced):
            leaves = jax.tree.leaves(params)
            new_leaves, new_opt, norm, _ = opt.step(opt.state_to_local(opt_state), self._to_local(reduced), leaves)
            new_params = jax.tree.unflatten(meta["treedef"], [new_leaves[i] for i in range(len(leaves))])
            return new_params, opt.state_from_local(new_opt), norm

        specs = (meta["param_specs"], meta["opt_specs"], self.local_spec)
        step = self._program("step", lambda: jax.jit(self._shard_map(
            fn, specs, (meta["param_specs"], meta["opt_specs"], P()))))
        params, opt_state, norm = step(params, opt_state, reduced)
        self.params = params
        return params, opt_state, norm

    def start_param_sync(self, params: Any) -> Any:
        """Make every data-parallel rank's params equal to dp rank 0's (all-gather analogue).

        The optimizer step already gathers updated shards; this re-syncs params that were
        changed outside it (e.g. loaded on one rank).
        """
        return self.broadcast_params(params)

    def broadcast_params(self, params: Any) -> Any:
        """Broadcast params from data-parallel rank 0 to the other data-parallel ranks.

        Each parameter is broadcast over the ranks that hold copies of it
        (:meth:`~core.parallel_state.ParallelState.replica_axes`): dense parameters over the
        data-parallel x context-parallel group, expert parameters over the expert-data-parallel
        x context-parallel group only (the ``ep`` ranks hold different experts).
        """
        meta = self._require_init()

        def broadcast(x, info):
            axes = self.state.replica_axes(info.expert)
            if not axes:
                return x
            first = lax.axis_index(axes) == 0
            return lax.psum(jnp.where(first, x, jnp.zeros_like(x)), axes)

        def fn(p):
            leaves, treedef = jax.tree.flatten(p)
            return jax.tree.unflatten(treedef, [broadcast(x, i) for x, i in zip(leaves, meta["infos"], strict=True)])

        return self._program("broadcast", lambda: jax.jit(self._shard_map(
            fn, (meta["param_specs"],), meta["param_specs"])))(params)

    # -- Megatron's module facade ----------------------------------------------------------
    def __call__(self, params: Any, *inputs: Any, **kwargs: Any) -> Any:
        """Megatron's ``forward``: the wrapped module applied to ``params`` (``module.apply``).

        Call it where the module's collectives have their mesh axes: inside ``shard_map`` (the
        schedules' ``forward_step_func`` gets it that way), on local shapes.
        """
        return self.module.apply(params, *inputs, **kwargs)

    forward = __call__

    def state_dict(self, params: Any | None = None) -> dict[str, np.ndarray]:
        """Megatron's ``state_dict``: every parameter of ``params`` (default :attr:`params`) as a
        host numpy array of its global shape, keyed by its tree path (``params/layer_00/kernel``).

        Every process must call it (multi-process arrays are gathered)."""
        params = self._current(params)
        out = {}
        for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
            if not x.is_fully_addressable:
                from jax.experimental import multihost_utils

                x = multihost_utils.process_allgather(x, tiled=True)
            out[_path_key(path)] = np.asarray(x)
        return out

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> Any:
        """Megatron's ``load_state_dict``: parameters (global arrays, sharded as :attr:`param_specs`
        say) from a :meth:`state_dict`; they also become :attr:`params`.

        ``strict``: every key must match a parameter and no parameter may be missing; without it
        unknown keys are ignored and missing parameters keep their :attr:`params` values.
        Shapes must match the model's global shapes (``ValueError`` naming the parameter).
        """
        meta = self._require_init()
        keys = [_path_key(p) for p, _ in jax.tree_util.tree_flatten_with_path(self._structure())[0]]
        missing = [k for k in keys if k not in state_dict]
        unexpected = sorted(set(state_dict) - set(keys))
        if strict and (missing or unexpected):
            raise KeyError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        if missing and self.params is None:
            raise KeyError(f"load_state_dict: missing keys {missing} and no current params to keep")
        current = jax.tree.leaves(self.params) if missing else None
        leaves = []
        for i, (key, shape) in enumerate(zip(keys, meta["shapes"], strict=True)):
            if key not in state_dict:
                leaves.append(current[i])
                continue
            value = np.asarray(state_dict[key])
            if value.shape != shape.shape:
                raise ValueError(f"load_state_dict: {key} has shape {value.shape}, the model's is {shape.shape}")
            value = value.astype(shape.dtype)
            leaves.append(jax.make_array_from_callback(shape.shape, shape.sharding, lambda idx, v=value: v[idx]))
        self.params = jax.tree.unflatten(meta["treedef"], leaves)
        return self.params

    def _structure(self) -> Any:
        meta = self._require_init()
        return jax.tree.unflatten(meta["treedef"], meta["shapes"])

    def _current(self, params: Any | None) -> Any:
        params = self.params if params is None else params
        if params is None:
            raise RuntimeError("no parameters: call DistributedDataParallel.init(rng, *sample_inputs) first")
        return params

    def run_forward_backward(self, schedule: Callable, *, forward_step_func: Callable, data_iterator: Any,
                             num_microbatches: int, forward_only: bool = False, **kwargs: Any) -> list[dict]:
        """Run a schedule of :mod:`core.pipeline_parallel.schedules` on this model, Megatron's way:
        the schedules call this when their ``model`` is a ``DistributedDataParallel`` (or a
        list holding one).

        ``data_iterator`` yields global microbatches (split over data parallelism, e.g. from
        :meth:`shard_batch`); ``forward_step_func(microbatch, model)`` gets the local slices
        and ``model(*inputs)``, the module on :attr:`params`. The grads are added to the grad
        buffers and, outside :meth:`no_sync`, the grad sync is started (Megatron's hooks).
        Returns one dict per microbatch of the ``loss_func``'s reduced values, averaged over
        data parallelism. With a per-token loss, :attr:`num_tokens` is the global token count
        to pass to ``finalize_model_grads([model], num_tokens)``.
        """
        meta = self._require_init()
        params = self._current(None)
        if self._grad_buffers is None and not forward_only:
            self.zero_grad_buffer()
        microbatches = tuple(next(data_iterator) for _ in range(num_microbatches))
        dp_axes = self.state.data_parallel_with_context_axis_name
        stage_fn = lambda p, *a, **k: self.module.apply(p, *a, **k)
        key = ("forward_backward", schedule, forward_step_func, num_microbatches, forward_only,
               tuple(sorted(kwargs.items())))
        traced = self._traced.setdefault(key, {})

        def fn(params, buffers, mbs):
            losses, grads, ntok = schedule(forward_step_func=forward_step_func, data_iterator=iter(mbs),
                                           model=(stage_fn, params), num_microbatches=num_microbatches,
                                           forward_only=forward_only, **kwargs)
            losses = jax.tree.map(lambda x: lax.pmean(jnp.asarray(x, jnp.float32), dp_axes), losses)
            if self.state.pipeline_model_parallel_size > 1:  # the last stage's values, zeros elsewhere
                losses = jax.tree.map(lambda x: lax.psum(x, "pp"), losses)
            traced["per_token"] = ntok is not None
            ntok = jnp.zeros(()) if ntok is None else lax.psum(jnp.asarray(ntok, jnp.float32), dp_axes)
            if forward_only:
                return buffers, losses, ntok
            return self._add_to_buffers(buffers, grads), losses, ntok

        mb_specs = tuple(jax.tree.map(lambda _: self.batch_spec, mb) for mb in microbatches)
        buffers = self._grad_buffers if not forward_only else ()
        buf_spec = self.local_spec if not forward_only else ()
        program = self._program(key, lambda: jax.jit(self._shard_map(
            fn, (meta["param_specs"], buf_spec, mb_specs), (buf_spec, P(), P()))))
        new_buffers, losses, ntok = program(params, buffers, microbatches)
        self.num_tokens = ntok if traced.get("per_token") else None
        if not forward_only:
            self._grad_buffers = new_buffers
            self._after_backward()
            if self.finalize_model_grads_func is not None:
                self.finalize_model_grads_func([self], self.num_tokens)
        return losses

    def shard_batch(self, local_batch: Any) -> Any:
        """Global batch arrays from each process's local rows (split over data parallelism)."""
        sharding = NamedSharding(self.mesh, self.batch_spec)
        return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), local_batch)


def _path_key(path: tuple) -> str:
    """``params/layer_00/kernel`` for a tree path (dict keys, sequence indices, attributes)."""
    parts = []
    for k in path:
        parts.append(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))))
    return "/".join(parts)
