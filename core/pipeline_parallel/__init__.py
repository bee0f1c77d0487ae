"""pipeline_parallel."""
