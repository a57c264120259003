"""Rotary position embeddings over named axes: each token's position within its segment, and the
rotation of pairs of ``HeadSize`` by it (Llama's rotate-half layout)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import _ops as ops
from .._axis import Axis, AxisError, AxisSelector, format_axes, name_of
from .._core import NamedArray, expect_named, unchecked
from .._shape import arange, concatenate
from ._masks import check_segment_ids


def positions_from_segments(segment_ids: NamedArray, Pos: AxisSelector = "position") -> NamedArray:
    """Position of each token within its segment (restarting at 0 where the id changes).

    The result has the axes of ``segment_ids``, in the same order, with dtype int32.
    """
    pos = name_of(Pos)
    n = expect_named(segment_ids, "positions_from_segments").axis_size(pos)
    check_segment_ids(segment_ids, "positions_from_segments")
    ids = segment_ids.rearrange((..., pos))
    prev = ids.array
    starts = jnp.concatenate([jnp.ones_like(prev[..., :1], bool), prev[..., 1:] != prev[..., :-1]], axis=-1)
    idx = jnp.arange(n, dtype=jnp.int32)
    start_idx = jax.lax.cummax(jnp.where(starts, idx, 0), axis=prev.ndim - 1)
    return unchecked(idx - start_idx, ids.axes).rearrange(segment_ids.names)


def rotary_embedding(
    x: NamedArray,
    positions: NamedArray,
    *,
    HeadSize: AxisSelector = "head_size",
    theta: float = 10000.0,
    inv_freq: NamedArray | None = None,
    scale=1.0,
) -> NamedArray:
    """Rotate pairs (i, i + d/2) of ``HeadSize`` by ``position * theta^(-2i/d)`` (Llama's rotate-half
    layout). ``positions`` is an integer NamedArray whose axes ``x`` has (e.g. ``position`` or
    ``(batch, position)``). Computed in float32, returned in ``x.dtype``.

    ``inv_freq`` (one axis of ``d/2`` entries, any name) replaces ``theta^(-2i/d)`` for the scaled
    variants (Llama 3, YaRN, ...); ``scale`` (a number or a NamedArray without axes) multiplies
    cos and sin, as YaRN's attention factor does. A model whose layers differ passes both as
    per-layer data."""
    hs = expect_named(x, "rotary_embedding").resolve_axis(HeadSize)
    expect_named(positions, "rotary_embedding", "positions")
    if hs.size % 2:
        raise AxisError(f"rotary_embedding needs an even {hs.name!r} size, got {hs.size}")
    half = Axis(hs.name, hs.size // 2)
    if inv_freq is None:
        inv_freq = 1.0 / (theta ** (arange(half, dtype=jnp.float32) * (2.0 / hs.size)))
    elif inv_freq.ndim != 1 or inv_freq.size != half.size:
        raise AxisError(
            f"rotary_embedding: inv_freq needs one axis of {half.size} entries, got {format_axes(inv_freq.axes)}"
        )
    else:
        inv_freq = NamedArray(inv_freq.array.astype(jnp.float32), (half,))
    angles = positions.astype(jnp.float32) * inv_freq
    cos = concatenate(hs.name, [ops.cos(angles)] * 2)
    sin = concatenate(hs.name, [ops.sin(angles)] * 2)
    if not (isinstance(scale, (int, float)) and scale == 1):
        scale = scale.array if isinstance(scale, NamedArray) else scale
        cos, sin = cos * scale, sin * scale
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[hs.name, : half.size], x32[hs.name, half.size :]
    rotated = concatenate(hs.name, [-x2, x1])
    return (x32 * cos + rotated * sin).astype(x.dtype)
