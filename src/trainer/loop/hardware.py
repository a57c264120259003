"""What an accelerator can do, for MFU in the logs and the roofline of ``named-plan --search``.

One row per device kind, from the vendors' spec sheets (dense matmul peaks, without sparsity:
bf16, and on NVIDIA GPUs TF32 and plain float32; HBM capacity and bandwidth; the interconnect
bandwidth one device can send at, one direction). docs/trainer.md lists the sources. A kind is
matched by substring of JAX's ``device_kind`` (``"NVIDIA H100 80GB HBM3"`` matches ``H100``),
longest name first. ``Device.matmul_peak`` picks the peak a compute dtype runs at.

A CPU has no row: ``this_cpu`` measures this machine's (matmul FLOP/s, memory bandwidth and an
all-reduce over its devices, a few seconds) and caches it in the user's cache folder, keyed by the
machine, the JAX version and the devices.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
import time
from pathlib import Path

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
    f32_flops: float | None = None  # plain float32 (NVIDIA CUDA cores; a CPU's measured float32)
    platform: str = "gpu"  # JAX's platform: gpu, tpu or cpu

    def matmul_peak(self, compute_dtype, precision: str | None = None) -> tuple[float, str]:
        """The dense matmul FLOP/s for compute in ``compute_dtype``, and its name (``bf16``, ...).

        16-bit compute runs at the bf16 peak. A float32 matmul runs as JAX's default precision
        (``jax_default_matmul_precision``, or ``precision``) makes it: TF32 on NVIDIA tensor cores
        and one bf16 pass on a TPU by default; exact float32 (``highest``) on CUDA cores, or as
        six bf16 passes on a TPU; ``high``: TF32, or three bf16 passes."""
        if jnp.dtype(compute_dtype).itemsize < 4:
            return self.peak_flops, "bf16"
        if self.platform == "cpu":
            return self.f32_flops or self.peak_flops, "float32 (measured)"
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
        Device("TPU v4", 275e12, 32 * _GB, 1.2e12, platform="tpu"),
        Device("TPU v5 lite", 197e12, 16 * _GB, 819 * _GB, 200 * _GB, platform="tpu"),  # v5e: ICI 1,600 Gbit/s
        Device("TPU v5p", 459e12, 95 * _GB, 2.765e12, 600 * _GB, platform="tpu"),  # ICI 4,800 Gbit/s
        Device("TPU v6 lite", 918e12, 32 * _GB, 1.64e12, 448 * _GB, platform="tpu"),  # v6e: ICI 3,584 Gbit/s
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


# ---- this CPU, measured ----------------------------------------------------------------------

CPU_NAME = "this CPU"


def cache_dir() -> Path:
    """The user's cache folder for named (``$XDG_CACHE_HOME/named``, else ``~/.cache/named``)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "named"


def _machine_key(devices) -> str:
    """What a calibration holds for: the machine, the JAX version, the device count and kind."""
    cpu = platform.machine()  # (platform.processor() would start `uname -p`)
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    text = f"{platform.node()}|{cpu}|{os.cpu_count()}|jax {jax.__version__}|{len(devices)} x {devices[0].device_kind}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def this_cpu(*, refresh: bool = False) -> Device:
    """This machine's CPU devices as a device row, measured once (``measure_cpu``) and cached in
    ``cache_dir()/calibration/<key>.json``; ``refresh`` measures again. The memory per device is
    the machine's memory shared by its devices."""
    devices = jax.devices()
    path = cache_dir() / "calibration" / f"{_machine_key(devices)}.json"
    figures = None
    if not refresh and path.is_file():
        try:
            figures = json.loads(path.read_text())
            figures = {k: float(figures[k]) for k in ("f32_flops", "hbm_bandwidth", "link_bandwidth")}
        except (OSError, ValueError, KeyError, TypeError):
            figures = None  # a damaged cache is measured again
    if figures is None:
        figures = measure_cpu(devices)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(figures))
            tmp.replace(path)
        except OSError:
            pass  # a read-only home: measured again next time
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / len(devices)
    except (ValueError, OSError, AttributeError):
        memory = None
    return Device(
        CPU_NAME,
        figures["f32_flops"],
        memory,
        figures["hbm_bandwidth"],
        figures["link_bandwidth"],
        f32_flops=figures["f32_flops"],
        platform="cpu",
    )


def _best_seconds(f, *args, repeats: int = 5) -> float:
    jax.block_until_ready(f(*args))  # compiled and warm
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def measure_cpu(devices=None) -> dict[str, float]:
    """Per device, with every device busy at once (CPU devices share the cores): the float32
    matmul FLOP/s (a 512 x 512 product on each), the memory bandwidth (reading and writing 16 MiB
    on each) and the bytes each sends per second in an all-reduce of 4 MiB over all of them (a
    ring sends ``2 (n - 1) / n`` of it). The best of five runs of each; a second or two in all."""
    devices = list(devices if devices is not None else jax.devices())
    n = len(devices)
    mesh = jax.sharding.Mesh(devices, ("d",))
    split = jax.sharding.NamedSharding(mesh, jax.P("d"))
    whole = jax.sharding.NamedSharding(mesh, jax.P())
    k = 512
    a = jax.device_put(jnp.ones((n, k, k), jnp.float32), split)
    matmul = jax.jit(lambda x: jnp.einsum("nij,njk->nik", x, x), out_shardings=split)
    flops = 2 * k**3 / _best_seconds(matmul, a)
    words = 4 * 2**20  # 16 MiB of float32 per device
    x = jax.device_put(jnp.ones((n, words), jnp.float32), split)
    copy = jax.jit(lambda x: x * 2.0 + 1.0, out_shardings=split)
    bandwidth = 2 * words * 4 / _best_seconds(copy, x)
    if n > 1:
        y = jax.device_put(jnp.ones((n, 2**20), jnp.float32), split)
        reduce = jax.jit(lambda y: jnp.sum(y, axis=0), out_shardings=whole)
        link = 2 * (n - 1) / n * 2**20 * 4 / _best_seconds(reduce, y)
    else:
        link = bandwidth  # nothing to send: any finite figure ranks alike
    return {"f32_flops": flops, "hbm_bandwidth": bandwidth, "link_bandwidth": link}
