"""Indexing by name: ``x["batch", 0:4]``, ``x["seq", i]``, gathers with NamedArray indices,
``x.at[...]`` functional updates, and dynamic slices.

Index kinds, per axis:
- an int (or a traced 0-d integer, or a 0-d NamedArray such as an argmax): the axis is dropped;
- a static slice: the axis keeps its name with the new size;
- ``nm.ds(start, size)``: a slice of static size at a (possibly traced) start; a start that is
  a NamedArray over other axes of the array (``batch``) gives each row its own window;
- a NamedArray of integers: a gather. The indexed axis is replaced by the index's axes.
  Index axes that the array also has (and that are not themselves indexed) are matched
  element by element, like ``take_along_axis``: ``logits["vocab", targets]`` with
  ``targets[batch, position]`` gives ``[batch, position]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._axis import Axis, AxisError, broadcast_axes, check_unique, format_axes, index_of, name_of, union
from ._core import NamedArray, axes_of, expect_named, raw, unchecked
from ._transforms import vmap


def as_offset(value, what: str = "offset"):
    """An offset as lax takes it (an int or a 0-d integer array, possibly traced); a 0-d
    NamedArray, which is what ``argmax`` and ``sum`` return, is unwrapped. Roll shifts,
    ``nm.ds`` starts and ``updated_slice`` offsets all go through here."""
    if isinstance(value, NamedArray):
        if value.ndim:
            raise AxisError(f"{what} must be a single integer, got a NamedArray with axes {format_axes(value.axes)}")
        value = value.array
    integer = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
    if not integer and not (
        hasattr(value, "dtype") and np.ndim(value) == 0 and jnp.issubdtype(value.dtype, jnp.integer)
    ):
        raise AxisError(f"{what} must be an integer (an int, or a 0-d integer array or NamedArray), got {value!r}")
    return value


def concrete(value) -> np.ndarray | None:
    """The value when it is known before tracing (so it can be checked), else None."""
    try:
        return np.asarray(value.array if isinstance(value, NamedArray) else value)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def first_flagged(flags: np.ndarray, axes) -> tuple[tuple[int, ...], str]:
    """The index of the first True entry of ``flags`` (laid out as ``axes``) and how a message
    names it: ``batch=1, position=0``."""
    where = tuple(int(i) for i in np.argwhere(flags)[0])
    return where, ", ".join(f"{a.name}={i}" for a, i in zip(axes, where))


@dataclasses.dataclass(frozen=True)
class ds:
    """A dynamic slice: ``size`` (static) elements from ``start`` (may be traced).

    A negative start counts from the end. A start known before tracing must place the whole
    window inside the axis (``[-size_of_axis, size_of_axis - size]``), or ``x[ds]`` and
    ``x.at[ds]`` raise an AxisError, as ``updated_slice`` does. A traced start cannot be
    checked: as in ``lax.dynamic_slice`` the window is then clamped to lie inside the axis, and
    ``x[ds]`` and ``x.at[ds]`` place it the same way. ``start`` may be a NamedArray over other
    axes of the indexed array (``batch``): each row then gets its own window, as a gather (or a
    scatter under ``x.at``)."""

    start: Any
    size: int


def _parse(x: NamedArray, idx) -> dict[int, Any]:
    if isinstance(idx, Mapping):
        items = list(idx.items())
    elif isinstance(idx, tuple) and len(idx) % 2 == 0 and all(isinstance(k, (str, Axis)) for k in idx[::2]):
        items = list(zip(idx[::2], idx[1::2]))
    elif isinstance(idx, (str, Axis)):
        raise AxisError(
            f"x[{name_of(idx)!r}] needs an index after the name: x[{name_of(idx)!r}, 0] or x[{name_of(idx)!r}, 2:5]"
        )
    else:
        raise AxisError(
            f"index NamedArrays by name: x['batch', 0:4] or x[{{'batch': 0}}], got {idx!r}; array axes "
            f"{format_axes(x.axes)}"
        )
    out: dict[int, Any] = {}
    for name, value in items:
        i = index_of(x.axes, name)
        if i in out:
            raise AxisError(f"axis {x.axes[i].name!r} is indexed twice (array axes {format_axes(x.axes)})")
        out[i] = value
    return out


def _kind(value) -> str:
    if isinstance(value, NamedArray):
        if jnp.issubdtype(value.dtype, jnp.bool_):
            raise AxisError("boolean NamedArray masks give data-dependent shapes; use nm.where(mask, x, fill) instead")
        if not jnp.issubdtype(value.dtype, jnp.integer):
            raise AxisError(
                f"an index NamedArray must hold integers, got dtype {value.dtype} {format_axes(value.axes)}"
            )
        return "int" if value.ndim == 0 else "gather"
    if isinstance(value, slice):
        return "slice"
    if isinstance(value, ds):
        return "ds"
    if isinstance(value, (bool, np.bool_)):  # numpy reads a bool as a mask, jax as 0 or 1: say which is meant
        raise AxisError(f"unsupported index {value!r}: a bool is not an index; use 0 or 1, or nm.where for a mask")
    if isinstance(value, (int, np.integer)) or (
        hasattr(value, "shape") and np.ndim(value) == 0 and jnp.issubdtype(value.dtype, jnp.integer)
    ):
        return "int"
    raise AxisError(f"unsupported index {value!r}: use an int, a slice, nm.ds(start, size) or an integer NamedArray")


def _check_gather(a: Axis, index: NamedArray) -> None:
    """Indices known before tracing follow numpy, as an int index does: each lies in ``[-size, size)``
    (a negative one counts from the end); XLA's gather would clamp them without a word. Traced
    indices cannot be checked and are clamped as any XLA gather clamps them (docs/named_arrays.md).
    A zero-size axis has no entry to gather, traced or not."""
    if a.size == 0 and index.size:
        raise AxisError(
            f"a gather of {format_axes(index.axes)} indices from axis {a.name!r} of size 0: it has no entry"
        )
    known = concrete(index)
    if known is None:
        return
    off = (known < -a.size) | (known >= a.size)
    if off.any():
        where, at = first_flagged(off, index.axes)
        raise AxisError(
            f"index {int(known[where])} at ({at}) is out of range for axis {a.name!r} of size {a.size}; "
            f"an index lies in [{-a.size}, {a.size - 1}] (a negative one counts from the end, as in numpy); "
            f"{int(off.sum())} index(es) out of range in all"
        )


def check_window(what: str, a: Axis, start, size: int, effect: str) -> None:
    """One rule for every window with a static start (``nm.ds`` in ``x[...]`` and ``x.at[...]``,
    ``updated_slice``): a start known before tracing (an int, a concrete array, per-row starts
    included) must place its ``size`` entries inside ``a``, a negative one counting from the
    end. lax would clamp it instead, and ``effect``. A traced start cannot be checked: lax
    places it (negative from the end, then clamped into the axis)."""
    known = concrete(start)
    if known is None or not known.size:
        return
    at = np.where(known < 0, known + a.size, known)
    off = (at < 0) | (at > a.size - size)
    if off.any():
        raise AxisError(
            f"{what} of size {size} at offset {int(known.flat[np.argmax(off)])} does not fit in axis "
            f"{a.name!r} of size {a.size}; offsets must lie in [{-a.size}, {a.size - size}] (lax would "
            f"clamp it and {effect})"
        )


def check_rows(what: str, rows: NamedArray, x: NamedArray) -> None:
    """Per-row values (offsets, starts: one per row of ``batch``) are over axes ``x`` has, at the
    sizes it has them; said in the caller's words rather than as a vmap or broadcast over axes
    the caller never mapped."""
    for r in rows.axes:
        if r.name in x.names and x.axis_size(r.name) != r.size:
            raise AxisError(
                f"{what} are over {r.name}={r.size} but the array has {r.name}={x.axis_size(r.name)} "
                f"{format_axes(x.axes)}; per-row values need one entry for each row of {r.name!r}"
            )


def _check_ds(a: Axis, v: ds, writes: bool = False) -> None:
    if not 0 <= v.size <= a.size:
        raise AxisError(f"nm.ds(start, {v.size}) does not fit in axis {a.name!r} of size {a.size}")
    effect = "overwrite entries that were not addressed" if writes else "read a window that was not asked for"
    check_window("nm.ds: a window", a, v.start, v.size, effect)


def _check_int(a: Axis, value) -> None:
    """A static integer index must be in range, as numpy requires (a negative one counts from the
    end); JAX would clamp it (a read) or drop it (a write) without a word. A traced index keeps
    JAX's behaviour."""
    known = concrete(value)
    if known is not None and not -a.size <= int(known) < a.size:
        raise AxisError(
            f"index {int(known)} is out of range for axis {a.name!r} of size {a.size}; an index lies in "
            f"[{-a.size}, {a.size - 1}] (a negative one counts from the end, as in numpy)"
        )


def _int(value):
    return value.array if isinstance(value, NamedArray) else value


def _per_row(v: ds) -> bool:
    return isinstance(v.start, NamedArray) and v.start.ndim > 0


def _window(a: Axis, v: ds) -> NamedArray:
    """The indices ``x[a, v]`` reads, as a gather index over the start's axes + the window."""
    if _per_row(v):
        if not jnp.issubdtype(v.start.dtype, jnp.integer):
            raise AxisError(f"nm.ds start for axis {a.name!r} must be integer, got dtype {v.start.dtype}")
        start, start_axes = v.start.array, v.start.axes
    else:
        start, start_axes = jnp.asarray(as_offset(v.start, f"nm.ds start for axis {a.name!r}")), ()
    # Place the window the way lax.dynamic_slice does (a negative start counts from the end,
    # then the window is clamped into the axis), so x[ds] and x.at[ds] agree.
    start = jnp.clip(jnp.where(start < 0, start + a.size, start), 0, a.size - v.size)
    return NamedArray(start[..., None] + jnp.arange(v.size), start_axes + (Axis(a.name, v.size),))


@dataclasses.dataclass
class _Plan:
    """Indexing rewritten as: transpose by ``perm``, then index with ``positional``; the
    result has ``pre_axes`` and is then transposed by ``post_perm`` into ``out_axes``."""

    perm: tuple[int, ...]
    positional: tuple
    pre_axes: tuple[Axis, ...]
    post_perm: tuple[int, ...]
    out_axes: tuple[Axis, ...]


def _plan(x: NamedArray, idx, writes: bool = False) -> _Plan:
    parsed = _parse(x, idx)
    kinds = {i: _kind(v) for i, v in parsed.items()}
    gathers: dict[int, NamedArray] = {}
    for i, v in parsed.items():
        if kinds[i] == "gather":
            _check_gather(x.axes[i], v)
            gathers[i] = v
        elif kinds[i] == "ds":
            _check_ds(x.axes[i], v, writes)
            if _per_row(v):
                check_rows(f"the nm.ds starts for axis {x.axes[i].name!r}", v.start, x)
            gathers[i] = _window(x.axes[i], v)
        elif kinds[i] == "int":
            _check_int(x.axes[i], v)
    if not gathers:
        positional = tuple(_int(parsed[i]) if i in parsed else slice(None) for i in range(x.ndim))
        out_axes = []
        for i, a in enumerate(x.axes):
            if i not in parsed:
                out_axes.append(a)
            elif kinds[i] == "slice":
                out_axes.append(Axis(a.name, len(range(*parsed[i].indices(a.size)))))
        ident = tuple(range(x.ndim))
        return _Plan(ident, positional, tuple(out_axes), tuple(range(len(out_axes))), tuple(out_axes))

    idx_axes = broadcast_axes(*(g.axes for g in gathers.values()))
    # Index axes the array also has, and which nothing indexes, are matched pointwise.
    shared = [
        index_of(x.axes, a.name) for a in idx_axes if a.name in x.names and index_of(x.axes, a.name) not in parsed
    ]
    for i in shared:
        union(idx_axes, (x.axes[i],))
        gathers[i] = NamedArray(jnp.arange(x.axes[i].size), (x.axes[i],))
    front = list(gathers)
    rest = [i for i in range(x.ndim) if i not in gathers]
    perm = tuple(front + rest)
    positional = [jnp.broadcast_to(raw(gathers[i], idx_axes), tuple(a.size for a in idx_axes)) for i in front]
    kept: list[Axis] = []
    for i in rest:
        a = x.axes[i]
        if i not in parsed:
            positional.append(slice(None))
            kept.append(a)
        elif kinds[i] == "slice":
            positional.append(parsed[i])
            kept.append(Axis(a.name, len(range(*parsed[i].indices(a.size)))))
        else:
            positional.append(_int(parsed[i]))
    pre_axes = tuple(idx_axes) + tuple(kept)
    check_unique(pre_axes, "the indexed")
    # Put the gathered axes where the first indexed axis was.
    first = min(front)
    n_before = sum(1 for i in rest if i < first and kinds.get(i) != "int")
    k = len(idx_axes)
    post = list(range(k, k + n_before)) + list(range(k)) + list(range(k + n_before, len(pre_axes)))
    return _Plan(perm, tuple(positional), pre_axes, tuple(post), tuple(pre_axes[j] for j in post))


def _transpose(arr, perm):
    return arr if tuple(perm) == tuple(range(len(perm))) else jnp.transpose(arr, perm)


def _has_ds_only(x: NamedArray, idx) -> bool:
    try:
        parsed = _parse(x, idx)
    except AxisError:
        return False
    return any(isinstance(v, ds) for v in parsed.values()) and all(
        (isinstance(v, ds) and not _per_row(v)) or (not isinstance(v, ds) and _kind(v) in ("int", "slice"))
        for v in parsed.values()
    )


def getitem(x: NamedArray, idx) -> NamedArray:
    if _has_ds_only(x, idx):
        parsed = _parse(x, idx)
        arr, axes = x.array, list(x.axes)
        rest = {}
        for i, v in parsed.items():
            if isinstance(v, ds):
                _check_ds(axes[i], v)
                start = as_offset(v.start, f"nm.ds start for axis {axes[i].name!r}")
                arr = lax.dynamic_slice_in_dim(arr, start, v.size, axis=i)
                axes[i] = Axis(axes[i].name, v.size)
            else:
                rest[axes[i].name] = v
        y = unchecked(arr, tuple(axes))
        return getitem(y, rest) if rest else y
    plan = _plan(x, idx)
    out = _transpose(x.array, plan.perm)[plan.positional]
    return unchecked(_transpose(out, plan.post_perm), plan.out_axes)


def take(x: NamedArray, axis, index) -> NamedArray:
    """``x[axis, index]``: the entries at ``index`` (an int or an integer NamedArray) along ``axis``."""
    expect_named(x, "nm.take")
    return getitem(x, {axis: index})


class AtIndexer:
    """``x.at[idx].set(v)`` etc.: functional updates with the same index grammar as ``x[idx]``."""

    def __init__(self, x: NamedArray):
        self._x = x

    def __getitem__(self, idx) -> _AtRef:
        return _AtRef(self._x, idx)


class _AtRef:
    def __init__(self, x: NamedArray, idx):
        self._x, self._idx = x, idx

    def get(self) -> NamedArray:
        return getitem(self._x, self._idx)

    def _update(self, method: str, values, **kwargs) -> NamedArray:
        x = self._x
        plan = _plan(x, self._idx, writes=True)
        axes_of(values)  # refuses a positional array with dimensions: wrap it with nm.named
        if isinstance(values, NamedArray):
            extra = [a for a in values.axes if a.name not in {b.name for b in plan.pre_axes}]
            if extra:
                raise AxisError(
                    f"update values have axes {format_axes(extra)} that the indexed region "
                    f"{format_axes(plan.out_axes)} lacks"
                )
            union(plan.pre_axes, values.axes)
            v = jnp.broadcast_to(raw(values, plan.pre_axes), tuple(a.size for a in plan.pre_axes))
        else:
            v = values
        xt = _transpose(jnp.asarray(x.array), plan.perm)  # x may wrap a numpy array, which has no .at
        out = getattr(xt.at[plan.positional], method)(v, **kwargs)
        inverse = tuple(int(i) for i in np.argsort(plan.perm))
        return unchecked(_transpose(out, inverse), x.axes)

    def set(self, values, **kw):
        return self._update("set", values, **kw)

    def add(self, values, **kw):
        return self._update("add", values, **kw)

    def multiply(self, values, **kw):
        return self._update("multiply", values, **kw)

    def min(self, values, **kw):
        return self._update("min", values, **kw)

    def max(self, values, **kw):
        return self._update("max", values, **kw)


def updated_slice(x: NamedArray, start: Mapping, update: NamedArray) -> NamedArray:
    """Write ``update`` into ``x`` at ``start`` (``{axis: offset}``): the KV-cache write, one
    ``dynamic_update_slice``. ``update`` has (some of) x's axes, smaller sizes allowed. An axis
    the update lacks follows ``x.at[...]``: with an offset, the update goes to that one entry
    (like ``x.at[axis, offset]``; the decode step that writes one token); without one, the
    update is broadcast by name over the whole axis (like an axis ``x.at`` does not index).

    An offset is an int, a 0-d integer array or a 0-d NamedArray, possibly traced; or a
    NamedArray over other axes of ``x`` (e.g. ``batch``), one offset per row: the ragged
    write of a batch of sequences that each stand at their own position.

    A static (known before tracing) offset whose window does not fit raises an AxisError. A
    traced one cannot be checked and is placed as ``lax.dynamic_update_slice`` places it: a
    negative offset counts from the end, then the window is clamped into the axis, so a write
    that would run past the end lands earlier instead.
    """
    expect_named(x, "updated_slice", "the array")
    expect_named(update, "updated_slice", "the update")
    missing = [a for a in update.names if a not in x.names]
    if missing:
        raise AxisError(f"updated_slice: update axes {missing} are not in the array {format_axes(x.axes)}")
    given = {x.axes[index_of(x.axes, sel)].name for sel in start}
    up_axes = tuple(
        Axis(a.name, update.axis_size(a.name)) if a.name in update.names else Axis(a.name, 1) if a.name in given else a
        for a in x.axes
    )
    for a, b in zip(up_axes, x.axes):
        if a.size > b.size:
            raise AxisError(f"updated_slice: update axis {a.name!r} has size {a.size} > {b.size}")
        if a.size != b.size and a.name not in given:  # as x.at[...].set: an axis not indexed is written whole
            raise AxisError(
                f"updated_slice: the update has {a.name}={a.size} but the array has {b.name}={b.size}, and "
                f"no offset for {a.name!r}: give one ({{{a.name!r}: 0}} writes the first {a.size}) or an "
                "update over the whole axis"
            )
    offsets: dict[str, Any] = {}
    for sel, s in start.items():
        i = index_of(x.axes, sel)
        a, n = x.axes[i], up_axes[i].size
        if a.name in offsets:
            raise AxisError(f"updated_slice: axis {a.name!r} is given two offsets")
        if not (isinstance(s, NamedArray) and s.ndim):
            s = as_offset(s, f"updated_slice offset for axis {a.name!r}")
        elif not jnp.issubdtype(s.dtype, jnp.integer):
            raise AxisError(f"updated_slice: offsets for axis {a.name!r} must be integer, got dtype {s.dtype}")
        check_window("updated_slice: an update", a, s, n, "overwrite entries that were not addressed")
        offsets[a.name] = s
    for name, s in offsets.items():
        if isinstance(s, NamedArray) and s.ndim:
            check_rows(f"updated_slice: the offsets for axis {name!r}", s, x)
    rows = union(*(s.axes for s in offsets.values() if isinstance(s, NamedArray) and s.ndim))
    if rows:
        bad = [r.name for r in rows if r.name not in x.names or r.name in offsets]
        if bad:
            raise AxisError(
                f"updated_slice: per-row offsets have axes {bad} that are not other axes of the array "
                f"{format_axes(x.axes)}"
            )
        for r in rows:
            if r.name in update.names and update.axis_size(r.name) != x.axis_size(r.name):
                raise AxisError(
                    f"updated_slice: the update has {r.name}={update.axis_size(r.name)} but the array has "
                    f"{r.name}={x.axis_size(r.name)}; with offsets per row of {r.name!r} the update has "
                    "every row, or no such axis (then each row gets the same update)"
                )
        # One dynamic_update_slice per row; under vmap XLA emits a single scatter that clamps
        # each row's window exactly as the unbatched write does.
        out = vmap(updated_slice, tuple(x.resolve_axis(r.name) for r in rows))(x, offsets, update)
        return out.rearrange(x.names)
    upd = jnp.broadcast_to(raw(update, up_axes), tuple(a.size for a in up_axes)).astype(x.dtype)
    starts = [jnp.asarray(_int(offsets.get(a.name, 0)), dtype=jnp.int32) for a in x.axes]
    return unchecked(lax.dynamic_update_slice(x.array, upd, starts), x.axes)
