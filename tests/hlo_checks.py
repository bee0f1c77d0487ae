"""Checks on a program's HLO text shared by the tests."""

import re

_BF16_SCATTER_ADD = re.compile(r"= bf16\[[^\]]*\][^ ]* scatter\((?![^\n]*unique_indices=true)")


def bf16_scatter_adds(hlo: str) -> list[str]:
    """The bf16 scatters of ``hlo`` (``as_text(dialect="hlo")``) without unique indices: they add
    by atomic compare-and-swap loops on a GPU (the embedding's and the MoE layer's were 200x and
    100x slower than their fp32 or gathered forms on an H100, docs/gpu-performance.md)."""
    return _BF16_SCATTER_ADD.findall(hlo)
