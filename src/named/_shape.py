"""Shape ops by name: rename, rearrange, flatten/unflatten, split/stack/concat, broadcast,
masks, roll, pad, top_k; and array creation."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _index  # roll's shift is an offset: _index.as_offset
from ._axis import (
    ArgumentError,
    ArgumentTypeError,
    Axis,
    AxisError,
    AxisSelection,
    AxisSelector,
    as_selectors,
    check_unique,
    format_axes,
    index_of,
    indices_of,
    name_of,
    resolve,
    union,
)
from ._core import NamedArray, axes_of, expect_named, unchecked

# ---- creation ----------------------------------------------------------------------


def axes_for_creation(axes: AxisSelection) -> tuple[Axis, ...]:
    out = as_selectors(axes)
    for a in out:
        if not isinstance(a, Axis):
            raise AxisError(f"creating an array needs Axis objects with sizes, got the bare name {a!r}")
    check_unique(out, "the requested")
    return out  # type: ignore[return-value]


def zeros(axes: AxisSelection, dtype=None) -> NamedArray:
    ax = axes_for_creation(axes)
    return NamedArray(jnp.zeros(tuple(a.size for a in ax), dtype), ax)


def ones(axes: AxisSelection, dtype=None) -> NamedArray:
    ax = axes_for_creation(axes)
    return NamedArray(jnp.ones(tuple(a.size for a in ax), dtype), ax)


def _fill(value, what: str):
    """A fill value is one value: a number, a 0-d array or a 0-d NamedArray. One with dimensions
    would broadcast by position (or by name, to axes the caller did not ask for)."""
    if isinstance(value, NamedArray):
        if value.ndim:
            raise ArgumentTypeError(
                f"{what}: fill_value has axes {format_axes(value.axes)}; give one value, or nm.broadcast_to the array"
            )
        return value.array
    if jnp.ndim(value):
        raise ArgumentTypeError(
            f"{what}: fill_value has shape {jnp.shape(value)}; give one value, or wrap the array "
            "with nm.named and nm.broadcast_to it"
        )
    return value


def full(axes: AxisSelection, fill_value, dtype=None) -> NamedArray:
    ax = axes_for_creation(axes)
    return NamedArray(jnp.full(tuple(a.size for a in ax), _fill(fill_value, "nm.full"), dtype), ax)


def zeros_like(x: NamedArray, dtype=None) -> NamedArray:
    expect_named(x, "nm.zeros_like")
    return NamedArray(jnp.zeros_like(x.array, dtype), x.axes)


def ones_like(x: NamedArray, dtype=None) -> NamedArray:
    expect_named(x, "nm.ones_like")
    return NamedArray(jnp.ones_like(x.array, dtype), x.axes)


def full_like(x: NamedArray, fill_value, dtype=None) -> NamedArray:
    expect_named(x, "nm.full_like")
    return NamedArray(jnp.full_like(x.array, _fill(fill_value, "nm.full_like"), dtype), x.axes)


def arange(axis: AxisSelection, *, start=0, step=1, dtype=None) -> NamedArray:
    """``start, start + step, ...`` along ``axis`` (axis.size values). Several axes (Haliax's
    ``arange((X, Y))``) count row-major over them: the arange of the product of their sizes,
    reshaped. ``start`` may be traced."""
    if isinstance(axis, str) or (not isinstance(axis, Axis) and not as_selectors(axis)):
        raise AxisError(f"arange needs an Axis with a size, got {axis!r} (or several Axes, counted row-major)")
    ax = axes_for_creation(axis)
    n = math.prod(a.size for a in ax)
    return NamedArray((start + jnp.arange(n, dtype=dtype) * step).reshape(tuple(a.size for a in ax)), ax)


def _spaced(fn, axis, start, stop, what: str, **kwargs) -> NamedArray:
    if isinstance(axis, str):
        axis = Axis(axis, 50)  # numpy's default number of samples, as Haliax does for a bare name
    if not isinstance(axis, Axis):
        raise AxisError(f"{what} needs an Axis (or a name, for numpy's 50 samples), got {axis!r}")
    return NamedArray(fn(start, stop, axis.size, **kwargs), (axis,))


def linspace(axis: AxisSelector, *, start, stop, endpoint: bool = True, dtype=None) -> NamedArray:
    """``axis.size`` evenly spaced values from ``start`` to ``stop`` (``jnp.linspace``) along ``axis``."""
    return _spaced(jnp.linspace, axis, start, stop, "nm.linspace", endpoint=endpoint, dtype=dtype)


def logspace(axis: AxisSelector, *, start, stop, endpoint: bool = True, base: float = 10.0, dtype=None) -> NamedArray:
    """``base ** linspace(start, stop)`` along ``axis`` (``jnp.logspace``)."""
    return _spaced(jnp.logspace, axis, start, stop, "nm.logspace", endpoint=endpoint, base=base, dtype=dtype)


def geomspace(axis: AxisSelector, *, start, stop, endpoint: bool = True, dtype=None) -> NamedArray:
    """A geometric progression from ``start`` to ``stop`` along ``axis`` (``jnp.geomspace``)."""
    for end in (start, stop):  # numpy refuses 0 too; jnp gives NaN
        known = _index.concrete(end)
        if known is not None and (known == 0).any():
            raise ArgumentError(f"nm.geomspace from {start!r} to {stop!r}: a geometric sequence cannot include 0")
    return _spaced(jnp.geomspace, axis, start, stop, "nm.geomspace", endpoint=endpoint, dtype=dtype)


# ---- renaming and reordering ---------------------------------------------------------


def rename(x: NamedArray, mapping: Mapping[AxisSelector, AxisSelector]) -> NamedArray:
    """Rename axes: ``x.rename({"position": "key_position"})``. Sizes are kept."""
    expect_named(x, "nm.rename")
    new = list(x.axes)
    for old, nw in mapping.items():
        i = index_of(x.axes, old)
        if isinstance(nw, Axis) and nw.size != x.axes[i].size:
            raise AxisError(f"rename: axis {x.axes[i].name!r} has size {x.axes[i].size}, the new {nw!r} has another")
        new[i] = Axis(name_of(nw), x.axes[i].size)
    check_unique(new, "the renamed")
    return unchecked(x.array, tuple(new))


def order_of(axes: tuple[Axis, ...], order, what: str = "rearrange") -> tuple[int, ...]:
    """The permutation of ``axes`` that ``order`` asks for: names, and ``...`` for the rest in
    their order. Several ``...`` (Haliax's partial order, ``(..., "embed", ...)``) each take
    the unlisted axes that follow, in ``axes``, the listed ones before them."""
    sels = as_selectors(order)
    named_idx = [index_of(axes, s) for s in sels if s is not Ellipsis]
    if len(set(named_idx)) != len(named_idx):
        twice = sorted({axes[i].name for i in named_idx if named_idx.count(i) > 1})
        raise AxisError(f"{what}: axis {', '.join(map(repr, twice))} is listed twice in {order!r}")
    if Ellipsis not in sels:
        if len(named_idx) != len(axes):
            missing = [a.name for i, a in enumerate(axes) if i not in named_idx]
            raise AxisError(
                f"{what}: {order!r} leaves out axes {missing} of {format_axes(axes)}; list them or use '...'"
            )
        return tuple(named_idx)
    if sels.count(Ellipsis) == 1:
        rest = [i for i in range(len(axes)) if i not in named_idx]
        k = sels.index(Ellipsis)
        return tuple(named_idx[:k] + rest + named_idx[k:])
    return _partial_order(sels, named_idx, len(axes))


def _partial_order(sels, named_idx: list[int], n: int) -> tuple[int, ...]:
    """Several ``...``: the listed axes keep their listed order; an unlisted axis goes to the
    first ``...`` after every listed axis that comes before it in the array (or stays in the
    current one when no ``...`` follows), so the array's own order is kept where it can be."""
    slots: list[list[int]] = []
    where: dict[int, int] = {}  # a listed axis -> its slot
    it = iter(named_idx)
    for s in sels:
        slots.append([] if s is Ellipsis else [next(it)])
        if s is not Ellipsis:
            where[slots[-1][0]] = len(slots) - 1
    free = [k for k, s in enumerate(sels) if s is Ellipsis]
    target = free[0]
    for i in range(n):
        if i in where:
            later = [k for k in free if k > where[i] and k >= target]
            target = later[0] if later else target
        else:
            slots[target].append(i)
    return tuple(i for slot in slots for i in slot)


def rearrange(x: NamedArray, order: AxisSelection, **sizes) -> NamedArray:
    """Transpose to ``order`` (names; ``...`` stands for the other axes in their order), or
    split, merge and transpose by an einops-style pattern with ``->``.

    ``x.rearrange(("batch", ..., "embed"))``, ``x.rearrange("batch ... embed")``,
    ``nm.rearrange(x, "(embed: heads head_size) ... -> ... heads head_size", heads=4)``
    (the pattern grammar is in ``named._rearrange``).
    """
    expect_named(x, "nm.rearrange")
    if isinstance(order, str) and "->" in order:
        from ._rearrange import rearrange_pattern

        return rearrange_pattern(x, order, sizes)
    if sizes:
        raise ArgumentError(
            f"rearrange: sizes {sorted(sizes)} are for a pattern with '->'; {order!r} is an order of names"
        )
    if isinstance(order, str):
        order = tuple(Ellipsis if t == "..." else t for t in order.split())
    perm = order_of(x.axes, order)
    if perm == tuple(range(x.ndim)):
        return x
    return unchecked(jnp.transpose(x.array, perm), tuple(x.axes[i] for i in perm))


def flatten_axes(x: NamedArray, axes: AxisSelection, new_axis: AxisSelector) -> NamedArray:
    """Merge ``axes`` (in the given order) into one axis placed where the first of them was."""
    expect_named(x, "nm.flatten_axes")
    sels = as_selectors(axes)
    if not sels:
        raise AxisError("flatten_axes needs at least one axis")
    idx = list(indices_of(x.axes, sels, "flatten_axes"))
    first = min(idx)
    rest = [i for i in range(x.ndim) if i not in idx]
    before = [i for i in rest if i < first]
    after = [i for i in rest if i > first]
    perm = before + idx + after
    arr = jnp.transpose(x.array, perm) if perm != list(range(x.ndim)) else x.array
    size = int(np.prod([x.axes[i].size for i in idx]))
    if isinstance(new_axis, Axis) and new_axis.size != size:
        raise AxisError(f"flatten_axes: {new_axis!r} does not match the product {size} of {[x.axes[i] for i in idx]}")
    new = Axis(name_of(new_axis), size)
    out_axes = tuple(x.axes[i] for i in before) + (new,) + tuple(x.axes[i] for i in after)
    check_unique(out_axes, "the flattened")
    return unchecked(arr.reshape(tuple(a.size for a in out_axes)), out_axes)


def unflatten_axis(x: NamedArray, axis: AxisSelector, new_axes: Sequence[Axis]) -> NamedArray:
    """Split one axis into ``new_axes`` (row-major), in its place."""
    expect_named(x, "nm.unflatten_axis")
    i = index_of(x.axes, axis)
    new_axes = tuple(new_axes)
    for a in new_axes:
        if not isinstance(a, Axis):
            raise AxisError(f"unflatten_axis needs Axis objects with sizes, got {a!r}")
    if int(np.prod([a.size for a in new_axes])) != x.axes[i].size:
        raise AxisError(
            f"unflatten_axis: {format_axes(new_axes)} do not multiply to the size {x.axes[i].size} of "
            f"{x.axes[i].name!r}"
        )
    out_axes = x.axes[:i] + new_axes + x.axes[i + 1 :]
    check_unique(out_axes, "the unflattened")
    return unchecked(x.array.reshape(tuple(a.size for a in out_axes)), out_axes)


def split(x: NamedArray, axis: AxisSelector, new_axes: Sequence[Axis]) -> list[NamedArray]:
    """Split along ``axis`` into pieces with the given axes (their sizes must sum to the axis')."""
    expect_named(x, "nm.split")
    i = index_of(x.axes, axis)
    new_axes = tuple(new_axes)
    for a in new_axes:
        if not isinstance(a, Axis):
            raise AxisError(f"split needs Axis objects with sizes for the pieces, got {a!r}")
        check_unique(x.axes[:i] + (a,) + x.axes[i + 1 :], "a split piece's")
    sizes = [a.size for a in new_axes]
    if sum(sizes) != x.axes[i].size:
        raise AxisError(f"split: sizes {sizes} do not sum to the size {x.axes[i].size} of {x.axes[i].name!r}")
    cuts = np.cumsum(sizes)[:-1].tolist()
    parts = jnp.split(x.array, cuts, axis=i)
    return [unchecked(p, x.axes[:i] + (a,) + x.axes[i + 1 :]) for p, a in zip(parts, new_axes)]


def unbind(x: NamedArray, axis: AxisSelector) -> list[NamedArray]:
    """The slices of ``x`` along ``axis``, each without that axis."""
    expect_named(x, "nm.unbind")
    i = index_of(x.axes, axis)
    rest = x.axes[:i] + x.axes[i + 1 :]
    # One split, not n takes: jnp.take with an int is a gather plus an out-of-bounds select
    # (a scatter-add in the gradient), and n static slices have n pads in the gradient; the
    # gradient of a split is one concatenate.
    parts = lax.split(x.array, (1,) * x.axes[i].size, axis=i)
    return [unchecked(lax.squeeze(p, (i,)), rest) for p in parts]


def stack(axis: AxisSelector, arrays: Sequence[NamedArray]) -> NamedArray:
    """Stack arrays with equal axes (any order) along a new leading axis ``axis``."""
    if not arrays:
        raise AxisError("stack needs at least one array")
    for a in arrays:
        expect_named(a, "nm.stack")
    first = arrays[0]
    name = name_of(axis)
    if name in first.names:
        raise AxisError(f"stack: the new axis {name!r} already exists in {format_axes(first.axes)}")
    parts = []
    for a in arrays:
        if set(a.names) != set(first.names):
            raise AxisError(f"stack: arrays have different axes {format_axes(first.axes)} and {format_axes(a.axes)}")
        union(first.axes, a.axes)
        parts.append(rearrange(a, first.names).array)
    new = Axis(name, len(arrays))
    if isinstance(axis, Axis) and axis.size != new.size:
        raise AxisError(f"stack: {axis!r} but {len(arrays)} arrays were given")
    return unchecked(jnp.stack(parts, axis=0), (new,) + first.axes)


def concatenate(axis: AxisSelector, arrays: Sequence[NamedArray]) -> NamedArray:
    """Concatenate along the existing axis ``axis``; other axes must agree by name."""
    if not arrays:
        raise AxisError("concatenate needs at least one array")
    for a in arrays:
        expect_named(a, "nm.concatenate")
    name = name_of(axis)
    first = arrays[0]
    i = index_of(first.axes, name)
    others = first.axes[:i] + first.axes[i + 1 :]
    parts = []
    total = 0
    for a in arrays:
        j = index_of(a.axes, name)
        rest = a.axes[:j] + a.axes[j + 1 :]
        if set(b.name for b in rest) != set(b.name for b in others):
            raise AxisError(
                f"concatenate along {name!r}: arrays have different other axes {format_axes(others)} and "
                f"{format_axes(rest)}"
            )
        union(others, rest)
        total += a.axes[j].size
        parts.append(rearrange(a, first.names).array)
    out_axes = first.axes[:i] + (Axis(name, total),) + first.axes[i + 1 :]
    return unchecked(jnp.concatenate(parts, axis=i), out_axes)


def broadcast_axis(x: NamedArray, axes: AxisSelection) -> NamedArray:
    """Add new axes (Axis objects) in front of ``x``'s; axes it already has are size-checked."""
    expect_named(x, "nm.broadcast_axis")
    sels = as_selectors(axes)
    new = []
    for a in sels:
        if not isinstance(a, Axis):
            raise AxisError(f"broadcast_axis needs Axis objects with sizes, got {a!r}")
        if a.name in x.names:
            union(x.axes, (a,))
        else:
            new.append(a)
    if not new:
        return x
    out_axes = tuple(new) + x.axes
    arr = jnp.broadcast_to(x.array, tuple(a.size for a in out_axes))
    return unchecked(arr, out_axes)


def broadcast_to(
    x, axes: AxisSelection, *, ensure_order: bool = True, enforce_no_extra_axes: bool = True
) -> NamedArray:
    """Broadcast to exactly ``axes`` (in that order); x's axes must be among them.

    ``enforce_no_extra_axes=False`` (Haliax's) keeps x's axes that ``axes`` lacks, after them.
    ``ensure_order=False`` (Haliax's) puts the new axes in front and leaves x's in its order."""
    if not (enforce_no_extra_axes and ensure_order):
        target = as_selectors(axes)
        x_axes = x.axes if isinstance(x, NamedArray) else ()
        extra = tuple(a for a in x_axes if a.name not in {name_of(t) for t in target})
        full = broadcast_to(x, target if enforce_no_extra_axes else target + extra)  # extra axes refused, or kept
        if ensure_order:
            return full
        kept = [a.name for a in x_axes]
        return full.rearrange(tuple(n for n in full.names if n not in kept) + tuple(kept))
    if not isinstance(x, NamedArray) and jnp.ndim(x):  # a number or a 0-d array broadcasts anywhere
        expect_named(x, "nm.broadcast_to")
    target = as_selectors(axes)
    x_axes = axes_of(x)
    resolved = []
    for a in target:
        if isinstance(a, Axis):
            resolved.append(a)
        else:
            resolved.append(resolve(x_axes, a))
    out_axes = tuple(resolved)
    check_unique(out_axes, "the target")
    missing = [a for a in x_axes if a.name not in {b.name for b in out_axes}]
    if missing:
        raise AxisError(
            f"broadcast_to: the array's axes {format_axes(missing)} are not in the target {format_axes(out_axes)}"
        )
    union(out_axes, x_axes)
    from ._core import raw

    arr = jnp.broadcast_to(raw(x, out_axes), tuple(a.size for a in out_axes))
    return unchecked(arr, out_axes)


# ---- masks, roll, pad, top_k, one_hot ------------------------------------------------


def _triangle(fn, x: NamedArray, axis1: AxisSelector, axis2: AxisSelector, k: int) -> NamedArray:
    expect_named(x, f"nm.{fn.__name__}")
    i, j = index_of(x.axes, axis1), index_of(x.axes, axis2)
    moved = jnp.moveaxis(x.array, (i, j), (-2, -1))
    out = jnp.moveaxis(fn(moved, k), (-2, -1), (i, j))
    return unchecked(out, x.axes)


def tril(x: NamedArray, axis1: AxisSelector, axis2: AxisSelector, k: int = 0) -> NamedArray:
    """Zero the entries with ``index(axis2) > index(axis1) + k`` (the lower triangle stays)."""
    return _triangle(jnp.tril, x, axis1, axis2, k)


def triu(x: NamedArray, axis1: AxisSelector, axis2: AxisSelector, k: int = 0) -> NamedArray:
    """Zero the entries with ``index(axis2) < index(axis1) + k``."""
    return _triangle(jnp.triu, x, axis1, axis2, k)


def roll(x: NamedArray, shift, axis: AxisSelection) -> NamedArray:
    expect_named(x, "nm.roll")
    sels = as_selectors(axis)
    dims = tuple(index_of(x.axes, s) for s in sels)
    shifts = shift if isinstance(shift, (tuple, list)) else (shift,) * len(dims)
    shifts = tuple(_index.as_offset(s, "roll shift") for s in shifts)  # a 0-d NamedArray (an argmax) too
    return unchecked(jnp.roll(x.array, shifts, axis=dims), x.axes)


def pad(
    x: NamedArray, pad_width: Mapping[AxisSelector, tuple[int, int]], *, mode: str = "constant", constant_values=0
) -> NamedArray:
    """Pad named axes: ``nm.pad(x, {"position": (0, 3)})``; the axes keep their names."""
    expect_named(x, "nm.pad")
    widths = [(0, 0)] * x.ndim
    for a, (lo, hi) in pad_width.items():
        i = index_of(x.axes, a)
        for w in (lo, hi):
            if isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < 0:
                raise ArgumentError(
                    f"nm.pad: the widths for axis {x.axes[i].name!r} must "
                    f"be ints >= 0 (as numpy's), got ({lo!r}, {hi!r})"
                )
        widths[i] = (int(lo), int(hi))
    kwargs = {"constant_values": constant_values} if mode == "constant" else {}
    arr = jnp.pad(x.array, widths, mode=mode, **kwargs)
    out_axes = tuple(Axis(a.name, a.size + lo + hi) for a, (lo, hi) in zip(x.axes, widths))
    return unchecked(arr, out_axes)


def top_k(
    x: NamedArray, axis: AxisSelector, k: int, new_axis: AxisSelector | None = None
) -> tuple[NamedArray, NamedArray]:
    """The ``k`` largest values along ``axis`` and their indices; the axis becomes ``new_axis``
    (same name by default) of size k."""
    expect_named(x, "nm.top_k")
    i = index_of(x.axes, axis)
    if not 0 <= k <= x.axes[i].size:
        raise AxisError(f"top_k: k={k} is not within [0, {x.axes[i].size}], the size of {x.axes[i].name!r}")
    moved = jnp.moveaxis(x.array, i, -1)
    vals, idx = lax.top_k(moved, k)
    new = Axis(name_of(new_axis) if new_axis is not None else x.axes[i].name, k)
    out_axes = x.axes[:i] + (new,) + x.axes[i + 1 :]
    check_unique(out_axes, "the top_k")
    return (
        unchecked(jnp.moveaxis(vals, -1, i), out_axes),
        unchecked(jnp.moveaxis(idx, -1, i), out_axes),
    )


def one_hot(index, axis: Axis, *, dtype=jnp.float32) -> NamedArray:
    """One-hot encode integer ``index`` (a NamedArray or an int) along a new trailing ``axis``."""
    if not isinstance(axis, Axis):
        raise AxisError(f"one_hot needs an Axis with a size, got {axis!r}")
    idx_axes = index.axes if isinstance(index, NamedArray) else ()
    if axis.name in {a.name for a in idx_axes}:
        raise AxisError(f"one_hot: the new axis {axis.name!r} already exists in {format_axes(idx_axes)}")
    raw = index.array if isinstance(index, NamedArray) else jnp.asarray(index)
    if raw.ndim != len(idx_axes):
        expect_named(index, "nm.one_hot")
    if not jnp.issubdtype(raw.dtype, jnp.integer):
        raise ArgumentTypeError(f"nm.one_hot takes integer indices, got dtype {raw.dtype}")
    known = _index.concrete(raw)
    if known is not None:  # a traced index outside [0, n) gives a row of zeros, as jax.nn.one_hot does
        off = (known < 0) | (known >= axis.size)
        if off.any():
            where, at = _index.first_flagged(off, idx_axes)
            raise ArgumentError(
                f"nm.one_hot: index {int(known[where])} at ({at}) is outside [0, {axis.size}) (axis {axis.name!r})"
            )
    return unchecked(jax.nn.one_hot(raw, axis.size, dtype=dtype), idx_axes + (axis,))
