"""Models built on the parallel layers (``gpt``)."""
