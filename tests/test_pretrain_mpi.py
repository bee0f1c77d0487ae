"""Layout invariance of GPT pretraining in 8 real processes (one device each): the loss
trajectory of 10 iterations equals the one-device run (relative 1e-4, fp32).

The one-device references run on rank 0 only and are sent to the others, which wait sleeping:
eight copies of the same single-device run would share the cores and cost eight times the time."""

import functools

import jax
import numpy as np
import pytest
from mpi_helpers import from_rank_0
from pretrain_harness import LAYOUTS, LLAMA, layout_losses, reference_losses

pytestmark = pytest.mark.mpi(min_size=8)


@functools.cache
def _reference(extra: tuple = ()) -> list[float]:
    return from_rank_0(lambda: reference_losses(extra=extra))


def test_loss_trajectory_matches_single_device():
    # tp2 x pp2 x dp2, distributed optimizer, SP: every GPT collective crosses processes. The other
    # layouts run in one process (tests/test_pretrain_layouts.py), with the same code paths.
    tp, pp, extra = LAYOUTS[3]
    losses = layout_losses(tp, pp, jax.devices(), extra=extra)
    np.testing.assert_allclose(losses, _reference(), rtol=1e-4)


@pytest.mark.parametrize("comm_type", ["p2p", "a2a"])
def test_context_parallel_loss_trajectory_matches_single_device(comm_type):
    # tp2 x cp2 x dp2 over 8 processes: the ring's K/V exchange (p2p) or the q/k/v/output
    # all-to-alls (a2a) and the seq-sharded batch cross processes.
    extra = LLAMA + ("--context-parallel-size", "2", "--sequence-parallel", "--cp-comm-type", comm_type)
    losses = layout_losses(2, 1, jax.devices(), extra=extra)
    np.testing.assert_allclose(losses, _reference(LLAMA), rtol=1e-4)


# 4 layers, MoE on layers 0 and 2 (dense 1 and 3), 8 experts top-2, aux and z losses, dropless all-to-all.
MOE = ("--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--moe-layer-freq", "2",
       "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001", "--moe-token-dispatcher-type", "alltoall",
       "--moe-grouped-gemm")


def test_moe_expert_parallel_loss_trajectory_matches_single_device():
    # tp2 x ep2 x dp2 with SP over 8 processes: the tokens' all-to-all over "ep" and the expert grads'
    # reduction over the expert-data-parallel group cross processes.
    losses = layout_losses(2, 1, jax.devices(), extra=MOE + ("--expert-model-parallel-size", "2",
                                                             "--sequence-parallel"))
    np.testing.assert_allclose(losses, _reference(MOE), rtol=1e-4)


def test_fp8_delayed_scaling_loss_trajectory_matches_single_device():
    # tp2 x pp2 x dp2 with SP and FP8 delayed scaling over 8 processes: the amaxes' MAX over tp and
    # dp crosses processes, so every rank quantizes with the same scales. The tolerance is FP8's
    # (tests/test_fp8_layouts.py says why the first step's unit scales leave a trace).
    fp8 = LLAMA + ("--fp8-format", "hybrid", "--fp8-recipe", "delayed")
    losses = layout_losses(2, 2, jax.devices(), extra=fp8 + ("--sequence-parallel",))
    np.testing.assert_allclose(losses, _reference(fp8), rtol=1e-3)


def test_zero_bubble_loss_trajectory_matches_single_device():
    # ZB-H1 at tp2 x pp2 x dp2 with SP and the distributed optimizer over 8 processes (m = 4 = 2pp):
    # the F activations and B input gradients cross processes in the slot loop, the W grads feed
    # the same reduction as 1F1B's.
    tp, pp, extra = LAYOUTS[3]
    losses = layout_losses(tp, pp, jax.devices(), extra=extra + ("--pipeline-schedule", "zb-h1"))
    np.testing.assert_allclose(losses, _reference(), rtol=1e-4)


def test_zb_v_loss_trajectory_matches_single_device():
    # ZB-V at tp2 x pp2 x dp2 with SP and the distributed optimizer over 8 processes (m = 4 = 2pp):
    # chunk 0's activations go down and chunk 1's up across processes, the turn of the V stays on
    # rank pp - 1, and the W grads feed the same reduction as interleaved 1F1B's.
    tp, pp, extra = LAYOUTS[3]
    zb_v = ("--pipeline-schedule", "zb-v", "--virtual-pipeline-model-parallel-size", "2")
    losses = layout_losses(tp, pp, jax.devices(), extra=extra + zb_v)
    np.testing.assert_allclose(losses, _reference(), rtol=1e-4)
