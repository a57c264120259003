"""What an accelerator can do, for MFU in the logs and the roofline of ``named-plan --search``.

One row per device kind, from the vendors' spec sheets (dense matmul peaks, without sparsity:
bf16, and on NVIDIA GPUs TF32 and plain float32; HBM capacity and bandwidth; the interconnect
bandwidth one device can send at, one direction). docs/trainer.md lists the sources. A kind is
matched by substring of JAX's ``device_kind`` (``"NVIDIA H100 80GB HBM3"`` matches ``H100``),
longest name first. ``Device.matmul_peak`` picks the peak a compute dtype runs at.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

# jax_default_matmul_precision values that make a float32 matmul exact float32 (six bf16 passes on
# a TPU) or TF32-like (three bf16 passes on a TPU); None and the rest: JAX's default, the fastest.
_F32_PRECISIONS = ("highest", "float32", "f32_f32_f32")
_HIGH_PRECISIONS = ("high", "tensorfloat32", "bfloat16_3x", "tf32_tf32_f32")


@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    peak_flops: float  # bf16 (and fp16) dense, FLOP/s
    hbm_bytes: float | None = None
    hbm_bandwidth: float | None = None  # bytes/s
    link_bandwidth: float | None = None  # bytes/s one device sends to its peers (one direction)
    tf32_flops: float | None = None  # NVIDIA tensor cores on float32 inputs rounded to TF32, dense
    f32_flops: float | None = None  # plain float32 (NVIDIA CUDA cores)

    def matmul_peak(self, compute_dtype, precision: str | None = None) -> tuple[float, str]:
        """The dense matmul FLOP/s for compute in ``compute_dtype``, and its name (``bf16``, ...).

        16-bit compute runs at the bf16 peak. A float32 matmul runs as JAX's default precision
        (``jax_default_matmul_precision``, or ``precision``) makes it: TF32 on NVIDIA tensor cores
        and one bf16 pass on a TPU by default; exact float32 (``highest``) on CUDA cores, or as
        six bf16 passes on a TPU; ``high``: TF32, or three bf16 passes."""
        if jnp.dtype(compute_dtype).itemsize < 4:
            return self.peak_flops, "bf16"
        p = str(precision if precision is not None else jax.config.jax_default_matmul_precision).lower()
        if self.tf32_flops is None:  # a TPU: float32 as bf16 passes
            passes = 6 if p in _F32_PRECISIONS else 3 if p in _HIGH_PRECISIONS else 1
            return self.peak_flops / passes, "bf16" if passes == 1 else f"bf16 x{passes} passes"
        if p in _F32_PRECISIONS and self.f32_flops is not None:
            return self.f32_flops, "float32"
        return self.tf32_flops, "TF32"


_GB = 1e9
DEVICES = {
    d.name: d
    for d in (
        # NVIDIA: TF32 and float32 peaks from the same sheets (TF32 without sparsity: half the sheet's starred figure)
        Device("H100", 989e12, 80 * _GB, 3.35e12, 450 * _GB, 494e12, 67e12),  # SXM5, NVLink 4: 900 GB/s both directions
        Device("H200", 989e12, 141 * _GB, 4.8e12, 450 * _GB, 494e12, 67e12),  # SXM, NVLink 4
        Device(
            "A100", 312e12, 80 * _GB, 2.039e12, 300 * _GB, 156e12, 19.5e12
        ),  # SXM4 80GB, NVLink 3: 600 GB/s both ways
        Device("L4", 121e12, 24 * _GB, 300 * _GB, 32 * _GB, 60e12, 30.3e12),  # PCIe Gen4 x16
        # TPUs: Google gives bf16 peaks only; float32 matmuls run as bf16 passes (Device.matmul_peak)
        Device("TPU v4", 275e12, 32 * _GB, 1.2e12),
        Device("TPU v5 lite", 197e12, 16 * _GB, 819 * _GB, 200 * _GB),  # v5e: ICI 1,600 Gbit/s
        Device("TPU v5p", 459e12, 95 * _GB, 2.765e12, 600 * _GB),  # ICI 4,800 Gbit/s
        Device("TPU v6 lite", 918e12, 32 * _GB, 1.64e12, 448 * _GB),  # v6e: ICI 3,584 Gbit/s
    )
}
# Aliases people type for the same chips.
_ALIASES = {"v5e": "TPU v5 lite", "v6e": "TPU v6 lite", "v5p": "TPU v5p", "v4": "TPU v4"}


def find(kind: str) -> Device | None:
    """The row whose name is in ``kind`` (case-insensitive), or None."""
    k = kind.lower()
    for alias, name in _ALIASES.items():
        if alias == k:
            return DEVICES[name]
    for name in sorted(DEVICES, key=len, reverse=True):
        if name.lower() in k:
            return DEVICES[name]
    return None


def local() -> Device | None:
    return find(jax.devices()[0].device_kind)


def parse_bytes(text: str) -> float | None:
    """``16GiB``, ``80GB``, ``512MiB`` or a plain number of bytes; None if ``text`` is none of these."""
    units = {
        "kib": 2**10,
        "mib": 2**20,
        "gib": 2**30,
        "tib": 2**40,
        "kb": 1e3,
        "mb": 1e6,
        "gb": 1e9,
        "tb": 1e12,
        "b": 1,
    }
    t = text.strip().lower().replace(" ", "")
    unit = next((u for u in sorted(units, key=len, reverse=True) if t.endswith(u)), "")
    try:
        value = float(t[: len(t) - len(unit)]) * units.get(unit, 1)
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None
