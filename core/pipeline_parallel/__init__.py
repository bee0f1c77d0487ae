"""Pipeline parallelism in one SPMD ``jit(shard_map)`` program over the ``"pp"`` mesh axis.

* ``schedule_table``: Megatron's 1F1B / interleaved orders as pure-Python tables (+ config checks).
* ``gpipe``: the xlstm_jax GPipe API (``execute_pipeline_step``, ``execute_pipeline``, ``PipelineModule``).
* ``timeline`` + ``table_driven``: Megatron's exact 1F1B / interleaved orders placed into global slots and
  run as one scan (Megatron's bubble); behind ``schedules``' entry points.
* ``schedules``: Megatron's ``get_forward_backward_func`` and ``forward_backward_*`` contract.
* ``p2p_communication``: Megatron-named stage transfers on ``ppermute``.
* ``utils``: layers per stage / chunk and layer offsets.
"""
