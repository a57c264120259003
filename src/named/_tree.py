"""Tree utilities over models: resize one axis everywhere, and map over the layers of stacks."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from ._axis import ArgumentError, ArgumentTypeError, Axis, AxisError, AxisSelector, name_of
from ._core import NamedArray, is_named_array
from ._shape import concatenate, zeros
from ._transforms import vmap
from .nn import BlockSeq, Stacked
from .random import normal

__all__ = ["resize_axis", "tree_map_layers"]


def resize_axis(
    tree,
    axis: AxisSelector,
    new_size: int,
    *,
    key=None,
    std: float | None = None,
    init: Callable[..., NamedArray] | None = None,
):
    """``tree`` with axis ``axis`` resized to ``new_size`` in every NamedArray that has it.

    Shrinking keeps the first ``new_size`` entries. Growing appends entries (a vocabulary, a
    position table, layers): zeros without ``key``; with ``key``, normal draws of standard
    deviation ``std`` (default: the standard deviation of the array's existing values, so the new
    rows match the old ones' scale); or ``init(key, axes, dtype)`` for the new block, whose axes
    are the array's with ``axis`` of the added size. The n-th grown array (in tree order) draws
    with ``jax.random.fold_in(key, n)``.

    Static Axis fields of Equinox modules (``Embedding.Vocab``, ``Linear.Out``, ``Stacked.Layers``)
    named ``axis`` are resized too, so the modules stay consistent. Sizes kept as plain numbers
    (a model's config) are not: update those yourself.
    """
    name = name_of(axis)
    if isinstance(new_size, bool) or not isinstance(new_size, int) or new_size < 0:
        raise ArgumentError(f"resize_axis: new_size must be a non-negative int, got {new_size!r}")
    if init is not None and not callable(init):
        raise ArgumentTypeError(f"resize_axis: init must be a function init(key, axes, dtype), got {init!r}")
    if init is not None and key is None:
        raise ArgumentError("resize_axis: init= needs a key= to draw with")
    grown, found = [0], [0]

    def leaf(x):
        if not isinstance(x, NamedArray) or name not in x.names:
            return x
        found[0] += 1
        old = x.axis_size(name)
        if new_size <= old:
            return x[name, :new_size]
        axes = tuple(a.resize(new_size - old) if a.name == name else a for a in x.axes)
        if key is None:
            extra = zeros(axes, x.dtype)
        else:
            k = jax.random.fold_in(key, grown[0])
            grown[0] += 1
            extra = init(k, axes, x.dtype) if init is not None else _normal(k, x, axes, std, name)
            if not isinstance(extra, NamedArray) or set(extra.names) != set(x.names):
                got = extra.names if isinstance(extra, NamedArray) else type(extra).__name__
                raise ArgumentError(f"resize_axis: init returned {got}, expected a NamedArray with axes {x.names}")
        return concatenate(name, [x, extra.astype(x.dtype)])

    resized = _resize_static_axes(jax.tree.map(leaf, tree, is_leaf=is_named_array), name, new_size)
    if not found[0]:  # a misspelt axis would resize nothing without a word
        raise AxisError(f"resize_axis: no NamedArray of the tree has axis {name!r}")
    return resized


def _normal(key, x: NamedArray, axes, std, name: str) -> NamedArray:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ArgumentError(
            f"resize_axis: an array with axes {x.names} holds {x.dtype}; normal draws need a "
            "floating-point dtype (grow it without key= to fill with zeros)"
        )
    scale = jnp.std(x.array.astype(jnp.float32)) if std is None else std
    return normal(key, axes, jnp.float32) * scale


def _is_module(x) -> bool:
    return isinstance(x, eqx.Module)


def _resized(value, name: str, size: int):
    if isinstance(value, Axis):
        return value.resize(size) if value.name == name else value
    if isinstance(value, (tuple, list)) and type(value) in (tuple, list):
        return type(value)(_resized(v, name, size) for v in value)
    return value


def _resize_static_axes(tree, name: str, size: int):
    def module(m):
        if not _is_module(m):
            return m
        if isinstance(m, BlockSeq) and m.Layers.name == name and m.Layers.size != size:
            raise ArgumentError(
                f"resize_axis({name!r}): a BlockSeq's layers are its blocks; edit them with "
                "unstacked() and BlockSeq.from_layers"
            )
        # Static fields live in the treedef, out of reach of tree maps; a module is rebuilt the way
        # Equinox unflattens one: a bare instance with each field set.
        out = object.__new__(type(m))
        for f in dataclasses.fields(m):
            v = getattr(m, f.name)
            if f.metadata.get("static", False):
                v = _resized(v, name, size)
            else:
                v = jax.tree.map(module, v, is_leaf=_is_module)
            object.__setattr__(out, f.name, v)
        check = getattr(out, "__check_init__", None)
        if check is not None:
            check()  # e.g. Stacked: remat every=k must still divide the number of layers
        return out

    return jax.tree.map(module, tree, is_leaf=_is_module)


def tree_map_layers(f: Callable, tree, *, is_leaf: Callable[[Any], bool] | None = None):
    """``jax.tree.map(f, tree)`` in which ``f`` sees each layer of a ``Stacked`` or ``BlockSeq``
    on its own: a stacked weight reaches ``f`` without its layers axis, as ``get_layer(i)``
    would give it, and ``f``'s results are stacked back.

    Inside a ``Stacked``, ``f`` runs once under ``nm.vmap`` over the layers axis (so it must be
    traceable and return NamedArrays); in a ``BlockSeq`` once per block. ``is_leaf`` stops at
    nodes such as modules, which ``f`` then gets whole (per layer): ``tree_map_layers(scale_lin,
    model, is_leaf=lambda x: isinstance(x, nn.Linear))``.
    """
    if not callable(f):
        raise ArgumentTypeError(f"tree_map_layers maps a function over the tree, got {type(f).__name__}")

    def node(x) -> bool:
        return is_named_array(x) or isinstance(x, (Stacked, BlockSeq)) or (is_leaf is not None and is_leaf(x))

    def one(x):
        if is_leaf is not None and is_leaf(x):
            return f(x)
        if isinstance(x, Stacked):
            stacked = vmap(lambda block: tree_map_layers(f, block, is_leaf=is_leaf), x.Layers)(x.stacked)
            return eqx.tree_at(lambda s: s.stacked, x, stacked)
        if isinstance(x, BlockSeq):
            blocks = tuple(tree_map_layers(f, b, is_leaf=is_leaf) for b in x.blocks)
            return eqx.tree_at(lambda s: s.blocks, x, blocks)
        return f(x)

    return jax.tree.map(one, tree, is_leaf=node)
