"""Rotary position embeddings and dot-product attention over named axes.

Attention is written against names: the query has ``QPos`` and the key/value have ``KPos``
(default ``position`` and ``key_position``); both have ``HeadSize``; every other axis
(batch, heads, ...) is carried through. Grouped-query attention: when the query has ``Heads``
and the key/value ``KVHeads`` of a smaller size, each kv head serves ``heads / kv_heads``
consecutive query heads (the Hugging Face ``repeat_kv`` order).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from .._axis import Axis, AxisError, AxisSelector, format_axes, name_of
from .._core import NamedArray
from .._einsum import dot
from .. import _ops as ops
from .._shape import arange, broadcast_to, concatenate, flatten_axes, rename, unflatten_axis

# ---- rotary embeddings --------------------------------------------------------------


def positions_from_segments(segment_ids: NamedArray, Pos: AxisSelector = "position") -> NamedArray:
    """Position of each token within its segment (restarting at 0 where the id changes)."""
    pos = name_of(Pos)
    n = segment_ids.axis_size(pos)
    idx = arange(Axis(pos, n), dtype=jnp.int32)
    prev = segment_ids.rearrange((..., pos)).array
    starts = jnp.concatenate([jnp.ones_like(prev[..., :1], bool), prev[..., 1:] != prev[..., :-1]], axis=-1)
    start_idx = jnp.where(starts, jnp.arange(n, dtype=jnp.int32), 0)
    start_idx = jax.lax.cummax(start_idx, axis=start_idx.ndim - 1)
    other = tuple(a for a in segment_ids.axes if a.name != pos)
    return idx - NamedArray(start_idx, other + (Axis(pos, n),))


def rotary_embedding(x: NamedArray, positions: NamedArray, *, HeadSize: AxisSelector = "head_size",
                     theta: float = 10000.0) -> NamedArray:
    """Rotate pairs (i, i + d/2) of ``HeadSize`` by ``position * theta^(-2i/d)`` (Llama's rotate-half
    layout). ``positions`` is an integer NamedArray whose axes ``x`` has (e.g. ``position`` or
    ``(batch, position)``). Computed in float32, returned in ``x.dtype``."""
    hs = x.resolve_axis(HeadSize)
    if hs.size % 2:
        raise AxisError(f"rotary_embedding needs an even {hs.name!r} size, got {hs.size}")
    half = Axis(hs.name, hs.size // 2)
    inv_freq = 1.0 / (theta ** (arange(half, dtype=jnp.float32) * (2.0 / hs.size)))
    angles = positions.astype(jnp.float32) * inv_freq
    cos = concatenate(hs.name, [ops.cos(angles)] * 2)
    sin = concatenate(hs.name, [ops.sin(angles)] * 2)
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[hs.name, : half.size], x32[hs.name, half.size :]
    rotated = concatenate(hs.name, [-x2, x1])
    return (x32 * cos + rotated * sin).astype(x.dtype)


# ---- masks ------------------------------------------------------------------------------


def causal_mask(QPos: Axis, KPos: Axis, *, q_offset=0) -> NamedArray:
    """True where key position <= query position (+ ``q_offset``, for queries that continue a cache)."""
    return arange(QPos, start=q_offset) >= arange(KPos)


def segment_mask(q_segments: NamedArray, k_segments: NamedArray) -> NamedArray:
    """True where query and key belong to the same packed segment."""
    return q_segments == k_segments


# ---- attention --------------------------------------------------------------------------


def _cudnn_ok(q: NamedArray, bias, segment_ids) -> bool:
    return (
        jax.default_backend() == "gpu"
        and q.dtype in (jnp.bfloat16, jnp.float16)
        and bias is None
        and segment_ids is None
    )


def dot_product_attention(
    query: NamedArray,
    key: NamedArray,
    value: NamedArray,
    *,
    QPos: AxisSelector = "position",
    KPos: AxisSelector = "key_position",
    HeadSize: AxisSelector = "head_size",
    Heads: AxisSelector = "heads",
    KVHeads: AxisSelector = "kv_heads",
    causal: bool = False,
    mask: NamedArray | None = None,
    bias: NamedArray | None = None,
    segment_ids: NamedArray | None = None,
    scale: float | None = None,
    implementation: str = "auto",
) -> NamedArray:
    """``softmax(q·k / sqrt(d) + bias, masked) · v`` with the softmax in float32.

    Args:
        query: axes include ``QPos``, ``HeadSize`` and (for GQA) ``Heads``.
        key, value: axes include ``KPos``, ``HeadSize`` and ``Heads`` or ``KVHeads``.
        causal: mask keys after the query position (query and key positions aligned at 0).
        mask: boolean NamedArray, True = attend; combined with causal and segments.
        bias: added to the scores (e.g. ALiBi).
        segment_ids: integer NamedArray with ``QPos`` (and batch axes): tokens attend only
            within their segment (packed sequences).
        implementation: ``"auto"`` uses cuDNN flash attention on GPU when the inputs allow,
            else the XLA reference below; ``"xla"`` forces the reference; ``"cudnn"`` requires cuDNN.

    Returns:
        the query's axes, with ``HeadSize`` taken from ``value``.
    """
    qpos, kpos, hs = name_of(QPos), name_of(KPos), name_of(HeadSize)
    for what, x, need in (("query", query, (qpos, hs)), ("key", key, (kpos, hs)), ("value", value, (kpos,))):
        missing = [n for n in need if n not in x.names]
        if missing:
            raise AxisError(f"dot_product_attention: {what} lacks axes {missing}; it has {format_axes(x.axes)}")
    heads, kvheads = name_of(Heads), name_of(KVHeads)
    grouped = heads in query.names and kvheads in key.names and heads not in key.names
    if grouped:
        H, KV = query.resolve_axis(heads), key.resolve_axis(kvheads)
        if H.size % KV.size:
            raise AxisError(f"grouped-query attention: {H.size} query heads is not a multiple of {KV.size} kv heads")
        group = Axis(f"{heads}_per_{kvheads}", H.size // KV.size)
        query = unflatten_axis(query, heads, (KV, group))
    if implementation not in ("auto", "xla", "cudnn"):
        raise AxisError(f"unknown attention implementation {implementation!r}; use auto, xla or cudnn")
    use_cudnn = implementation == "cudnn" or (implementation == "auto" and _cudnn_ok(query, bias, segment_ids))
    if use_cudnn:
        out = _cudnn_attention(query, key, value, qpos, kpos, hs, causal, mask, scale)
    else:
        out = _xla_attention(query, key, value, qpos, kpos, hs, causal, mask, bias, segment_ids, scale)
    if grouped:
        out = flatten_axes(out, (kvheads, group.name), heads)
    return out


def _combined_mask(query, key, qpos, kpos, causal, mask, segment_ids):
    m = mask
    if causal:
        c = causal_mask(query.resolve_axis(qpos), key.resolve_axis(kpos))
        m = c if m is None else m & c
    if segment_ids is not None:
        s = segment_mask(segment_ids, rename(segment_ids, {qpos: kpos}))
        m = s if m is None else m & s
    return m


def _xla_attention(query, key, value, qpos, kpos, hs, causal, mask, bias, segment_ids, scale):
    d = query.axis_size(hs)
    scale = 1.0 / jnp.sqrt(d) if scale is None else scale
    scores = dot(query * jnp.asarray(scale, query.dtype), key, axis=hs, preferred_element_type=jnp.float32)
    scores = scores.astype(jnp.float32)
    if bias is not None:
        scores = scores + bias.astype(jnp.float32)
    m = _combined_mask(query, key, qpos, kpos, causal, mask, segment_ids)
    if m is not None:
        scores = ops.where(m, scores, jnp.finfo(jnp.float32).min)
    weights = ops.softmax(scores, kpos).astype(value.dtype)
    out = dot(weights, value, axis=kpos)
    return out.rearrange(tuple(n for n in query.names if n in out.names) + tuple(n for n in out.names if n not in query.names))


def _cudnn_attention(query, key, value, qpos, kpos, hs, causal, mask, scale):
    # jax.nn.dot_product_attention wants [batch, seq, heads, head_dim]: fold every other axis
    # of the query into batch/heads by name.
    shared = [n for n in query.names if n in key.names and n not in (hs,)]
    q_only = [n for n in query.names if n not in key.names and n not in (qpos, hs)]
    batch_axes = [n for n in shared if n != kpos]
    q = query.rearrange(tuple(batch_axes) + (qpos,) + tuple(q_only) + (hs,))
    k = key.rearrange(tuple(batch_axes) + (kpos, hs))
    v = value.rearrange(tuple(batch_axes) + (kpos, hs))
    B = math.prod(q.axis_size(n) for n in batch_axes)
    G = math.prod(q.axis_size(n) for n in q_only)
    T, S, D = q.axis_size(qpos), k.axis_size(kpos), q.axis_size(hs)
    qa = q.array.reshape(B, T, G, D)
    ka = k.array.reshape(B, S, 1, D)
    va = v.array.reshape(B, S, 1, v.axis_size(hs))
    m = None
    if mask is not None:  # broadcast_to refuses mask axes that are not batch/query/key positions
        m = broadcast_to(mask, tuple(q.resolve_axis(n) for n in batch_axes) + (q.resolve_axis(qpos), k.resolve_axis(kpos)))
    out = jax.nn.dot_product_attention(qa, ka, va, mask=None if m is None else m.array.reshape(B, 1, T, S),
                                       scale=scale, is_causal=causal, implementation="cudnn")
    out_axes = tuple(q.resolve_axis(n) for n in batch_axes) + (q.resolve_axis(qpos),) + tuple(
        q.resolve_axis(n) for n in q_only) + (v.resolve_axis(hs),)
    res = NamedArray(out.reshape(tuple(a.size for a in out_axes)), out_axes)
    return res.rearrange(tuple(n for n in query.names))
