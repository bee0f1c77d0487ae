"""Stage-to-stage transfers with Megatron's names, on ``lax.ppermute`` over the pipeline axis.

Call inside ``shard_map``. Megatron pairs a send on one rank with a receive on its neighbour; in
SPMD every stage runs the same call, so each helper is one ``ppermute`` that both sends and
receives: ``forward`` moves stage ``i``'s tensor to ``i + 1``, ``backward`` moves it to ``i - 1``.
Stages with no neighbour receive zeros (Megatron's ``None``). The combined helpers
(``send_forward_recv_backward`` ...) take both tensors because, in one SPMD program, the
neighbour's matching send happens in the same call.
"""

from __future__ import annotations

import jax
from jax import lax


def _forward_perm(n: int) -> list[tuple[int, int]]:
    return [(i, i + 1) for i in range(n - 1)]


def _backward_perm(n: int) -> list[tuple[int, int]]:
    return [(i + 1, i) for i in range(n - 1)]


def send_forward_recv_forward(output_tensor: jax.Array, axis_name: str = "pp") -> jax.Array:
    """Send this stage's output to the next stage; return the previous stage's output (zeros on stage 0)."""
    return lax.ppermute(output_tensor, axis_name, _forward_perm(lax.axis_size(axis_name)))


def send_backward_recv_backward(input_tensor_grad: jax.Array, axis_name: str = "pp") -> jax.Array:
    """Send this stage's input grad to the previous stage; return the next stage's (zeros on the last)."""
    return lax.ppermute(input_tensor_grad, axis_name, _backward_perm(lax.axis_size(axis_name)))


# Megatron's one-directional names: in SPMD a send on stage i is the receive on its neighbour.
send_forward = recv_forward = send_forward_recv_forward
send_backward = recv_backward = send_backward_recv_backward


def send_forward_recv_backward(output_tensor: jax.Array, input_tensor_grad: jax.Array,
                               axis_name: str = "pp") -> tuple[jax.Array, jax.Array]:
    """Steady-state 1F1B exchange: send output forward and input grad backward.

    Returns ``(input_tensor, output_tensor_grad)``: the activation from the previous stage and the
    gradient of this stage's output from the next stage.
    """
    return (send_forward_recv_forward(output_tensor, axis_name),
            send_backward_recv_backward(input_tensor_grad, axis_name))


send_backward_recv_forward = send_forward_backward_recv_forward_backward = send_forward_recv_backward
