"""Small tensor-parallel helpers (Megatron-core's ``tensor_parallel/utils.py``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def divide(numerator: int, denominator: int) -> int:
    """``numerator / denominator``, raising a clear error when it does not divide."""
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def split_tensor_along_last_dim(x: jax.Array, num_partitions: int) -> list[jax.Array]:
    """Split ``x`` into ``num_partitions`` equal chunks along its last dimension."""
    divide(x.shape[-1], num_partitions)
    return jnp.split(x, num_partitions, axis=-1)


class VocabUtility:
    """The ``[first, last)`` vocabulary range a tensor-parallel rank owns (Megatron's names)."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(per_partition_vocab_size: int, rank, world_size: int):
        """Range of ``rank`` when every rank holds ``per_partition_vocab_size`` entries."""
        del world_size
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size: int, rank, world_size: int):
        """Range of ``rank`` for a vocabulary of ``global_vocab_size`` split ``world_size`` ways."""
        per = divide(global_vocab_size, world_size)
        return VocabUtility.vocab_range_from_per_partition_vocab_size(per, rank, world_size)
