"""Training on a Megatron indexed dataset in 8 real processes (one device each, tp=2 dp=4):
rank 0 builds the sample-index caches while the others wait, then they load them, and every
process trains on the same global batches. NullTokenizer data (numpy only, no ``tokenizers``)."""

import os
import shutil
import tempfile

import jax
import numpy as np
import pytest
from pretrain_harness import TINY

from core import parallel_state as ps
from core.data import IndexedDatasetBuilder, load_corpus
from core.training.arguments import parse_args, validate_args
from core.training.pretrainer import Pretrainer
from core.training.run_config import pretrain_config

pytestmark = pytest.mark.mpi(min_size=8)

EOD = 255  # NullTokenizer --vocab-size 255: ids 0..254 (UTF-8 never has bytes 0xFE/0xFF) + EOD = 256 ids


@pytest.fixture
def shared_prefix():
    """One dataset for all ranks, written by rank 0 (the corpus' paragraphs as byte ids + EOD)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    directory = comm.bcast(tempfile.mkdtemp(prefix="data_mpi_") if comm.rank == 0 else None, root=0)
    prefix = os.path.join(directory, "corpus_text_document")
    if comm.rank == 0:
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
        for doc in load_corpus(None)[0].split("\n\n")[:800]:
            ids = list(doc.encode("utf-8")) + [EOD]
            builder.add_document(ids, [len(ids)])
        builder.finalize(prefix + ".idx")
    comm.barrier()
    yield prefix
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(directory, ignore_errors=True)


def test_indexed_training_under_mpirun(shared_prefix):
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    args = parse_args(TINY + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1",
                              "--train-iters", "3", "--data-path", shared_prefix, "--split", "95,5,0",
                              "--tokenizer-type", "NullTokenizer", "--vocab-size", "255",
                              "--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"])
    layout = validate_args(args, jax.device_count())
    trainer = Pretrainer(pretrain_config(args), layout, ps.build_parallel_state(2, 1, None, devices=jax.devices()))
    built = comm.gather(trainer.data.train_data.built_anew_on_cache_miss, root=0)
    if comm.rank == 0:
        assert built == [True] + [False] * (comm.size - 1)  # rank 0 built, the others loaded
    batch = trainer.data.valid_host_batch(0)
    assert all(np.array_equal(b, batch["tokens"]) for b in comm.allgather(batch["tokens"]))
    losses = [trainer.step()["loss"] for _ in range(3)]
    assert np.isfinite(losses).all()
    assert all(other == losses for other in comm.allgather(losses))
