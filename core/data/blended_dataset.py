"""Megatron-LM's dataset blending: ``--data-path 0.3 prefixA 0.7 prefixB``.

* :func:`parse_data_path` reads the weight/prefix list (weights normalised; one bare prefix has
  weight 1).
* :func:`get_size_per_split_per_dataset` asks each dataset for its share of every split's
  samples plus Megatron's 0.5% margin, ``ceil(n * w * 1.005)``, so the blend never runs short.
* :func:`build_blending_indices` is helpers.cpp's ``build_blending_indices``: sample ``i`` goes
  to the dataset whose count lags its target the most, ``argmax_k w_k * max(i, 1) - count_k``
  (ties to the lowest index), so every prefix of the blend follows the weights within one sample.
* :class:`BlendedDataset` serves sample ``i`` as sample ``dataset_sample_index[i]`` of
  ``datasets[dataset_index[i]]``, with the dataset's index under ``"dataset_id"``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def parse_data_path(data_path: str | Sequence[str]) -> tuple[list[str], list[float]]:
    """Prefixes and normalised weights of ``--data-path`` (a list, or one whitespace-separated string).

    ``[prefix]`` is weight 1; otherwise the list alternates ``weight prefix``. ``ValueError``
    for an empty or odd-length list, a weight that is not a number, or one that is not positive.
    """
    items = data_path.split() if isinstance(data_path, str) else [str(item) for item in data_path]
    if not items:
        raise ValueError("--data-path is empty: give a dataset prefix or 'weight prefix' pairs")
    if len(items) == 1:
        return [items[0].strip()], [1.0]
    if len(items) % 2:
        raise ValueError(
            f"--data-path has {len(items)} entries: expected one prefix or 'weight prefix' pairs, got {items}"
        )
    prefixes, weights = [], []
    for raw_weight, prefix in zip(items[0::2], items[1::2]):
        try:
            weight = float(raw_weight)
        except ValueError:
            raise ValueError(
                f"--data-path: weight {raw_weight!r} (before {prefix!r}) is not a number; "
                "expected 'weight prefix' pairs such as '0.3 prefixA 0.7 prefixB'"
            ) from None
        if not math.isfinite(weight) or weight <= 0.0:
            raise ValueError(f"--data-path: weight {raw_weight!r} of {prefix!r} must be a positive number")
        prefixes.append(prefix.strip())
        weights.append(weight)
    return prefixes, normalize(weights)


def normalize(weights: Sequence[float]) -> list[float]:
    """Megatron's ``utils.normalize``: the weights divided by their sum (float64)."""
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def get_size_per_split_per_dataset(
    normalized_weights: Sequence[float], target_size_per_split: Sequence[int | None]
) -> list[list[int | None]]:
    """Samples each dataset must provide per split: ``int(math.ceil(n * w * 1.005))`` (None stays None)."""
    if not math.isclose(sum(normalized_weights), 1.0, rel_tol=1e-9, abs_tol=1e-9):
        raise ValueError(f"weights must be normalised (sum to 1), got sum {sum(normalized_weights)}")
    return [
        [None if n is None else int(math.ceil(n * weight * 1.005)) for n in target_size_per_split]
        for weight in normalized_weights
    ]


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """helpers.cpp's ``build_blending_indices``: (int16 dataset index, int64 sample index within it)."""
    num_datasets = len(weights)
    if not 0 < num_datasets < 32767:
        raise ValueError(f"need 1 to 32766 datasets to blend, got {num_datasets}")
    w = [float(x) for x in weights]
    current = [0] * num_datasets
    dataset_index = np.zeros(size, dtype=np.int16)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    chosen_list = [0] * size
    sample_list = [0] * size
    for i in range(size):
        t = max(float(i), 1.0)
        best, best_error = 0, w[0] * t - current[0]
        for k in range(1, num_datasets):
            error = w[k] * t - current[k]
            if error > best_error:
                best, best_error = k, error
        chosen_list[i] = best
        sample_list[i] = current[best]
        current[best] += 1
    dataset_index[:] = chosen_list
    dataset_sample_index[:] = sample_list
    return dataset_index, dataset_sample_index


class BlendedDataset:
    """Megatron's ``BlendedDataset``: ``size`` samples drawn from ``datasets`` in the ratio of ``weights``.

    ``dataset[i]`` is the item of the chosen dataset with ``"dataset_id"`` added (a dict item
    is merged, any other item comes under ``"sample"``). ``ValueError`` at construction if a
    dataset has fewer samples than the blend takes from it.
    """

    def __init__(self, datasets: Sequence[Any], weights: Sequence[float], size: int) -> None:
        """Blend ``datasets`` with (not necessarily normalised, positive) ``weights`` into ``size`` samples."""
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        if any(not w > 0 for w in weights):
            raise ValueError(f"blend weights must be positive, got {list(weights)}")
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        self.datasets = list(datasets)
        """The blended datasets."""
        self.weights = normalize(weights)
        """Normalised weights."""
        self.size = size
        """Number of samples of the blend."""
        self.dataset_index, self.dataset_sample_index = build_blending_indices(self.weights, size)
        counts = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for k, (dataset, count) in enumerate(zip(self.datasets, counts)):
            if len(dataset) < count:
                raise ValueError(
                    f"dataset {k} of the blend has {len(dataset)} samples but the blend of {size} with weight "
                    f"{self.weights[k]:.4f} takes {count}; build it with get_size_per_split_per_dataset's sizes"
                )

    def __len__(self) -> int:
        """Number of samples."""
        return self.size

    def __getitem__(self, idx: int) -> dict[str, Any]:
        """Sample ``idx``: the chosen dataset's item with its ``dataset_id``."""
        if not -self.size <= idx < self.size:
            raise IndexError(f"sample {idx} out of range for a blend of {self.size}")
        dataset_id = int(self.dataset_index[idx])
        item = self.datasets[dataset_id][int(self.dataset_sample_index[idx])]
        if isinstance(item, Mapping):
            return {"dataset_id": dataset_id, **item}
        return {"dataset_id": dataset_id, "sample": item}
