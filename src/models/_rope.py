"""Rotary-embedding frequencies for the RoPE variants of today's checkpoints, computed once on the
host from the config: ``default``, ``linear`` (position interpolation), ``dynamic`` (NTK),
``llama3`` (Llama 3.1+) and ``yarn``.

Each gives ``head_size / 2`` inverse frequencies and an attention factor that multiplies cos and
sin (so the q·k scores by its square): 1 except for YaRN. The formulas are those of the papers as
``transformers`` writes them (``modeling_rope_utils``), float32 where it computes in float32.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

import named as nm

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """How rotary frequencies are stretched past the pre-training context (Hugging Face
    ``rope_parameters`` / ``rope_scaling`` without ``rope_theta``). Each type reads its fields:

    - ``linear``: ``factor`` divides every frequency.
    - ``dynamic``: NTK scaling that only changes frequencies past ``max_position_embeddings``,
      which our models refuse: within it, the default frequencies (what ``transformers`` uses too).
    - ``llama3``: ``factor``, ``low_freq_factor``, ``high_freq_factor`` and
      ``original_max_position_embeddings`` (Llama 3.1/3.2: 8, 1, 4, 8192; 3.2 uses factor 32).
    - ``yarn``: ``factor``, ``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``,
      ``attention_factor`` (or ``mscale`` / ``mscale_all_dim``) and ``truncate``.

    ``original_max_position_embeddings`` None means the model's ``max_position_embeddings``.
    """

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise nm.ArgumentError(f"rope_scaling.rope_type={self.rope_type!r} is not one of {', '.join(ROPE_TYPES)}")
        for name in (
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "beta_fast",
            "beta_slow",
            "attention_factor",
            "mscale",
            "mscale_all_dim",
        ):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise nm.ArgumentError(f"rope_scaling.{name} must be a finite positive number, got {value!r}")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise nm.ArgumentError(
                f"rope_scaling.high_freq_factor={self.high_freq_factor} must exceed "
                f"low_freq_factor={self.low_freq_factor}"
            )


def _default(head_size: int, theta: float) -> np.ndarray:
    exponents = np.arange(0, head_size, 2).astype(np.float32) / np.float32(head_size)
    return (np.float32(1.0) / (np.float32(theta) ** exponents)).astype(np.float32)


def _llama3(inv: np.ndarray, s: RopeScaling, original: int) -> np.ndarray:
    # long wavelengths are divided by factor, short ones kept, the band between interpolated
    low_wavelen, high_wavelen = original / s.low_freq_factor, original / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (original / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(head_size: int, theta: float, s: RopeScaling, original: int) -> tuple[np.ndarray, float]:
    d = head_size
    if s.attention_factor is not None:
        factor = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        factor = _yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim)
    else:
        factor = _yarn_mscale(s.factor)

    def correction_dim(rotations: float) -> float:  # the dimension that turns ``rotations`` times in ``original``
        return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # a one-point ramp would divide by zero
    ramp = np.clip((np.arange(d // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp  # 1: keep the frequency (short wavelengths), 0: interpolate it
    pos_freqs = np.float32(theta) ** (np.arange(0, d, 2).astype(np.float32) / np.float32(d))
    inv = (1.0 / (s.factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv.astype(np.float32), float(factor)


def rope_frequencies(
    head_size: int, theta: float, scaling: RopeScaling, max_position_embeddings: int
) -> tuple[np.ndarray, float]:
    """``(inverse frequencies [head_size / 2] float32, attention factor)`` for one kind of layer."""
    inv = _default(head_size, theta)
    original = scaling.original_max_position_embeddings or max_position_embeddings
    kind = scaling.rope_type
    if kind == "linear":
        return (inv / np.float32(scaling.factor)).astype(np.float32), 1.0
    if kind == "llama3":
        return _llama3(inv, scaling, original), 1.0
    if kind == "yarn":
        return _yarn(head_size, theta, scaling, original)
    return inv, 1.0  # default, and dynamic within max_position_embeddings
