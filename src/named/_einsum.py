"""Contractions by name: ``nm.dot`` and ``nm.einsum``.

einsum grammar: ``"in1, in2, ... -> out"``. Each side lists axis names separated by spaces.
- An input spec names the axes of its operand in any order (names, not positions). It may
  hold ``...``, standing for the operand's other axes; without ``...`` it must name them all.
- The output lists the result's axes in order; ``...`` there stands for every input axis that
  is neither listed nor contracted, in first-seen order. An input axis missing from the output
  is summed over (contracted). ``->`` is required: there is no implicit mode.
"""

from __future__ import annotations

import string

import jax.numpy as jnp

from ._axis import ArgumentTypeError, Axis, AxisError, AxisSelection, as_selectors, format_axes, name_of, union
from ._core import NamedArray


def _letters(names) -> dict[str, str]:
    pool = string.ascii_letters
    if len(names) > len(pool):
        raise AxisError(f"einsum over more than {len(pool)} distinct axes")
    return {n: pool[i] for i, n in enumerate(names)}


def _contract(arrays: tuple[NamedArray, ...], out_axes: tuple[Axis, ...], **kwargs) -> NamedArray:
    all_axes = union(*(a.axes for a in arrays))
    letters = _letters([a.name for a in all_axes])
    ins = ",".join("".join(letters[a.name] for a in x.axes) for x in arrays)
    out = "".join(letters[a.name] for a in out_axes)
    result = jnp.einsum(f"{ins}->{out}", *(x.array for x in arrays), **kwargs)
    return NamedArray._unchecked(result, out_axes)


def dot(*arrays: NamedArray, axis: AxisSelection | None, **kwargs) -> NamedArray:
    """Multiply ``arrays`` and sum over ``axis`` (one name, several, ``()`` for an outer product,
    or None for every axis). The result keeps all other axes in first-seen order.

    Keyword arguments (``precision``, ``preferred_element_type``) go to ``jnp.einsum``.
    """
    for x in arrays:
        if not isinstance(x, NamedArray):
            raise ArgumentTypeError(f"nm.dot takes NamedArrays, got {type(x).__name__}")
    all_axes = union(*(x.axes for x in arrays))
    if axis is None:
        contracted = {a.name for a in all_axes}
    else:
        contracted = {name_of(a) for a in as_selectors(axis)}
        for c in contracted:
            if not any(c in x.names for x in arrays):
                raise AxisError(f"nm.dot: axis {c!r} is in none of the operands {' , '.join(format_axes(x.axes) for x in arrays)}")
    out_axes = tuple(a for a in all_axes if a.name not in contracted)
    return _contract(arrays, out_axes, **kwargs)


def _parse_side(spec: str) -> list:
    toks = spec.split()
    return [Ellipsis if t == "..." else t for t in toks]


def einsum(equation: str, *arrays: NamedArray, **kwargs) -> NamedArray:
    """Named einsum: ``nm.einsum("batch seq embed, embed mlp -> batch seq mlp", x, w)``."""
    if "->" not in equation:
        raise AxisError(f"einsum {equation!r} needs '->' and an output spec (there is no implicit mode)")
    lhs, rhs = equation.split("->")
    in_specs = [_parse_side(s) for s in lhs.split(",")]
    if len(in_specs) != len(arrays):
        raise AxisError(f"einsum {equation!r} has {len(in_specs)} input specs but {len(arrays)} arrays were given")
    for k, (spec, x) in enumerate(zip(in_specs, arrays)):
        if not isinstance(x, NamedArray):
            raise ArgumentTypeError(f"einsum operand {k} is a {type(x).__name__}, not a NamedArray")
        names = [s for s in spec if s is not Ellipsis]
        if len(set(names)) != len(names):
            raise AxisError(f"einsum operand {k}: spec {' '.join(map(str, names))!r} repeats a name")
        missing = [n for n in names if n not in x.names]
        if missing:
            raise AxisError(f"einsum operand {k}: axes {missing} are not in its axes {format_axes(x.axes)}")
        if Ellipsis not in spec and set(names) != set(x.names):
            extra = [n for n in x.names if n not in names]
            raise AxisError(f"einsum operand {k} has axes {extra} that its spec does not list (add them or '...')")
    all_axes = union(*(x.axes for x in arrays))
    by_name = {a.name: a for a in all_axes}
    out_spec = _parse_side(rhs)
    listed = [s for s in out_spec if s is not Ellipsis]
    if len(set(listed)) != len(listed):
        raise AxisError(f"einsum output {rhs.strip()!r} repeats a name")
    unknown = [n for n in listed if n not in by_name]
    if unknown:
        raise AxisError(f"einsum output names {unknown} are in no operand (operand axes: {format_axes(all_axes)})")
    # Axes named in some input spec but not in the output are contracted; axes covered only by
    # an input's '...' pass through to the output's '...'.
    explicit = {s for spec in in_specs for s in spec if s is not Ellipsis}
    out_names: list[str] = []
    for s in out_spec:
        if s is Ellipsis:
            out_names.extend(a.name for a in all_axes if a.name not in listed and a.name not in explicit)
        else:
            out_names.append(s)
    if Ellipsis not in out_spec:
        dropped = [a.name for a in all_axes if a.name not in explicit and a.name not in listed]
        if dropped:
            raise AxisError(f"einsum: axes {dropped} come in through '...' but the output has no '...' for them")
    return _contract(arrays, tuple(by_name[n] for n in out_names), **kwargs)
