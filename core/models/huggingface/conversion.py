"""Whole-model conversion between a Hugging Face model directory and the package's checkpoint.

* :func:`import_hf_model`: ``config.json`` and the safetensors weights -> a checkpoint at
  iteration 0 holding the parameters only (no optimizer state), its model record in the
  metadata (what ``--use-checkpoint-args`` reads) and the HF config (for the way back). Any
  layout loads it (``--load DIR --finetune``).
* :func:`export_hf_model`: a checkpoint (converted or trained, any layout) -> ``config.json``
  and safetensors shards with their index that ``transformers``' ``from_pretrained`` loads; the
  tokenizer files copied from ``tokenizer_dir``.

Both stream: one parameter array (all layers of one weight, stacked) and the HF tensors it is
made of are in memory at a time.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from core import checkpointing
from core.atomic_files import write_atomically
from core.checkpointing.checkpointer import OPTIMIZER_FORMAT, model_record
from core.checkpointing.params_checkpoint import (
    ParamPath,
    read_params_array,
    saved_param_shapes,
    write_params_checkpoint,
)
from core.models.gpt.gpt_config import GPTConfig
from core.models.gpt.gpt_model import GPTModel
from core.models.huggingface.config_mapping import (
    HFConversionError,
    gpt_config_from_hf,
    hf_config_from_gpt,
)
from core.models.huggingface.safetensors_files import INDEX_FILE, SINGLE_FILE, SafetensorsReader, write_safetensors
from core.models.huggingface.weight_mapping import (
    check_every_tensor_used,
    hf_tensors_from_param,
    param_from_hf,
)
from core.param_metadata import abstract_boxed_params, unbox

CONFIG_FILE = "config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "chat_template.jinja", "generation_config.json")
"""Files copied with ``--tokenizer-dir`` (those present)."""

LARGE_ARRAY_BYTES = 2**28
"""An export ends the current shard before reading an array of at least this size (the peak is
then about that array, not the array plus a shard's worth of earlier tensors)."""

DTYPES = {"float32": np.float32, "bfloat16": jnp.bfloat16, "float16": np.float16}
"""Weight dtypes an export writes, by ``transformers``' names."""


def read_hf_config(directory: str) -> dict:
    """The parsed ``config.json`` of an HF model directory; one-line errors when missing or malformed."""
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.isdir(directory):
        raise HFConversionError(f"{directory} is not a directory")
    if not os.path.isfile(path):
        raise HFConversionError(f"{directory} has no {CONFIG_FILE}")
    try:
        with open(path) as f:
            config = json.load(f)
    except ValueError as e:
        raise HFConversionError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise HFConversionError(f"{path} holds a {type(config).__name__}, not a JSON object")
    return config


def param_shapes(config: GPTConfig) -> dict[ParamPath, tuple[int, ...]]:
    """Global shapes of :class:`GPTModel`'s parameters for ``config`` (layers stacked
    ``[1, L, ...]``, the checkpoints' order), by path; computed abstractly (no memory)."""
    from core import parallel_state as ps  # the one-device state the abstract init runs under

    state = ps.build_parallel_state(1, 1, None, devices=jax.devices()[:1])
    model = GPTModel(config, state)
    tree = unbox(abstract_boxed_params(model.init, state.mesh,
                                       (jax.random.key(0), jax.ShapeDtypeStruct((1, 8), jnp.int32)), (P(), P())))
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {tuple(k.key for k in path): tuple(leaf.shape) for path, leaf in flat}


def _checkpoint_metadata(config: GPTConfig, hf_config: dict, dtype: str) -> dict:
    return {"iteration": 0, "consumed_samples": 0, "seed": 0, "run_id": checkpointing.new_run_id(),
            "layout": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                       "virtual_pipeline_model_parallel_size": None, "data_parallel_size": 1,
                       "context_parallel_size": 1, "use_distributed_optimizer": False, "num_devices": 1},
            "model": model_record(config), "optimizer_format": OPTIMIZER_FORMAT, "optimizer_saved": False,
            "huggingface": {"config": hf_config, "dtype": dtype}}


def import_hf_model(hf_dir: str, save_dir: str) -> GPTConfig:
    """Convert the HF model in ``hf_dir`` into a checkpoint in ``save_dir`` (a new or empty
    directory); returns the model's config. Every tensor of the HF files must be used
    (:class:`HFConversionError` names one that is not)."""
    hf_config = read_hf_config(hf_dir)
    config = gpt_config_from_hf(hf_config)
    reader = SafetensorsReader(hf_dir)
    shapes = param_shapes(config)
    check_every_tensor_used(config, list(shapes), reader.names, f"{hf_dir}: ")

    def arrays() -> Iterator[tuple[ParamPath, np.ndarray]]:
        for path, shape in shapes.items():
            yield path, param_from_hf(config, path, shape, reader.get)

    write_params_checkpoint(save_dir, arrays(), _checkpoint_metadata(config, hf_config, reader.dtype()))
    return config


def checkpoint_model_config(load_dir: str, step: int | None = None) -> tuple[GPTConfig, dict]:
    """``(model config, metadata)`` of a checkpoint (its newest complete step when ``step`` is None)."""
    meta = checkpointing.load_metadata(load_dir, step)
    record = dict(meta["model"])
    overrides = {}
    if "seq_length" not in record:  # rotary positions: any length; the imported model's own when known
        hf = (meta.get("huggingface") or {}).get("config") or {}
        overrides["seq_length"] = int(hf.get("max_position_embeddings", 4096))
    return GPTConfig.from_record(record, **overrides), meta


def _refuse_existing_model(directory: str) -> None:
    for name in (CONFIG_FILE, SINGLE_FILE, INDEX_FILE):
        if os.path.exists(os.path.join(directory, name)):
            raise HFConversionError(f"{directory} already holds a model ({name}): write into a new or empty directory")


def export_hf_model(load_dir: str, hf_dir: str, tokenizer_dir: str | None = None, dtype: str | None = None,
                    max_shard_bytes: int = 10**9, step: int | None = None) -> dict:
    """Write the checkpoint's model (newest complete step, or ``step``) to ``hf_dir`` as an HF
    model directory; returns the ``config.json`` written. ``dtype``: the weights' dtype (default:
    the imported model's, else float32). ``config.json`` is written last: a directory with it is
    complete."""
    config, meta = checkpoint_model_config(load_dir, step)
    imported = meta.get("huggingface") or {}
    dtype = dtype or imported.get("dtype", "float32")
    if dtype not in DTYPES:
        raise HFConversionError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    hf_config = hf_config_from_gpt(config, imported.get("config"), dtype)
    _refuse_existing_model(hf_dir)
    os.makedirs(hf_dir, exist_ok=True)
    saved = saved_param_shapes(load_dir, step)
    missing = sorted(set(param_shapes(config)) - set(saved))
    if missing:
        raise HFConversionError(f"checkpoint {load_dir} has no parameter {'/'.join(missing[0])}")

    def tensors() -> Iterator[tuple[str, np.ndarray] | None]:
        for path in saved:
            shape, _ = saved[path]
            if np.prod(shape) * np.dtype(DTYPES[dtype]).itemsize >= LARGE_ARRAY_BYTES:
                yield None  # end the shard before reading it: its tensors and this array never overlap
            yield from hf_tensors_from_param(config, path, read_params_array(load_dir, path, step, DTYPES[dtype]))

    write_safetensors(hf_dir, tensors(), max_shard_bytes)
    if tokenizer_dir:
        copy_tokenizer_files(tokenizer_dir, hf_dir)
    _write_json(os.path.join(hf_dir, CONFIG_FILE), hf_config)
    return hf_config


def copy_tokenizer_files(source: str, destination: str) -> list[str]:
    """Copy the tokenizer files of :data:`TOKENIZER_FILES` that ``source`` holds (each written
    atomically); returns their names. At least one must exist."""
    names = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(source, n))]
    if not names:
        raise HFConversionError(f"--tokenizer-dir {source} holds none of {', '.join(TOKENIZER_FILES)}")
    for name in names:
        with open(os.path.join(source, name), "rb") as src:
            write_atomically(os.path.join(destination, name), lambda dst, src=src: shutil.copyfileobj(src, dst))
    return names


def _write_json(path: str, value: dict) -> None:
    write_atomically(path, lambda f: json.dump(value, f, indent=2, sort_keys=True), mode="w")


__all__ = ["CONFIG_FILE", "DTYPES", "TOKENIZER_FILES", "checkpoint_model_config", "copy_tokenizer_files",
           "export_hf_model", "import_hf_model", "param_shapes", "read_hf_config"]
