"""Megatron-core-style distributed training for JAX.

Subpackages follow Megatron-core's layout: ``parallel_state`` (the device mesh and rank
math), ``distributed`` (data parallelism), ``tensor_parallel``, ``pipeline_parallel`` and
``optimizer``.
"""
