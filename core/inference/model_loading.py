"""The model behind ``launch/generate.py --load DIR``: a Hugging Face model directory or a
checkpoint of this package, loaded straight into an inference layout.

* A Hugging Face directory (``config.json`` and ``model.safetensors`` or its sharded form):
  the config through :func:`~core.models.huggingface.gpt_config_from_hf`, each parameter built
  by the conversion's mapping (:func:`~core.models.huggingface.weight_mapping.param_from_hf`),
  one array at a time, and placed on the devices; no checkpoint is written.
* A checkpoint directory (step directories written by ``launch/pretrain.py`` or the converter):
  the model from the checkpoint's model record (what ``--use-checkpoint-args`` reads), the
  parameters (and a MoE model's expert biases) restored into the layout, from the newest intact
  step or ``step``.

Every failure is a :class:`ModelLoadError` with one line naming ``--load``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from core.models.gpt.gpt_config import GPTConfig
from core.parallel_state import ParallelState

HF_KIND, CHECKPOINT_KIND = "huggingface", "checkpoint"


class ModelLoadError(ValueError):
    """``--load`` names nothing loadable (one line)."""


@dataclasses.dataclass
class LoadedModel:
    """A model ready for :class:`~core.inference.GenerationEngine`."""

    config: GPTConfig
    """The model's config (``bf16`` as asked; no sequence or context parallelism)."""
    params: Any
    """Global parameters placed in the state's layout, in the compute dtype."""
    moe_state: dict | None
    """A MoE model's expert biases when its checkpoint holds them, else None."""
    kind: str
    """:data:`HF_KIND` or :data:`CHECKPOINT_KIND`."""
    step: int | None = None
    """The checkpoint step loaded (checkpoints only)."""
    notes: list[str] = dataclasses.field(default_factory=list)
    """Lines for the user: checkpoints skipped as damaged."""


def detect_kind(load: str) -> str:
    """:data:`HF_KIND` for a directory with ``config.json`` and safetensors weights,
    :data:`CHECKPOINT_KIND` for one with checkpoint step directories; :class:`ModelLoadError` else."""
    from core import checkpointing
    from core.models.huggingface.safetensors_files import INDEX_FILE, SINGLE_FILE

    if not os.path.exists(load):
        raise ModelLoadError(f"--load {load}: no such directory")
    if not os.path.isdir(load):
        raise ModelLoadError(f"--load {load}: not a directory")
    has_config = os.path.isfile(os.path.join(load, "config.json"))
    has_weights = any(os.path.isfile(os.path.join(load, n)) for n in (SINGLE_FILE, INDEX_FILE))
    if has_config and has_weights:
        return HF_KIND
    if checkpointing.complete_steps(load):
        return CHECKPOINT_KIND
    if has_config:
        raise ModelLoadError(f"--load {load}: config.json but no {SINGLE_FILE} or {INDEX_FILE} (a Hugging Face model "
                             "directory needs its safetensors weights)")
    why = checkpointing.why_nothing_to_load(load)
    raise ModelLoadError(f"--load {load}: {why}; expected a Hugging Face model directory (config.json and "
                         f"{SINGLE_FILE}) or a checkpoint directory of this package")


def abstract_params(config: GPTConfig, state: ParallelState) -> tuple[Any, Any]:
    """``(params, specs)``: the inference model's global parameters as ``ShapeDtypeStruct``
    leaves (float32, with their shardings) and their partition specs (nothing allocated)."""
    from core.inference.engine import inference_config
    from core.models.gpt.gpt_model import GPTModel
    from core.param_metadata import init_sharded_params

    model = GPTModel(inference_config(config), state)
    params, specs, _ = init_sharded_params(model.init, state.mesh, (jax.random.key(0), jnp.zeros((1, 8), jnp.int32)),
                                           (P(), P()), abstract=True)
    return params, specs


def _paths(tree: Any) -> list[tuple[tuple[str, ...], Any]]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [(tuple(k.key for k in path), leaf) for path, leaf in flat]


def _place(array: np.ndarray, like: jax.ShapeDtypeStruct, dtype: Any) -> jax.Array:
    """A host array as a global array with ``like``'s sharding, each device given its block."""
    array = np.asarray(array).astype(dtype) if array.dtype != dtype else array
    return jax.make_array_from_callback(array.shape, like.sharding, lambda index: array[index])


def _model_config(config: GPTConfig, bf16: bool) -> GPTConfig:
    return dataclasses.replace(config, bf16=bf16, context_parallel_size=1, sequence_parallel=False,
                               recompute_granularity=None)


def _validated(config: GPTConfig, state: ParallelState, load: str) -> GPTConfig:
    try:
        config.validate(state.tensor_model_parallel_size)
    except ValueError as e:
        raise ModelLoadError(f"--load {load}: the model cannot run at --tensor-model-parallel-size "
                             f"{state.tensor_model_parallel_size}: {e}") from None
    return config


def load_hf_model(load: str, state: ParallelState, bf16: bool = False) -> LoadedModel:
    """The Hugging Face model in ``load``, placed for ``state`` one parameter at a time."""
    from core.models.huggingface.config_mapping import HFConversionError, gpt_config_from_hf
    from core.models.huggingface.conversion import read_hf_config
    from core.models.huggingface.safetensors_files import SafetensorsReader
    from core.models.huggingface.weight_mapping import check_every_tensor_used, param_from_hf

    try:
        config = gpt_config_from_hf(read_hf_config(load))
        tp = state.tensor_model_parallel_size
        if config.vocab_rows % tp:  # Megatron's padding of the vocabulary to the tensor-parallel size
            config = dataclasses.replace(config, padded_vocab_size=-(-config.vocab_rows // (128 * tp)) * 128 * tp)
        config = _validated(_model_config(config, bf16), state, load)
        reader = SafetensorsReader(load)
        abstract, _ = abstract_params(config, state)
        leaves = _paths(abstract)
        check_every_tensor_used(config, [p for p, _ in leaves], reader.names, "")
        placed = {}
        for path, like in leaves:
            placed[path] = _place(param_from_hf(config, path, like.shape, reader.get), like, config.compute_dtype)
    except (HFConversionError, OSError) as e:
        raise ModelLoadError(f"--load {load}: {' '.join(str(e).split())}") from None
    params = jax.tree_util.tree_unflatten(jax.tree.structure(abstract), [placed[p] for p, _ in leaves])
    return LoadedModel(config, params, None, HF_KIND)


def _checkpoint_step(load: str, step: int | None) -> tuple[int, list[str]]:
    from core import checkpointing

    if step is not None:
        problem = checkpointing.step_problem(load, step)
        if problem is not None:
            raise ModelLoadError(f"--load {load} --ckpt-step {step}: {problem}")
        return step, []
    found, skipped = checkpointing.latest_valid_step(load)
    if found is None:
        raise ModelLoadError(f"--load {load}: no intact checkpoint ({'; '.join(skipped) or 'none complete'})")
    return found, skipped


def load_checkpoint_model(load: str, state: ParallelState, step: int | None = None,
                          bf16: bool = False) -> LoadedModel:
    """The model of checkpoint ``step`` (newest intact when None) in ``load``, restored for ``state``."""
    from core import checkpointing
    from core.models.gpt.gpt_model import GPTModel
    from core.models.huggingface.conversion import checkpoint_model_config

    step, skipped = _checkpoint_step(load, step)
    try:
        config, _ = checkpoint_model_config(load, step)
    except (KeyError, TypeError, ValueError, OSError) as e:
        raise ModelLoadError(f"--load {load}: cannot read the model of checkpoint {step}: "
                             f"{' '.join(str(e).split())}") from None
    config = _validated(_model_config(config, bf16), state, load)
    abstract, _ = abstract_params(config, state)
    dtype = config.compute_dtype
    target: dict[str, Any] = {"params": jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding), abstract)}
    saved = _saved_entries(load, step)
    if config.moe is not None and "moe_state" in saved:
        model = GPTModel(config, state)
        target["moe_state"] = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(state.mesh, spec))
                               for (k, v), spec in zip(model.moe_state_shape().items(),
                                                       GPTModel.moe_state_spec().values())}
    try:
        restored, _ = checkpointing.restore_checkpoint(load, step, target, partial=True)
    except (ValueError, FileNotFoundError, OSError) as e:
        raise ModelLoadError(f"--load {load}: checkpoint {step} does not hold the model its record describes: "
                             f"{' '.join(str(e).split())[:400]}") from None
    notes = [f"WARNING: --load {load}: {line}" for line in skipped]
    return LoadedModel(config, restored["params"], restored.get("moe_state"), CHECKPOINT_KIND, step, notes)


def _saved_entries(load: str, step: int) -> set[str]:
    """The top-level entries of checkpoint ``step``'s state item (``params``, ``opt_state``, ``moe_state``, ...)."""
    from core import checkpointing

    try:
        return set(checkpointing.saved_tree(load, step))
    except Exception:  # noqa: BLE001 (orbax's errors for unreadable metadata vary)
        return {"params"}


def load_model(load: str, state: ParallelState, step: int | None = None, bf16: bool = False) -> LoadedModel:
    """:func:`load_hf_model` or :func:`load_checkpoint_model` as :func:`detect_kind` says
    (``step`` applies to checkpoints only)."""
    kind = detect_kind(load)
    if kind == HF_KIND:
        if step is not None:
            raise ModelLoadError(f"--ckpt-step {step}: --load {load} is a Hugging Face model directory, not a "
                                 "checkpoint with steps")
        return load_hf_model(load, state, bf16)
    return load_checkpoint_model(load, state, step, bf16)

__all__ = ["CHECKPOINT_KIND", "HF_KIND", "LoadedModel", "ModelLoadError", "abstract_params", "detect_kind",
           "load_checkpoint_model", "load_hf_model", "load_model"]
