"""``launch/pretrain.py`` with one rank's data slowed down, for the timer tests:

    mpirun -n 4 python tests/slow_rank.py RANK SECONDS [pretrain flags...]

On rank ``RANK`` only, every training batch takes ``SECONDS`` longer to build (a slow disk or
data source on one host); the timers must name that rank in ``batch-generator``.
"""

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "launch"))

from core.training import pretrainer  # noqa: E402


def main() -> int:
    rank, seconds, flags = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
    if int(os.environ.get("OMPI_COMM_WORLD_RANK", "0")) == rank:
        original = pretrainer.PretrainingData.next_train_host_batch

        def slow(self):
            time.sleep(seconds)
            return original(self)

        pretrainer.PretrainingData.next_train_host_batch = slow
    import pretrain

    return pretrain.main(flags)


if __name__ == "__main__":
    sys.exit(main())
