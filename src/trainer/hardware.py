"""What an accelerator can do, for MFU in the logs and the roofline of ``named-plan --search``.

One row per device kind, from the vendors' spec sheets (dense bf16 matmul peak, without
sparsity; HBM capacity and bandwidth; the interconnect bandwidth one device can send at, one
direction). docs/trainer.md lists the sources. A kind is matched by substring of JAX's
``device_kind`` (``"NVIDIA H100 80GB HBM3"`` matches ``H100``), longest name first.
"""

from __future__ import annotations

import dataclasses
import math

import jax


@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    peak_flops: float  # bf16 dense, FLOP/s
    hbm_bytes: float | None = None
    hbm_bandwidth: float | None = None  # bytes/s
    link_bandwidth: float | None = None  # bytes/s one device sends to its peers (one direction)


_GB = 1e9
DEVICES = {d.name: d for d in (
    Device("H100", 989e12, 80 * _GB, 3.35e12, 450 * _GB),    # SXM5, NVLink 4: 900 GB/s both directions
    Device("H200", 989e12, 141 * _GB, 4.8e12, 450 * _GB),    # SXM, NVLink 4
    Device("A100", 312e12, 80 * _GB, 2.039e12, 300 * _GB),   # SXM4 80GB, NVLink 3: 600 GB/s both directions
    Device("L4", 121e12, 24 * _GB, 300 * _GB, 32 * _GB),     # PCIe Gen4 x16
    Device("TPU v4", 275e12, 32 * _GB, 1.2e12),
    Device("TPU v5 lite", 197e12, 16 * _GB, 819 * _GB, 200 * _GB),   # v5e: ICI 1,600 Gbit/s
    Device("TPU v5p", 459e12, 95 * _GB, 2.765e12, 600 * _GB),        # ICI 4,800 Gbit/s
    Device("TPU v6 lite", 918e12, 32 * _GB, 1.64e12, 448 * _GB),     # v6e: ICI 3,584 Gbit/s
)}
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
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "b": 1}
    t = text.strip().lower().replace(" ", "")
    unit = next((u for u in sorted(units, key=len, reverse=True) if t.endswith(u)), "")
    try:
        value = float(t[: len(t) - len(unit)]) * units.get(unit, 1)
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None
