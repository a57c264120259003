"""einops-style ``rearrange`` by name: split, merge and transpose in one pattern.

``nm.rearrange(x, "batch position (embed: heads head_size) -> batch heads position head_size", heads=4)``

Grammar: ``left -> right``; names are separated by spaces (or commas).

- The **left side names the array's axes by name, in any order** (as einsum's input specs do):
  it is matched by name, never by position. ``...`` stands for the axes it does not name;
  without ``...`` it must name them all. Braces around the left side (Haliax's unordered form,
  ``{heads position} -> ...``) are accepted and imply ``...``. One exception keeps a
  positional-looking pattern from meaning two things: a left side written in one-letter names
  (``"h w -> w h"``, as in einops and Haliax, which bind it by position) that names an axis
  where the array has another is refused; braces or the array's order say which is meant.
- A group on the left **splits** an axis into new axes, row-major (the first part varies
  slowest): ``(embed: heads head_size)`` splits ``embed``. A group without ``axis:``
  (``(heads head_size)``) splits one of the axes the left side does not name; such groups take
  those axes in the array's order, so they need a left side without ``...``.
- A group on the right **merges** axes into a new one, which needs a name:
  ``(token: batch position)``; ``...`` may stand inside it (``(flat: ...)``).
- ``...`` on the right stands for every axis the right side does not name, in the array's order
  (split axes in place of the axis they came from). The right side is a rearrangement: every
  axis appears on it exactly once.
- Keywords bind names: an int gives a split part its size (one part per group may be left
  out and is inferred), an ``Axis`` or a string gives a name in the pattern another axis name.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import jax.numpy as jnp

from ._axis import ArgumentError, ArgumentTypeError, Axis, AxisError, check_unique, format_axes, index_of
from ._core import NamedArray, expect_named, unchecked

_TOKEN = re.compile(r"\.\.\.|[(){}:]|[^\s(){}:,]+")


@dataclass
class _Group:
    name: str | None  # the axis split (left) or the new merged axis (right); None if anonymous
    parts: list = field(default_factory=list)  # names and Ellipsis


def _parse(side: str, what: str) -> tuple[list, bool]:
    """The items of one side (names, Ellipsis, _Group) and whether it was wrapped in braces."""
    toks = _TOKEN.findall(side)
    braced = bool(toks) and toks[0] == "{"
    if braced:
        if toks[-1] != "}":
            raise AxisError(f"rearrange: unbalanced braces in {what} {side.strip()!r}")
        toks = toks[1:-1]
    items: list = []
    i = 0
    while i < len(toks):
        t = toks[i]
        if t in ("{", "}", ":", ")"):
            raise AxisError(f"rearrange: unexpected {t!r} in {what} {side.strip()!r}")
        if t != "(":
            items.append(Ellipsis if t == "..." else t)
            i += 1
            continue
        close = toks.index(")", i) if ")" in toks[i:] else -1
        if close < 0:
            raise AxisError(f"rearrange: unclosed '(' in {what} {side.strip()!r}")
        inner = toks[i + 1 : close]
        name = None
        if len(inner) >= 2 and inner[1] == ":":
            name, inner = inner[0], inner[2:]
        if any(t in ("(", ":", "{", "}") for t in inner) or name == "...":
            raise AxisError(f"rearrange: groups do not nest; write '(name: a b)' in {what} {side.strip()!r}")
        items.append(_Group(name, [Ellipsis if t == "..." else t for t in inner]))
        i = close + 1
    return items, braced


class _Bindings:
    """The keyword arguments: each pattern name's axis name and size, and which were used."""

    def __init__(self, kwargs: dict):
        for k, v in kwargs.items():
            if isinstance(v, bool) or not isinstance(v, (int, str, Axis)):
                raise ArgumentTypeError(f"rearrange: {k}= must be a size (int), an Axis or an axis name, got {v!r}")
        self.kwargs = kwargs
        self.used: set[str] = set()

    def __call__(self, token: str) -> tuple[str, int | None]:
        v = self.kwargs.get(token)
        if v is None:
            return token, None
        self.used.add(token)
        if isinstance(v, Axis):
            return v.name, v.size
        if isinstance(v, str):
            return v, None
        return token, int(v)

    def check_all_used(self, pattern: str):
        unused = sorted(set(self.kwargs) - self.used)
        if unused:
            raise ArgumentError(f"rearrange: keywords {unused} name nothing in {pattern!r}")


def _split_sizes(axis: Axis, parts: list[str], bind: _Bindings) -> list[Axis]:
    bound = [bind(p) for p in parts]
    unknown = [p for p, (_, s) in zip(parts, bound) if s is None]
    known = math.prod(s for _, s in bound if s is not None)
    if len(unknown) > 1:
        raise ArgumentError(
            f"rearrange: splitting {axis.name!r} (size {axis.size}) into ({' '.join(parts)}) needs the sizes "
            f"of all parts but one; pass them as keywords, e.g. {unknown[0]}=..."
        )
    if unknown:
        if known == 0 or axis.size % known:
            raise AxisError(
                f"rearrange: axis {axis.name!r} of size {axis.size} does not split into ({' '.join(parts)}) "
                f"with the given sizes (their product {known} does not divide it)"
            )
        fill = axis.size // known
        bound = [(n, fill if s is None else s) for n, s in bound]
    elif known != axis.size:
        raise AxisError(
            f"rearrange: the sizes of ({' '.join(parts)}) multiply to "
            f"{known}, not to the size {axis.size} of {axis.name!r}"
        )
    return [Axis(n, s) for n, s in bound]


def refuse_positional_misreading(what: str, side: str, items: list, axes, names: list, braces: bool = True) -> None:
    """Refuse a positional-looking left side that Haliax (and einops) would read otherwise.

    Here the left side of a pattern (rearrange's, or an einsum input spec) is matched by name,
    in any order. Haliax binds an unbraced one by position: item ``k`` is axis ``k``, and items
    after ``...`` count from the end. A left side written in one-letter names (``"h w c"``, the
    einops idiom) looks positional; where an item of it names an axis of the array that is not
    the one at its position, the two readings give different results with no error in either
    library, so the pattern is refused; in braces (``{h w} -> ...``, rearrange's; ``braces=False``
    where the caller has no braced form to offer) both match by name. Names
    of more than one letter are names, read as such in any order. ``names`` holds, per item,
    the axis name it stands for (None for ``...`` and for an anonymous group)."""
    if not all(len(name) == 1 for name in names if name is not None):
        return
    n = len(axes)
    if Ellipsis in items:
        k = items.index(Ellipsis)
        front, back = names[:k], names[k + 1 :]
        if len(front) + len(back) > n:
            return
    else:
        front, back = names, []
        if len(front) != n:
            return  # Haliax would refuse it: no second reading
    placed = list(zip(front, axes[: len(front)])) + list(zip(back, axes[n - len(back) :]))
    present = {a.name for a in axes}
    for name, axis in placed:
        if name is not None and name in present and name != axis.name:
            raise AxisError(
                f"{what}: {side.strip()!r} names the axes of {format_axes(axes)} in another order. Here a left side is "
                f"matched by name ({name!r} is axis {name!r}), but Haliax and einops bind an unbraced one by position, "
                f"where {name!r} would be axis {axis.name!r}, and the "
                "result would differ. List the axes in the array's "
                f"order ({' '.join(a.name for a in axes)})"
                + (
                    f", or put the left side in braces ('{{{side.strip()}}}') to match by name in both"
                    if braces
                    else ""
                )
            )


def rearrange_pattern(x: NamedArray, pattern: str, kwargs: dict) -> NamedArray:
    expect_named(x, "rearrange")
    if pattern.count("->") != 1:
        raise AxisError(f"rearrange: pattern {pattern!r} needs exactly one '->'")
    left_s, right_s = pattern.split("->")
    left, braced = _parse(left_s, "the left side")
    right, right_braced = _parse(right_s, "the right side")
    if right_braced:
        raise AxisError(
            f"rearrange: braces select axes on the left side only; the right side of {pattern!r} is an order"
        )
    bind = _Bindings(kwargs)
    if not braced:

        def stands_for(item):
            token = item.name if isinstance(item, _Group) else item
            if token is None or token is Ellipsis:
                return None
            v = kwargs.get(token)
            return v.name if isinstance(v, Axis) else v if isinstance(v, str) else token

        refuse_positional_misreading("rearrange", left_s, left, x.axes, [stands_for(i) for i in left])

    # ---- left: which axes the pattern names, and what each becomes ----------------------
    pieces: dict[int, list[Axis]] = {}  # array axis -> the axes it becomes
    var: dict[str, Axis] = {}  # pattern name -> its axis after the split
    anonymous: list[_Group] = []
    ellipsis = braced or Ellipsis in left
    if left.count(Ellipsis) > 1:
        raise AxisError(f"rearrange: the left side of {pattern!r} has more than one '...'")

    def claim(i: int, what: str):
        if i in pieces:
            raise AxisError(
                f"rearrange: axis {x.axes[i].name!r} appears twice on the left side of {pattern!r} ({what})"
            )

    def define(token: str, axis: Axis):
        if token in var:
            raise AxisError(f"rearrange: {token!r} appears twice on the left side of {pattern!r}")
        var[token] = axis

    for item in left:
        if item is Ellipsis:
            continue
        if isinstance(item, _Group):
            if Ellipsis in item.parts:
                raise AxisError(f"rearrange: '...' cannot be split; a group on the left splits one axis ({pattern!r})")
            if item.name is None:
                anonymous.append(item)
                continue
            name, size = bind(item.name)
            i = index_of(x.axes, Axis(name, size) if size is not None else name)
            claim(i, "split")
            pieces[i] = _split_sizes(x.axes[i], item.parts, bind)
            for t, a in zip(item.parts, pieces[i]):
                define(t, a)
        else:
            name, size = bind(item)
            i = index_of(x.axes, Axis(name, size) if size is not None else name)
            claim(i, "named")
            pieces[i] = [x.axes[i]]
            define(item, x.axes[i])
    unnamed = [i for i in range(x.ndim) if i not in pieces]
    if anonymous:
        if ellipsis:
            raise AxisError(
                f"rearrange: with '...' on the left, say which axis a group splits: "
                f"'({{axis}}: {' '.join(anonymous[0].parts)})' in {pattern!r}"
            )
        if len(anonymous) != len(unnamed):
            raise AxisError(
                f"rearrange: the left side of {pattern!r} has {len(anonymous)} unnamed groups for the "
                f"{len(unnamed)} axes it does not name {[x.axes[i].name for i in unnamed]}"
            )
        for g, i in zip(anonymous, unnamed):
            pieces[i] = _split_sizes(x.axes[i], g.parts, bind)
            for t, a in zip(g.parts, pieces[i]):
                define(t, a)
        unnamed = []
    if unnamed and not ellipsis:
        raise AxisError(
            f"rearrange: the left side of {pattern!r} leaves out axes {[x.axes[i].name for i in unnamed]} "
            f"of {format_axes(x.axes)}; name them or add '...'"
        )
    for i in unnamed:
        pieces[i] = [x.axes[i]]
    mid = [a for i in range(x.ndim) for a in pieces[i]]  # the array's order, split axes in place
    check_unique(mid, "the split")
    by_name = {a.name: k for k, a in enumerate(mid)}

    # ---- right: the order and the merges -------------------------------------------------
    hidden = {a.name for i in unnamed for a in pieces[i]}  # under the left side's '...'

    def lookup(token: str) -> int:
        if token in var:
            return by_name[var[token].name]
        name, size = bind(token)
        if name not in hidden:
            raise AxisError(
                f"rearrange: {token!r} on the right side of {pattern!r} is not an axis of the left side "
                f"(axes after the split: {format_axes(mid)})"
            )
        return index_of(mid, Axis(name, size) if size is not None else name)

    def names_in(items) -> list[int]:
        out = []
        for item in items:
            if isinstance(item, _Group):
                out += names_in(item.parts)
            elif item is not Ellipsis:
                out.append(lookup(item))
        return out

    explicit = names_in(right)
    twice = sorted({mid[k].name for k in explicit if explicit.count(k) > 1})
    if twice:
        raise AxisError(f"rearrange: axes {twice} appear twice on the right side of {pattern!r}")
    n_ellipses = sum(1 for t in right if t is Ellipsis) + sum(
        g.parts.count(Ellipsis) for g in right if isinstance(g, _Group)
    )
    if n_ellipses > 1:
        raise AxisError(f"rearrange: the right side of {pattern!r} has more than one '...'")
    rest = [k for k in range(len(mid)) if k not in explicit]
    if rest and not n_ellipses:
        raise AxisError(
            f"rearrange: axes {[mid[k].name for k in rest]} are not on the right side of {pattern!r}; "
            "rearrange does not drop axes (name them or add '...')"
        )

    def expand(items) -> list[int]:
        out = []
        for t in items:
            out += rest if t is Ellipsis else [lookup(t)]
        return out

    perm: list[int] = []
    out_axes: list[Axis] = []
    for item in right:
        if isinstance(item, _Group):
            if item.name is None:
                parts = " ".join("..." if p is Ellipsis else p for p in item.parts)
                raise AxisError(f"rearrange: a merged axis needs a name: '(name: {parts})' in {pattern!r}")
            ks = expand(item.parts)
            name, size = bind(item.name)
            merged = Axis(name, math.prod(mid[k].size for k in ks))
            if size is not None and size != merged.size:
                raise AxisError(f"rearrange: merged axis {merged.name!r} has size {merged.size}, not the {size} given")
            perm += ks
            out_axes.append(merged)
        else:
            ks = expand([item])
            perm += ks
            out_axes += [mid[k] for k in ks]
    bind.check_all_used(pattern)
    out = tuple(out_axes)
    check_unique(out, "the rearranged")

    arr = x.array
    mid_shape = tuple(a.size for a in mid)
    if mid_shape != arr.shape:
        arr = arr.reshape(mid_shape)
    if perm != list(range(len(mid))):
        arr = jnp.transpose(arr, perm)
    out_shape = tuple(a.size for a in out)
    if out_shape != arr.shape:
        arr = arr.reshape(out_shape)
    return unchecked(arr, out)
