"""Reading and writing a Hugging Face model directory's weights: ``model.safetensors`` or shards
``model-00001-of-0000N.safetensors`` with ``model.safetensors.index.json`` (its ``weight_map``
names each tensor's file), through the ``safetensors`` library, one tensor at a time.

Reads are memory-mapped (a tensor costs memory only once read); writes go shard by shard to
temporary names, and the files are renamed into place only once every shard is written, the
index last.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from core.atomic_files import TMP_PREFIX, remove_quietly, replace_together, temporary_path
from core.checkpointing.params_checkpoint import release_free_memory
from core.models.huggingface.config_mapping import HFConversionError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_DTYPE_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
"""safetensors' dtype codes by ``transformers``' names."""


class SafetensorsReader:
    """The tensors of a model directory by name (:meth:`get`), read one at a time."""

    def __init__(self, directory: str):
        self.directory = directory
        index = os.path.join(directory, INDEX_FILE)
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    self.weight_map: dict[str, str] = dict(json.load(f)["weight_map"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise HFConversionError(f"{index} is not a readable safetensors index ({e})") from None
        elif os.path.isfile(os.path.join(directory, SINGLE_FILE)):
            with safe_open(os.path.join(directory, SINGLE_FILE), "numpy") as f:
                self.weight_map = {name: SINGLE_FILE for name in f.keys()}
        else:
            raise HFConversionError(f"{directory} has neither {SINGLE_FILE} nor {INDEX_FILE}")
        missing = sorted({f for f in self.weight_map.values() if not os.path.isfile(os.path.join(directory, f))})
        if missing:
            raise HFConversionError(f"{directory}: shard {missing[0]} named by {INDEX_FILE} is missing"
                                    + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))

    @property
    def names(self) -> list[str]:
        """Every tensor name."""
        return list(self.weight_map)

    def get(self, name: str) -> np.ndarray:
        """Tensor ``name`` as a numpy array (bf16 as ``ml_dtypes.bfloat16``)."""
        if name not in self.weight_map:
            raise HFConversionError(f"{self.directory} has no tensor {name}")
        path = os.path.join(self.directory, self.weight_map[name])
        # Opened per tensor: a mapping kept open would count every page read so far in the
        # process's resident memory until the end.
        try:
            with safe_open(path, "numpy") as f:
                return f.get_tensor(name)
        except Exception as e:  # the library raises its own error types for damaged files
            raise HFConversionError(f"{path} is not a readable safetensors file ({e})") from None

    def dtype(self) -> str:
        """The dtype of the first tensor, as ``transformers`` names it (``"bfloat16"``...), read
        from its file's header (no tensor is read)."""
        name = next(iter(self.weight_map))
        with safe_open(os.path.join(self.directory, self.weight_map[name]), "numpy") as f:
            code = f.get_slice(name).get_dtype()
        return _DTYPE_NAMES.get(code, code.lower())


def write_safetensors(directory: str, tensors: Iterable[tuple[str, np.ndarray] | None], max_shard_bytes: int
                      ) -> list[str]:
    """Write ``tensors`` (consumed in order) as shards of at most ``max_shard_bytes`` (a larger
    single tensor gets a shard of its own) plus the index, or as ``model.safetensors`` alone when
    one shard holds everything; a ``None`` item ends the current shard (the caller's tensors
    before it are then freed before it makes the next ones). Returns the file names. Nothing
    appears under the final names until every shard is written."""
    os.makedirs(directory, exist_ok=True)
    written: list[tuple[str, list[str], int]] = []  # (tmp path, names, bytes)
    batch: dict[str, np.ndarray] = {}
    size = 0

    def flush() -> None:
        nonlocal batch, size
        if batch:
            tmp = temporary_path(os.path.join(directory, f"shard-{len(written)}.safetensors"))
            save_file(batch, tmp, metadata={"format": "pt"})
            written.append((tmp, list(batch), size))
            batch, size = {}, 0
            release_free_memory()

    try:
        for item in tensors:
            if item is None:
                flush()
                continue
            name, array = item
            array = np.ascontiguousarray(array)
            if batch and size + array.nbytes > max_shard_bytes:
                flush()
            batch[name] = array
            size += array.nbytes
        flush()
        return _rename_shards(directory, written)
    except BaseException:
        for tmp, _, _ in written:
            remove_quietly(tmp)
        raise


def _rename_shards(directory: str, written: list[tuple[str, list[str], int]]) -> list[str]:
    if len(written) == 1:
        replace_together([(written[0][0], os.path.join(directory, SINGLE_FILE))])
        return [SINGLE_FILE]
    n = len(written)
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    index = {"metadata": {"total_size": sum(s for _, _, s in written)},
             "weight_map": {t: names[i] for i, (_, tensors, _) in enumerate(written) for t in tensors}}
    index_tmp = temporary_path(os.path.join(directory, INDEX_FILE))
    try:
        with open(index_tmp, "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
        # The shards first, the index last: a reader that finds the index finds every shard.
        replace_together([(tmp, os.path.join(directory, name)) for (tmp, _, _), name in zip(written, names)]
                         + [(index_tmp, os.path.join(directory, INDEX_FILE))])
    except BaseException:
        remove_quietly(index_tmp)
        raise
    return names + [INDEX_FILE]


def parse_size(text: str) -> int:
    """``"5GB"``, ``"500MB"``, ``"2GiB"`` or a byte count -> bytes (``--max-shard-size``)."""
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    upper = text.strip().upper()
    for unit, scale in units.items():
        if upper.endswith(unit):
            return int(float(upper[:-len(unit)]) * scale)
    return int(upper)


__all__ = ["INDEX_FILE", "SINGLE_FILE", "TMP_PREFIX", "SafetensorsReader", "parse_size", "write_safetensors"]
