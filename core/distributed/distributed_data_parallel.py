"""``DistributedDataParallel``: a flax module trained data-parallel over the global mesh.

Data parallelism only, as Megatron's class: the parameters' layout (metadata, partition specs),
the bucketed gradient buffers, the gradient sync (``finalize_model_grads``: model-parallel sums,
then one collective per bucket) and the parameter sync. The optimizer is built separately
(:func:`core.optimizer.get_megatron_optimizer`) and the fused one-program training step that
composes both lives in :mod:`core.training.train_step`.

Megatron's method names are kept as a PyTorch-style facade over the same pure functions,
for code written against Megatron's loop (``zero_grad_buffer``, ``no_sync``,
``start_grad_sync``/``finish_grad_sync``, ``scale_gradients``, ``start_param_sync``,
``broadcast_params``); each call is its own jitted program, so prefer the fused step.

State layout: parameters are global arrays sharded as their metadata says (tensor-parallel
dims over ``"tp"``, replicated over data parallelism); grad buffers and per-device flags are
*device-local* values, stored as global arrays with a leading axis of one entry per device
(spec ``P(all mesh axes)``).

Parameter order: buffers are laid out in reverse "model order", taken as the flattened
parameter tree order (``jax.tree`` sorts dict keys, so name layers with zero-padded indices
to make it the forward order). It only affects which grads share a bucket, not results.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from core import parallel_state
from core.distributed.array_utils import stack_device_local, unstack_device_local
from core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from core.distributed.finalize_model_grads import finalize_model_grads
from core.distributed.fsdp.param_sharding import shard_over_data_parallel
from core.distributed.fsdp.unit_gather import ParamGather
from core.distributed.param_and_grad_buffer import (
    BufferSpec,
    build_buffer_specs,
    flatten_to_buckets,
    unflatten_from_buckets,
)
from core.distributed.storage_split import StorageSplit
from core.parallel_state import ParallelState
from core.param_metadata import ParamInfo, init_sharded_params

LossFn = Callable[[Any, Any], jax.Array]


@dataclasses.dataclass(frozen=True)
class ModelLayout:
    """What :meth:`DistributedDataParallel.init` learns about the wrapped model's parameters."""

    treedef: Any
    """The parameter tree's structure (flattened order is the buffers' model order)."""
    infos: tuple[ParamInfo, ...]
    """Each parameter's parallel metadata (flattened order)."""
    buffer_specs: tuple[BufferSpec, ...]
    """The gradient buffers: dtype keys, members, bucket layouts."""
    param_specs: Any
    """Partition spec of every parameter (a tree shaped like the params)."""
    paths: tuple[str, ...]
    """Tree path of every parameter (flattened order), for messages."""
    shapes: tuple[jax.ShapeDtypeStruct, ...]
    """Global shape, dtype and sharding of every parameter (flattened order)."""

    @property
    def leaf_specs(self) -> list[P]:
        """The partition specs in flattened order."""
        return jax.tree.leaves(self.param_specs, is_leaf=lambda x: isinstance(x, P))


class DistributedDataParallel:
    """Megatron's ``DistributedDataParallel(config, ddp_config, module)`` for a flax linen module.

    ``config`` is the :class:`~core.parallel_state.ParallelState` (None: the default one);
    ``disable_bucketing`` puts every parameter of a buffer in one bucket whatever
    ``ddp_config.bucket_size`` says (Megatron's flag, used for all model chunks but the first
    with interleaved pipelining).

    Two ways to train: the fused step (:func:`core.training.train_step.make_train_step`, one
    program per step) and Megatron's loop over this object as a stateful facade
    (``model.zero_grad_buffer()``, ``get_forward_backward_func()(..., model=[model])``,
    ``finalize_model_grads([model], num_tokens)``, ``optimizer.step()``); the facade keeps its
    current parameters in :attr:`params`.
    """

    def __init__(
        self,
        config: ParallelState | None,
        ddp_config: DistributedDataParallelConfig,
        module: nn.Module,
        disable_bucketing: bool = False,
    ):
        self.state = config if config is not None else parallel_state.get_parallel_state()
        self.ddp_config = ddp_config
        n, built = ddp_config.num_distributed_optimizer_instances, self.state.num_distributed_optimizer_instances
        if ddp_config.shards_params and n != built:  # HSDP shards inside the mesh's instances
            raise ValueError(f"data_parallel_sharding_strategy='optim_grads_params' with num_distributed_optimizer_"
                             f"instances={n} needs a parallel state built with the same number, got {built}")
        self.module = module
        self.disable_bucketing = disable_bucketing
        self.finalize_model_grads_func: Callable | None = None
        """Megatron's ``config.finalize_model_grads_func``: when set, the schedules call it as
        ``finalize_model_grads_func([model], num_tokens)`` after the backward (``num_tokens`` the
        global token count of a per-token loss, else None), as Megatron's schedules do."""
        self.num_tokens = None
        """Global token count of the last :meth:`run_forward_backward` with a per-token loss."""
        self.params = None
        """The facade's current parameters: set by :meth:`init`, the optimizer's ``step`` and
        :meth:`load_state_dict`, read by the schedules when this object is their ``model``."""
        self._is_last_microbatch = True
        self._grad_buffers = None
        self._reduced = None
        self._layout: ModelLayout | None = None
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

    @property
    def layout(self) -> ModelLayout:
        """The parameters' layout (:class:`ModelLayout`); needs :meth:`init` first."""
        if self._layout is None:
            raise RuntimeError("call DistributedDataParallel.init(rng, *sample_inputs) first")
        return self._layout

    def shard_map(self, f: Callable, in_specs: Any, out_specs: Any) -> Callable:
        """``jax.shard_map`` of ``f`` over the global mesh (the package's programs all run so)."""
        return jax.shard_map(f, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    def _program(self, key: Any, build: Callable[[], Callable]) -> Callable:
        """The facade's jitted program for ``key``, built once (a new closure per call would make
        ``jax.jit`` retrace and recompile every call)."""
        if key not in self._programs:
            self._programs[key] = build()
        return self._programs[key]

    # -- init ------------------------------------------------------------------------------
    def init(self, rng: jax.Array, *sample_inputs: Any, abstract: bool = False) -> Any:
        """Initialise parameters (global arrays) from one microbatch's local-shaped sample inputs.

        Reads the parameters' parallel metadata and builds the gradient buffers. With ``abstract``
        nothing is allocated: the parameters are ``jax.ShapeDtypeStruct`` leaves (global shapes,
        shardings), enough to lower and compile a training step (``step.lower(...)``) and read its
        ``memory_analysis`` for a model too large for this machine.
        """
        in_specs = (P(),) * (1 + len(sample_inputs))
        refine = prepare = None
        if self.ddp_config.shards_params:  # ZeRO-3: each rank keeps its block of every parameter it creates
            if not hasattr(self.module, "param_gather"):
                raise TypeError(f"data_parallel_sharding_strategy='optim_grads_params' needs a module that gathers "
                                f"its parameters unit by unit (a 'param_gather' attribute, as GPTModel has); "
                                f"{type(self.module).__name__} has none")
            self.module.param_gather = None  # the abstract pass sees the whole parameters
            refine = lambda info, shape: shard_over_data_parallel(info, shape, self.state)
            reduce_dtype = "float32" if self.ddp_config.grad_reduce_in_fp32 else None
            prepare = lambda infos: setattr(self.module, "param_gather", ParamGather(
                infos, reduce_dtype, self.ddp_config.fsdp_reshard_after_forward))
        params, specs_tree, info_tree = init_sharded_params(self.module.init, self.mesh, (rng, *sample_inputs),
                                                            in_specs, refine, abstract, prepare)
        leaves, treedef = jax.tree.flatten(params)
        infos = jax.tree.leaves(info_tree, is_leaf=lambda x: hasattr(x, "partition_spec"))
        local_shapes = [tuple(self._local_shape(x.shape, i.partition_spec)) for x, i in zip(leaves, infos, strict=True)]
        dp = self.state.replica_size(expert=False)
        specs = build_buffer_specs(
            local_shapes, [x.dtype for x in leaves], infos,
            data_parallel_size=self.ddp_config.intra_instance_size(dp, self.state.replica_size(expert=True)),
            bucket_size=None if self.disable_bucketing else self.ddp_config.effective_bucket_size(dp),
            use_distributed_optimizer=self.ddp_config.shards_optimizer_state,
            grad_reduce_in_fp32=self.ddp_config.grad_reduce_in_fp32,
            pad_buckets_for_high_nccl_busbw=self.ddp_config.pad_buckets_for_high_nccl_busbw,
        )
        paths = tuple(jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0])
        self._layout = ModelLayout(
            treedef=treedef, infos=tuple(infos), buffer_specs=tuple(specs), param_specs=specs_tree, paths=paths,
            shapes=tuple(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in leaves))
        self.params = None if abstract else params
        return params

    def _local_shape(self, shape: Sequence[int], spec: P) -> list[int]:
        out = list(shape)
        for d, entry in enumerate(spec):
            for a in (entry if isinstance(entry, tuple) else (entry,)):
                if a is not None:
                    out[d] //= self.mesh.shape[a]
        return out

    @property
    def param_specs(self) -> Any:
        """Partition spec of every parameter (the tree of ``shard_map`` in/out specs)."""
        return self.layout.param_specs

    @property
    def buffer_specs(self) -> tuple[BufferSpec, ...]:
        """The gradient buffers (dtype keys, members, bucket layouts)."""
        return self.layout.buffer_specs

    @property
    def param_paths(self) -> tuple[str, ...]:
        """Tree path of every parameter (flattened order)."""
        return self.layout.paths

    def checkpoint_sharding(self, param: jax.Array) -> NamedSharding:
        """The sharding of a checkpoint's copy of ``param``: its own, also split over the
        data-parallel axes as the optimizer state's global form is
        (:class:`~core.distributed.storage_split.StorageSplit`), so a save's copy of the params
        takes 1/dp of them per device."""
        return NamedSharding(self.mesh, StorageSplit.choose(param.shape, param.sharding.spec, self.state).spec)

    # -- Megatron's facade -----------------------------------------------------------------
    def zero_grad_buffer(self) -> None:
        """Zero the (device-local) grad buffers before a new step's microbatches."""
        meta = self.layout
        fn = lambda: stack_device_local(tuple(
            tuple(jnp.zeros(n, jnp.dtype(s.key.grad_dtype)) for n in s.bucket_sizes()) for s in meta.buffer_specs))
        self._grad_buffers = self._program("zero", lambda: jax.jit(self.shard_map(fn, (), self.local_spec)))()
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
        meta = self.layout
        if self._grad_buffers is None:
            self.zero_grad_buffer()

        def fn(params, buffers, mb):
            loss, g = jax.value_and_grad(lambda p: loss_fn(p, mb) * scale)(params)
            return self._add_to_buffers(buffers, g), lax.pmean(loss, self.state.data_parallel_with_context_axis_name)

        self._grad_buffers, loss = self._program(("backward", loss_fn, scale), lambda: jax.jit(self.shard_map(
            fn, (meta.param_specs, self.local_spec, self.batch_spec), (self.local_spec, P()))))(
            params, self._grad_buffers, microbatch)
        self._after_backward()
        return loss

    def _add_to_buffers(self, buffers: Any, grads: Any) -> Any:
        """Inside ``shard_map``: the device-local grad buffers plus ``grads`` (a params-shaped tree)."""
        leaves = jax.tree.leaves(grads)
        new = tuple(tuple(b + a.astype(b.dtype) for b, a in zip(bs, flatten_to_buckets(leaves, s), strict=True))
                    for s, bs in zip(self.layout.buffer_specs, unstack_device_local(buffers), strict=True))
        return stack_device_local(new)

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
        meta = self.layout
        def fn(buffers):
            buffers = unstack_device_local(buffers)
            leaves: dict[int, jax.Array] = {}
            for spec, bs in zip(meta.buffer_specs, buffers, strict=True):
                leaves.update(unflatten_from_buckets(bs, spec))
            grad_leaves = [leaves[i] for i in range(len(leaves))]
            return stack_device_local(finalize_model_grads(grad_leaves, meta.infos, meta.buffer_specs,
                                                         self.ddp_config, self.state))

        sync = self._program("sync", lambda: jax.jit(self.shard_map(fn, (self.local_spec,), self.local_spec)))
        self._reduced = sync(self._grad_buffers)

    def finish_grad_sync(self) -> Any:
        """Wait for (start if needed) the grad sync; return the reduced buckets (or shards)."""
        if self._reduced is None:
            self.start_grad_sync()
        return self._reduced

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
        meta = self.layout

        def broadcast(x, info):
            # Over the ranks holding copies (an FSDP-sharded parameter has none on its fsdp axes).
            axes = tuple(a for a in self.state.replica_axes(info.expert) if a not in info.fsdp_axes)
            if not axes:
                return x
            first = lax.axis_index(axes) == 0
            return lax.psum(jnp.where(first, x, jnp.zeros_like(x)), axes)

        def fn(p):
            leaves, treedef = jax.tree.flatten(p)
            return jax.tree.unflatten(treedef, [broadcast(x, i) for x, i in zip(leaves, meta.infos, strict=True)])

        return self._program("broadcast", lambda: jax.jit(self.shard_map(
            fn, (meta.param_specs,), meta.param_specs)))(params)

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
        meta = self.layout
        keys = [_path_key(p) for p, _ in jax.tree_util.tree_flatten_with_path(self._structure())[0]]
        missing = [k for k in keys if k not in state_dict]
        unexpected = sorted(set(state_dict) - set(keys))
        if strict and (missing or unexpected):
            raise KeyError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        if missing and self.params is None:
            raise KeyError(f"load_state_dict: missing keys {missing} and no current params to keep")
        current = jax.tree.leaves(self.params) if missing else None
        leaves = []
        for i, (key, shape) in enumerate(zip(keys, meta.shapes, strict=True)):
            if key not in state_dict:
                leaves.append(current[i])
                continue
            value = np.asarray(state_dict[key])
            if value.shape != shape.shape:
                raise ValueError(f"load_state_dict: {key} has shape {value.shape}, the model's is {shape.shape}")
            value = value.astype(shape.dtype)
            leaves.append(jax.make_array_from_callback(shape.shape, shape.sharding, lambda idx, v=value: v[idx]))
        self.params = jax.tree.unflatten(meta.treedef, leaves)
        return self.params

    def _structure(self) -> Any:
        meta = self.layout
        return jax.tree.unflatten(meta.treedef, meta.shapes)

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
        meta = self.layout
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
        program = self._program(key, lambda: jax.jit(self.shard_map(
            fn, (meta.param_specs, buf_spec, mb_specs), (buf_spec, P(), P()))))
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
