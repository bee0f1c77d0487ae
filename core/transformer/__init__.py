"""Transformer building blocks beyond the tensor-parallel layers (Megatron's ``core/transformer``)."""
