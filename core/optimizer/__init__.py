"""Optimizers, Megatron's names: ``get_megatron_optimizer`` and the ``MegatronOptimizer`` it
returns, ``OptimizerConfig``, the distributed optimizer's pure functions (ZeRO-1 over the
data-parallel group) and global-norm gradient clipping."""

from core.optimizer.clip_grads import clip_grad_by_total_norm, get_grad_norm_fp32
from core.optimizer.distrib_optimizer import DistributedOptimizer
from core.optimizer.optimizer import MegatronOptimizer, get_megatron_optimizer
from core.optimizer.optimizer_config import OptimizerConfig, get_optax_transformation

__all__ = ["DistributedOptimizer", "MegatronOptimizer", "OptimizerConfig", "clip_grad_by_total_norm",
           "get_grad_norm_fp32", "get_megatron_optimizer", "get_optax_transformation"]
