"""Configuration of :class:`~core.distributed.distributed_data_parallel.DistributedDataParallel`."""

from __future__ import annotations

import dataclasses

SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
"""Megatron-FSDP's ``data_parallel_sharding_strategy`` values: what is sharded over data parallelism."""


@dataclasses.dataclass(frozen=True)
class DistributedDataParallelConfig:
    """Megatron-core's DDP options (same names, defaults and meaning).

    Megatron-core fields not here, and why:

    * ``num_buckets`` (an alternative to ``bucket_size``): not supported; give ``bucket_size``.
    * ``fp8_param_gather``, ``fp4_param_gather``, ``reuse_grad_buf_for_mxfp8_param_ag``,
      ``keep_fp8_transpose_cache``: not applicable, the package has no FP8/FP4 parameters.
    * ``use_custom_fsdp`` (Megatron's deprecated alias of ``use_megatron_fsdp``),
      ``megatron_fsdp_version``, ``outer_dp_sharding_strategy`` (hybrid FSDP),
      ``suggested_communication_unit_size``, ``preserve_fp32_weights``, ``fsdp_double_buffer``:
      Megatron-FSDP's buffer-management options, not applicable (XLA allocates the gathered
      copies and schedules the collectives).
    * ``nccl_ub``, ``disable_symmetric_registration``: NCCL user-buffer registration; not
      applicable, XLA allocates and registers collective buffers itself.
    * ``gradient_reduce_div_fusion``: not applicable, XLA fuses the 1/dp pre-scaling into the
      producer of the bucket anyway.
    * ``delay_wgrad_compute``: not supported (XLA schedules the weight-gradient matmuls).
    """

    grad_reduce_in_fp32: bool = False
    """Accumulate and reduce gradients in fp32 buffers whatever the parameter dtype."""
    overlap_grad_reduce: bool = False
    """Issue each bucket's collective as soon as its grads exist (the last microbatch is unrolled so
    XLA can overlap bucket collectives with the rest of the backward pass)."""
    overlap_param_gather: bool = False
    """Distributed optimizer: one all-gather of updated params per bucket (each can overlap with other
    work) instead of one all-gather per buffer (fewer, larger collectives). Needs
    ``use_distributed_optimizer`` (Megatron's rule)."""
    align_param_gather: bool = False
    """Megatron: every pipeline stage launches its param all-gathers at the same time (through the
    schedule's ``param_sync_func``) instead of each stage on its own; only consulted with
    ``overlap_param_gather``, otherwise ignored, as in Megatron (whose CLI default is True). In this
    SPMD package every stage runs one program that issues the same gathers in the same order, so
    they are aligned by construction: accepted, no effect on the program."""
    use_distributed_optimizer: bool = False
    """Reduce-scatter grads and shard fp32 master params + optimizer state over data parallelism (ZeRO-1)."""
    num_distributed_optimizer_instances: int = 1
    """Partial distributed optimizer: the data-parallel (x context-parallel) group is split into this
    many instances of contiguous ranks; optimizer state is sharded over the ranks of one instance
    (reduce-scatter and param all-gather inside it) and replicated across instances (the shards are
    all-reduced over the ranks holding the same shard). 1: shard over all of data parallelism.
    Needs ``use_distributed_optimizer``; dp x cp (and the expert-data-parallel size) must divide by it.
    With ``optim_grads_params`` (HSDP) the parameters are sharded inside an instance and replicated
    across; the :class:`~core.parallel_state.ParallelState` must be built with the same number (its
    outer data-parallel axis ``"dpo"``)."""
    check_for_nan_in_grad: bool = False
    """Skip the update when any rank's grads hold a NaN/Inf (seen in the global grad norm, the same on
    every rank) and report the params and ranks whose local grads had them (``check_nonfinite``)."""
    check_for_large_grads: bool = False
    """Before the data-parallel collective, check every bucket's local grad norm against 10x the max of
    the first 100 finite bucket norms this rank saw (Megatron's ``is_unexpectedly_large``, kept in the
    optimizer state); a large one on any rank skips the update everywhere, sets the ``large_grads``
    metric and makes ``check_nonfinite`` raise naming bucket, params and rank."""
    check_for_spiky_loss: bool = False
    """Skip the update when the step's loss is above ``spiky_loss_factor`` x the largest of the last
    100 accepted losses (after 10 of them; ``core.distributed.spiky_loss``, tracker kept in the
    optimizer state); sets the ``spiky_loss`` and ``recent_max_loss`` metrics."""
    spiky_loss_factor: float = 10.0
    """The multiple of the recent maximum loss above which a loss is spiky (Megatron's threshold 10)."""
    bucket_size: int | None = None
    """Elements per bucket. None: Megatron's default max(40M, 1M * dp) when overlapping, one bucket
    otherwise. An explicit value is honoured even without overlap (Megatron silently ignores it)."""
    pad_buckets_for_high_nccl_busbw: bool = False
    """Pad bucket ends to lcm(dp, 128, 2**16) instead of lcm(dp, 128) (distributed optimizer only)."""
    reduce_scatter_with_fp32_accumulation: bool = False
    """Distributed optimizer: reduce-scatter as an all-to-all of the grads in their own dtype (bf16 on
    the wire, the traffic of a ring reduce-scatter) and a local fp32 sum of the received chunks, cast
    back to the grad dtype (Megatron's implementation). No effect without the distributed optimizer."""
    average_in_collective: bool = False
    """Average in the collective (pmean) instead of pre-scaling grads by 1/dp and summing."""
    use_megatron_fsdp: bool = False
    """Megatron-FSDP: shard over data parallelism what ``data_parallel_sharding_strategy`` says."""
    data_parallel_sharding_strategy: str = "no_shard"
    """With ``use_megatron_fsdp``: ``no_shard`` (plain DDP), ``optim`` (optimizer state and fp32
    masters, ZeRO-1: the distributed optimizer), ``optim_grads`` (also the gradients, ZeRO-2: each
    microbatch's grads are reduce-scattered into this rank's shard right after its backward, so only
    shard-sized accumulators live across microbatches; under a pipeline schedule, which accumulates
    grads itself, it behaves as ``optim``), ``optim_grads_params`` (also the parameters, ZeRO-3:
    each parameter is split over the data-parallel ranks at rest, the model gathers one unit (the
    embedding, a layer, the head) right before using it and the gather's transpose reduce-scatters
    the unit's grads per microbatch; the optimizer steps every rank's shards, ``core.distributed.fsdp``).
    Megatron's config default; its CLI default is ``optim_grads_params``."""
    fsdp_reshard_after_forward: bool = True
    """``optim_grads_params``: gather a unit's parameters again for its backward (the gathered copy
    is dead after each use); False keeps the forward's copy for the backward (one gather fewer per
    unit and microbatch, every unit's gathered parameters held from its forward to its backward).
    torchtitan's name; Megatron-FSDP always re-gathers."""

    @property
    def shards_params(self) -> bool:
        """Whether parameters are sharded over data parallelism at rest (``optim_grads_params``, ZeRO-3)."""
        return self.use_megatron_fsdp and self.data_parallel_sharding_strategy == "optim_grads_params"

    @property
    def shards_optimizer_state(self) -> bool:
        """Whether the distributed optimizer shards optimizer state and fp32 masters over data
        parallelism in bucket shards (``use_distributed_optimizer``, or Megatron-FSDP's ``optim`` /
        ``optim_grads``). Under ``optim_grads_params`` the state is split like the (sharded)
        parameters instead, leaf by leaf, so this is False there."""
        if self.shards_params:
            return False
        return self.use_distributed_optimizer or (
            self.use_megatron_fsdp and self.data_parallel_sharding_strategy in ("optim", "optim_grads"))

    @property
    def reduce_scatter_per_microbatch(self) -> bool:
        """Whether the fused step reduce-scatters each microbatch's grads right after its backward
        (Megatron-FSDP ``optim_grads``) instead of the accumulated grads once per step."""
        return self.use_megatron_fsdp and self.data_parallel_sharding_strategy == "optim_grads"

    def _check_megatron_fsdp(self) -> None:
        strategy = self.data_parallel_sharding_strategy
        if strategy not in SHARDING_STRATEGIES:
            raise ValueError(f"data_parallel_sharding_strategy must be one of {', '.join(SHARDING_STRATEGIES)}, "
                             f"got {strategy!r}")
        if not self.use_megatron_fsdp:
            if strategy != "no_shard":
                raise ValueError(f"data_parallel_sharding_strategy={strategy!r} needs use_megatron_fsdp=True")
            return
        if strategy == "no_shard" and self.use_distributed_optimizer:
            raise ValueError("use_distributed_optimizer=True shards the optimizer state, which contradicts "
                             "data_parallel_sharding_strategy='no_shard'; use 'optim' or 'optim_grads'")
        if strategy in ("optim_grads", "optim_grads_params") and self.check_for_large_grads:
            raise ValueError("check_for_large_grads checks the local grads accumulated over the step, which "
                             f"data_parallel_sharding_strategy={strategy!r} never holds; use 'optim'")

    def __post_init__(self) -> None:
        self._check_megatron_fsdp()
        if not self.spiky_loss_factor > 1.0:
            raise ValueError(f"spiky_loss_factor must be > 1, got {self.spiky_loss_factor}")
        if self.bucket_size is not None and (not isinstance(self.bucket_size, int) or self.bucket_size < 1):
            raise ValueError(f"bucket_size must be a positive int or None, got {self.bucket_size!r}")
        n = self.num_distributed_optimizer_instances
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"num_distributed_optimizer_instances must be a positive int, got {n!r}")
        if n > 1 and not self.shards_optimizer_state and not self.shards_params:
            raise ValueError(f"num_distributed_optimizer_instances={n} (partial distributed optimizer) needs "
                             "use_distributed_optimizer=True")
        if n > 1 and self.reduce_scatter_with_fp32_accumulation:
            raise ValueError(f"reduce_scatter_with_fp32_accumulation is not supported with "
                             f"num_distributed_optimizer_instances={n} > 1 (as in Megatron)")
        if self.overlap_param_gather and not (self.shards_optimizer_state or self.shards_params):
            raise ValueError("overlap_param_gather needs use_distributed_optimizer=True (only the distributed "
                             "optimizer and Megatron-FSDP gather params)")

    def effective_bucket_size(self, data_parallel_size: int) -> int | None:
        """The bucket size actually used (None = a single bucket per buffer)."""
        if self.bucket_size is not None:
            return self.bucket_size
        if self.overlap_grad_reduce:
            return max(40_000_000, 1_000_000 * data_parallel_size)
        return None

    def intra_instance_size(self, data_parallel_size: int, expert_data_parallel_size: int | None = None) -> int:
        """Ranks per distributed-optimizer instance: ``data_parallel_size`` (dp x cp) divided by
        ``num_distributed_optimizer_instances``. Raises ``ValueError`` when it, or the expert
        data-parallel size (expert-dp x cp: the expert grads' reduction group), does not divide."""
        n = self.num_distributed_optimizer_instances
        if data_parallel_size % n:
            raise ValueError(f"data-parallel x context-parallel size {data_parallel_size} is not divisible by "
                             f"num_distributed_optimizer_instances={n}")
        if expert_data_parallel_size is not None and expert_data_parallel_size % n:
            raise ValueError(f"expert data-parallel size {expert_data_parallel_size} is not divisible by "
                             f"num_distributed_optimizer_instances={n}")
        return data_parallel_size // n
