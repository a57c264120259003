"""Dot-product attention over named axes (rotary embeddings: ``_rotary``).

Attention is written against names: the query has ``QPos`` and the key/value have ``KPos``
(default ``position`` and ``key_position``); both have ``HeadSize``; every other axis
(batch, heads, ...) is carried through. Grouped-query attention: when the query has ``Heads``
and the key/value ``KVHeads`` of a smaller size, each kv head serves ``heads / kv_heads``
consecutive query heads (the Hugging Face ``repeat_kv`` order).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator

import jax
import jax.numpy as jnp

from .. import _ops as ops
from .._axis import ArgumentError, ArgumentTypeError, Axis, AxisError, AxisSelector, NamedError, format_axes, name_of
from .._context import attention_context, current_attention
from .._core import NamedArray, expect_named, unchecked
from .._einsum import dot, einsum
from .._shape import broadcast_to, flatten_axes, rename, unflatten_axis
from ..partitioning import shard
from . import _flash
from ._flash import flash_attention, flash_unmet
from ._masks import causal_mask, check_query_key, segment_mask

_LOG = logging.getLogger("named.nn")

# ---- attention --------------------------------------------------------------------------

_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
_IMPLEMENTATIONS = ("auto", "xla", "cudnn", "flash")


@contextlib.contextmanager
def attention_implementation(implementation: str) -> Iterator[None]:
    """Make every ``dot_product_attention(implementation="auto")`` inside take ``implementation``
    ("xla", "flash" or "cudnn"; "auto" restores the automatic choice). Calls that name an implementation
    keep theirs. This is how a model whose layers call attention with the default is run on the
    XLA path on a GPU (to compare it with cuDNN's kernel, or to rule the kernel out). It is part
    of every jit's cache key: a jitted step called under another implementation is traced again."""
    if implementation not in _IMPLEMENTATIONS:
        raise ArgumentError(f"unknown attention implementation {implementation!r}; use {', '.join(_IMPLEMENTATIONS)}")
    with attention_context(implementation):
        yield


def auto_attention(backend: str | None = None, key_length: int = 0, dtype=None) -> str:
    """The implementation ``dot_product_attention(implementation="auto")`` takes (read through
    ``nn.attention_implementation``): ``"cudnn"`` on a GPU with a bf16/f16 ``dtype`` (a plan from
    shapes alone does not know the head size or the bias, and assumes cuDNN's conditions on them
    hold), else ``"flash"`` once the keys span more than one block (``key_length`` > 256), else
    ``"xla"``. ``backend`` is the device kind the run will use (``"gpu"``, ``"tpu"``, ``"cpu"``;
    default this process's)."""
    implementation = current_attention()
    if implementation != "auto":
        return implementation
    backend = jax.default_backend() if backend is None else backend
    if backend == "gpu" and dtype is not None and jnp.dtype(dtype) in _CUDNN_DTYPES:
        return "cudnn"
    return "flash" if _flash_pays(key_length) else "xla"


def attention_keeps_scores(
    implementation: str = "auto", backend: str | None = None, key_length: int = 0, dtype=None
) -> bool:
    """Whether attention's backward pass keeps the ``[query, key]`` scores of each layer: what a
    memory model counts. ``"xla"`` keeps them; ``"cudnn"`` and ``"flash"`` never do; ``"auto"``
    is what ``auto_attention`` says it takes (on the XLA path below one block of keys, whose one
    block of scores is the whole of them)."""
    if implementation not in _IMPLEMENTATIONS:
        raise ArgumentError(f"unknown attention implementation {implementation!r}; use {', '.join(_IMPLEMENTATIONS)}")
    if implementation == "auto":
        implementation = auto_attention(backend, key_length, dtype)
    return implementation == "xla"


def _flash_pays(key_length: int) -> bool:
    """Whether "auto" takes the blockwise path over the XLA one: once the keys span more than one
    block; with one block both hold the same scores, and the XLA path does not recompute them."""
    return key_length > _flash.BLOCK


def _cudnn_unmet(query: NamedArray, key: NamedArray, value: NamedArray, hs: str) -> list[str]:
    """Why the cuDNN flash kernel cannot run these inputs (empty when it can)."""
    why = []
    if jax.default_backend() != "gpu":
        why.append(f"the backend is {jax.default_backend()!r}, not 'gpu'")
    dtypes = {query.dtype, key.dtype, value.dtype}
    if len(dtypes) != 1 or query.dtype not in _CUDNN_DTYPES:
        why.append(f"query/key/value dtypes are {sorted(str(d) for d in dtypes)}; cuDNN needs one of bfloat16, float16")
    d = query.axis_size(hs)
    if d % 8 or d > 128 or value.axis_size(hs) != d:
        why.append(
            f"{hs!r} is {d} (query) and {value.axis_size(hs)} (value); cuDNN needs equal sizes, a multiple of 8, <= 128"
        )
    return why


def dot_product_attention(
    query: NamedArray,
    key: NamedArray,
    value: NamedArray,
    *extra,
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
    window=None,
    softcap: float | None = None,
    q_offset=0,
    implementation: str = "auto",
) -> NamedArray:
    """``softmax(cap(q·k * scale) + bias, masked) · v`` with the scores and softmax in float32
    (float64 for float64 inputs).

    Args:
        query: axes include ``QPos``, ``HeadSize`` and (for GQA) ``Heads``. A query without
            ``QPos`` is one query per row (Haliax's form, a decoding step): the result has no
            ``QPos`` either, and ``causal`` places it at ``q_offset``.
        key, value: axes include ``KPos``, ``HeadSize`` and ``Heads`` or ``KVHeads``.
        causal: mask keys after the query position (query and key positions aligned at 0, or
            the queries at ``q_offset, q_offset + 1, ...`` when they continue a KV cache).
        mask: boolean NamedArray, True = attend; combined with causal and segments. It must
            have ``KPos`` (``padding_mask`` builds one from lengths or per-token flags) and
            may have ``QPos``, batch axes and ``Heads``; any other axis is an AxisError. Any
            other dtype is an ArgumentTypeError: an additive mask (0 = attend, -inf = blocked,
            torch's) goes in ``bias``. A query whose keys are all masked gets uniform weights
            (the mean of the values), not NaN.
        bias: a float array added to the scores (e.g. ``alibi_bias``); the same axes rule as
            ``mask``; may have ``Heads`` also under GQA. A boolean or integer one is an
            ArgumentTypeError: a keep/drop mask goes in ``mask``.
        segment_ids: integer NamedArray with ``QPos`` (and batch axes): tokens attend only
            within their segment (packed sequences).
        scale: multiplies the scores; default ``1 / sqrt(head_size)``.
        window: with ``causal``, a sliding window: each query sees only its ``window`` latest
            keys (itself included). An int, or a traced scalar (a layer's entry of per-layer
            windows); it joins causal, ``mask`` and segments in one mask.
        softcap: ``softcap * tanh(scores / softcap)`` on the scaled scores, before bias and mask
            (Gemma 2's attention logit soft-capping).
        q_offset: where the queries stand among the keys, for ``causal`` (an int, a traced one, or
            a NamedArray over ``batch`` when each row continues its cache at its own position).
        implementation: ``"auto"`` uses cuDNN flash attention when the backend is GPU, the
            inputs are bf16/f16 with a head size that is a multiple of 8 and <= 128, and there
            is no bias, softcap, traced window or offset (``causal`` and an int ``window`` are
            fine; ``mask`` and ``segment_ids`` reach cuDNN as a dense bias); otherwise the
            blockwise path when the keys span more than one block of 256 (``"flash"``), else
            the XLA path. The choice is logged (logger
            ``named.nn``, INFO on GPU, DEBUG elsewhere) once per trace.
            ``"xla"`` forces the XLA path, which keeps the float32 ``[query, key]`` scores for
            the backward pass; ``"flash"`` forces the blockwise one (an online softmax over
            key blocks with its own VJP: it keeps the output and each row's logsumexp, and
            the backward pass recomputes each block's scores); both compute the same values.
            ``"cudnn"`` requires cuDNN and raises a NamedError
            saying why when it cannot run (masks, bias and segments then become a dense bias).
            Inside ``nn.attention_implementation(...)``, ``"auto"`` means what that names.

    Returns:
        the query's axes, with ``HeadSize`` taken from ``value``; constrained to the current
        compute mapping, like every activation a layer creates.
    """
    if implementation not in _IMPLEMENTATIONS:
        raise ArgumentError(f"unknown attention implementation {implementation!r}; use {', '.join(_IMPLEMENTATIONS)}")
    if implementation == "auto":
        implementation = current_attention()
    _check_order("dot_product_attention", query, key, value, *extra)  # first: Haliax's order has Axes in front
    _expect_named_inputs(
        "dot_product_attention", query=query, key=key, value=value, mask=mask, bias=bias, segment_ids=segment_ids
    )
    qpos, kpos, hs = name_of(QPos), name_of(KPos), name_of(HeadSize)
    check_query_key("dot_product_attention", QPos, KPos)
    _check_mask("dot_product_attention", mask, bias)
    if qpos not in query.names:  # one query per row (Haliax's form, a decoding step)
        args = dict(
            QPos=QPos,
            KPos=KPos,
            HeadSize=HeadSize,
            Heads=Heads,
            KVHeads=KVHeads,
            causal=causal,
            mask=mask,
            bias=bias,
            segment_ids=segment_ids,
            scale=scale,
            window=window,
            softcap=softcap,
            q_offset=q_offset,
            implementation=implementation,
        )
        return _with_one_query(dot_product_attention, query, (key, value), args)
    _check_axes("dot_product_attention", query, key, value, qpos, kpos, hs, mask, bias)
    heads, kvheads = name_of(Heads), name_of(KVHeads)
    query_heads = query.resolve_axis(heads) if heads in query.names else None
    query, mask, bias, group = _grouped(query, key, mask, bias, heads, kvheads)
    grouped = group is not None
    if isinstance(q_offset, NamedArray):
        for r in q_offset.axes:
            if r.name not in query.names or query.axis_size(r.name) != r.size:
                raise AxisError(
                    f"dot_product_attention: q_offset has {r.name}={r.size}, but the query "
                    f"{format_axes(query.axes)} has "
                    f"{r.name}={query.axis_size(r.name) if r.name in query.names else 'no such axis'}; "
                    "per-row offsets need one entry for each row"
                )
    if window is not None and not causal:
        raise ArgumentError("dot_product_attention: a sliding window needs causal=True")
    if implementation == "cudnn":
        why = _cudnn_unmet(query, key, value, hs) + _fused_unmet(None, None, None, softcap, window, q_offset)
        if why:
            raise NamedError(
                "dot_product_attention(implementation='cudnn') cannot run here: "
                + "; ".join(why)
                + ". Use implementation='auto' (falls back to XLA) or 'xla'."
            )
    # A boolean mask and segment ids go to cuDNN as a dense bias: on an H200 the trainer's step on
    # packed rows ran 1.9x faster than on the XLA path, whose f32 scores it keeps per layer
    # (docs/benchmarks.md §6). An additive bias is not sent there unasked (not measured).
    flash_why = flash_unmet(query, key, value, kpos, hs, scale, softcap)
    if implementation == "flash" and flash_why:
        raise NamedError(
            "dot_product_attention(implementation='flash') cannot run here: "
            + "; ".join(flash_why)
            + ". Use implementation='auto' or 'xla'."
        )
    why_not = _cudnn_unmet(query, key, value, hs) + _fused_unmet(None, bias, None, softcap, window, q_offset)
    use_fused = implementation == "cudnn" or (implementation == "auto" and not why_not)
    use_flash = not use_fused and (
        implementation == "flash" or (implementation == "auto" and not flash_why and _flash_pays(key.axis_size(kpos)))
    )
    _log_choice("cudnn" if use_fused else "flash" if use_flash else "xla", implementation, why_not)
    if use_fused:
        if segment_ids is not None:
            s = segment_mask(segment_ids, rename(segment_ids, {qpos: kpos}))
            mask = s if mask is None else mask & s
        out = fused_attention(query, key, value, qpos, kpos, hs, causal, mask, bias, scale, "cudnn", window)
    elif use_flash:
        out = flash_attention(
            query,
            key,
            value,
            qpos,
            kpos,
            hs,
            causal=causal,
            mask=mask,
            bias=bias,
            segment_ids=segment_ids,
            q_offset=q_offset,
            window=window,
            scale=scale,
            softcap=softcap,
        )
    else:
        m = _combined_mask(query, key, qpos, kpos, causal, mask, segment_ids, q_offset, window)
        out = _xla_attention(query, key, value, qpos, kpos, hs, m, bias, scale, softcap)
    if grouped:
        out = flatten_axes(out, (kvheads, group.name), heads)
        # the query's own heads axis back: in explicit mode it carries the heads' split
        out = unchecked(out.array, tuple(query_heads if a.name == heads else a for a in out.axes))
    return shard(out)


def _check_order(what: str, *arrays) -> None:
    """The arrays come first, the names by keyword; Haliax's positional names are refused (a plain
    array where a NamedArray belongs is left to ``expect_named``'s message)."""
    n = 3 if what == "dot_product_attention" else 2
    # Axes or names among them (or too many of them) is Haliax's order; a plain array in its place
    # gets expect_named's message (wrap it) instead
    haliax = any(isinstance(a, (Axis, str)) for a in arrays)
    if len(arrays) != n or haliax:
        got = ", ".join(type(a).__name__ for a in arrays)
        raise ArgumentTypeError(
            f"{what} takes the query, key (and value) NamedArrays first and the axis names by keyword "
            f"(QPos=, KPos=, HeadSize=), got ({got}); Haliax's order, {what}(KPos, Key, query, "
            f"key, ...), reads here as {what}(query, key, ..., KPos=KPos, HeadSize=Key)"
        )


def _expect_named_inputs(what: str, **inputs) -> None:
    for arg, x in inputs.items():
        if x is not None:
            expect_named(x, what, arg)


def _check_mask(what: str, mask, bias=None) -> None:
    """``mask`` is boolean (True = attend); ``bias`` is a float added to the scores. A boolean or
    integer array as ``bias`` would be added as 0/1, keeping every masked key."""
    if mask is not None:
        ops.check_bool_mask(
            mask,
            f"{what}: mask",
            "attend",
            "; a float mask of scores to add (ALiBi, a learned bias) is bias=, not a mask",
        )
    if bias is not None and not jnp.issubdtype(bias.dtype, jnp.floating):
        raise ArgumentTypeError(
            f"{what}: bias has dtype {bias.dtype} {format_axes(bias.axes)}; bias= is a float added to the "
            "scores. A boolean mask (True = attend) goes in mask=, as do 0/1 ones (`mask=bias != 0`)"
        )


def _check_axes(what: str, query, key, value, qpos: str, kpos: str, hs: str, mask, bias) -> None:
    for who, x, need in (("query", query, (qpos, hs)), ("key", key, (kpos, hs)), ("value", value, (kpos, hs))):
        if x is None:
            continue
        missing = [n for n in need if n not in x.names]
        if missing:
            raise AxisError(f"{what}: {who} lacks axes {missing}; it has {format_axes(x.axes)}")
    for who, t in (("mask", mask), ("bias", bias)):
        _check_scores_term(who, t, query, key, qpos, kpos)


def _with_one_query(fn, query, others, args: dict) -> NamedArray:
    """``fn`` for a query without a position axis: run with one of size 1, then drop it."""
    qpos = name_of(args["QPos"])
    if args.get("segment_ids") is not None:
        raise AxisError(
            "attention: segment_ids are per query position, but the "
            f"query {format_axes(query.axes)} has no {qpos!r} axis"
        )
    out = fn(query.broadcast_axis(Axis(qpos, 1)), *others, **args)
    return out[qpos, 0]


def _grouped(query, key, mask, bias, heads: str, kvheads: str):
    """Grouped-query attention: query head h uses kv head h // (heads / kv_heads). Splits heads
    into (kv_heads, group), kv-major (Hugging Face's repeat_kv order); mask and bias follow the
    query. Returns the query, mask, bias and the group axis (None when not grouped)."""
    if not (heads in query.names and kvheads in key.names and heads not in key.names):
        return query, mask, bias, None
    H, KV = query.resolve_axis(heads), key.resolve_axis(kvheads)
    if H.size % KV.size:
        raise AxisError(f"grouped-query attention: {H.size} query heads is not a multiple of {KV.size} kv heads")
    group = Axis(f"{heads}_per_{kvheads}", H.size // KV.size)

    def follow_query(m):
        return unflatten_axis(m, heads, (KV, group)) if m is not None and heads in m.names else m

    return unflatten_axis(query, heads, (KV, group)), follow_query(mask), follow_query(bias), group


def dot_product_attention_weights(
    query: NamedArray,
    key: NamedArray,
    *extra,
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
    window=None,
    softcap: float | None = None,
    q_offset=0,
) -> NamedArray:
    """The attention weights ``softmax(cap(q·k * scale) + bias, masked)`` over ``KPos`` that
    ``dot_product_attention`` (its XLA path) multiplies the values by, for inspection or a custom
    combination (Haliax's ``dot_product_attention_weights``). The arguments are those of
    ``dot_product_attention``; the result has the query's axes without ``HeadSize``, then
    ``KPos``, in the query's dtype (the scores and softmax are computed in float32)."""
    _check_order("dot_product_attention_weights", query, key, *extra)
    _expect_named_inputs(
        "dot_product_attention_weights", query=query, key=key, mask=mask, bias=bias, segment_ids=segment_ids
    )
    check_query_key("dot_product_attention_weights", QPos, KPos)
    _check_mask("dot_product_attention_weights", mask, bias)
    qpos, kpos, hs = name_of(QPos), name_of(KPos), name_of(HeadSize)
    args = dict(
        QPos=QPos,
        KPos=KPos,
        HeadSize=HeadSize,
        Heads=Heads,
        KVHeads=KVHeads,
        causal=causal,
        mask=mask,
        bias=bias,
        segment_ids=segment_ids,
        scale=scale,
        window=window,
        softcap=softcap,
        q_offset=q_offset,
    )
    if qpos not in query.names:
        return _with_one_query(dot_product_attention_weights, query, (key,), args)
    _check_axes("dot_product_attention_weights", query, key, None, qpos, kpos, hs, mask, bias)
    if window is not None and not causal:
        raise ArgumentError("dot_product_attention_weights: a sliding window needs causal=True")
    heads, kvheads = name_of(Heads), name_of(KVHeads)
    grouped_query, mask, bias, group = _grouped(query, key, mask, bias, heads, kvheads)
    m = _combined_mask(grouped_query, key, qpos, kpos, causal, mask, segment_ids, q_offset, window)
    weights = _weights(grouped_query, key, kpos, hs, m, bias, scale, softcap)
    if group is not None:
        weights = flatten_axes(weights, (kvheads, group.name), heads)
    order = tuple(n for n in query.names if n != hs) + (kpos,)
    return weights.rearrange(order).astype(query.dtype)


def _check_scores_term(what: str, t, query, key, qpos: str, kpos: str) -> None:
    """A mask or bias says, per query, something about each key: it must have the key axis
    (one over the query axis alone is the classic renaming slip, and would broadcast to a
    silently wrong answer), and no axis that neither query nor key has."""
    if t is None:
        return
    if kpos not in t.names:
        hint = (
            (
                f"; it has the query axis {qpos!r}: a per-token mask is over keys, build it with "
                f"nn.padding_mask(...) (or rename {qpos!r} to {kpos!r})"
            )
            if qpos in t.names
            else ""
        )
        raise AxisError(f"dot_product_attention: the {what} {format_axes(t.axes)} lacks the key axis {kpos!r}{hint}")
    extra = [a for a in t.axes if a.name not in query.names and a.name not in key.names]
    if extra:
        raise AxisError(f"dot_product_attention: {what} axes {format_axes(extra)} are in neither query nor key")


def _fused_unmet(mask, bias, segment_ids, softcap, window, q_offset) -> list[str]:
    """Why the fused kernel cannot take these arguments (besides the inputs: ``_cudnn_unmet``)."""
    why = [
        f"{what} is given"
        for what, x in (("mask", mask), ("bias", bias), ("segment_ids", segment_ids), ("softcap", softcap))
        if x is not None
    ]
    if window is not None and not isinstance(window, int):
        why.append("the window is traced (per-layer data), not an int")
    if not (isinstance(q_offset, int) and q_offset == 0):
        why.append("the queries continue a cache (q_offset)")
    return why


def _log_choice(chosen: str, implementation: str, why_not: list[str]) -> None:
    level = logging.INFO if jax.default_backend() == "gpu" else logging.DEBUG
    reason = f"implementation={implementation!r}" if implementation != "auto" or not why_not else "; ".join(why_not)
    _LOG.log(level, "dot_product_attention: %s path (%s)", chosen, reason)


def _combined_mask(query, key, qpos, kpos, causal, mask, segment_ids, q_offset=0, window=None):
    m = mask
    if causal:
        c = causal_mask(query.resolve_axis(qpos), key.resolve_axis(kpos), q_offset=q_offset, window=window)
        m = c if m is None else m & c
    if segment_ids is not None:
        s = segment_mask(segment_ids, rename(segment_ids, {qpos: kpos}))
        m = s if m is None else m & s
    return m


def _xla_attention(query, key, value, qpos, kpos, hs, m, bias, scale, softcap):
    weights = _weights(query, key, kpos, hs, m, bias, scale, softcap).astype(value.dtype)
    out = dot(weights, value, axis=kpos)
    return out.rearrange(
        tuple(n for n in query.names if n in out.names) + tuple(n for n in out.names if n not in query.names)
    )


def _weights(query, key, kpos, hs, m, bias, scale, softcap):
    """The float32 (float64 for float64 inputs) softmax over ``kpos`` of the scaled, capped, biased
    and masked scores, in dot_general's own output order (no transpose of the largest array)."""
    scale = 1.0 / math.sqrt(query.axis_size(hs)) if scale is None else scale
    acc = jnp.dtype(ops.wide(query.dtype, key.dtype))  # float32, or float64 for float64 inputs
    # Scores in dot_general's own output order (shared axes such as batch and heads, then the
    # query's, then the key's): any other order costs a transpose of the largest array here.
    shared = [n for n in query.names if n in key.names and n != hs]
    order = (
        shared
        + [n for n in query.names if n not in shared and n != hs]
        + [n for n in key.names if n not in shared and n != hs]
    )
    scores = einsum(
        f"{' '.join(query.names)}, {' '.join(key.names)} -> {' '.join(order)}",
        query,
        key,
        preferred_element_type=acc,
    )
    # Scale the float32 scores, not the query: q * scale in bf16 would round (as jax.nn does).
    scores = scores.astype(acc) * acc.type(scale)
    if softcap is not None:
        scores = ops.tanh(scores / acc.type(softcap)) * acc.type(softcap)
    if bias is not None:
        scores = scores + bias.astype(acc)
    if m is not None:
        # where() lays its result out in first-seen axis order: bring the (small) mask to the
        # scores' layout first, so that the big scores array is not transposed.
        scores = ops.where(broadcast_to(m, scores.axes), scores, jnp.finfo(acc).min)
    return ops.softmax(scores, kpos)


def fused_attention(query, key, value, qpos, kpos, hs, causal, mask, bias, scale, implementation, window=None):
    """``jax.nn.dot_product_attention`` on ``[B, T, N, D]`` arrays folded from the named ones:
    axes the query shares with the key (batch, kv heads) become B, query-only axes (heads, or
    the GQA group) become N against a single kv head. ``implementation="xla"`` runs the same
    layout code on any backend (that is how the tests check it on CPU)."""
    batch_axes = [n for n in query.names if n in key.names and n not in (hs, kpos)]
    q_only = [n for n in query.names if n not in key.names and n not in (qpos, hs)]
    extra = [n for n in list(key.names) + list(value.names) if n not in query.names and n not in (kpos, hs)]
    if extra:
        raise AxisError(f"dot_product_attention: key/value axes {extra} are not in the query {format_axes(query.axes)}")
    q = query.rearrange(tuple(batch_axes) + (qpos,) + tuple(q_only) + (hs,))
    k = key.rearrange(tuple(batch_axes) + (kpos, hs))
    v = value.rearrange(tuple(batch_axes) + (kpos, hs))
    B = math.prod(q.axis_size(n) for n in batch_axes)
    G = math.prod(q.axis_size(n) for n in q_only)
    T, S, D = q.axis_size(qpos), k.axis_size(kpos), q.axis_size(hs)

    def bnts(x):  # a mask or bias laid out [B or 1, N or 1, T, S]
        if x is None:
            return None
        b = batch_axes if any(n in x.names for n in batch_axes) else []
        g = q_only if any(n in x.names for n in q_only) else []
        target = tuple(q.resolve_axis(n) for n in b + g) + (q.resolve_axis(qpos), k.resolve_axis(kpos))
        arr = broadcast_to(x, target).array  # refuses axes that are not among these
        return arr.reshape(math.prod(q.axis_size(n) for n in b), math.prod(q.axis_size(n) for n in g), T, S)

    out = jax.nn.dot_product_attention(
        q.array.reshape(B, T, G, D),
        k.array.reshape(B, S, 1, D),
        v.array.reshape(B, S, 1, v.axis_size(hs)),
        bias=bnts(None if bias is None else bias.astype(query.dtype)),
        mask=bnts(mask),
        scale=scale,
        is_causal=causal,
        local_window_size=None if window is None else (window - 1, 0),
        implementation=implementation,
    )
    out_axes = (
        tuple(q.resolve_axis(n) for n in batch_axes)
        + (q.resolve_axis(qpos),)
        + tuple(q.resolve_axis(n) for n in q_only)
        + (v.resolve_axis(hs),)
    )
    res = NamedArray(out.reshape(tuple(a.size for a in out_axes)), out_axes)
    return res.rearrange(query.names)
