"""Megatron-core-style distributed training for JAX.

Subpackages follow Megatron-core's layout: ``parallel_state`` (the device mesh and rank
math), ``distributed`` (data parallelism), ``tensor_parallel``, ``pipeline_parallel`` and
``optimizer``; ``runtime`` holds the process runtime (starting ``jax.distributed``, the
CPU backend's threads, devices and malloc settings).
"""
