"""Megatron's ``--profile``: a ``jax.profiler`` trace of iterations ``(start, end]`` on the ranks
of ``--profile-ranks``, written under ``--profile-dir`` (TensorBoard / XProf / Perfetto read it;
``python -m core.training.profile_summary DIR`` tabulates it)."""

from __future__ import annotations

import os

import jax

from core.training.config import ProfileConfig


class StepProfiler:
    """Starts the trace before iteration ``start + 1`` and stops it once iteration ``end`` has run
    (Megatron: ``--profile-step-start 10 --profile-step-end 12`` traces two steps)."""

    def __init__(self, config: ProfileConfig, rank: int):
        self.enabled = config.profile and rank in config.profile_ranks
        self.start, self.end, self.directory = config.profile_step_start, config.profile_step_end, config.profile_dir
        self.active = False

    def before_step(self, iteration: int, in_flight: list) -> None:
        """Call before dispatching iteration ``iteration + 1`` (``in_flight``: arrays of steps
        still running, waited for so that the trace holds only the traced steps)."""
        if self.enabled and not self.active and iteration == self.start:
            jax.block_until_ready(in_flight)
            os.makedirs(self.directory, exist_ok=True)
            jax.profiler.start_trace(self.directory)
            self.active = True

    def after_step(self, iteration: int, result) -> None:
        """Call after dispatching iteration ``iteration`` (``result``: its outputs)."""
        if self.active and iteration >= self.end:
            jax.block_until_ready(result)
            jax.profiler.stop_trace()
            self.active = False

    def close(self) -> None:
        """Stop a trace still running (training ended inside the window)."""
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
