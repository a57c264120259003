"""Haliax's axis-spec helpers. An axis spec is an Axis or a name, a sequence of them (``"a b"``
too), or a ``{name: size}`` dict whose size may be None (unknown). Each helper returns the kind of
spec it was given: a dict for a dict, else a tuple (of Axes, and names where no size is known).
A name two specs both size must have one size in both; a mistake is an AxisError, which is also
the ValueError Haliax raises."""

from __future__ import annotations

from collections.abc import Mapping

from ._axis import Axis, AxisError, as_selectors, name_of

__all__ = [
    "axis_spec_to_shape_dict",
    "concat_axes",
    "concat_axis_specs",
    "eliminate_axes",
    "replace_axis",
    "without_axes",
]

ShapeDict = dict[str, "int | None"]


def axis_spec_to_shape_dict(spec) -> ShapeDict:
    """``{name: size}`` of an axis spec, in its order; a bare name has size None."""
    if isinstance(spec, Mapping):
        for n, s in spec.items():
            if not isinstance(n, str) or not (s is None or (isinstance(s, int) and not isinstance(s, bool) and s >= 0)):
                raise AxisError(f"an axis spec dict maps names to sizes (or None), got {n!r}: {s!r}")
        return dict(spec)
    out: ShapeDict = {}
    for a in as_selectors(spec):
        if a is Ellipsis:
            raise AxisError(f"an axis spec names axes; ... is not one (in {spec!r})")
        n = name_of(a)
        if n in out:
            raise AxisError(f"the axis spec {spec!r} names {n!r} twice")
        out[n] = a.size if isinstance(a, Axis) else None
    return out


def _like(spec, d: ShapeDict):
    return dict(d) if isinstance(spec, Mapping) else tuple(n if s is None else Axis(n, s) for n, s in d.items())


def _same_size(what: str, name: str, a, b) -> None:
    if a is not None and b is not None and a != b:
        raise AxisError(f"{what}: axis {name!r} has size {a} in one spec and {b} in the other")


def concat_axes(a1, a2):
    """``a1`` then ``a2``; a name in both is an AxisError (the specs overlap)."""
    d1, d2 = axis_spec_to_shape_dict(a1), axis_spec_to_shape_dict(a2)
    both = [n for n in d2 if n in d1]
    if both:
        raise AxisError(f"concat_axes: the specs overlap: {', '.join(map(repr, both))} in both {a1!r} and {a2!r}")
    return _like(a1, {**d1, **d2})


concat_axis_specs = concat_axes  # Haliax's second name for it


def eliminate_axes(spec, to_remove):
    """``spec`` without the axes of ``to_remove``, each of which it must have (at the same size)."""
    d = axis_spec_to_shape_dict(spec)
    for n, s in axis_spec_to_shape_dict(to_remove).items():
        if n not in d:
            raise AxisError(f"eliminate_axes: axis {n!r} is not in the spec {spec!r}")
        _same_size("eliminate_axes", n, d[n], s)
        del d[n]
    return _like(spec, d)


def without_axes(spec, to_remove, allow_mismatched_sizes: bool = False):
    """``spec`` without those axes of ``to_remove`` it has; a name at another size is an AxisError
    unless ``allow_mismatched_sizes``."""
    d = axis_spec_to_shape_dict(spec)
    for n, s in axis_spec_to_shape_dict(to_remove).items():
        if n in d:
            if not allow_mismatched_sizes:
                _same_size("without_axes", n, d[n], s)
            del d[n]
    return _like(spec, d)


def replace_axis(spec, old, new):
    """``spec`` with the axis ``old`` (which it must have) replaced, in place, by the axes of ``new``;
    a new name that another axis of ``spec`` already has is an AxisError."""
    d, replacement = axis_spec_to_shape_dict(spec), axis_spec_to_shape_dict(new)
    name = name_of(old)
    if name not in d:
        raise AxisError(f"replace_axis: axis {name!r} is not in the spec {spec!r}")
    _same_size("replace_axis", name, d[name], old.size if isinstance(old, Axis) else None)
    clash = [n for n in replacement if n in d and n != name]
    if clash:
        raise AxisError(f"replace_axis: {', '.join(map(repr, clash))} is already in the spec {spec!r}")
    out: ShapeDict = {}
    for n, s in d.items():
        out.update(replacement if n == name else {n: s})
    return _like(spec, out)
