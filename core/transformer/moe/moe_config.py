"""``MoEConfig``: Megatron-core's MoE flags (``--num-experts``, ``--moe-*``) as one frozen dataclass.

Field names are Megatron's flag names with dashes as underscores (``--num-experts`` is
``num_experts``; Megatron's ``TransformerConfig`` calls it ``num_moe_experts``), defaults are
Megatron's. :meth:`MoEConfig.validate` applies Megatron's rules (and this package's limits) and
raises one ``ValueError`` with a one-line message per problem, the first it finds.
"""

from __future__ import annotations

import dataclasses

SCORE_FUNCTIONS = ("softmax", "sigmoid")
"""What ``moe_router_score_function`` accepts."""
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")
"""What ``moe_router_load_balancing_type`` accepts (Megatron's ``sinkhorn`` is not implemented)."""
DISPATCHER_TYPES = ("alltoall", "allgather")
"""What ``moe_token_dispatcher_type`` accepts."""
GROUPED_GEMM_IMPLEMENTATIONS = ("ragged_dot", "windows")
"""What ``moe_grouped_gemm_implementation`` accepts."""
DROP_POLICIES = ("probs", "position")
"""What ``moe_token_drop_policy`` accepts."""
ROUTER_DTYPES = ("fp32", None)
"""What ``moe_router_dtype`` accepts (``None``: the input's dtype)."""


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Megatron-core's MoE options (see the module docstring and ``docs/moe.md``)."""

    num_experts: int
    """``--num-experts``: routed experts per MoE layer (global, split over the ``ep`` axis)."""
    moe_ffn_hidden_size: int
    """``--moe-ffn-hidden-size``: hidden width of each routed expert's MLP."""
    moe_router_topk: int = 2
    """``--moe-router-topk``: experts each token is routed to."""
    moe_router_score_function: str = "softmax"
    """``--moe-router-score-function``: ``"softmax"`` or ``"sigmoid"`` router scores."""
    moe_router_pre_softmax: bool = False
    """``--moe-router-pre-softmax``: softmax over all experts before the top-k (softmax scores only;
    default: softmax over the k selected logits)."""
    moe_router_dtype: str | None = None
    """``--moe-router-dtype``: ``"fp32"`` computes the router's linear layer in float32; ``None``
    in the input's dtype. Score arithmetic is always float32."""
    moe_router_load_balancing_type: str = "aux_loss"
    """``--moe-router-load-balancing-type``: ``"aux_loss"`` (Switch loss over the micro-batch),
    ``"seq_aux_loss"`` (per sequence, averaged) or ``"none"``."""
    moe_aux_loss_coeff: float = 0.0
    """``--moe-aux-loss-coeff``: weight of the load-balancing loss (0: not computed)."""
    moe_z_loss_coeff: float | None = None
    """``--moe-z-loss-coeff``: weight of the router z-loss (None: not computed)."""
    moe_router_enable_expert_bias: bool = False
    """``--moe-router-enable-expert-bias``: aux-loss-free balancing, a per-expert bias added to the
    scores for the top-k selection only (a non-trainable ``"moe_state"`` variable)."""
    moe_router_bias_update_rate: float = 1e-3
    """``--moe-router-bias-update-rate``: step of the expert-bias update
    (:func:`core.transformer.moe.moe_utils.get_updated_expert_bias`)."""
    moe_router_force_load_balancing: bool = False
    """``--moe-router-force-load-balancing``: for benchmarking only, as in Megatron: route by random
    normal logits instead of the gate's, so every expert gets about ``T * k / E`` tokens; the gate
    still gets its logits' gradient (straight through). The logits are drawn from a fixed seed per
    rank, the same every step (Megatron draws new ones each step)."""
    moe_token_dispatcher_type: str = "allgather"
    """``--moe-token-dispatcher-type``: ``"alltoall"`` or ``"allgather"`` over the ``ep`` axis."""
    moe_grouped_gemm: bool = False
    """``--moe-grouped-gemm``: all local experts in one ``jax.lax.ragged_dot`` (False: a loop over
    the local experts, Megatron's ``SequentialMLP``)."""
    moe_grouped_gemm_implementation: str | None = None
    """``--moe-grouped-gemm-implementation`` (this package's): the grouped GEMM as ``"ragged_dot"``
    (``jax.lax.ragged_dot``) or ``"windows"`` (batched matmuls over fixed windows of each expert's
    rows, :mod:`~core.transformer.moe.grouped_gemm`); None: windows on the CPU, ragged_dot elsewhere."""
    moe_expert_capacity_factor: float | None = None
    """``--moe-expert-capacity-factor``: capacity ``ceil(tokens * topk / experts * factor)`` per
    expert and rank; None: dropless."""
    moe_token_drop_policy: str = "probs"
    """``--moe-token-drop-policy``: over capacity keep the highest-prob (``"probs"``) or the
    earliest (``"position"``) tokens of each expert."""
    moe_pad_expert_input_to_capacity: bool = False
    """``--moe-pad-expert-input-to-capacity``: every expert computes exactly ``capacity`` rows."""
    moe_shared_expert_intermediate_size: int | None = None
    """``--moe-shared-expert-intermediate-size``: width of the shared expert (a dense tensor-parallel
    MLP on every token, added to the routed output); None: no shared expert."""
    swiglu: bool = False
    """``--swiglu``: SwiGLU expert (and shared-expert) MLPs instead of GELU."""
    add_bias_linear: bool = True
    """Biases on the expert and shared-expert linear layers (False: ``--disable-bias-linear``)."""

    @property
    def capacity_dropping(self) -> bool:
        """Whether tokens over an expert's capacity are dropped (a capacity factor is set)."""
        return self.moe_expert_capacity_factor is not None

    def validate(self, expert_model_parallel_size: int = 1, tensor_model_parallel_size: int = 1,
                 sequence_parallel: bool = False) -> MoEConfig:
        """Check the options against Megatron's rules and the given layout; returns ``self``.

        Raises ``ValueError`` with a one-line message naming the flag and value.
        """
        ep, tp = expert_model_parallel_size, tensor_model_parallel_size
        _positive_int("--num-experts", self.num_experts)
        _positive_int("--moe-ffn-hidden-size", self.moe_ffn_hidden_size)
        _positive_int("--moe-router-topk", self.moe_router_topk)
        _positive_int("--expert-model-parallel-size", ep)
        if self.num_experts % ep:
            raise ValueError(f"--num-experts ({self.num_experts}) must be divisible by "
                             f"--expert-model-parallel-size ({ep})")
        if self.moe_router_topk > self.num_experts:
            raise ValueError(f"--moe-router-topk ({self.moe_router_topk}) must not exceed --num-experts "
                             f"({self.num_experts})")
        _one_of("--moe-router-score-function", self.moe_router_score_function, SCORE_FUNCTIONS)
        _one_of("--moe-router-load-balancing-type", self.moe_router_load_balancing_type, LOAD_BALANCING_TYPES)
        _one_of("--moe-token-dispatcher-type", self.moe_token_dispatcher_type, DISPATCHER_TYPES)
        _one_of("--moe-token-drop-policy", self.moe_token_drop_policy, DROP_POLICIES)
        if self.moe_grouped_gemm_implementation is not None:
            _one_of("--moe-grouped-gemm-implementation", self.moe_grouped_gemm_implementation,
                    GROUPED_GEMM_IMPLEMENTATIONS)
            if not self.moe_grouped_gemm:
                raise ValueError("--moe-grouped-gemm-implementation needs --moe-grouped-gemm")
        _one_of("--moe-router-dtype", self.moe_router_dtype, ROUTER_DTYPES)
        if (self.moe_router_topk == 1 and self.moe_router_score_function == "softmax"
                and not self.moe_router_pre_softmax):
            raise ValueError("--moe-router-topk 1 with softmax scores needs --moe-router-pre-softmax "
                             "(a softmax over one logit is constant: the router would get no gradient)")
        if self.moe_aux_loss_coeff < 0:
            raise ValueError(f"--moe-aux-loss-coeff must be >= 0, got {self.moe_aux_loss_coeff}")
        if self.moe_z_loss_coeff is not None and self.moe_z_loss_coeff < 0:
            raise ValueError(f"--moe-z-loss-coeff must be >= 0, got {self.moe_z_loss_coeff}")
        if self.moe_router_enable_expert_bias and self.moe_router_score_function != "sigmoid":
            raise ValueError("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid "
                             f"(got {self.moe_router_score_function!r})")
        if self.moe_router_bias_update_rate < 0:
            raise ValueError(f"--moe-router-bias-update-rate must be >= 0, got {self.moe_router_bias_update_rate}")
        if self.moe_expert_capacity_factor is not None:
            if not self.moe_expert_capacity_factor > 0:
                raise ValueError(f"--moe-expert-capacity-factor must be > 0, got {self.moe_expert_capacity_factor}")
            if self.moe_token_dispatcher_type != "alltoall":
                raise ValueError("--moe-expert-capacity-factor needs --moe-token-dispatcher-type alltoall "
                                 f"(got {self.moe_token_dispatcher_type!r}), as in Megatron")
        elif self.moe_pad_expert_input_to_capacity:
            raise ValueError("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
        if self.moe_shared_expert_intermediate_size is not None:
            _positive_int("--moe-shared-expert-intermediate-size", self.moe_shared_expert_intermediate_size)
        _positive_int("--tensor-model-parallel-size", tp)
        if tp > 1 and not sequence_parallel:
            raise ValueError(f"MoE with --tensor-model-parallel-size {tp} needs --sequence-parallel "
                             "(expert tensor parallelism is fixed at 1; each tp rank routes its sequence shard)")
        return self


def _positive_int(flag: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{flag} must be a positive int, got {value!r}")


def _one_of(flag: str, value: object, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{flag} must be one of {list(allowed)}, got {value!r}")
