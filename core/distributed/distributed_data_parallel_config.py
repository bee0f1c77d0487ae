"""Configuration of :class:`~core.distributed.distributed_data_parallel.DistributedDataParallel`."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DistributedDataParallelConfig:
    """Megatron-core's DDP options (same names and defaults)."""

    grad_reduce_in_fp32: bool = False
    """Accumulate and reduce gradients in fp32 buffers whatever the parameter dtype."""
    overlap_grad_reduce: bool = False
    """Issue each bucket's collective as soon as its grads exist (the last microbatch is unrolled so
    XLA can overlap bucket collectives with the rest of the backward pass)."""
    overlap_param_gather: bool = False
    """Distributed optimizer: one all-gather of updated params per bucket (each can overlap with other
    work) instead of one all-gather per buffer (fewer, larger collectives)."""
    use_distributed_optimizer: bool = False
    """Reduce-scatter grads and shard fp32 master params + optimizer state over data parallelism (ZeRO-1)."""
    bucket_size: int | None = None
    """Elements per bucket. None: Megatron's default max(40M, 1M * dp) when overlapping, one bucket
    otherwise. An explicit value is honoured even without overlap (Megatron silently ignores it)."""
    average_in_collective: bool = False
    """Average in the collective (pmean) instead of pre-scaling grads by 1/dp and summing."""
    check_for_nan_in_grad: bool = False
    """Skip the update when any rank's grads hold a NaN/Inf (seen in the global grad norm, the same on
    every rank) and report the params and ranks whose local grads had them (``check_nonfinite``)."""
    pad_buckets_for_high_nccl_busbw: bool = False
    """Pad bucket ends to lcm(dp, 128, 2**16) instead of lcm(dp, 128) (distributed optimizer only)."""

    def __post_init__(self) -> None:
        if self.bucket_size is not None and (not isinstance(self.bucket_size, int) or self.bucket_size < 1):
            raise ValueError(f"bucket_size must be a positive int or None, got {self.bucket_size!r}")

    def effective_bucket_size(self, data_parallel_size: int) -> int | None:
        """The bucket size actually used (None = a single bucket per buffer)."""
        if self.bucket_size is not None:
            return self.bucket_size
        if self.overlap_grad_reduce:
            return max(40_000_000, 1_000_000 * data_parallel_size)
        return None
