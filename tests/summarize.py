"""Add up the JUnit XML reports of both levels into one 'N passed, N failed' line.

Usage: ``summarize.py SINGLE_XML MPI_RANK0_XML [MPI_RANK1_XML ...]``. Passed counts the
single-process level plus rank 0 of the MPI level (every rank runs the same tests); failed
counts failures on any rank. Exits 1 on any failure, a missing report, or no test run.
"""

import os
import sys
import xml.etree.ElementTree as ET


def _counts(path: str) -> tuple[int, int, int] | None:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    total = failed = skipped = 0
    for suite in root.iter("testsuite"):
        total += int(suite.get("tests", 0))
        failed += int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        skipped += int(suite.get("skipped", 0))
    return total - failed - skipped, failed, skipped


def main(single: str, mpi_ranks: list[str]) -> int:
    """Print the combined summary; return the exit code."""
    passed = failed = skipped = 0
    for i, path in enumerate([single, *mpi_ranks]):
        counts = _counts(path)
        if counts is None:
            print(f"missing or broken report: {path}")
            failed += 1
            continue
        p, f, s = counts
        failed += f
        if i == 0:
            passed, skipped = p, s
        elif i == 1:
            passed += p
    if not mpi_ranks:
        print("no MPI-level reports found")
        failed += 1
    print(f"tests: {passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed or passed == 0 else 0


def _rank(path: str) -> int:
    """The rank in a ``mpi.rank<N>.xml`` report name."""
    return int(path.rsplit("rank", 1)[1].split(".")[0])


if __name__ == "__main__":
    # an unmatched shell glob (the MPI level never ran) arrives as the literal pattern
    sys.exit(main(sys.argv[1], sorted((p for p in sys.argv[2:] if os.path.exists(p)), key=_rank)))
