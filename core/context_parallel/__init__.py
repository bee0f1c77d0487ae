"""Context parallelism: the sequence split over the ``"cp"`` mesh axis.

* :mod:`~core.context_parallel.load_balance`: the load-balanced chunk order for causal
  attention (rank ``r`` holds chunks ``r`` and ``2cp-1-r``), its inverse, local global positions.
* :mod:`~core.context_parallel.ring_attention`: ring (``p2p``) attention, K/V rotated by ``ppermute``
  (by an all-gather on the CPU backend inside pipeline stages: :func:`kv_rotation_for`).
* :mod:`~core.context_parallel.all_gather_attention`: K/V all-gathered, queries local.
* :mod:`~core.context_parallel.a2a_attention`: all-to-all from the sequence split to a head split
  around the backend's attention (Ulysses, ``a2a``), or the ring across a2a groups (``a2a+p2p``).
* :mod:`~core.context_parallel.dispatch`: :func:`context_parallel_attention` by ``comm_type``.
* :mod:`~core.context_parallel.dropout`: attention dropout drawn per global (query, key) index.
"""

from core.context_parallel._blocks import block_products
from core.context_parallel.a2a_attention import a2a_attention, group_all_to_all
from core.context_parallel.all_gather_attention import all_gather_attention
from core.context_parallel.dispatch import COMM_TYPES, context_parallel_attention
from core.context_parallel.dropout import attention_dropout_mask
from core.context_parallel.load_balance import (
    cp_positions,
    load_balance_chunk_order,
    load_balance_permutation,
    reorder_for_cp,
    restore_from_cp,
)
from core.context_parallel.ring_attention import KV_ROTATIONS, kv_rotation_for, ring_attention

__all__ = [
    "COMM_TYPES",
    "KV_ROTATIONS",
    "a2a_attention",
    "all_gather_attention",
    "attention_dropout_mask",
    "block_products",
    "context_parallel_attention",
    "cp_positions",
    "group_all_to_all",
    "kv_rotation_for",
    "load_balance_chunk_order",
    "load_balance_permutation",
    "reorder_for_cp",
    "restore_from_cp",
    "ring_attention",
]
