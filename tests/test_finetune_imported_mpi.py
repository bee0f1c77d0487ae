"""Fine-tuning an imported Hugging Face model on chat data in real processes: ``--load
--use-checkpoint-args --finetune --sft`` at tp2 x dp4 over 8 processes gives the losses of one
device (relative 1e-4, fp32). Rank 0 builds and converts the model."""

import shutil
import tempfile
from pathlib import Path

import jax
import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import from_rank_0

pytestmark = pytest.mark.mpi(min_size=4)


def test_tp2_finetune_of_an_imported_model_equals_one_device():
    pytest.importorskip("transformers")
    from hf_finetune import finetune_flags, finetune_losses, make_imported_model

    comm = MPI.COMM_WORLD
    root = comm.bcast(tempfile.mkdtemp(prefix="hf_finetune_") if comm.rank == 0 else None, root=0)
    try:
        paths = from_rank_0(lambda: make_imported_model(Path(root)))
        flags = finetune_flags(*paths)
        losses = finetune_losses(flags, 2, iters=4)
        # Every rank runs the one-device reference on its own device: loading the checkpoint is a
        # collective of all processes (each reads its own full copy here).
        reference = finetune_losses(flags, 1, jax.local_devices()[:1], iters=4)
    finally:
        comm.Barrier()  # every rank is done with the files
        if comm.rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    np.testing.assert_allclose(losses, reference, rtol=1e-4)
