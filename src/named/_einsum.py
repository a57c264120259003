"""Contractions by name: ``nm.dot`` and ``nm.einsum``.

einsum grammar: ``"in1, in2, ... -> out"``. Each side lists axis names separated by spaces.
- An input spec names the axes of its operand in any order (names, not positions). It may
  hold ``...``, standing for the operand's other axes; without ``...`` it must name them all.
  A spec written in one-letter names (``"h w d"``) looks like Haliax's positional form: one
  that names an axis where the operand has another is refused, since Haliax would read it
  otherwise (list them in the operand's order, or use the braces form below).
- The output lists the result's axes in order; ``...`` there stands for every input axis that
  is neither listed nor contracted, in first-seen order. An input axis missing from the output
  is summed over (contracted). ``->`` is required: there is no implicit mode.
- One shared spec in braces, ``"{embed heads} -> ..."``, names axes of any operand: a named
  axis missing from the output is contracted, the others go to the output's ``...``. With
  ``...`` in the braces, or a left side of only ``...`` or nothing (``"-> batch out"``), every
  axis the output does not keep is contracted.
"""

from __future__ import annotations

import re
import string

import jax.numpy as jnp

from ._axis import ArgumentTypeError, Axis, AxisError, AxisSelection, as_selectors, format_axes, name_of, union
from ._context import current_body
from ._core import NamedArray, expect_named, unchecked
from ._rearrange import refuse_positional_misreading

# What jnp.einsum takes besides the equation and operands; anything else is a caller's typo.
_EINSUM_OPTIONS = ("precision", "preferred_element_type", "optimize")


def _letters(names) -> dict[str, str]:
    pool = string.ascii_letters
    if len(names) > len(pool):
        raise AxisError(f"einsum over more than {len(pool)} distinct axes")
    return {n: pool[i] for i, n in enumerate(names)}


def _options(what: str, kwargs: dict, takes: str) -> dict:
    unknown = sorted(k for k in kwargs if k not in _EINSUM_OPTIONS)
    if unknown:
        raise ArgumentTypeError(
            f"{what} got unexpected keyword arguments {unknown}; it takes {takes}"
            f"{', '.join(o + '=' for o in _EINSUM_OPTIONS)}"
        )
    return kwargs


def _contract(
    arrays: tuple[NamedArray, ...], out_axes: tuple[Axis, ...], options: dict, settle: bool = True
) -> NamedArray:
    all_axes = union(*(a.axes for a in arrays))
    letters = _letters([a.name for a in all_axes])
    ins = ",".join("".join(letters[a.name] for a in x.axes) for x in arrays)
    out = "".join(letters[a.name] for a in out_axes)

    def contract(*raw):
        return jnp.einsum(f"{ins}->{out}", *raw, **options)

    body = current_body()
    if body is None:
        result = contract(*(x.array for x in arrays))
    else:  # local blocks (nm.shard_map): explicit mode owes the sums over split axes, and pays them
        result = body.contract(contract, arrays, out_axes, settle)
    return unchecked(result, out_axes)


def dot(*arrays: NamedArray, axis: AxisSelection | None, out_axes: AxisSelection | None = None, **kwargs) -> NamedArray:
    """Multiply ``arrays`` and sum over ``axis`` (one name, several, ``()`` for an outer product,
    or None for every axis). The result keeps all other axes in first-seen order, or in the
    order of ``out_axes`` (names of the kept axes; ``...`` for the ones it does not list).

    Keyword arguments (``precision``, ``preferred_element_type``) go to ``jnp.einsum``.
    """
    options = _options("nm.dot", kwargs, "axis=, out_axes=, ")
    for x in arrays:
        expect_named(x, "nm.dot")
    all_axes = union(*(x.axes for x in arrays))
    if axis is None:
        contracted = {a.name for a in all_axes}
    else:
        contracted = {name_of(a) for a in as_selectors(axis)}
        for c in contracted:
            if not any(c in x.names for x in arrays):
                raise AxisError(
                    f"nm.dot: axis {c!r} is in none of the operands {' , '.join(format_axes(x.axes) for x in arrays)}"
                )
    kept = tuple(a for a in all_axes if a.name not in contracted)
    if out_axes is not None:
        from ._shape import order_of

        for a in as_selectors(out_axes):
            if a is not Ellipsis and name_of(a) in contracted:
                raise AxisError(f"nm.dot: out_axes names {name_of(a)!r}, which axis= contracts")
        kept = tuple(kept[i] for i in order_of(kept, out_axes, "nm.dot out_axes"))
    return _contract(arrays, kept, options)


def _parse_side(spec: str) -> list:
    toks = spec.split()
    return [Ellipsis if t == "..." else t for t in toks]


def _shared_spec(lhs: str) -> list | None:
    """The one spec of the braces form (``{a b ...}``, ``...`` or nothing), else None."""
    s = lhs.strip()
    if s in ("", "..."):
        return [Ellipsis]
    if s.startswith("{") and s.endswith("}") and "," not in s:
        return _parse_side(s[1:-1])
    return None


def einsum(equation: str, *arrays: NamedArray, **kwargs) -> NamedArray:
    """Named einsum: ``nm.einsum("batch seq embed, embed mlp -> batch seq mlp", x, w)``.

    Keyword arguments other than jnp.einsum's options are axis aliases (Haliax's): a name used
    in the equation stands for an axis, ``nm.einsum("{x y} -> y", a, b, x=H, y="width")``, so
    generic code can be written once. An alias given as an Axis has its size checked; every
    alias must be used.

    Inside ``nm.shard_map``, contracting an axis that is split over mesh axes sums the local
    results over them (``psum``), so the result is the one the same call gives outside;
    ``nm.einsum_unreduced`` leaves that sum owed instead."""
    aliases = {k: v for k, v in kwargs.items() if k not in _EINSUM_OPTIONS}
    if aliases:
        equation = _dealias(equation, aliases, arrays)
        kwargs = {k: v for k, v in kwargs.items() if k in _EINSUM_OPTIONS}
    return local_einsum(equation, *arrays, settle=True, **kwargs)


_TOKEN = re.compile(r"(\s+|,|->|[{}()])")


def _dealias(equation: str, aliases: dict, arrays) -> str:
    """``equation`` with each alias token replaced by its axis' name (sizes of Axis aliases checked)."""
    for key, target in aliases.items():
        if not isinstance(target, (Axis, str)):
            raise ArgumentTypeError(
                f"nm.einsum got {key}={target!r}; a keyword is an einsum option "
                f"({', '.join(_EINSUM_OPTIONS)}) or an axis alias (an Axis or a name)"
            )
        if isinstance(target, Axis):
            for k, x in enumerate(arrays):
                if isinstance(x, NamedArray) and target.name in x.names and x.axis_size(target.name) != target.size:
                    raise AxisError(
                        f"nm.einsum alias {key}={target!r}: operand {k} has {target.name!r} of size "
                        f"{x.axis_size(target.name)}"
                    )
    parts = _TOKEN.split(equation)
    used = {p for p in parts if p in aliases}
    unused = sorted(set(aliases) - used)
    if unused:
        raise ArgumentTypeError(
            f"nm.einsum got unexpected keyword arguments {unused}: not einsum options "
            f"({', '.join(o + '=' for o in _EINSUM_OPTIONS)}), and as axis aliases they do not "
            f"occur in {equation!r}"
        )
    return "".join(name_of(aliases[p]) if p in aliases else p for p in parts)


def local_einsum(equation: str, *arrays: NamedArray, settle: bool, **kwargs) -> NamedArray:
    options = _options("nm.einsum", kwargs, "")
    if "->" not in equation:
        raise AxisError(f"einsum {equation!r} needs '->' and an output spec (there is no implicit mode)")
    lhs, rhs = equation.split("->", 1)
    for k, x in enumerate(arrays):
        if not isinstance(x, NamedArray):
            raise ArgumentTypeError(f"einsum operand {k} is a {type(x).__name__}, not a NamedArray")
    if any(c in equation for c in "{}()"):
        if _shared_spec(lhs) is None or any(c in rhs for c in "{}()"):
            raise AxisError(
                f"einsum {equation!r}: braces enclose the whole left side ({{a b}} -> ...); einsum has no groups"
            )
    shared = _shared_spec(lhs)
    all_axes = union(*(x.axes for x in arrays))
    by_name = {a.name: a for a in all_axes}
    if shared is not None:
        names = [s for s in shared if s is not Ellipsis]
        if len(set(names)) != len(names):
            raise AxisError(f"einsum {lhs.strip()!r} repeats a name")
        missing = [n for n in names if n not in by_name]
        if missing:
            raise AxisError(f"einsum: axes {missing} are in no operand (operand axes: {format_axes(all_axes)})")
        explicit, rest_contracted = set(names), Ellipsis in shared
    else:
        in_specs = [_parse_side(s) for s in lhs.split(",")]
        if len(in_specs) != len(arrays):
            raise AxisError(f"einsum {equation!r} has {len(in_specs)} input specs but {len(arrays)} arrays were given")
        for k, (spec, x) in enumerate(zip(in_specs, arrays)):
            names = [s for s in spec if s is not Ellipsis]
            if len(set(names)) != len(names):
                raise AxisError(f"einsum operand {k}: spec {' '.join(map(str, names))!r} repeats a name")
            missing = [n for n in names if n not in x.names]
            if missing:
                raise AxisError(
                    f"einsum operand {k}: axes {missing} are not in its axes {format_axes(x.axes)} (a spec "
                    "names axes, never positions)"
                )
            if Ellipsis not in spec and set(names) != set(x.names):
                extra = [n for n in x.names if n not in names]
                raise AxisError(f"einsum operand {k} has axes {extra} that its spec does not list (add them or '...')")
            refuse_positional_misreading(
                f"einsum operand {k}",
                " ".join("..." if t is Ellipsis else t for t in spec),
                spec,
                x.axes,
                [None if t is Ellipsis else t for t in spec],
                braces=False,
            )
        # Axes named in some input spec but not in the output are contracted; axes covered only
        # by an input's '...' pass through to the output's '...'.
        explicit, rest_contracted = {s for spec in in_specs for s in spec if s is not Ellipsis}, False
    out_spec = _parse_side(rhs)
    if out_spec.count(Ellipsis) > 1:
        raise AxisError(f"einsum output {rhs.strip()!r} has more than one '...'")
    listed = [s for s in out_spec if s is not Ellipsis]
    if len(set(listed)) != len(listed):
        raise AxisError(f"einsum output {rhs.strip()!r} repeats a name")
    unknown = [n for n in listed if n not in by_name]
    if unknown:
        raise AxisError(f"einsum output names {unknown} are in no operand (operand axes: {format_axes(all_axes)})")
    out_names: list[str] = []
    for s in out_spec:
        if s is Ellipsis:
            out_names.extend(a.name for a in all_axes if a.name not in listed and a.name not in explicit)
        else:
            out_names.append(s)
    if Ellipsis not in out_spec and not rest_contracted:
        dropped = [a.name for a in all_axes if a.name not in explicit and a.name not in listed]
        if dropped:
            raise AxisError(f"einsum: axes {dropped} come in through '...' but the output has no '...' for them")
    return _contract(arrays, tuple(by_name[n] for n in out_names), options, settle)
