"""Checks on a program's HLO text shared by the tests."""

import re

_BF16_SCATTER_ADD = re.compile(r"= bf16\[[^\]]*\][^ ]* scatter\((?![^\n]*unique_indices=true)")


def bf16_scatter_adds(hlo: str) -> list[str]:
    """The bf16 scatters of ``hlo`` (``as_text(dialect="hlo")``) without unique indices: they add
    by atomic compare-and-swap loops on a GPU (the embedding's and the MoE layer's were 200x and
    100x slower than their fp32 or gathered forms on an H100, docs/gpu-performance.md)."""
    return _BF16_SCATTER_ADD.findall(hlo)


_OP = re.compile(r"= [^=]*? (all-gather|reduce-scatter|all-gather-start|reduce-scatter-start|dot|convolution|fusion|"
                 r"custom-call|while)\(")


def scheduled_ops(hlo: str) -> dict[str, list[str]]:
    """Per computation of a compiled (scheduled) module's text (``compiled.as_text()``), its
    collectives and matmuls in schedule order: ``all-gather``, ``reduce-scatter``, ``while`` and
    ``dot`` (a dot, or a fusion or custom call whose line names a dot or a GEMM, as XLA:CPU and
    XLA:GPU emit matmuls); other instructions are left out."""
    out: dict[str, list[str]] = {}
    for block in re.split(r"\n(?=\S[^\n]*\{\n)", hlo):
        name, _, body = block.partition("\n")
        ops = []
        for line in body.splitlines():
            match = _OP.search(line)
            if not match:
                continue
            op = match.group(1).removesuffix("-start")
            if op in ("fusion", "custom-call", "convolution"):
                if not re.search(r"dot|gemm|matmul|convolution", line, re.IGNORECASE):
                    continue
                op = "dot"
            ops.append(op)
        out[name.split(" ")[0]] = ops
    return out
