"""The dense matmul peak MFU is measured against: the datasheet figure of known accelerators in
the compute dtype, else a large matmul measured in this process.

Datasheet figures are dense (no 2:4 sparsity) tensor-core TFLOP/s per GPU. On NVIDIA GPUs a
float32 matmul runs on the TF32 tensor cores unless ``jax_default_matmul_precision`` asks for
``highest``, so float32 is compared with the TF32 figure by default. The CPU has no such figure:
its peak is measured (a 2048^2 matmul in the compute dtype, in this process, so with several
processes per host it is this process's share of the machine).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp

# device_kind substring (checked in order), excluded substrings -> dense TFLOP/s for bf16/fp16,
# tf32, fp32 (no tensor cores), fp8 (e4m3 and e5m2 alike; None: no FP8 tensor cores)
_DATASHEET: tuple[tuple[str, tuple[str, ...], float, float, float, float | None], ...] = (
    ("H100 PCIe", (), 756.0, 378.0, 51.2, 1513.0),
    ("H100 NVL", (), 835.0, 417.5, 59.8, 1670.5),
    ("H200 NVL", (), 835.0, 417.5, 59.8, 1670.5),
    ("H100", (), 989.4, 494.7, 66.9, 1978.9),    # SXM5 (device_kind "NVIDIA H100 80GB HBM3")
    ("H200", (), 989.4, 494.7, 66.9, 1978.9),    # SXM
    ("GH200", (), 989.4, 494.7, 66.9, 1978.9),
    ("A100", (), 312.0, 156.0, 19.5, None),      # SXM4 and PCIe alike
    ("L40S", (), 362.1, 183.0, 91.6, 733.0),
    ("L4", ("L40",), 121.0, 60.0, 30.3, 242.5),
)


@dataclasses.dataclass(frozen=True)
class DevicePeak:
    """A device's dense matmul peak in one dtype."""

    flops: float
    """FLOP/s."""
    source: str
    """Where the figure comes from: ``"datasheet"`` or ``"measured"``."""
    description: str
    """Device and dtype, for the log header."""

    def describe(self) -> str:
        """``989.4 TFLOP/s (NVIDIA H100 80GB HBM3, bf16 dense, datasheet)``."""
        figure = f"{self.flops / 1e12:.1f} TFLOP/s" if self.flops >= 1e12 else f"{self.flops / 1e9:.1f} GFLOP/s"
        return f"{figure} ({self.description}, {self.source})"


def datasheet_peak(device_kind: str, dtype_name: str, matmul_precision: str | None = None) -> float | None:
    """Dense TFLOP/s x 1e12 for ``device_kind`` in ``dtype_name`` (``bfloat16``, ``float16``,
    ``float32``, or an FP8 dtype's name: ``float8_e4m3fn``, ``float8_e5m2``), or None for a device
    not in the table (or, in FP8, one without FP8 tensor cores)."""
    for name, excluded, half, tf32, fp32, fp8 in _DATASHEET:
        if name in device_kind and not any(x in device_kind for x in excluded):
            if dtype_name in ("bfloat16", "float16"):
                return half * 1e12
            if dtype_name.startswith("float8"):
                return None if fp8 is None else fp8 * 1e12
            return (fp32 if matmul_precision in ("highest", "float32") else tf32) * 1e12
    return None


def measure_matmul_peak(dtype=jnp.float32, n: int = 2048, repeats: int = 5) -> float:
    """Dense ``n x n`` matmul FLOP/s of this process's first device in ``dtype`` (best of ``repeats``)."""
    device = jax.local_devices()[0]
    a = jax.device_put(jnp.ones((n, n), dtype), device)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2.0 * n**3 / best


def device_peak(dtype=jnp.float32) -> DevicePeak:
    """The peak MFU is taken against for this process's first device computing in ``dtype``."""
    device = jax.local_devices()[0]
    name = jnp.dtype(dtype).name
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(name, name)
    kind = device.device_kind
    if device.platform != "cpu":
        precision = jax.config.jax_default_matmul_precision
        flops = datasheet_peak(kind, name, precision)
        if flops is not None:
            tf32 = name == "float32" and precision not in ("highest", "float32")
            return DevicePeak(flops, "datasheet", f"{kind}, {short}{' as TF32' if tf32 else ''} dense")
    n = 2048 if device.platform == "cpu" else 8192
    return DevicePeak(measure_matmul_peak(dtype, n), "measured", f"{kind}, {short} {n}^2 matmul")
