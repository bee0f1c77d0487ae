"""Token dispatchers: send each routed token to its expert's ep rank and bring the outputs back.

Both run inside ``shard_map`` over the ``ep`` mesh axis (ep ranks hold different tokens and
different experts) and group rows by expert with a stable sort of the ``T * k`` assignments
(``argsort`` of expert ids), never a dense one-hot matmul. :meth:`dispatch` returns the rows for
this rank's local experts, grouped by local expert (``rows [M, h]``, ``group_sizes [E_local]``; rows
past ``sum(group_sizes)`` are padding), and a context; :meth:`combine` takes the experts' ``[M, h]``
outputs and returns each token's prob-weighted sum over its ``k`` experts, ``[T, h]``.

``alltoall`` (:class:`MoEAlltoAllTokenDispatcher`, Megatron's): permute by expert, exchange the
per-expert counts and the rows with ``lax.all_to_all`` over ``ep``, re-sort the received rows by
local expert; the reverse all-to-all and unpermute restore token order. The number of rows a rank
sends to another varies from step to step; ``lax.ragged_all_to_all`` would move exactly those, but
XLA:CPU cannot compile it (JAX 0.10.2: "HLO opcode ragged-all-to-all is not supported"), so the
dropless exchange has static shapes: ``T * min(k, E_local)`` slots per peer at worst (a token sends
at most one row to each of its ``k`` experts, and at most ``E_local`` of those live on one rank),
with the true counts exchanged alongside. The first ``all_to_all`` sends only
:func:`exchange_width` slots per peer (1.25x the mean ``T * k / ep``); the rest go in a second
one, run (``lax.cond``) only when some rank of the ep group has more rows for a peer. Rows on the
wire at ep 8, top-2 of 8 experts: 1.25x the real ones instead of 4x. The received buffer
(``ep * T * min(k, E_local) * h`` elements, ``ep * min(k, E_local) / k`` times the permuted
activations, the second exchange's part zeros when it did not run) is what the experts get, their
padding rows skipped by the CPU's windows. With a capacity factor the buffer is exact:
``capacity`` slots per expert and source rank (``E * capacity`` rows per rank).

``allgather`` (:class:`MoEAllGatherTokenDispatcher`, Megatron's): all-gather the tokens and routing
decisions of the ep group, each rank runs its local experts on the assignments routed to them
(at most ``ep * T * min(k, E_local)`` rows), weights them by their probs, and a reduce-scatter over ep
returns each rank its tokens' sums. Only over ``ep``: the experts are replicated over tp (expert
tensor parallelism 1), so tp ranks route and dispatch their own sequence shards independently.
Dropless only (Megatron's capacity factor needs the all-to-all dispatcher).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from core.transformer.moe.moe_utils import permute_rows, sort_by_expert
from core.transformer.moe.router import RouterOutput

Context = dict[str, Any]
ExpertFn = Callable[[jax.Array, jax.Array], jax.Array]


def _weighted_sum(out: jax.Array, probs: jax.Array, dtype: Any) -> jax.Array:
    """``[T * k, h]`` expert outputs in assignment order -> ``sum_k probs * out``, ``[T, h]``."""
    t, k = probs.shape
    out = out.reshape(t, k, -1).astype(jnp.float32)
    return jnp.einsum("tkh,tk->th", out, probs.astype(jnp.float32)).astype(dtype)


def _rows_fp32_grad(x: jax.Array, index: jax.Array) -> jax.Array:
    """``x[index]`` (rows, repeats allowed) read from an fp32 copy of ``x``: autodiff's scatter-add
    of the rows' gradients then adds in fp32, as GPUs do natively, instead of a bf16
    compare-and-swap loop (see :func:`~core.transformer.moe.moe_utils.permute_rows`)."""
    return x.astype(jnp.float32)[index].astype(x.dtype)


def _exclusive_cumsum(x: jax.Array, axis: int = -1) -> jax.Array:
    return jnp.cumsum(x, axis=axis) - x


EXCHANGE_MARGIN = 1.25
"""The dropless all-to-all's first exchange over the mean rows per peer (a rank with more rows
for some peer makes its group exchange the rest too)."""


def exchange_width(rows: int, ep: int, width: int) -> int:
    """Rows per peer of the dropless all-to-all's first exchange: ``EXCHANGE_MARGIN`` times the mean
    ``rows / ep``, a multiple of 8, at most the worst case ``width``."""
    mean = math.ceil(EXCHANGE_MARGIN * rows / ep)
    return min(width, -(-mean // 8) * 8)


class _TokenDispatcher:
    """What both dispatchers hold: the expert split over the ``ep`` axis."""

    def __init__(self, num_experts: int, ep_size: int, ep_axis: str = "ep"):
        """``num_experts`` global experts split over ``ep_size`` ranks along mesh axis ``ep_axis``."""
        self.num_experts = num_experts
        self.ep = ep_size
        self.num_local_experts = num_experts // ep_size
        self.ep_axis = ep_axis


class MoEAlltoAllTokenDispatcher(_TokenDispatcher):
    """Megatron's ``alltoall`` dispatcher over the ``ep`` axis (see the module docstring)."""

    def dispatch(self, x: jax.Array, routing: RouterOutput) -> tuple[jax.Array, jax.Array, Context]:
        """Rows ``[M, h]`` for the local experts, ``group_sizes [E_local]`` and the combine context."""
        if routing.capacity is not None:
            return self._dispatch_capacity(x, routing)
        t, k = routing.indices.shape
        experts = routing.indices.reshape(-1)
        order, inverse, counts = sort_by_expert(experts, self.num_experts)
        ctx: Context = {"order": order, "inverse": inverse, "probs": routing.probs, "dtype": x.dtype}
        if self.ep == 1:
            return permute_rows(x, order, inverse), counts, ctx  # [T * k, h], grouped by expert
        ep, e_local = self.ep, self.num_local_experts
        width = t * min(k, e_local)  # worst-case rows to one destination
        first = exchange_width(t * k, ep, width)  # the first exchange's rows per destination
        dest_counts = counts.reshape(ep, e_local).sum(axis=1)
        dest_start = _exclusive_cumsum(dest_counts)
        overflow = lax.pmax(jnp.max(dest_counts) > first, self.ep_axis)  # the same on every rank of the group

        def send(lo: int, hi: int) -> jax.Array:  # slots [lo, hi) of every destination, [ep * (hi - lo), h]
            slot = jnp.arange(lo, hi, dtype=jnp.int32)
            source = dest_start[:, None] + slot[None, :]  # [ep, hi - lo] index into the sorted rows
            filled = slot[None, :] < dest_counts[:, None]
            token = (order // k)[jnp.minimum(source, t * k - 1)]  # gathered from x directly: no [T * k, h] copy
            rows = _rows_fp32_grad(x, token)
            return jnp.where(filled[..., None], rows, 0).reshape(ep * (hi - lo), -1)

        recv = self._exchange(send, first, width, overflow)
        recv_counts = lax.all_to_all(counts.reshape(ep, e_local), self.ep_axis, 0, 0, tiled=True)  # [src, E_local]
        # Local expert of every received slot (E_local for padding), then group rows by it.
        ends = jnp.cumsum(recv_counts, axis=1)
        slot = jnp.arange(width, dtype=jnp.int32)
        local_expert = (slot[None, :, None] >= ends[:, None, :]).sum(axis=-1).reshape(-1)
        recv_order, recv_inverse, group_sizes = sort_by_expert(local_expert, e_local)
        ctx.update(recv_order=recv_order, recv_inverse=recv_inverse, width=width, first=first, overflow=overflow,
                   experts_sorted=experts[order], dest_start=dest_start)
        return permute_rows(recv, recv_order, recv_inverse), group_sizes, ctx

    def _exchange(self, send: Callable[[int, int], jax.Array], first: int, width: int,
                  overflow: jax.Array) -> jax.Array:
        """All-to-all of ``width`` slots per peer, ``[ep * width, h]`` received (peer-major): slots
        ``[0, first)`` always, the rest only when a rank of the group has more rows for a peer
        (``overflow``); otherwise they are padding and stay zeros."""
        ep = self.ep
        a2a = lambda rows: lax.all_to_all(rows, self.ep_axis, 0, 0, tiled=True)
        recv = a2a(send(0, first)).reshape(ep, first, -1)
        if first < width:
            rest = lax.cond(overflow, lambda: a2a(send(first, width)),
                            lambda: jnp.zeros((ep * (width - first), recv.shape[-1]), recv.dtype))
            recv = jnp.concatenate([recv, rest.reshape(ep, width - first, -1)], axis=1)
        return recv.reshape(ep * width, -1)

    def combine(self, out: jax.Array, ctx: Context) -> jax.Array:
        """``[T, h]``: every token's prob-weighted sum of its experts' outputs ``out [M, h]``."""
        if "capacity" in ctx:
            return self._combine_capacity(out, ctx)
        if self.ep > 1:
            ep, width = self.ep, ctx["width"]
            slots = permute_rows(out, ctx["recv_inverse"], ctx["recv_order"]).reshape(ep, width, -1)  # received order
            back = self._exchange(lambda lo, hi: slots[:, lo:hi].reshape(ep * (hi - lo), -1), ctx["first"], width,
                                  ctx["overflow"])  # [ep * width, h]
            dest = ctx["experts_sorted"] // self.num_local_experts
            position = jnp.arange(dest.shape[0], dtype=jnp.int32) - ctx["dest_start"][dest]
            # [T * k, h] in sorted order; each slot read once (a scatter without atomics backward)
            out = back.reshape(ep, width, -1).at[dest, position].get(unique_indices=True)
        return _weighted_sum(permute_rows(out, ctx["inverse"], ctx["order"]), ctx["probs"], ctx["dtype"])

    # -- capacity: a fixed [E, capacity] buffer per rank -------------------------------------
    def _dispatch_capacity(self, x: jax.Array, routing: RouterOutput) -> tuple[jax.Array, jax.Array, Context]:
        t, k = routing.indices.shape
        cap, n = routing.capacity, t * k
        e_all, ep, e_local = self.num_experts, self.ep, self.num_local_experts
        where = jnp.where(routing.keep, routing.indices * cap + routing.slots, e_all * cap).reshape(-1)
        owner = jnp.full((e_all * cap + 1,), n, jnp.int32).at[where].set(jnp.arange(n, dtype=jnp.int32))[:-1]
        buf = jnp.where((owner < n)[:, None], _rows_fp32_grad(x, jnp.minimum(owner // k, t - 1)), 0)  # [E * cap, h]
        if ep > 1:
            buf = lax.all_to_all(buf, self.ep_axis, 0, 0, tiled=True)  # [src, E_local, cap, h] flattened
            buf = buf.reshape(ep, e_local, cap, -1).transpose(1, 0, 2, 3).reshape(e_local * ep * cap, -1)
        group_sizes = jnp.full((e_local,), ep * cap, jnp.int32)
        ctx: Context = {"capacity": cap, "where": where, "probs": routing.probs, "dtype": x.dtype}
        return buf, group_sizes, ctx

    def _combine_capacity(self, out: jax.Array, ctx: Context) -> jax.Array:
        cap, ep, e_local = ctx["capacity"], self.ep, self.num_local_experts
        if ep > 1:
            out = out.reshape(e_local, ep, cap, -1).transpose(1, 0, 2, 3).reshape(ep * e_local * cap, -1)
            out = lax.all_to_all(out, self.ep_axis, 0, 0, tiled=True)  # [E * cap, h] in this rank's slots
        out = jnp.concatenate([out, jnp.zeros((1, out.shape[-1]), out.dtype)])  # dropped -> zero row
        return _weighted_sum(out.astype(jnp.float32)[ctx["where"]], ctx["probs"], ctx["dtype"])  # fp32 backward


class MoEAllGatherTokenDispatcher(_TokenDispatcher):
    """Megatron's ``allgather`` dispatcher over the ``ep`` axis (see the module docstring)."""

    def dispatch(self, x: jax.Array, routing: RouterOutput) -> tuple[jax.Array, jax.Array, Context]:
        """Rows ``[M, h]`` of the ep group's assignments to the local experts, grouped by expert."""
        if routing.capacity is not None:
            raise ValueError("the allgather dispatcher is dropless: use alltoall with a capacity factor")
        t, k = routing.indices.shape
        e_local = self.num_local_experts
        xg = gather_from_sequence_parallel_region(x, True, self.ep_axis)  # [ep * T, h]
        probs = gather_from_sequence_parallel_region(routing.probs, True, self.ep_axis)  # [ep * T, k]
        indices = routing.indices if self.ep == 1 else lax.all_gather(routing.indices, self.ep_axis, tiled=True)
        local = indices.reshape(-1) - lax.axis_index(self.ep_axis) * e_local
        key = jnp.where((local >= 0) & (local < e_local), local, e_local)
        order, _, group_sizes = sort_by_expert(key, e_local)
        order = order[: self.ep * t * min(k, e_local)]  # local assignments come first; at most this many
        valid = key[order] < e_local
        token = order // k
        rows = jnp.where(valid[:, None], _rows_fp32_grad(xg, token), 0)
        weight = jnp.where(valid, probs.reshape(-1).at[order].get(unique_indices=True), 0)  # order: no repeats
        ctx: Context = {"token": token, "weight": weight, "tokens": self.ep * t, "dtype": x.dtype}
        return rows, group_sizes, ctx

    def combine(self, out: jax.Array, ctx: Context) -> jax.Array:
        """``[T, h]``: the local experts' weighted outputs summed per token, reduce-scattered over ep."""
        weighted = out.astype(jnp.float32) * ctx["weight"].astype(jnp.float32)[:, None]
        yg = jnp.zeros((ctx["tokens"], out.shape[-1]), jnp.float32).at[ctx["token"]].add(weighted)
        return reduce_scatter_to_sequence_parallel_region(yg, self.ep_axis).astype(ctx["dtype"])


def build_token_dispatcher(dispatcher_type: str, num_experts: int, ep_size: int,
                           ep_axis: str = "ep") -> MoEAlltoAllTokenDispatcher | MoEAllGatherTokenDispatcher:
    """The dispatcher ``--moe-token-dispatcher-type`` names (``"alltoall"`` or ``"allgather"``)."""
    if dispatcher_type == "alltoall":
        return MoEAlltoAllTokenDispatcher(num_experts, ep_size, ep_axis)
    if dispatcher_type == "allgather":
        return MoEAllGatherTokenDispatcher(num_experts, ep_size, ep_axis)
    raise ValueError(f"unknown token dispatcher type {dispatcher_type!r}")
