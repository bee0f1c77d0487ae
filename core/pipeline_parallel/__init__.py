"""Pipeline parallelism in one SPMD ``jit(shard_map)`` program over the ``"pp"`` mesh axis.

* ``schedule_table``: Megatron's 1F1B / interleaved orders as pure-Python tables (+ config checks).
* ``gpipe``: the xlstm_jax GPipe API (``execute_pipeline_step``, ``execute_pipeline``, ``PipelineModule``).
* ``timeline`` + ``table_driven``: Megatron's exact 1F1B / interleaved orders placed into global slots and
  run as one scan (Megatron's bubble); behind ``schedules``' entry points.
* ``zero_bubble`` + ``zero_bubble_executor``: ZB-H1 / ZB-V slot tables (B/W-split backward) and the
  executors of ZB-H1 and ZB-V (its V placement: ``utils.virtual_stage``).
* ``schedules``: Megatron's ``get_forward_backward_func`` and ``forward_backward_*`` contract.
* ``p2p_communication``: Megatron-named stage transfers on ``ppermute``.
* ``utils``: layers per stage / chunk and layer offsets.
"""

from core.pipeline_parallel.gpipe import PipelineModule, execute_pipeline, execute_pipeline_step
from core.pipeline_parallel.p2p_communication import (
    send_backward_recv_backward,
    send_forward_recv_backward,
    send_forward_recv_forward,
)
from core.pipeline_parallel.schedules import (
    forward_backward_no_pipelining,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
    forward_backward_pipelining_zero_bubble,
    forward_backward_pipelining_zero_bubble_v,
    get_forward_backward_func,
)
from core.pipeline_parallel.utils import get_num_layers_to_build, split_microbatches

__all__ = [
    "PipelineModule", "execute_pipeline", "execute_pipeline_step", "forward_backward_no_pipelining",
    "forward_backward_pipelining_with_interleaving", "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_zero_bubble", "forward_backward_pipelining_zero_bubble_v",
    "get_forward_backward_func", "get_num_layers_to_build", "send_backward_recv_backward",
    "send_forward_recv_backward", "send_forward_recv_forward", "split_microbatches",
]
