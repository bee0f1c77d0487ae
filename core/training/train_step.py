"""The fused training step: one jitted ``shard_map`` program per step that composes the model's
forward/backward over the microbatches (``lax.scan``; grads accumulate and are reduced once per
step, Megatron's ``no_sync`` semantics) or a pipeline schedule, the data-parallel gradient sync
(``finalize_model_grads``: model-parallel sums, then one collective per bucket), the NaN / large
gradient / spiky loss checks, global-norm clipping, the (distributed) optimizer step and the
parameter all-gather. No host round trip inside a step.

The pieces it composes live in their own packages: the model's layout and gradient buffers in
:class:`~core.distributed.DistributedDataParallel`, the optimizer state and update in
:class:`~core.optimizer.MegatronOptimizer`, the schedules in :mod:`core.pipeline_parallel`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from core.distributed.array_utils import fold_rng_over_axis
from core.distributed.distributed_data_parallel import DistributedDataParallel
from core.distributed.finalize_model_grads import (
    divide_by_global_tokens,
    finalize_model_grads,
    nonfinite_flags,
    reduce_local_grads,
)
from core.distributed.loss_normalization import loss_terms, sequence_mean
from core.distributed.spiky_loss import check_spiky_loss
from core.optimizer.optimizer import MegatronOptimizer
from core.pipeline_parallel.utils import split_microbatches
from core.transformer.moe.moe_utils import moe_aux_loss_scale

LossFn = Callable[..., Any]
ForwardBackwardFn = Callable[..., tuple]


def make_train_step(model: DistributedDataParallel, optimizer: MegatronOptimizer, loss_fn: LossFn | None,
                    num_microbatches: int = 1, *, forward_backward: ForwardBackwardFn | None = None,
                    calculate_per_token_loss: bool = False, with_rng: bool = False, sequence_axis: str | None = None,
                    model_state_specs: Any = None, update_model_state: Callable | None = None) -> Callable:
    """Jitted ``step(params, opt_state, batch) -> (params, opt_state, metrics)`` of ``model``
    (initialised) and ``optimizer`` (``get_megatron_optimizer(config, [model])``; ``opt_state``
    from its ``init_state``).

    ``loss_fn(params, microbatch)`` runs inside ``shard_map`` on local shapes and returns Megatron's
    loss contract, ``(loss, num_tokens, report)``: the loss summed over this rank's tokens of the
    microbatch, their number, and a dict of logged values (:mod:`core.distributed.loss_normalization`;
    an already normalised ``(mean_loss, report)`` or a bare mean is accepted too, as Megatron
    does). Each microbatch's loss is divided by its token count and the microbatches are
    averaged (Megatron's default), or with ``calculate_per_token_loss`` the summed losses are
    divided by the global token count. The batch is a pytree of global arrays whose dim 0 (the
    global batch) is split over data parallelism and then into ``num_microbatches``.

    Metrics: ``loss`` (global mean), ``grad_norm`` (before clipping), ``report`` (the loss
    function's values averaged over the microbatches and the data-parallel ranks), ``nonfinite``
    (device-local per-param flags), ``skipped`` (update skipped because of a NaN/Inf grad, or a
    large grad or a spiky loss when those checks are on; then also ``large_grads`` /
    ``spiky_loss`` and ``recent_max_loss``).

    The step's ``lower(params, opt_state, batch, ...)`` returns its program lowered without
    running it (``jax.jit``'s ``Lowered``: its HLO text, ``compile().memory_analysis()``).

    ``params`` and ``opt_state`` are donated, updated in place as Megatron's optimizer does
    (without it every step allocates and writes a second copy of the parameters): use the
    returned values, and copy the inputs first (``jax.tree.map(jnp.copy, params)``) to keep the
    old ones.

    ``forward_backward(params, local_batch) -> (grads, loss, num_tokens, report)`` replaces the
    microbatch loop (e.g. a pipeline schedule, which splits microbatches itself): grads of the
    normalised objective, this rank's mean loss (the summed loss with ``calculate_per_token_loss``),
    its token count and its report averaged over its microbatches.

    Megatron-FSDP ``optim_grads`` (``model.ddp_config.reduce_scatter_per_microbatch``): each
    microbatch's grads are reduced (tp/pp sums, then the per-bucket reduce-scatter over data
    parallelism) right after its backward and the scan accumulates only this rank's fp32 bucket
    shards; no reduction is left for the end of the step. With ``forward_backward`` (which
    accumulates grads itself) the reduction stays once per step, as with ``optim``.

    ``with_rng``: the step is ``step(params, opt_state, batch, rng)`` and the loss function
    gets a key, ``loss_fn(params, microbatch, rng)`` (``forward_backward(params, batch,
    rng)``): ``rng`` folded over the data-parallel (x context-parallel) axes and then with
    the microbatch index, so every data-parallel rank and microbatch draws its own dropout
    masks while tensor-parallel ranks share theirs (fold over ``"tp"`` inside for more).

    ``sequence_axis`` (context parallelism: ``"cp"``): dim 1 of the batch's ``[b, s, ...]``
    leaves is also split over this mesh axis (``model.batch_specs``), so each rank's loss
    function sees its ``[b/dp, s/cp]`` shard; the token counts are summed over the axis, so each
    microbatch's mean is the whole sequence's (:func:`~core.distributed.loss_normalization.sequence_mean`).
    A loss function that returns a mean must itself return ``cp`` times its share of it.

    ``model_state_specs`` (with ``update_model_state``): the model also has non-trainable state
    (the MoE expert biases, the FP8 delayed-scaling state), a pytree of global arrays split as
    these specs say, which is not a parameter (no optimizer or checkpoint shard of its own). The
    step is ``step(params, opt_state, batch, model_state[, rng]) -> (params, opt_state, metrics,
    model_state)``; the loss function gets it as ``loss_fn(params, microbatch[, rng],
    model_state=...)`` (``forward_backward(params, batch[, rng], model_state=...)``, which then
    returns a fifth item, ``observed`` below). The loss is differentiated with respect to the
    state too: its cotangents are statistics the model reports through it (the FP8 scales'
    cotangents are the amaxes their GEMMs saw, :mod:`core.fp8.linear`; state that only steers
    the forward, like the expert bias, gets zeros), combined over the microbatches with ``max``,
    not summed. After the optimizer step ``update_model_state(model_state, local_report,
    observed)`` (inside ``shard_map``) returns the new state from this rank's report, averaged
    over its microbatches only, and those combined cotangents.

    MoE auxiliary losses enter the backward through
    :func:`~core.transformer.moe.moe_utils.attach_aux_loss` with the scale this step sets
    (``1 / num_microbatches``, :func:`~core.transformer.moe.moe_utils.moe_aux_loss_scale`).
    """
    layout = model.layout
    if (loss_fn is None) == (forward_backward is None):
        raise ValueError("make_train_step needs exactly one of loss_fn and forward_backward")
    with_state = model_state_specs is not None
    if with_state and update_model_state is None:
        raise ValueError("model_state_specs needs update_model_state")
    step = _step_body(model, optimizer, loss_fn, forward_backward, num_microbatches, calculate_per_token_loss,
                      sequence_axis, update_model_state if with_state else None)
    state_specs = (model_state_specs,) if with_state else ()
    metric_specs = {"loss": P(), "grad_norm": P(), "report": P(), "nonfinite": model.local_spec, "skipped": P()}
    if model.ddp_config.check_for_large_grads:
        metric_specs["large_grads"] = model.local_spec
    if model.ddp_config.check_for_spiky_loss:
        metric_specs.update(spiky_loss=P(), recent_max_loss=P())
    programs: dict[Any, Callable] = {}

    def program(batch):
        # One program per batch structure: the specs follow the leaves' ranks (see batch_specs).
        key = (jax.tree.structure(batch), tuple(len(x.shape) for x in jax.tree.leaves(batch)))
        if key not in programs:
            in_specs = (layout.param_specs, optimizer.state_specs, model.batch_specs(batch, sequence_axis)) \
                + state_specs + ((P(),) if with_rng else ())
            fn = model.shard_map(step, in_specs, (layout.param_specs, optimizer.state_specs, metric_specs)
                                 + state_specs)
            programs[key] = jax.jit(fn, donate_argnums=(0, 1))
        return programs[key]

    dp = model.state.data_parallel_size
    seq_split = model.mesh.shape[sequence_axis] if sequence_axis is not None else 1

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
        # The donated inputs are gone; Megatron's loop (model.params, optimizer.step()) follows the step.
        model.params, optimizer.opt_state = out[0], out[1]
        return out

    def lower(params, opt_state, batch, *rest) -> jax.stages.Lowered:
        """The step's program for these arguments, lowered and not run (``jax.jit``'s
        ``lower``: ``.as_text()``, ``.compile().memory_analysis()``); nothing is donated."""
        check(batch, rest)
        return program(batch).lower(params, opt_state, batch, *rest)

    train_step.lower = lower
    return train_step


def mean_loss(loss_fn: LossFn) -> Callable[..., jax.Array]:
    """A loss function of the contract as a scalar mean over its tokens (one rank's view: no
    sequence split), for ``jax.value_and_grad`` outside a training step."""
    def fn(*args: Any, **kwargs: Any) -> jax.Array:
        terms = loss_terms(loss_fn(*args, **kwargs))
        return terms.loss if terms.num_tokens is None else sequence_mean(terms.loss, terms.num_tokens)

    return fn


def _microbatch_objective(loss_fn: LossFn, m: int, per_token: bool, sequence_axis: str | None):
    """``objective(params, *args) -> (objective, (loss value, num_tokens, report))`` of one
    microbatch, normalised as the step says (see :mod:`core.distributed.loss_normalization`)."""
    def objective(params, *args, **kwargs):
        terms = loss_terms(loss_fn(params, *args, **kwargs))
        report = jax.tree.map(lambda v: v / m, terms.report)
        if per_token:
            if terms.num_tokens is None:
                raise TypeError("calculate_per_token_loss needs a loss function that returns "
                                "(loss_sum, num_tokens, report)")
            return terms.loss, (terms.loss, terms.num_tokens, report)
        zero = jnp.zeros((), jnp.float32)
        mean = terms.loss if terms.num_tokens is None else sequence_mean(terms.loss, terms.num_tokens, sequence_axis)
        return mean / m, (mean / m, zero, report)

    return objective


def _microbatch_grads(model: DistributedDataParallel, loss_fn: LossFn, params: Any, batch: Any,
                      num_microbatches: int, per_token: bool, sequence_axis: str | None, rng: jax.Array | None,
                      model_state_kwargs: dict, reduce: Callable[[list], Any] | None = None
                      ) -> tuple[tuple[Any, jax.Array, jax.Array, dict], Any]:
    """``((grads, loss, tokens, report), observed)``: accumulated local grads, loss value (the
    microbatches' mean, or their summed loss per token), token count and report (averaged over
    the microbatches), and the model state's cotangents combined with max (None without state).

    With ``reduce`` (Megatron-FSDP ``optim_grads``) each microbatch's grad leaves go through it
    right after the backward and the accumulated values are what it returns, in fp32 (this rank's
    bucket shards), so no full-size accumulator lives across microbatches."""
    grad_dtype = jnp.float32 if model.ddp_config.grad_reduce_in_fp32 else None
    m = num_microbatches
    mbs = (split_microbatches(batch, m), jnp.arange(m))
    objective = _microbatch_objective(loss_fn, m, per_token, sequence_axis)

    model_state = model_state_kwargs.get("model_state")

    def one(mb_index):
        mb, index = mb_index
        args = (mb,) if rng is None else (mb, jax.random.fold_in(rng, index))
        # MoE aux losses get the LM loss's per-microbatch weight (None: no weight per token).
        with moe_aux_loss_scale(None if per_token else 1.0 / m):
            (_, (loss, tokens, report)), (g, observed) = jax.value_and_grad(
                lambda p, s: objective(p, *args, **({} if s is None else {"model_state": s})),
                argnums=(0, 1), has_aux=True)(params, model_state)
        g = jax.tree.map(lambda x: x.astype(grad_dtype or x.dtype), g)
        if reduce is not None:
            g = jax.tree.map(lambda x: x.astype(jnp.float32), reduce(jax.tree.leaves(g)))
        return (g, jnp.asarray(loss, jnp.float32), jnp.asarray(tokens, jnp.float32), report), observed

    def add(carry, mb):
        (sums, observed), (new_sums, new_observed) = carry, one(mb)
        # Gradients, losses and reports add up; the state's cotangents are statistics (max).
        return (jax.tree.map(jnp.add, sums, new_sums), jax.tree.map(jnp.maximum, observed, new_observed)), None

    first = jax.tree.map(lambda x: x[0], mbs)
    if m == 1:
        return one(first)
    zero = jax.tree.map(jnp.zeros_like, jax.eval_shape(one, first))
    if model.ddp_config.overlap_grad_reduce:
        # Unroll the last microbatch so each bucket's collective can start during its backward.
        acc, _ = lax.scan(add, zero, jax.tree.map(lambda x: x[:-1], mbs))
        acc, _ = add(acc, jax.tree.map(lambda x: x[-1], mbs))
    else:
        acc, _ = lax.scan(add, zero, mbs)
    return acc


def _step_body(model: DistributedDataParallel, optimizer: MegatronOptimizer, loss_fn: LossFn | None,
               forward_backward: ForwardBackwardFn | None, num_microbatches: int, per_token: bool,
               sequence_axis: str | None, update_model_state: Callable | None) -> Callable:
    """The step inside ``shard_map``: local grads, their sync, the checks and the optimizer update."""
    layout = model.layout
    state, ddp_config, opt = model.state, model.ddp_config, optimizer.inner
    dp_axes = state.data_parallel_with_context_axis_name
    grad_dtype = jnp.float32 if ddp_config.grad_reduce_in_fp32 else None

    # Megatron-FSDP optim_grads: reduce-scatter every microbatch's grads right after its backward
    # (a pipeline schedule accumulates grads itself: there the reduction stays once per step).
    per_microbatch = ddp_config.reduce_scatter_per_microbatch and forward_backward is None

    def reduce_microbatch(grad_leaves):
        shards = reduce_local_grads(grad_leaves, layout.infos, layout.buffer_specs, ddp_config, state,
                                    per_token_loss=per_token)
        # The per-param NaN/Inf flags need the local grads, which only exist inside the microbatch.
        flags = nonfinite_flags(grad_leaves) if ddp_config.check_for_nan_in_grad else jnp.zeros(len(grad_leaves), bool)
        return shards, flags

    def local_grads(params, batch, rng, model_state_kwargs):
        if forward_backward is None:
            return _microbatch_grads(model, loss_fn, params, batch, num_microbatches, per_token, sequence_axis,
                                     rng, model_state_kwargs, reduce_microbatch if per_microbatch else None)
        grads, loss, tokens, report, *observed = forward_backward(params, batch, *(() if rng is None else (rng,)),
                                                                  **model_state_kwargs)
        grads = jax.tree.map(lambda g: g.astype(grad_dtype or g.dtype), grads)
        return (grads, loss, jnp.asarray(tokens, jnp.float32), report), (observed[0] if observed else None)

    def body(params, opt_state, batch, *rest):
        model_state = rest[0] if update_model_state is not None else None
        rng = rest[-1] if len(rest) > (update_model_state is not None) else None
        rng = None if rng is None else fold_rng_over_axis(rng, dp_axes)  # the rank's key
        # The state is an input of the loss, differentiated for the statistics it reports; no optimizer sees it.
        kwargs = {} if update_model_state is None else {"model_state": model_state}
        (grads, loss, tokens, local_report), observed = local_grads(params, batch, rng, kwargs)
        new_params, new_opt, metrics = update(params, opt.state_to_local(opt_state), grads, loss, tokens)
        metrics["report"] = jax.tree.map(lambda v: lax.pmean(v, dp_axes), local_report)
        out = (new_params, opt.state_from_local(new_opt), metrics)
        if update_model_state is None:
            return out
        return (*out, update_model_state(model_state, local_report, observed))

    def update(params, opt_state, grads, loss, tokens):
        leaves = jax.tree.leaves(params)
        if per_microbatch:  # already reduced: this rank's shards and the OR of the microbatches' flags
            reduced, local_flags = grads
            reduced = divide_by_global_tokens(reduced, tokens, state) if per_token else reduced
            grad_leaves = None
        else:
            grad_leaves = jax.tree.leaves(grads)
            reduced = finalize_model_grads(grad_leaves, layout.infos, layout.buffer_specs, ddp_config, state,
                                           num_tokens=tokens if per_token else None)
        # A NaN/Inf in any rank's grads makes the global grad norm non-finite on every rank:
        # the skip needs no collective of its own, and the per-param flags that name the
        # culprits are computed only when it happens.
        if per_token:
            mean_loss = lax.psum(loss, dp_axes) / jnp.maximum(lax.psum(tokens, dp_axes), 1.0)
        else:
            mean_loss = lax.pmean(loss, dp_axes)
        skip, extra = None, {}
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
        if per_microbatch:
            flags = local_flags.astype(bool)
        else:
            flags = lax.cond(skipped, nonfinite_flags, lambda g: jnp.zeros(len(g), bool), grad_leaves)
        new_params = jax.tree.unflatten(layout.treedef, [new_leaves[i] for i in range(len(leaves))])
        metrics = {"loss": mean_loss, "grad_norm": grad_norm, "nonfinite": flags[None], "skipped": skipped, **extra}
        return new_params, new_opt, metrics

    return body
