"""Masks and biases for ``dot_product_attention``, over ``(position, key_position)``: causal
(with a sliding window), chunked, packed segments, padding, forgetful (random key dropping),
and ALiBi. Each takes the
queries' place among the keys as ``q_offset``: an int, a traced scalar, or a NamedArray over
``batch`` when every row continues its own cache."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp

from .. import random as nmr
from .._axis import ArgumentError, ArgumentTypeError, Axis, AxisError, AxisSelector, format_axes, name_of, union
from .._core import NamedArray, expect_named
from .._index import concrete
from .._shape import arange, rename


def _query_positions(QPos: Axis, q_offset) -> NamedArray:
    """Where each query stands among the keys: ``q_offset + i``. A NamedArray offset (0-d, or
    over ``batch`` for rows that each continue their own cache) broadcasts by name."""
    return arange(QPos) + q_offset


_KEY_WORDS = frozenset({"k", "key", "keys", "kv", "kpos"})
_QUERY_WORDS = frozenset({"q", "query", "queries", "qpos"})


def _words(axis) -> set[str]:
    return set(re.split(r"[^a-z]+", name_of(axis).lower()))


def check_query_key(what: str, QPos, KPos) -> None:
    """The query axis comes first, the key axis second: a mask built with the two swapped is the
    transpose, which for a causal mask is anti-causal and still a valid-looking boolean. The swap is
    refused where the names tell it (a query axis named like a key's, or the other way round);
    passing ``QPos=``/``KPos=`` by keyword makes the roles explicit."""
    if _words(QPos) & _KEY_WORDS or _words(KPos) & _QUERY_WORDS:
        raise AxisError(
            f"{what}: the query axis is {name_of(QPos)!r} and the key axis {name_of(KPos)!r}; these names "
            f"read the other way round. The query's axis comes first: {what}(QPos, KPos), or by keyword "
            f"{what}(QPos=..., KPos=...) (swapped, a causal mask is anti-causal)"
        )


def causal_mask(QPos: Axis, KPos: Axis, *, q_offset=0, window=None) -> NamedArray:
    """True where key position <= query position (+ ``q_offset``, for queries that continue a cache;
    an int, a traced scalar, or a NamedArray over ``batch`` when each row stands at its own
    position) and, with a sliding ``window`` (an int, or a traced scalar such as a layer's entry
    of per-layer windows), the key is one of the ``window`` latest: ``query - window < key <= query``.

    ``QPos`` is the query's axis and ``KPos`` the key's (Haliax's order). Axes whose names read the
    other way round (``causal_mask(KPos, QPos)`` with ``key_position`` first) are an AxisError."""
    check_query_key("causal_mask", QPos, KPos)
    distance = _query_positions(QPos, q_offset) - arange(KPos)
    causal = distance >= 0
    if window is None:
        return causal
    window = check_window(window)
    return causal & (distance < window)


def check_window(window):
    """A sliding window as an int or array (a NamedArray's array), refused when it is known to be
    below 1 (a window of no key would mask every query's keys)."""
    window = window.array if isinstance(window, NamedArray) else window
    known = concrete(window)
    if known is not None and (known < 1).any():
        raise ArgumentError(f"causal_mask: window={window!r}; a sliding window holds at least 1 key (the query's own)")
    return window


def chunked_mask(QPos: Axis, KPos: Axis, chunk: int, *, q_offset=0) -> NamedArray:
    """True where query and key fall in the same block of ``chunk`` positions (Llama 4's chunked
    attention: pass it as ``mask=`` together with ``causal=True``). Not causal by itself."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ArgumentError(f"chunked_mask: chunk must be a positive int, got {chunk!r}")
    check_query_key("chunked_mask", QPos, KPos)
    return _query_positions(QPos, q_offset) // chunk == arange(KPos) // chunk


def check_segment_ids(ids: NamedArray, what: str) -> None:
    """Segment ids are integers: floats compare equal only by accident of rounding."""
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ArgumentTypeError(f"{what}: segment ids must be integers, got dtype {ids.dtype} {format_axes(ids.axes)}")


def segment_mask(q_segments: NamedArray, k_segments: NamedArray) -> NamedArray:
    """True where query and key belong to the same packed segment."""
    for name, ids in (("q_segments", q_segments), ("k_segments", k_segments)):
        check_segment_ids(expect_named(ids, "segment_mask", name), "segment_mask")
    return q_segments == k_segments


def padding_mask(
    valid_or_lengths: NamedArray, KPos: AxisSelector = "key_position", *, Pos: AxisSelector = "position"
) -> NamedArray:
    """A mask over the key axis that hides padding, for ``dot_product_attention(mask=...)``.

    From integer lengths (e.g. over ``batch``, with ``KPos`` an Axis): True at key positions
    below each length (right padding); a length of at least ``KPos.size`` masks nothing, one of
    0 or less masks every key. From a boolean per token (True = a real token) over
    ``Pos`` (or already over ``KPos``): the same values on the key axis, so nobody renames by
    hand (and nobody passes a mask over queries by mistake)."""
    x = expect_named(valid_or_lengths, "padding_mask")
    kpos, pos = name_of(KPos), name_of(Pos)
    if jnp.issubdtype(x.dtype, jnp.integer):
        if not isinstance(KPos, Axis):
            raise AxisError(f"padding_mask from lengths needs KPos as an Axis with a size, got {KPos!r}")
        if kpos in x.names:
            raise AxisError(f"padding_mask: lengths already have the key axis {kpos!r} {format_axes(x.axes)}")
        return x > arange(KPos)
    if not jnp.issubdtype(x.dtype, jnp.bool_):
        raise ArgumentTypeError(f"padding_mask takes integer lengths or a boolean per token, got dtype {x.dtype}")
    if kpos in x.names:
        return x
    if pos not in x.names:
        raise AxisError(f"padding_mask: a per-token mask needs axis {pos!r} or {kpos!r}, got {format_axes(x.axes)}")
    return rename(x, {pos: kpos})


def forgetful_causal_mask(KPos: Axis, mask_prob: float, sample_prob: bool = True, *, key) -> NamedArray:
    """Forgetful causal masking (Liu et al. 2022, "Towards Better Few-Shot and Finetuning
    Performance with Forgetful Causal Language Models"): a boolean over ``KPos`` that hides each key
    position with probability ``mask_prob`` (with ``sample_prob``, a probability drawn uniformly
    from ``[0, mask_prob)`` per call, as the paper does); position 0 is always kept. Pass it as
    ``mask=`` together with ``causal=True`` during training."""
    if not isinstance(KPos, Axis):
        raise AxisError(f"forgetful_causal_mask needs KPos as an Axis with a size, got {KPos!r}")
    if not 0.0 <= mask_prob <= 1.0:
        raise ArgumentError(f"forgetful_causal_mask: mask_prob must be in [0, 1], got {mask_prob!r}")
    first = arange(KPos) == 0
    if mask_prob == 0:
        return first | True
    if sample_prob:
        key, sub = jax.random.split(key)
        mask_prob = jax.random.uniform(sub, (), minval=0.0, maxval=mask_prob)
    return nmr.bernoulli(key, KPos, 1.0 - mask_prob) | first


def alibi_slopes(Heads: Axis) -> NamedArray:
    """ALiBi's per-head slopes (Press et al. 2022): for ``n`` heads, a power of two, the geometric
    sequence ``2^(-8/n), 2^(-16/n), ...``; otherwise those of the largest power of two below
    ``n``, then every other slope of twice that many."""

    def geometric(m):
        return [2.0 ** (-8.0 * i / m) for i in range(1, m + 1)]

    n = Heads.size
    if n == 0:
        return NamedArray(jnp.zeros((0,), jnp.float32), (Heads,))
    p = 1 << (n.bit_length() - 1)
    slopes = geometric(p) + geometric(2 * p)[0::2][: n - p]
    return NamedArray(jnp.asarray(slopes, jnp.float32), (Heads,))


def alibi_bias(Heads: Axis, QPos: Axis, KPos: Axis, *, q_offset=0, slopes: NamedArray | None = None) -> NamedArray:
    """ALiBi's attention bias ``slope[head] * (key - query)`` over ``(heads, position,
    key_position)``, float32, for ``dot_product_attention(bias=...)``; under grouped-query
    attention the bias keeps the query's ``heads``. Use it with ``causal=True`` (the keys
    after the query would get a positive bias). ``slopes`` replaces ``alibi_slopes(Heads)``."""
    check_query_key("alibi_bias", QPos, KPos)
    slopes = alibi_slopes(Heads) if slopes is None else slopes
    union((Heads,), expect_named(slopes, "alibi_bias", "slopes").axes)  # one size per name: the heads'
    bias = slopes * (arange(KPos) - _query_positions(QPos, q_offset)).astype(jnp.float32)
    return bias.rearrange((name_of(Heads), ..., QPos.name, KPos.name))
