"""``MegatronOptimizer``: the optimizer of a model wrapped in ``DistributedDataParallel``, and
Megatron's constructor for it, :func:`get_megatron_optimizer`.

It owns what Megatron's optimizer owns: the (distributed) optimizer state (fp32 masters and
the optax state, whole per parameter or this data-parallel rank's bucket shards), its
sharding, the step (clip, update, parameter all-gather; pure functions in
:class:`~core.optimizer.distrib_optimizer.DistributedOptimizer`), and its state dict in the
layout-independent global form that checkpoints store.

Two ways to use it, as with the model:

* the fused training step (:func:`core.training.train_step.make_train_step`) reads
  :attr:`~MegatronOptimizer.inner` and :attr:`~MegatronOptimizer.state_specs` and threads the
  state (``opt_state``) through the step as a value;
* Megatron's loop: :meth:`MegatronOptimizer.step` after ``finalize_model_grads``, on the model's
  synced gradients and :attr:`DistributedDataParallel.params`, keeping the state in
  :attr:`MegatronOptimizer.opt_state`.

State layout: optimizer state is split like the params when replicated and is *device-local*
when distributed (a leading axis of one entry per device, spec ``P(all mesh axes)``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from core.distributed.array_utils import unstack_device_local
from core.distributed.storage_split import StorageSplit
from core.optimizer.distrib_optimizer import DistributedOptimizer, optimizer_state_bytes
from core.optimizer.optimizer_config import OptimizerConfig

if TYPE_CHECKING:
    from core.distributed.distributed_data_parallel import DistributedDataParallel


class MegatronOptimizer:
    """The optimizer of one :class:`~core.distributed.DistributedDataParallel` model (build it
    with :func:`get_megatron_optimizer`).

    ``config``: an :class:`OptimizerConfig` or any elementwise optax transformation;
    ``learning_rate``: a float or an optax schedule of the step count (the package's form of
    Megatron's ``OptimizerParamScheduler``), else ``config.lr``. The model must be initialised
    (``model.init``) before the optimizer's state is.
    """

    def __init__(self, config: OptimizerConfig | optax.GradientTransformation,
                 model: DistributedDataParallel, learning_rate: float | optax.Schedule | None = None):
        self.config = config
        self.model = model
        self.learning_rate = learning_rate
        self.opt_state: Any = None
        """The state :meth:`step` updates (Megatron's loop): set by :meth:`init_state`,
        :meth:`step` and :meth:`load_state_dict`."""
        self._inner: DistributedOptimizer | None = None
        self._programs: dict[Any, Callable] = {}

    # -- layout ----------------------------------------------------------------------------
    @property
    def inner(self) -> DistributedOptimizer:
        """The pure functions of the step and of the state conversions (inside ``shard_map``)."""
        if self._inner is None:
            layout, model = self.model.layout, self.model
            self._inner = DistributedOptimizer(self.config, layout.buffer_specs, layout.infos, model.state,
                                               model.ddp_config, self.learning_rate)
        return self._inner

    @property
    def state_specs(self) -> Any:
        """Partition specs of the optimizer state (the step's ``shard_map`` in/out specs)."""
        return self._program("state_specs", lambda: self.inner.state_specs(self.model.layout.leaf_specs,
                                                                            self.model.local_spec))

    def _program(self, key: Any, build: Callable[[], Any]) -> Any:
        if key not in self._programs:
            self._programs[key] = build()
        return self._programs[key]

    # -- state -----------------------------------------------------------------------------
    def init_state(self, params: Any) -> Any:
        """The optimizer state of ``params`` (a global-array tree from ``model.init``): split like
        the params when replicated; device-local when distributed (each data-parallel rank holds
        only its shards). It also becomes :attr:`opt_state`. For ``jax.ShapeDtypeStruct`` params
        (``model.init(..., abstract=True)``) the state's shapes and shardings, nothing allocated."""
        def build() -> Callable:
            opt = self.inner
            fn = lambda p: opt.state_from_local(opt.init(jax.tree.leaves(p)))
            return jax.jit(self.model.shard_map(fn, (self.model.param_specs,), self.state_specs))

        program = self._program("init_state", build)  # built once: a new jit recompiles
        if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params)):
            mesh = self.model.mesh
            place = lambda spec, sub: jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec)), sub)
            return jax.tree.map(place, self.state_specs, jax.eval_shape(program, params),
                                is_leaf=lambda x: isinstance(x, P))
        self.opt_state = program(params)
        return self.opt_state

    def state_bytes_per_device(self, opt_state: Any) -> int:
        """Optimizer-state bytes one device holds (masters + optax state)."""
        local = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.sharding.shard_shape(x.shape), x.dtype), opt_state)
        return optimizer_state_bytes(local)

    # -- Megatron's loop -------------------------------------------------------------------
    def step(self) -> tuple[bool, jax.Array, None]:
        """Megatron's ``optimizer.step()``: clip and step with the model's synced gradients
        (``finalize_model_grads`` or ``model.finish_grad_sync()``), gathering the updated shards
        when distributed. The model's :attr:`~core.distributed.DistributedDataParallel.params`
        and :attr:`opt_state` become the new values. Returns Megatron's ``(update_successful,
        grad_norm, num_zeros_in_grad)``; the update is skipped (``update_successful`` false)
        when the gradient norm is not finite and the model's ``check_for_nan_in_grad`` is on;
        ``num_zeros_in_grad`` is not counted (None)."""
        model, layout, opt = self.model, self.model.layout, self.inner
        if model.params is None:
            raise RuntimeError("optimizer.step(): the model has no parameters; call model.init first")
        if self.opt_state is None:
            self.init_state(model.params)
        reduced = model.finish_grad_sync()
        skip_nonfinite = model.ddp_config.check_for_nan_in_grad

        def fn(params, opt_state, reduced):
            leaves = jax.tree.leaves(params)
            new_leaves, new_opt, norm, skipped = opt.step(opt.state_to_local(opt_state), unstack_device_local(reduced),
                                                          leaves, skip_nonfinite=skip_nonfinite)
            new_params = jax.tree.unflatten(layout.treedef, [new_leaves[i] for i in range(len(leaves))])
            return new_params, opt.state_from_local(new_opt), norm, skipped

        specs = (layout.param_specs, self.state_specs, model.local_spec)
        program = self._program("step", lambda: jax.jit(model.shard_map(
            fn, specs, (layout.param_specs, self.state_specs, P(), P()))))
        model.params, self.opt_state, norm, skipped = program(model.params, self.opt_state, reduced)
        return not bool(skipped), norm, None

    def zero_grad(self) -> None:
        """Megatron's ``optimizer.zero_grad()``: zero the model's gradient buffers."""
        self.model.zero_grad_buffer()

    # -- the layout-independent state (checkpoints) ----------------------------------------
    def _storage_splits(self) -> tuple[Any, Any, tuple[StorageSplit, ...]]:
        """``(shapes, specs, splits)`` of the global form as this model holds it: global shapes; the
        global form's specs, each parameter-shaped leaf also split over the data-parallel axes
        (dp, cp, and ep where the leaf is not split over it already) along its last dimension
        that is not split yet and divides evenly (a leaf without one stays whole on every rank);
        and that split per parameter (:class:`~core.distributed.storage_split.StorageSplit`).
        So the global form takes 1/dp of the state per device, as the distributed optimizer's
        shards do, not all of it."""
        def build() -> tuple[Any, Any, tuple[StorageSplit, ...]]:
            model, layout, opt = self.model, self.model.layout, self.inner
            fn = lambda p: opt.state_to_global(opt.init(jax.tree.leaves(p)))
            params = jax.tree.unflatten(layout.treedef, list(layout.shapes))
            program = jax.jit(model.shard_map(fn, (layout.param_specs,), opt.global_state_specs(layout.leaf_specs)))
            shapes = jax.eval_shape(program, params)
            splits = tuple(StorageSplit.choose(x.shape, spec, model.state)
                           for x, spec in zip(layout.shapes, layout.leaf_specs, strict=True))
            return shapes, opt.global_state_specs([split.spec for split in splits]), splits

        return self._program("storage_splits", build)

    def state_to_global(self, opt_state: Any) -> Any:
        """The optimizer state in a form that does not depend on the data-parallel layout or on
        the distributed optimizer: the replicated optimizer's state (fp32 masters, Adam moments
        of the parameters' global shapes; step counts). Each leaf is split like its parameter
        and over the data-parallel ranks (:meth:`_storage_splits`); distributed shards go
        straight into those blocks, a group of parameters after the other (about the largest
        parameter's state in temporaries, not the whole state). What checkpoints store."""
        return self.conversion_program("to_global")(opt_state)

    def state_from_global(self, global_state: Any) -> Any:
        """Inverse of :meth:`state_to_global` into this model's layout (each data-parallel rank
        copies its shards out of the leaves when distributed, one leaf after the other), from a
        state written in any layout."""
        return self.conversion_program("from_global")(global_state)

    def conversion_program(self, direction: str) -> Callable:
        """The jitted program of :meth:`state_to_global` (``"to_global"``) or
        :meth:`state_from_global` (``"from_global"``), built once; its ``lower(...)`` shows the
        conversion's memory (``compile().memory_analysis()``) without running it."""
        def build() -> Callable:
            opt = self.inner
            _, specs, splits = self._storage_splits()
            if direction == "to_global":
                fn = lambda s: opt.state_to_global(opt.state_to_local(s), splits)
                return jax.jit(self.model.shard_map(fn, (self.state_specs,), specs))
            fn = lambda s: opt.state_from_local(opt.state_from_global(s, splits))
            return jax.jit(self.model.shard_map(fn, (specs,), self.state_specs))

        if direction not in ("to_global", "from_global"):
            raise ValueError(f"direction must be 'to_global' or 'from_global', not {direction!r}")
        return self._program(direction, build)

    def global_state_abstract(self) -> Any:
        """``jax.ShapeDtypeStruct`` tree (global shapes, shardings on this mesh) of
        :meth:`state_to_global`'s value: the restore target of a checkpoint."""
        shapes, specs, _ = self._storage_splits()
        place = lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(self.model.mesh, spec))
        return jax.tree.map(place, shapes, specs)

    def state_dict(self) -> Any:
        """Megatron's ``optimizer.state_dict()``: :attr:`opt_state` in the layout-independent
        global form (:meth:`state_to_global`; global arrays, loadable at any layout)."""
        if self.opt_state is None:
            raise RuntimeError("optimizer.state_dict(): no state yet; call init_state(params) or step() first")
        return self.state_to_global(self.opt_state)

    def load_state_dict(self, state_dict: Any) -> Any:
        """Megatron's ``optimizer.load_state_dict``: :attr:`opt_state` from a :meth:`state_dict`
        written at any layout; returns it."""
        self.opt_state = self.state_from_global(state_dict)
        return self.opt_state

    # -- reports ---------------------------------------------------------------------------
    def check_nonfinite(self, metrics: dict[str, Any]) -> None:
        """Raise ``FloatingPointError`` naming params and ranks if the training step (whose
        ``metrics`` these are) saw a NaN/Inf grad, or (``check_for_large_grads``)
        ``LargeGradientError`` naming rank, bucket, norm and params if it saw an unexpectedly
        large local grad norm. Params and optimizer state were left untouched by that step
        (the update was skipped)."""
        if not bool(metrics["skipped"]):
            return
        if bool(metrics.get("spiky_loss", False)) and np.isfinite(float(metrics["grad_norm"])):
            return  # skipped for a spiky loss, reported by the caller; nothing is NaN
        from jax.experimental import multihost_utils

        from core.distributed.grad_sync import LargeGradientError, large_grads_message

        model = self.model
        flags = np.asarray(multihost_utils.process_allgather(metrics["nonfinite"], tiled=True))
        ranks = model.state.device_ranks.reshape(-1)
        bad = [(int(ranks[d]), model.param_paths[i]) for d, i in zip(*np.nonzero(flags), strict=True)]
        if not bad and "large_grads" in metrics:
            report = {k: np.asarray(multihost_utils.process_allgather(v, tiled=True))
                      for k, v in metrics["large_grads"].items()}
            if report["flags"].any():
                raise LargeGradientError(large_grads_message(report, model.buffer_specs, model.param_paths, ranks))
        if not bad:
            raise FloatingPointError(
                "the global gradient norm is not finite (its float32 sum of squares overflowed) although "
                "every local gradient is; the update was skipped, parameters and optimizer state are unchanged.")
        names = "; ".join(f"rank {r}: params{p}" for r, p in bad[:10])
        raise FloatingPointError(
            f"NaN or Inf in local gradients ({len(bad)} param/rank pairs): {names}. "
            "The update was skipped; parameters and optimizer state are unchanged."
        )


def get_megatron_optimizer(config: OptimizerConfig | optax.GradientTransformation,
                           model_chunks: DistributedDataParallel | Sequence[DistributedDataParallel],
                           learning_rate: float | optax.Schedule | None = None) -> MegatronOptimizer:
    """Megatron's ``get_megatron_optimizer(config, model_chunks)``: the optimizer of a model
    wrapped in :class:`~core.distributed.DistributedDataParallel`, distributed (ZeRO-1 over
    the data-parallel group) when its ``ddp_config.shards_optimizer_state`` says so
    (``use_distributed_optimizer``, or Megatron-FSDP's ``optim`` / ``optim_grads``).

    ``model_chunks``: the model, or a list holding it. In this package one
    ``DistributedDataParallel`` holds every model chunk of a rank (virtual pipeline stages are
    stacked in its parameters), so the list has one entry. ``learning_rate``: a float or an
    optax schedule (the package's ``OptimizerParamScheduler``), else ``config.lr``.
    """
    chunks = [model_chunks] if not isinstance(model_chunks, (list, tuple)) else list(model_chunks)
    if len(chunks) != 1:
        raise ValueError(f"get_megatron_optimizer: one DistributedDataParallel holds every model chunk here "
                         f"(virtual stages are stacked in its parameters); got {len(chunks)} model chunks")
    return MegatronOptimizer(config, chunks[0], learning_rate)

