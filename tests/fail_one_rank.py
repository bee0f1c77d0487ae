"""``launch/pretrain.py`` with a failure injected on one rank, for the launcher's failure tests:

    mpirun -n 4 python tests/fail_one_rank.py RANK WHERE [pretrain flags...]

On rank ``RANK`` only (the others run normally, so they block in the step's collectives or at
a barrier when it fails):

* ``data``: ``OSError`` (EIO) reading the batch of iteration 3, as a failing disk would raise;
* ``memory``: ``MemoryError`` dispatching iteration 3;
* ``setup``: ``ValueError`` building the trainer, while the other ranks go on to the first step;
* ``interrupt``: ``KeyboardInterrupt`` (a Ctrl-C) dispatching iteration 3.
"""

import errno
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "launch"))

from core.training import pretrainer  # noqa: E402

FAILING_ITERATION = 3


def _inject(where: str) -> None:
    if where == "data":
        original = pretrainer.PretrainingData.next_train_host_batch

        def read(self):
            if self.sampler.consumed_samples // self.training.global_batch_size == FAILING_ITERATION - 1:
                raise OSError(errno.EIO, "Input/output error", "/data/shard-00007.bin")
            return original(self)

        pretrainer.PretrainingData.next_train_host_batch = read
        return
    if where == "setup":
        def refuse(self, *args, **kwargs):
            raise ValueError("--data-path: this rank cannot open its data (injected)")

        pretrainer.Pretrainer.__init__ = refuse
        return
    errors = {"memory": MemoryError, "interrupt": KeyboardInterrupt}
    original_dispatch = pretrainer.Pretrainer.dispatch_step

    def dispatch(self):
        if self.iteration == FAILING_ITERATION - 1:
            raise errors[where]()
        return original_dispatch(self)

    pretrainer.Pretrainer.dispatch_step = dispatch


if __name__ == "__main__":
    rank, where, flags = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    if int(os.environ.get("OMPI_COMM_WORLD_RANK", "0")) == rank:
        _inject(where)
    import pretrain

    sys.exit(pretrain.main(flags))
