"""Hugging Face tensors <-> :class:`~core.models.gpt.GPTModel` parameters (Llama, Mistral, Qwen).

Both sides store linear weights as ``[out, in]``, so most tensors move unchanged. The
reshapes are:

* the fused QKV weight (and Qwen2's bias) is laid out by query group, each group's ``r``
  query heads then its key then its value (``ParallelAttention``); HF keeps ``q_proj``,
  ``k_proj`` and ``v_proj`` apart. The package's rotary is the rotate-half form, as HF's, so q
  and k need no permutation (Megatron's own checkpoints interleave, HF's do not);
* SwiGLU's ``fc1`` is ``[2, ffn, h]``, ``[gate, up]``;
* the layer arrays stack every layer: ``[1, L, ...]`` (checkpoints store layers in layer order);
* the embedding and output layer have padding rows (zero) past the vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import numpy as np

from core.models.gpt.gpt_config import GPTConfig
from core.models.huggingface.config_mapping import HFConversionError

ParamPath = tuple[str, ...]

_LAYER_TENSORS: dict[ParamPath, tuple[str, ...]] = {
    ("input_layernorm", "scale"): ("input_layernorm.weight",),
    ("mlp", "layernorm", "scale"): ("post_attention_layernorm.weight",),
    ("self_attention", "linear_qkv", "weight"): ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                 "self_attn.v_proj.weight"),
    ("self_attention", "linear_qkv", "bias"): ("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                               "self_attn.v_proj.bias"),
    ("self_attention", "linear_proj", "weight"): ("self_attn.o_proj.weight",),
    ("self_attention", "q_layernorm", "scale"): ("self_attn.q_norm.weight",),
    ("self_attention", "k_layernorm", "scale"): ("self_attn.k_norm.weight",),
    ("mlp", "fc1", "weight"): ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    ("mlp", "fc2", "weight"): ("mlp.down_proj.weight",),
}
"""A layer parameter (path under ``"layers"``) and the HF tensors of one layer it holds."""

_MODEL_TENSORS: dict[ParamPath, str] = {
    ("embedding", "word_embeddings", "weight"): "model.embed_tokens.weight",
    ("head", "final_layernorm", "scale"): "model.norm.weight",
    ("head", "output_layer"): "lm_head.weight",
}
"""The parameters outside the layers and their HF tensor."""

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
"""HF tensors that hold no parameter (buffers some older checkpoints saved)."""


def _layer_tensor_names(path: ParamPath, layer: int) -> tuple[str, ...]:
    try:
        suffixes = _LAYER_TENSORS[path]
    except KeyError:
        raise HFConversionError(f"no Hugging Face tensor holds the layer parameter {'/'.join(path)}") from None
    return tuple(f"model.layers.{layer}.{s}" for s in suffixes)


def _group_qkv(config: GPTConfig, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """``q_proj``/``k_proj``/``v_proj`` rows -> the fused rows, by query group."""
    g, d = config.query_groups, config.head_dim
    r = config.num_attention_heads // g
    rest = q.shape[1:]
    parts = [q.reshape((g, r, d) + rest), k.reshape((g, 1, d) + rest), v.reshape((g, 1, d) + rest)]
    return np.concatenate(parts, axis=1).reshape((-1,) + rest)


def _ungroup_qkv(config: GPTConfig, qkv: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Inverse of :func:`_group_qkv`."""
    g, d = config.query_groups, config.head_dim
    r = config.num_attention_heads // g
    rest = qkv.shape[1:]
    grouped = qkv.reshape((g, r + 2, d) + rest)
    return (grouped[:, :r].reshape((-1,) + rest), grouped[:, r].reshape((-1,) + rest),
            grouped[:, r + 1].reshape((-1,) + rest))


def _layer_from_hf(config: GPTConfig, path: ParamPath, tensors: list[np.ndarray]) -> np.ndarray:
    if path[-2] == "linear_qkv":
        return _group_qkv(config, *tensors)
    if path[:2] == ("mlp", "fc1"):
        return np.stack(tensors)
    return tensors[0]


def _layer_to_hf(config: GPTConfig, path: ParamPath, array: np.ndarray) -> list[np.ndarray]:
    if path[-2] == "linear_qkv":
        return list(_ungroup_qkv(config, array))
    if path[:2] == ("mlp", "fc1"):
        return [array[0], array[1]]
    return [array]


def _pad_rows(array: np.ndarray, rows: int) -> np.ndarray:
    if array.shape[0] == rows:
        return array
    return np.concatenate([array, np.zeros((rows - array.shape[0],) + array.shape[1:], array.dtype)])


def _checked(name: str, array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if tuple(array.shape) != tuple(shape):
        raise HFConversionError(f"tensor {name} has shape {list(array.shape)}, config.json implies {list(shape)}")
    return array


def param_from_hf(config: GPTConfig, path: ParamPath, shape: tuple[int, ...],
                  read: Callable[[str], np.ndarray]) -> np.ndarray:
    """Parameter ``path`` (global ``shape``, layers stacked ``[1, L, ...]``) as float32, built
    from the HF tensors ``read(name)`` returns (each read as it is needed)."""
    if path[0] != "layers":
        if path not in _MODEL_TENSORS:
            raise HFConversionError(f"no Hugging Face tensor holds the parameter {'/'.join(path)}")
        name = _MODEL_TENSORS[path]
        array = read(name).astype(np.float32)
        array = _pad_rows(_checked(name, array, (config.vocab_size,) + tuple(shape[1:])), shape[0]) \
            if len(shape) == 2 else _checked(name, array, shape)
        return array
    out = np.empty(shape, np.float32)
    layer_path = path[1:]
    for layer in range(shape[1]):
        names = _layer_tensor_names(layer_path, layer)
        value = _layer_from_hf(config, layer_path, [read(n).astype(np.float32) for n in names])
        out[0, layer] = _checked(names[0], value, shape[2:])
    return out


def hf_tensors_from_param(config: GPTConfig, path: ParamPath, array: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """The HF tensors ``(name, array)`` that parameter ``path`` holds (padding rows dropped)."""
    if path[0] != "layers":
        if path not in _MODEL_TENSORS:
            raise HFConversionError(f"no Hugging Face tensor holds the parameter {'/'.join(path)}")
        yield _MODEL_TENSORS[path], array[:config.vocab_size] if array.ndim == 2 else array
        return
    for layer in range(array.shape[1]):
        names = _layer_tensor_names(path[1:], layer)
        yield from zip(names, _layer_to_hf(config, path[1:], array[0, layer]))


def check_every_tensor_used(config: GPTConfig, paths: list[ParamPath], names: Iterable[str], where: str) -> None:
    """Raise :class:`HFConversionError` when a tensor of the HF files (``names``) maps to no
    parameter ``paths`` of ``config`` (a config that does not describe its weights), ignoring
    the tensors HF keeps beside the weights and a tied model's ``lm_head.weight``."""
    expected = hf_names_of(config, paths, config.num_layers)
    unused = [n for n in names if n not in expected and not n.endswith(IGNORED_SUFFIXES)
              and not (n == "lm_head.weight" and config.share_embeddings_and_output_weights)]
    if unused:
        raise HFConversionError(f"{where}tensor {unused[0]} maps to no parameter of the model config.json "
                                f"describes ({len(unused)} such tensors)")


def hf_names_of(config: GPTConfig, paths: list[ParamPath], num_layers: int) -> set[str]:
    """Every HF tensor name the parameters ``paths`` hold."""
    names = set()
    for path in paths:
        if path[0] == "layers":
            for layer in range(num_layers):
                names.update(_layer_tensor_names(path[1:], layer))
        elif path in _MODEL_TENSORS:
            names.add(_MODEL_TENSORS[path])
    return names


__all__ = ["IGNORED_SUFFIXES", "hf_names_of", "hf_tensors_from_param", "param_from_hf"]
