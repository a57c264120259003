"""Where the ambient layout state lives: the compute mapping and the explicit-mode body.

Both are ``jax.make_user_context`` values, so they are part of every jit's cache key: a
function compiled with plain ``jax.jit`` or ``eqx.filter_jit`` that calls ``nm.shard`` is
traced again when the mapping around the call changes, instead of silently keeping the
layout of the first mapping it saw (as a thread-local stack, invisible to jax, did). The values
are per thread, not per asyncio task (measured: two tasks that interleave inside their own
``axis_mapping`` see each other's), and must be hashable, hence :class:`FrozenMapping`.

The mesh needs no context of ours: ``jax.set_mesh`` already keys jit caches on it, and inside
a trace its abstract mesh has the axis names and sizes that layouts are computed from.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, Union

import jax

from ._axis import NamedError

MeshAxes = Union[str, tuple[str, ...], None]
ResourceMapping = Mapping[str, MeshAxes]


class ShardingError(NamedError, ValueError):
    """A mapping does not fit the mesh or the array it is applied to."""


ShardingError.__module__ = "named.partitioning"  # where users import it from


def _check_mapping_values(mapping: ResourceMapping) -> None:
    if not isinstance(mapping, Mapping):
        raise ShardingError(f"an axis mapping is a dict from axis name to mesh axis, got {mapping!r}")
    for k, v in mapping.items():
        if not isinstance(k, str):
            raise ShardingError(f"axis mapping keys are axis names, got {k!r}")
        if v is None or isinstance(v, str):
            continue
        if isinstance(v, (tuple, list)) and all(isinstance(m, str) for m in v):
            continue
        raise ShardingError(f"axis {k!r} is mapped to {v!r}; use a mesh axis name, a tuple of them, or None")


class FrozenMapping(Mapping):
    """A read-only, hashable mapping (lists become tuples); equal to any mapping with the same items."""

    __slots__ = ("_items", "_hash")

    def __init__(self, mapping: Mapping[str, Any]):
        self._items = {k: tuple(v) if isinstance(v, list) else v for k, v in mapping.items()}
        self._hash = hash(frozenset(self._items.items()))

    def __getitem__(self, key):
        return self._items[key]

    def __iter__(self):
        return iter(self._items)

    def __len__(self):
        return len(self._items)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        if isinstance(other, FrozenMapping):
            return self._hash == other._hash and self._items == other._items
        return isinstance(other, Mapping) and self._items == dict(other.items())

    def __repr__(self):
        return repr(self._items)


_mapping = jax.make_user_context(default_value=None)
_body = jax.make_user_context(default_value=None)


def current_mapping() -> FrozenMapping | None:
    """The compute mapping set by the innermost ``axis_mapping`` block, or None."""
    return _mapping.value


@contextlib.contextmanager
def axis_mapping(mapping: ResourceMapping | None, *, merge: bool = False) -> Iterator[FrozenMapping | None]:
    """Set the compute mapping for a region: it replaces the enclosing one, or with
    ``merge=True`` is overlaid on it. jit caches key on it, so a jitted function called in
    another mapping is traced again."""
    if mapping is not None:
        _check_mapping_values(mapping)
        outer = current_mapping()
        mapping = FrozenMapping({**outer, **mapping} if merge and outer is not None else mapping)
    with _mapping(mapping):
        yield mapping


def current_mesh():
    """The mesh set by ``jax.set_mesh`` (or ``named_jit(mesh=)``), or None.

    Inside a trace jax exposes only the abstract mesh (names and sizes); it is returned then.
    """
    try:
        mesh = jax.sharding.get_mesh()
    except ValueError:  # inside jax.jit
        mesh = jax.sharding.get_abstract_mesh()
    return None if mesh is None or mesh.empty else mesh


def current_body() -> Any:
    """The explicit-mode body being traced (``nm.shard_map``), or None."""
    return _body.value


@contextlib.contextmanager
def body_context(body: Any) -> Iterator[None]:
    """Run a ``shard_map`` body: collectives find ``body``; layers' ``nm.shard`` calls do
    nothing, since a local block has nothing to constrain. ``body`` must be hashable."""
    with _body(body), _mapping(None):
        yield
