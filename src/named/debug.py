"""Debug helpers (Haliax's ``hax.debug``): ``diagnose_common_issues(module)`` finds the two module
mistakes that Equinox does not stop at construction (one array stored at two places, an array in
a static field), and ``visualize_shardings(tree)`` prints where every array of a pytree lives, in
the layout notation of docs/partitioning.md, eagerly or from inside a jitted function.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import jax

from ._axis import NamedError
from ._core import NamedArray, is_named_array
from ._layout import sharding_layout

__all__ = ["ModuleProblems", "diagnose_common_issues", "visualize_shardings"]


def _is_array(x) -> bool:
    return isinstance(x, NamedArray) or eqx.is_array(x)


def _describe(x) -> str:
    if isinstance(x, NamedArray):
        return f"NamedArray {x.dtype}[{' '.join(f'{a.name}={a.size}' for a in x.axes)}]"
    return f"array {x.dtype}{list(x.shape)}"


class ModuleProblems(NamedError, ValueError):
    """What ``diagnose_common_issues`` found: ``reused_arrays`` (an array and the paths that hold
    it) and ``static_arrays`` (the paths of arrays in static fields)."""

    def __init__(self, reused_arrays: list[tuple[Any, list[str]]], static_arrays: list[str]):
        self.reused_arrays = reused_arrays
        self.static_arrays = static_arrays
        lines = ["the module has problems that break its gradients or its compiled cache:"]
        lines += [
            f"  one {_describe(a)} is stored at {', '.join(paths)} (an optimizer updates each copy on its own; "
            "share it by referring to one field)"
            for a, paths in reused_arrays
        ]
        lines += [
            f"  {path} is a static field holding an array (it is hashed into every trace and gets no gradient; "
            "make it an ordinary field)"
            for path in static_arrays
        ]
        super().__init__("\n".join(lines))

    def __bool__(self) -> bool:
        return bool(self.reused_arrays or self.static_arrays)


def diagnose_common_issues(module) -> None:
    """Raise ``ModuleProblems`` if ``module`` holds one array at several paths, or an array in a
    static field; then run ``eqx.tree_check`` for the rest (cycles, a module reached twice)."""
    reused = _reused_arrays(module)
    static = _static_arrays(module, "")
    if reused or static:
        raise ModuleProblems(reused, static)
    eqx.tree_check(module)


def _reused_arrays(module) -> list[tuple[Any, list[str]]]:
    seen: dict[int, tuple[Any, list[str]]] = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(module, is_leaf=is_named_array):
        if _is_array(leaf):
            buffer = leaf.array if isinstance(leaf, NamedArray) else leaf
            seen.setdefault(id(buffer), (leaf, []))[1].append(jax.tree_util.keystr(path))
    return [(leaf, paths) for leaf, paths in seen.values() if len(paths) > 1]


def _static_arrays(node, path: str) -> list[str]:
    if isinstance(node, eqx.Module):
        found = []
        for f in dataclasses.fields(node):
            value = getattr(node, f.name, None)
            if f.metadata.get("static", False) and _is_array(value):
                found.append(f"{path}.{f.name}")
            else:
                found += _static_arrays(value, f"{path}.{f.name}")
        return found
    if isinstance(node, (list, tuple)):
        return [p for i, v in enumerate(node) for p in _static_arrays(v, f"{path}[{i}]")]
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in _static_arrays(v, f"{path}[{k!r}]")]
    return []


def visualize_shardings(tree) -> None:
    """Print ``path: layout`` for every array of ``tree`` (``batch/data embed/model``; a plain
    array's dimensions are numbered). Works on placed arrays and inside ``jax.jit`` (through
    ``jax.debug.inspect_array_sharding``, printed when the program is compiled)."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_named_array):
        if not _is_array(leaf):
            continue
        arr = leaf.array if isinstance(leaf, NamedArray) else leaf
        axes = leaf.names if isinstance(leaf, NamedArray) else tuple(f"dim{i}" for i in range(arr.ndim))
        where = jax.tree_util.keystr(path) or "array"

        def show(sharding, where=where, axes=axes):
            print(f"{where}: {sharding_layout(axes, sharding)}")

        jax.debug.inspect_array_sharding(arr, callback=show)
