"""optimizer."""
