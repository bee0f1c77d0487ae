"""``bench/convert.py``'s measurements run on a tiny model: the round trip is bit-identical, the
times and peak memory are positive numbers (no timing assertions), and packing fills sequences."""

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_convert", ROOT / "bench" / "convert.py")
bench_convert = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_convert)


def test_conversion_rows_round_trip_bit_exactly():
    (row,) = bench_convert.bench_conversion(bench_convert.QUICK)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[-1] == "yes"
    seconds = [float(c.split()[0]) for c in (cells[4], cells[6])]
    peaks = [float(cells[5]), float(cells[7])]
    assert all(s > 0 for s in seconds) and all(0 < p < 4 for p in peaks)


def test_packing_rows_fill_the_sequences():
    rows = bench_convert.bench_packing(4096, 200)
    fills = [float(re.findall(r"([\d.]+)%", row)[0]) for row in rows]
    assert len(rows) == 2 and all(90 < f <= 100 for f in fills)
