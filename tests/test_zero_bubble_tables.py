"""Slot tables of the zero-bubble schedules (ZB-H1, ZB-V) against dependencies, bubble formulas and memory bounds.

Units: F, B and W each take one slot. ZB-V's steps are per chunk; bubble fractions are ratios,
so they compare across schedules whatever the chunk size.
"""

from __future__ import annotations

import numpy as np
import pytest

from core.pipeline_parallel.zero_bubble import (
    ZeroBubbleTimeline,
    build_split_1f1b_timeline,
    build_zb_h1_timeline,
    build_zb_v_timeline,
    interleaved_1f1b_peak_live,
    one_f_one_b_reference,
    v_stage,
)

CONFIGS = [(pp, m) for pp in (2, 4, 8) for m in (pp, 2 * pp, 2 * pp + 1)]


def _slots(tl: ZeroBubbleTimeline, stage_of) -> dict[tuple[str, int, int], int]:
    """(kind, virtual stage, microbatch) -> slot; asserts each rank runs one step per slot and no step twice."""
    busy = (tl.forward >= 0).astype(int) + (tl.backward >= 0) + (tl.weight >= 0)
    assert busy.max() <= 1, "a rank runs two steps in one slot"
    out = {}
    for kind, table in (("F", tl.forward), ("B", tl.backward), ("W", tl.weight)):
        for t, r in zip(*np.nonzero(table >= 0)):
            mb, chunk = divmod(int(table[t, r]), tl.num_model_chunks)
            key = (kind, stage_of(int(r), chunk), mb)
            assert key not in out, f"{key} runs twice"
            out[key] = int(t)
    return out


def _check_table(tl: ZeroBubbleTimeline, pp: int, m: int, stage_of) -> None:
    slots = _slots(tl, stage_of)
    num_stages = pp * tl.num_model_chunks
    expected = {(k, s, mb) for k in "FBW" for s in range(num_stages) for mb in range(m)}
    assert set(slots) == expected
    for s in range(num_stages):
        for mb in range(m):
            if s > 0:
                assert slots[("F", s - 1, mb)] < slots[("F", s, mb)]
            assert slots[("F", s, mb)] < slots[("B", s, mb)]
            if s < num_stages - 1:
                assert slots[("B", s + 1, mb)] < slots[("B", s, mb)]
            assert slots[("B", s, mb)] < slots[("W", s, mb)]


@pytest.mark.parametrize("pp,m", CONFIGS)
def test_tables_complete_and_respect_dependencies(pp: int, m: int) -> None:
    _check_table(build_split_1f1b_timeline(m, pp), pp, m, lambda r, c: r)
    _check_table(build_zb_h1_timeline(m, pp), pp, m, lambda r, c: r)
    _check_table(build_zb_v_timeline(m, pp), pp, m, lambda r, c: v_stage(pp, r, c))


@pytest.mark.parametrize("pp,m", CONFIGS)
def test_1f1b_table_matches_paper_formula(pp: int, m: int) -> None:
    tl = build_split_1f1b_timeline(m, pp)
    bubble, peak = one_f_one_b_reference(m, pp)
    assert tl.bubble_fraction() == pytest.approx(bubble)
    assert tl.num_slots == 3 * m + 3 * (pp - 1)
    assert tl.peak_live_activations().max() == peak


@pytest.mark.parametrize("pp,m", CONFIGS)
def test_zb_h1_bubble_formula_and_memory(pp: int, m: int) -> None:
    tl = build_zb_h1_timeline(m, pp)
    # Paper: bubble (pp - 1)(T_F + T_B - T_W) = pp - 1 slots per rank, a third of 1F1B's 3 (pp - 1).
    assert tl.idle_slots().tolist() == [pp - 1] * pp
    # The last rank cannot start before slot pp - 1, so no schedule has fewer idle slots per rank.
    assert tl.bubble_fraction() == pytest.approx((pp - 1) / (3 * m + pp - 1))
    assert tl.peak_live_activations().tolist() == [pp] * pp
    assert tl.peak_live_activations().max() <= 1.05 * one_f_one_b_reference(m, pp)[1]


def test_zb_h1_targets_pp4_m8() -> None:
    pp, m = 4, 8
    tl, ref = build_zb_h1_timeline(m, pp), build_split_1f1b_timeline(m, pp)
    # Bubble time (idle slots per rank) is a third of 1F1B's: 3 against 9.
    assert tl.idle_slots().max() <= 0.4 * ref.idle_slots().min()
    # As a fraction of the (shorter) step, 3/27 against 9/33 = 0.407x: the 0.4x on fractions is
    # out of reach for any schedule here, since every rank idles at least pp - 1 of 3m + pp - 1 slots.
    ratio = tl.bubble_fraction() / ref.bubble_fraction()
    assert ratio == pytest.approx(33 / 81)
    assert tl.peak_live_activations().max() <= 1.05 * ref.peak_live_activations().max()


@pytest.mark.parametrize("pp,m", CONFIGS)
def test_zb_v_bubble_and_memory(pp: int, m: int) -> None:
    tl = build_zb_v_timeline(m, pp)
    if m >= 2 * pp - 1:
        # Every rank idles only pp - 1 of 6m + pp - 1 slots: the least possible, as the rank holding
        # virtual stages pp - 1 and pp cannot start before slot pp - 1.
        assert tl.idle_slots().tolist() == [pp - 1] * pp
        assert tl.bubble_fraction() == pytest.approx((pp - 1) / (6 * m + pp - 1))
    else:
        # Fewer microbatches than the handcrafted order's 2pp - 1: the missing ones leave gaps.
        assert tl.bubble_fraction() < one_f_one_b_reference(m, pp)[0]
    peak = tl.peak_live_activations()
    # 2pp half-size chunk activations = pp full-stage ones, 1F1B's memory.
    assert peak.max() <= 2 * pp
    if m % pp == 0:
        assert peak.max() <= interleaved_1f1b_peak_live(m, pp).max()


def test_zb_v_targets_pp4_m8() -> None:
    pp, m = 4, 8
    tl = build_zb_v_timeline(m, pp)
    ratio = tl.bubble_fraction() / one_f_one_b_reference(m, pp)[0]
    # 3/51 against 9/33 = 0.216x: the table reaches the slot lower bound, which lies above the 0.15x.
    assert ratio == pytest.approx((3 / 51) / (9 / 33))
    assert tl.peak_live_activations().tolist() == [8, 8, 8, 8]
    assert interleaved_1f1b_peak_live(m, pp).max() == 11


def test_rejects_too_few_microbatches() -> None:
    with pytest.raises(ValueError, match="num_microbatches >= pp"):
        build_zb_h1_timeline(3, 4)
    with pytest.raises(ValueError, match="num_microbatches >= pp"):
        build_zb_v_timeline(3, 4)
