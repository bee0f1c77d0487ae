"""tensor_parallel."""
