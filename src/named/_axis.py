"""Axes: a name and a size, and the helpers that resolve names against an array's axes."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable, Sequence
from typing import Union


class NamedError(Exception):
    """Base class of every error this library raises on purpose."""


class AxisError(NamedError, ValueError):
    """An axis name is unknown, repeated, or appears with two sizes."""


class ArgumentError(NamedError, ValueError):
    """An argument has a value the function does not accept (out of range, not understood)."""


class ArgumentTypeError(NamedError, TypeError):
    """An argument is of a kind the function does not take."""


@dataclasses.dataclass(frozen=True)
class Axis:
    """A named dimension: ``Axis("embed", 768)``. Static (hashable) pytree metadata."""

    name: str
    size: int

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise AxisError(f"an axis name must be a non-empty string, got {self.name!r}")
        if " " in self.name or "/" in self.name or self.name == "...":
            raise AxisError(f"axis name {self.name!r} may not contain spaces or '/', nor be '...'")
        size = self.size
        if not isinstance(size, int) or isinstance(size, bool):
            # numpy integers are welcome; floats, strings and bools are not (int() would truncate 2.5)
            if isinstance(size, bool) or not hasattr(size, "__index__"):
                raise AxisError(f"axis {self.name!r}: size must be an int, got {self.size!r}")
            size = operator.index(size)
            object.__setattr__(self, "size", size)
        if size < 0:
            raise AxisError(f"axis {self.name!r}: size must be >= 0, got {size}")

    def resize(self, size: int) -> Axis:
        return Axis(self.name, size)

    def alias(self, name: str) -> Axis:
        return Axis(name, self.size)

    def __repr__(self) -> str:
        return f"Axis({self.name!r}, {self.size})"


AxisSelector = Union[Axis, str]  # noqa: UP007 - a typing alias the public surface lists
"""An Axis, or just its name where the size is known from an array."""

AxisSelection = Union[AxisSelector, Sequence[AxisSelector]]  # noqa: UP007 - as AxisSelector
"""One axis selector or several; a space-separated string also names several axes."""


def name_of(axis: AxisSelector) -> str:
    if isinstance(axis, Axis):
        return axis.name
    if isinstance(axis, str):
        return axis
    raise AxisError(f"expected an Axis or an axis name, got {axis!r}")


def as_selectors(axes: AxisSelection | None) -> tuple[AxisSelector, ...]:
    """Normalise one selector, a sequence of them, or ``"a b c"`` to a tuple of selectors."""
    if axes is None:
        return ()
    if isinstance(axes, Axis):
        return (axes,)
    if isinstance(axes, str):
        return tuple(axes.split())
    if isinstance(axes, Iterable):
        out: list[AxisSelector] = []
        for a in axes:
            if isinstance(a, str) and " " in a.strip():
                out.extend(a.split())
            elif isinstance(a, (Axis, str)) or a is Ellipsis:
                out.append(a)
            else:
                raise AxisError(f"expected an Axis or an axis name, got {a!r}")
        return tuple(out)
    raise AxisError(f"expected an axis, a name or a sequence of them, got {axes!r}")


def axis_spec_to_tuple(axes: AxisSelection | None) -> tuple[AxisSelector, ...]:
    """One Axis (or name), a sequence of them, or ``"a b c"`` as a tuple: how to iterate a
    module's ``In``/``Out``, which keep the spelling they were given (Haliax's name)."""
    return as_selectors(axes)


def names_of(axes: AxisSelection | None) -> tuple[str, ...]:
    return tuple(name_of(a) for a in as_selectors(axes))


def format_axes(axes: Sequence[Axis]) -> str:
    """``(batch=4, embed=64)``: how every message in the library shows an array's axes."""
    return "(" + ", ".join(f"{a.name}={a.size}" for a in axes) + ")"


def check_unique(axes: Sequence[Axis], what: str = "array") -> None:
    seen: set[str] = set()
    for a in axes:
        if a.name in seen:
            raise AxisError(
                f"axis name {a.name!r} appears twice in {what} axes {format_axes(axes)}; "
                "names must be unique within an array (use rename to tell them apart)"
            )
        seen.add(a.name)


def index_of(axes: Sequence[Axis], axis: AxisSelector) -> int:
    """Position of ``axis`` in ``axes``; checks the size when an Axis is given."""
    name = name_of(axis)
    for i, a in enumerate(axes):
        if a.name == name:
            if isinstance(axis, Axis) and axis.size != a.size:
                raise AxisError(
                    f"axis {name!r} has size {a.size} in the array {format_axes(axes)} but {axis.size} was given"
                )
            return i
    raise AxisError(
        f"axis {name!r} not found in array with axes {format_axes(axes)}; "
        f"known names: {', '.join(a.name for a in axes) or '(none: a scalar)'}"
    )


def indices_of(axes: Sequence[Axis], selection: AxisSelection, what: str) -> tuple[int, ...]:
    """Positions of several selectors in ``axes`` (``index_of`` each), for an op over several axes
    at once (a reduction, a flatten, an n-dimensional transform): a name given twice is refused,
    naming it, where jax would raise its own positional error (or repeat the axis)."""
    sels = as_selectors(selection)
    names = [name_of(s) for s in sels]
    for i, name in enumerate(names):
        if names.index(name) != i:
            raise AxisError(
                f"{what}: axis {name!r} is given twice in {selection!r}; name each axis once "
                f"(the array has axes {format_axes(axes)})"
            )
    return tuple(index_of(axes, s) for s in sels)


def resolve(axes: Sequence[Axis], axis: AxisSelector) -> Axis:
    return axes[index_of(axes, axis)]


def union(*axes_lists: Sequence[Axis]) -> tuple[Axis, ...]:
    """The broadcasting rule: names in first-seen order, left to right; one size per name."""
    out: dict[str, Axis] = {}
    for axes in axes_lists:
        for a in axes:
            prev = out.get(a.name)
            if prev is None:
                out[a.name] = a
            elif prev.size != a.size:
                raise AxisError(
                    f"axis {a.name!r} has size {prev.size} in one operand and {a.size} in another "
                    f"(operands: {' vs '.join(format_axes(x) for x in axes_lists)})"
                )
    return tuple(out.values())


def broadcast_axes(*axes_lists: Sequence[Axis]) -> tuple[Axis, ...]:
    """The broadcasting rule of every n-ary elementwise op: the union of the operands' axes,
    ordered by the operand with the most axes (the leftmost one on a tie), then the names it
    lacks in first-seen order, left to right; one size per name.

    Broadcasting a small operand into a large one therefore never transposes the large one.
    """
    if not axes_lists:
        return ()
    base = max(range(len(axes_lists)), key=lambda i: (len(axes_lists[i]), -i))
    return union(axes_lists[base], *(a for i, a in enumerate(axes_lists) if i != base))


def without(axes: Sequence[Axis], remove: Iterable[AxisSelector]) -> tuple[Axis, ...]:
    drop = {name_of(r) for r in remove}
    return tuple(a for a in axes if a.name not in drop)
