"""Run pytest's MPI level on one rank: rank 0 prints to the terminal, others to a log.

Each rank writes ``<prefix>.rank<R>.xml``; a failing rank's log is echoed so its
traceback is not lost.
"""

import os
import sys

import pytest


def main() -> int:
    """Run this rank's pytest session; return its exit code."""
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
    args = sys.argv[1:]
    prefix = next(a.split("=", 1)[1] for a in args if a.startswith("--junitxml="))
    args = [a for a in args if not a.startswith("--junitxml=")]
    argv = ["-q", "--only-mpi", f"--junitxml={prefix}.rank{rank}.xml", *args, "tests"]
    if rank == 0:
        return pytest.main(argv)
    log = f"{prefix}.rank{rank}.log"
    with open(log, "w") as fh:
        os.dup2(fh.fileno(), 1)
        os.dup2(fh.fileno(), 2)
        code = pytest.main(argv)
    if code not in (0, 5):
        with open(log) as fh:
            sys.__stderr__.write(f"--- rank {rank} failed, its log:\n{fh.read()}\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
