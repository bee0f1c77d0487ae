"""Megatron's ``BlendedMegatronDatasetBuilder`` for GPT: train/valid/test datasets from ``--data-path`` and ``--split``.

One prefix: a :class:`GPTDataset` per split over that split's document range. Several
weighted prefixes: per prefix, a :class:`GPTDataset` per split asking for its share of the
split's samples plus 0.5%, and per split a :class:`BlendedDataset` of exactly the requested
size. Each :class:`GPTDataset` is built with :func:`build_on_rank0_then_share`, so rank 0
writes the index caches and the other ranks load them after ``barrier``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from core.data.blended_dataset import BlendedDataset, get_size_per_split_per_dataset, parse_data_path
from core.data.gpt_dataset import (
    SPLIT_NAMES,
    GPTDataset,
    GPTDatasetConfig,
    build_on_rank0_then_share,
    convert_split_vector_to_split_matrix,
    get_split_document_ids,
    parse_and_normalize_split,
)
from core.data.indexed_dataset import IndexedDataset


def _build_splits(
    prefix: str,
    split: str,
    sizes: Sequence[int | None],
    config: GPTDatasetConfig,
    rank: int,
    barrier: Callable[[], None] | None,
) -> list[GPTDataset | None]:
    """The train/valid/test :class:`GPTDataset` of one prefix (None where the split's weight is 0)."""
    indexed = IndexedDataset(prefix)
    datasets: list[GPTDataset | None] = []
    for name, ids, size in zip(SPLIT_NAMES, get_split_document_ids(split, len(indexed)), sizes):
        if ids is None or size == 0:
            datasets.append(None)
            continue
        datasets.append(
            build_on_rank0_then_share(
                lambda ids=ids, size=size, name=name: GPTDataset(indexed, ids, size, config, name),
                rank=rank,
                barrier=barrier,
            )
        )
    return datasets


def build_gpt_datasets(
    data_path: str | Sequence[str],
    split: str,
    num_samples: Sequence[int | None],
    config: GPTDatasetConfig,
    *,
    rank: int = 0,
    barrier: Callable[[], None] | None = None,
) -> list[GPTDataset | BlendedDataset | None]:
    """``[train, valid, test]`` for ``--data-path`` and ``--split`` with ``num_samples`` per split.

    ``num_samples[i]`` None means one epoch of that split for one prefix; a blend needs an
    integer size for every split with a non-zero weight (a zero-weight split is None).
    ``num_samples[i] == 0`` skips the split (None): training does not index the test split,
    whose few documents may not even fill one sample.
    """
    if len(num_samples) != len(SPLIT_NAMES):
        raise ValueError(f"num_samples must give train, valid and test sizes, got {list(num_samples)}")
    prefixes, weights = parse_data_path(data_path)
    if len(prefixes) == 1:
        return list(_build_splits(prefixes[0], split, num_samples, config, rank, barrier))
    present = [
        bookends is not None for bookends in convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    ]
    missing = [name for name, n, used in zip(SPLIT_NAMES, num_samples, present) if used and n is None]
    if missing:
        raise ValueError(f"a blend of several --data-path prefixes needs a sample count for {', '.join(missing)}")
    per_dataset = get_size_per_split_per_dataset(weights, num_samples)
    built = [_build_splits(p, split, sizes, config, rank, barrier) for p, sizes in zip(prefixes, per_dataset)]
    blends: list[GPTDataset | BlendedDataset | None] = []
    for i, size in enumerate(num_samples):
        parts = [datasets[i] for datasets in built]
        skipped = size is None or size == 0 or any(p is None for p in parts)
        blends.append(None if skipped else BlendedDataset(parts, weights, size))
    return blends
