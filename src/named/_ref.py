"""NamedRef: a mutable ``jax.Ref`` addressed by name (Haliax's ``hax.new_ref``).

A ref holds an array that a traced function may read and write in place
(``ref[{"layer": i}] = block``), which is how a scan fills a cache without carrying it. A view
(``ref.slice({"layer": slice(1, 4)})``) is the same ref with a selection staged per axis; reads,
writes and further views compose with it. Indices are those of NamedArray's basic indexing: an
int (possibly traced), a static slice, or ``nm.ds(start, size)`` with a possibly traced start.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._axis import ArgumentError, ArgumentTypeError, Axis, AxisError, AxisSelector, format_axes, index_of
from ._core import NamedArray
from ._index import check_window, ds
from ._shape import broadcast_to

# A staged selection of one base axis: None (all of it), ("int", i) (the axis is gone), or
# ("ds", start, size, stride). Tuples, so that a static view hashes as pytree metadata.
_ALL = None


def _length(start: int, stop: int, step: int) -> int:
    return max(0, (stop - start + (step - (1 if step > 0 else -1))) // step)


def _static_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _index_value(value, what: str):
    """An int index (an int, a 0-d integer array, a 0-d NamedArray), possibly traced."""
    if isinstance(value, NamedArray):
        if value.ndim:
            raise ArgumentError(
                f"{what}: a NamedRef takes ints, slices and nm.ds; a gather by a NamedArray over "
                f"{format_axes(value.axes)} is not supported (read the value, then index it)"
            )
        value = value.array
    if _static_int(value) or (
        hasattr(value, "dtype") and np.ndim(value) == 0 and jnp.issubdtype(value.dtype, jnp.integer)
    ):
        return value
    raise AxisError(f"{what}: unsupported index {value!r}; a NamedRef takes ints, static slices and nm.ds(start, size)")


def _compose(current, new, axis: Axis, what: str):
    """The base-axis selection of indexing ``current`` (the view's selection of a base axis whose
    view has ``axis``) with ``new``."""
    if current is not _ALL and current[0] == "int":
        raise AxisError(f"{what}: axis {axis.name!r} is already fixed by this view")
    start0, _, stride0 = (0, axis.size, 1) if current is _ALL else current[1:]
    if isinstance(new, slice):
        start, stop, step = new.indices(axis.size)
        return ("ds", start0 + start * stride0, _length(start, stop, step), stride0 * step)
    if isinstance(new, ds):
        if not 0 <= new.size <= axis.size:
            raise AxisError(f"{what}: nm.ds(start, {new.size}) does not fit in axis {axis.name!r} of size {axis.size}")
        start = _index_value(new.start, what)
        check_window(f"{what}: a window", axis, start, new.size, "address entries that were not asked for")
        if _static_int(start) and start < 0:  # in range: counts from the end, as x[ds] does
            start += axis.size
        return ("ds", start0 + start * stride0, new.size, stride0)
    i = _index_value(new, what)
    if _static_int(i):
        if not -axis.size <= i < axis.size:
            raise AxisError(f"{what}: index {i} is out of range for axis {axis.name!r} of size {axis.size}")
        i = i % axis.size
    return ("int", start0 + i * stride0)


def _view_axes(base: tuple[Axis, ...], selection: tuple) -> tuple[Axis, ...]:
    return tuple(a if s is _ALL else a.resize(s[2]) for a, s in zip(base, selection) if s is _ALL or s[0] == "ds")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NamedRef:
    """A ``jax.Ref`` with axis names: ``ref[{"x": 1}]`` reads a NamedArray, ``ref[{"x": 1}] = v``
    writes one, ``ref.slice({...})`` stages a view. Its only pytree leaf is the ``jax.Ref``."""

    ref: jax.Ref
    base_axes: tuple[Axis, ...] = dataclasses.field(metadata=dict(static=True))
    selection: tuple = dataclasses.field(metadata=dict(static=True))

    @property
    def axes(self) -> tuple[Axis, ...]:
        """The axes this view shows (the base's, less those an int fixed, resized by slices)."""
        return _view_axes(self.base_axes, self.selection)

    @property
    def shape(self) -> dict[str, int]:
        return {a.name: a.size for a in self.axes}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.axes)

    @property
    def ndim(self) -> int:
        return len(self.axes)

    @property
    def dtype(self):
        return self.ref.dtype

    def resolve_axis(self, axis: AxisSelector) -> Axis:
        return self.axes[index_of(self.axes, axis)]

    def _staged(self, idx, what: str) -> tuple:
        """The base selection after indexing this view with ``idx`` (a mapping or name, value pairs)."""
        if idx is Ellipsis or idx is None:
            return self.selection
        if isinstance(idx, Mapping):
            items = list(idx.items())
        elif isinstance(idx, tuple) and len(idx) % 2 == 0 and all(isinstance(k, (str, Axis)) for k in idx[::2]):
            items = list(zip(idx[::2], idx[1::2]))
        else:
            raise ArgumentError(f"{what}: index a NamedRef by name, ref[{{'x': 0}}] or ref['x', 0:2], got {idx!r}")
        view = self.axes
        # the base position of each view axis
        positions = [i for i, s in enumerate(self.selection) if s is _ALL or s[0] == "ds"]
        out = list(self.selection)
        seen: set[str] = set()
        for key, value in items:
            k = index_of(view, key)
            if view[k].name in seen:
                raise AxisError(f"{what}: axis {view[k].name!r} is indexed twice")
            seen.add(view[k].name)
            b = positions[k]
            out[b] = _compose(self.selection[b], value, view[k], what)
        return tuple(out)

    def _raw_index(self, selection: tuple) -> tuple:
        from jax.experimental.pallas import dslice  # a strided window of a ref, possibly at a traced start

        return tuple(
            slice(None) if s is _ALL else s[1] if s[0] == "int" else dslice(s[1], s[2], s[3]) for s in selection
        )

    def __getitem__(self, idx=Ellipsis) -> NamedArray:
        selection = self._staged(idx, "NamedRef read")
        return NamedArray(self.ref[self._raw_index(selection)], _view_axes(self.base_axes, selection))

    def __setitem__(self, idx, value) -> None:
        selection = self._staged(idx, "NamedRef write")
        self.ref[self._raw_index(selection)] = _payload(value, _view_axes(self.base_axes, selection), self.dtype)

    def value(self) -> NamedArray:
        """What this view holds now, as a NamedArray."""
        return self[...]

    def slice(self, selector: Mapping[AxisSelector, Any]) -> NamedRef:
        """A view of the same ref with ``selector`` staged for later reads, writes and views."""
        return dataclasses.replace(self, selection=self._staged(selector, "NamedRef.slice"))

    def unsliced(self) -> NamedRef:
        """The whole ref, without this view's selection."""
        return dataclasses.replace(self, selection=(_ALL,) * len(self.base_axes))

    def __repr__(self) -> str:
        return f"NamedRef({self.dtype}[{' '.join(f'{a.name}={a.size}' for a in self.axes)}])"


def _payload(value, axes: tuple[Axis, ...], dtype):
    """A value to write into a view with ``axes``: a NamedArray broadcast to them by name (its
    axes in the view's order), or a number."""
    if isinstance(value, NamedArray):
        extra = [a for a in value.axes if a.name not in {b.name for b in axes}]
        if extra:
            raise AxisError(
                f"NamedRef write: the value has axes {format_axes(extra)} that the target {format_axes(axes)} lacks"
            )
        return broadcast_to(value, axes).array.astype(dtype)
    if hasattr(value, "shape") and np.ndim(value):
        raise ArgumentTypeError(
            f"NamedRef write: a positional array of shape {tuple(np.shape(value))}; wrap it with "
            f"nm.named so that its dimensions have names (target {format_axes(axes)})"
        )
    return jnp.broadcast_to(jnp.asarray(value, dtype), tuple(a.size for a in axes))


def new_ref(value: NamedArray) -> NamedRef:
    """A new mutable ref holding ``value`` (Haliax's ``hax.new_ref``)."""
    if not isinstance(value, NamedArray):
        raise ArgumentTypeError(f"nm.new_ref takes a NamedArray, got {type(value).__name__}")
    return NamedRef(jax.new_ref(value.array), value.axes, (_ALL,) * value.ndim)


def _expect_ref(ref, what: str) -> NamedRef:
    if not isinstance(ref, NamedRef):
        raise ArgumentTypeError(f"{what} takes a NamedRef (nm.new_ref(x)), got {type(ref).__name__}")
    return ref


def freeze(ref: NamedRef) -> NamedArray:
    """The ref's current contents (this view's), as a NamedArray."""
    return _expect_ref(ref, "nm.freeze").value()


def get(ref: NamedRef, idx=Ellipsis) -> NamedArray:
    """``ref[idx]``, as a function."""
    return _expect_ref(ref, "nm.get")[idx]


def swap(ref: NamedRef, idx, value) -> NamedArray:
    """Write ``value`` at ``idx`` and return what was there."""
    selection = _expect_ref(ref, "nm.swap")._staged(idx, "nm.swap")
    axes = _view_axes(ref.base_axes, selection)
    old = jax.ref.swap(ref.ref, ref._raw_index(selection), _payload(value, axes, ref.dtype))
    return NamedArray(old, axes)


__all__ = ["NamedRef", "new_ref", "freeze", "get", "swap"]
