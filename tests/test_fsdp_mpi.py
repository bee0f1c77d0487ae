"""Megatron-FSDP's ``optim_grads_params`` (ZeRO-3) in 8 real processes (one device each): tp2 x dp4
with sequence parallelism trains as one device does. Every weight is sharded over the 4
data-parallel processes at rest (as are all params but the column-parallel biases, split over tp
only), gathered before use and its grad reduce-scattered back, so these collectives cross processes. Over 4 iterations of 4 microbatches per data-parallel rank the losses
and grad norms equal the one-device run's (fp32, rtol 1e-5) and the params after the run are
within rtol 1e-4 / atol 3e-5 of its params (gathered from the processes' shards). The params'
atol is 1% of the learning rate (3e-3), an Adam step's size: Adam divides each element's update by
its own grad's magnitude, so an element whose grads are near zero moves by a visibly different
fraction of a step when its grads are summed in another order. The largest difference, about 1e-5
on one element of ``fc2``, is the same element and size with the distributed optimizer in this
layout in one process; a wrong shard or a lost gradient moves elements by whole steps.

The one-device reference runs on rank 0 only and is sent to the others, which wait sleeping
(:func:`mpi_helpers.from_rank_0`)."""

import jax
import numpy as np
import pytest
from jax.experimental import multihost_utils
from mpi_helpers import from_rank_0
from pretrain_harness import layout_trainer

pytestmark = pytest.mark.mpi(min_size=8)

ITERS = 4
# 4 microbatches of 2 samples per data-parallel rank at dp 4.
FLAGS = ("--global-batch-size", "32")
ZERO3 = ("--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params", "--sequence-parallel")


def _one_device() -> tuple[list[dict], list[np.ndarray]]:
    """(metrics records of ``ITERS`` steps, params as host arrays after them) on this process's device."""
    trainer = layout_trainer(1, 1, [jax.local_devices()[0]], ITERS, FLAGS)
    records = [trainer.step() for _ in range(ITERS)]
    return records, [np.asarray(x) for x in jax.tree.leaves(trainer.params)]


def test_zero3_tp2_dp4_sequence_parallel_trains_as_one_device():
    ref_records, ref_params = from_rank_0(_one_device)
    trainer = layout_trainer(2, 1, jax.devices(), ITERS, FLAGS + ZERO3)
    assert trainer.layout.data_parallel_size == 4
    # ZeRO-3: the weights are sharded over the data-parallel processes at rest.
    specs = {p: x.sharding.spec for p, x in zip(trainer.ddp.param_paths, jax.tree.leaves(trainer.params))}
    weights = [spec for p, spec in specs.items() if p.endswith("['weight']")]
    assert len(weights) == 5 and all("dp" in tuple(spec) for spec in weights), specs
    records = [trainer.step() for _ in range(ITERS)]
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in records], [r[key] for r in ref_records], rtol=1e-5, err_msg=key)
    params = [np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in jax.tree.leaves(trainer.params)]
    assert len(params) == len(ref_params)
    for path, a, e in zip(trainer.ddp.param_paths, params, ref_params, strict=True):
        assert a.shape == e.shape, path  # the same padded vocabulary (256 rows) at tp 1 and tp 2
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=3e-5, err_msg=path)
