"""GPipe-order pipeline parallelism with the xlstm_jax API, inside ``jax.shard_map``.

Every stage runs the same program over ``M + stages - 1`` steps: stage 0 consumes microbatch
``t`` at step ``t``, every other stage the activation the previous stage sent at the step
before (``ppermute`` to the next stage); the last stage's results are the output (zeros on the
other stages). The backward pass is JAX's autodiff of that loop (a ``ppermute`` transposes to
the reverse ``ppermute``), i.e. all forwards then all backwards: GPipe, with activation memory
growing with ``M``. Stage parameters differ per stage when the stage module is wrapped in
``ModelParallelismWrapper(model_axis_name="pp", ...)``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax


def execute_pipeline_step(module: nn.Module, state: jax.Array, input: jax.Array, *args: Any,
                          model_axis_name: str, **kwargs: Any) -> tuple[jax.Array, jax.Array]:
    """One pipeline step: run the stage on ``input`` (stage 0) or ``state`` (others), send it on.

    Returns ``(new_state, output)``: the activation received from the previous stage and this
    step's output (the stage result on the last stage, zeros elsewhere).
    """
    num_stages = lax.axis_size(model_axis_name)
    stage = lax.axis_index(model_axis_name)
    state = jnp.where(stage == 0, input, state)
    state = module(state, *args, **kwargs)
    output = jnp.where(stage == num_stages - 1, state, jnp.zeros_like(state))
    state = lax.ppermute(state, model_axis_name, [(i, (i + 1) % num_stages) for i in range(num_stages)])
    return state, output


def execute_pipeline(module: nn.Module, x: jax.Array, *args: Any, num_microbatches: int, model_axis_name: str,
                     **kwargs: Any) -> jax.Array:
    """Run the pipeline on batch ``x`` split into ``num_microbatches``; the output lives on the last stage."""
    num_stages = lax.axis_size(model_axis_name)
    if x.shape[0] % num_microbatches:
        raise ValueError(f"batch size {x.shape[0]} is not divisible by num_microbatches {num_microbatches}")
    micro = x.reshape((num_microbatches, x.shape[0] // num_microbatches) + x.shape[1:])
    inputs = jnp.concatenate([micro, jnp.zeros((num_stages - 1,) + micro.shape[1:], micro.dtype)], axis=0)
    step = functools.partial(_scan_step, args=args, kwargs=kwargs, model_axis_name=model_axis_name)
    _, outputs = nn.scan(step, variable_broadcast={"params": True}, split_rngs={"params": False, "dropout": True},
                         length=inputs.shape[0], in_axes=0, out_axes=0)(module, jnp.zeros_like(micro[0]), inputs)
    return outputs[num_stages - 1:].reshape(x.shape[:1] + outputs.shape[2:])


def _scan_step(module, state, input, *, args, kwargs, model_axis_name):
    return execute_pipeline_step(module, state, input, *args, model_axis_name=model_axis_name, **kwargs)


class PipelineModule(nn.Module):
    """Wrap a stage module to run it as a GPipe pipeline over ``model_axis_name``."""

    model_axis_name: str
    """Pipeline mesh axis."""
    num_microbatches: int
    """Microbatches the batch is split into."""
    module_fn: Callable[..., nn.Module]
    """Constructor of the stage module."""

    @nn.compact
    def __call__(self, *args: Any, **kwargs: Any) -> jax.Array:
        """Run the pipeline; see :func:`execute_pipeline`."""
        return execute_pipeline(self.module_fn(), *args, num_microbatches=self.num_microbatches,
                                model_axis_name=self.model_axis_name, **kwargs)
