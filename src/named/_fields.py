"""Axis names for plain-array fields (Haliax's ``hax.field(axis_names=...)``): a module may keep
an array positional (a buffer it hands to plain JAX code) and still say what its dimensions are,
so that ``nm.shard``, ``nm.named_jit`` and ``nm.pspec_for`` lay it out by name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax

from ._axis import ArgumentError, Axis, AxisError, as_selectors, name_of
from ._core import NamedArray, is_named_array


def field(*, axis_names=None, static: bool = False, converter: Callable[[Any], Any] | None = None, **kwargs):
    """``eqx.field`` with ``axis_names``: the names of a plain array field's dimensions, in order
    (a tuple of names, or ``"batch embed"``)."""
    if axis_names is not None:
        if static:
            raise ArgumentError(
                "nm.field: axis_names describe an array's dimensions, and a static field holds no array "
                "to lay out; drop static=True or axis_names"
            )
        axis_names = tuple(name_of(a) for a in as_selectors(axis_names))
    metadata = dict(kwargs.pop("metadata", {}) or {})
    metadata["axis_names"] = axis_names
    if converter is not None:
        kwargs["converter"] = converter
    return eqx.field(static=static, metadata=metadata, **kwargs)


def field_axis_names(tree) -> dict[str, tuple[str, ...]]:
    """``{keystr(path): names}`` for every plain array in a field declared with ``axis_names``."""
    found: dict[str, tuple[str, ...]] = {}

    def visit(node, path: tuple):
        if isinstance(node, eqx.Module):
            for f in dataclasses.fields(node):
                if f.metadata.get("static", False):
                    continue
                value = getattr(node, f.name, None)
                here = path + (jax.tree_util.GetAttrKey(f.name),)
                names = f.metadata.get("axis_names")
                if names is not None and eqx.is_array(value):
                    if len(names) != value.ndim:
                        raise AxisError(
                            f"field {jax.tree_util.keystr(here)} declares axis_names {names} but holds an "
                            f"array of shape {tuple(value.shape)}"
                        )
                    found[jax.tree_util.keystr(here)] = tuple(names)
                else:
                    visit(value, here)
            return

        def stop(x):
            return x is not node and (isinstance(x, eqx.Module) or is_named_array(x))

        for sub, child in jax.tree_util.tree_flatten_with_path(node, is_leaf=stop)[0]:
            if isinstance(child, eqx.Module):
                visit(child, path + tuple(sub))

    visit(tree, ())
    return found


def map_named(fn: Callable[[NamedArray], Any], tree, *, plain: Callable[[Any], Any] = lambda x: x):
    """``fn`` on every NamedArray of ``tree`` and on every plain array in an ``axis_names`` field
    (seen as a NamedArray; a NamedArray result goes back as its array); ``plain`` on the rest."""
    names = field_axis_names(tree)

    def leaf(path, x):
        if isinstance(x, NamedArray):
            return fn(x)
        declared = names.get(jax.tree_util.keystr(path)) if eqx.is_array(x) else None
        if declared is None:
            return plain(x)
        out = fn(NamedArray(x, tuple(Axis(n, int(s)) for n, s in zip(declared, x.shape))))
        return out.array if isinstance(out, NamedArray) else out

    return jax.tree_util.tree_map_with_path(leaf, tree, is_leaf=is_named_array)
