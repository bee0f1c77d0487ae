"""The layers' norms: LayerNorm or RMSNorm (Megatron's ``--normalization``) over the last dim,
the fused CPU kernels of ``core.fusions``, params tagged for sequence parallelism."""

from __future__ import annotations

import flax.linen as nn

from core.fusions import FusedLayerNorm, FusedRMSNorm
from core.param_metadata import with_parallel_metadata

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
"""What :func:`build_norm` accepts (Megatron's ``--normalization``)."""


def build_norm(normalization: str, epsilon: float, sequence_parallel: bool, name: str,
               tp_partial_grad: bool = False) -> nn.Module:
    """A ``LayerNorm`` (params ``scale``, ``bias``) or ``RMSNorm`` (``scale``) over the last dim.

    Its params are replicated over tp; under sequence parallelism each rank normalises only its
    sequence shard, so they are tagged ``sequence_parallel`` (their grads are summed over tp).
    ``tp_partial_grad``: the norm sees only this rank's heads (the q/k norms), so its grads are
    summed over tp whatever the sequence parallelism.
    """
    meta = lambda init: with_parallel_metadata(init, (None,), sequence_parallel=sequence_parallel,
                                               tp_partial_grad=tp_partial_grad)
    if normalization == "LayerNorm":
        return FusedLayerNorm(epsilon=epsilon, scale_init=meta(nn.initializers.ones),
                              bias_init=meta(nn.initializers.zeros), name=name)
    if normalization == "RMSNorm":
        return FusedRMSNorm(epsilon=epsilon, scale_init=meta(nn.initializers.ones), name=name)
    raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")

