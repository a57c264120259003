"""Where named's ambient state lives, under one rule: whatever changes what a trace produces is
a ``jax.make_user_context`` value, part of every jit's cache key.

A function compiled with plain ``jax.jit`` or ``eqx.filter_jit`` that reads one of these values
is traced again when it is called under another value, instead of silently keeping what it
produced under the first (as a thread-local stack, invisible to jax, did in Haliax). The values:

- the compute mapping (``nm.axis_mapping``), which ``nm.shard`` lays activations out by;
- the ``nm.shard_map`` body being traced, which explicit mode's collectives read and through
  which explicit mode hooks its contractions and draws into the array core (:class:`Body`);
- the layer-stack driver (``nn.explicit_layers``), which makes every ``Stacked`` run per device;
- the parameter mapping of ``nn.gather_per_use``, under which a ``Linear`` gathers its FSDP
  weight where it uses it;
- the attention implementation that ``"auto"`` means (``nn.attention_implementation``);
- the part of a device's block being traced (explicit mode's batch split), which tells a random
  draw where the block sits in the global array.

The values are per thread, not per asyncio task (measured: two tasks that interleave inside
their own ``axis_mapping`` see each other's), and must be hashable, hence :class:`FrozenMapping`.

One value lives only within one trace and is no cache key: the collective order of explicit
mode's batch split. It is set and reset while a body is traced, and holds that trace's tracers
(as a key, jax's caches would keep them alive).

The mesh needs no context of ours: ``jax.set_mesh`` already keys jit caches on it, and inside
a trace its abstract mesh has the axis names and sizes that layouts are computed from.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import jax

from ._axis import NamedError

MeshAxes = str | tuple[str, ...] | None
ResourceMapping = Mapping[str, MeshAxes]


class ShardingError(NamedError, ValueError):
    """A mapping does not fit the mesh or the array it is applied to."""


ShardingError.__module__ = "named.partitioning"  # where users import it from


def check_mapping_values(mapping: ResourceMapping) -> None:
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
_layer_driver = jax.make_user_context(default_value=None)
weight_gather = jax.make_user_context(default_value=None)  # nn.gather_per_use's parameter mapping
_attention = jax.make_user_context(default_value="auto")
_parts = jax.make_user_context(default_value=FrozenMapping({}))
_order: contextvars.ContextVar = contextvars.ContextVar("named_collective_order", default=None)  # trace-local


def current_mapping() -> FrozenMapping | None:
    """The compute mapping set by the innermost ``axis_mapping`` block, or None."""
    return _mapping.value


@contextlib.contextmanager
def axis_mapping(mapping: ResourceMapping | None, *, merge: bool = False) -> Iterator[FrozenMapping | None]:
    """Set the compute mapping for a region: it replaces the enclosing one, or with
    ``merge=True`` is overlaid on it. jit caches key on it, so a jitted function called in
    another mapping is traced again."""
    if mapping is not None:
        check_mapping_values(mapping)
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


# ---- explicit mode's body, and its hooks into the core -----------------------------------------


class Body(Protocol):
    """What the array core asks of the ``nm.shard_map`` body around it (explicit mode's
    ``named._local.LocalBody``, which fills this slot when a body is traced). The core calls
    these hooks on local blocks and knows nothing else of explicit mode. A body is a jit-key
    value: frozen and hashable."""

    mesh: Any

    def contract(self, einsum: Callable[..., jax.Array], arrays: tuple, out_axes: tuple, settle: bool) -> jax.Array:
        """``einsum(*raw operands)`` for a contraction of local blocks ``arrays`` to ``out_axes``;
        with ``settle``, a contraction over a split axis is summed over the devices."""
        ...

    def draw(self, draw: Callable[[tuple[int, ...]], jax.Array], axes: tuple) -> jax.Array:
        """``draw(shape)`` made this device's block of a draw over the global ``axes``."""
        ...


def current_body() -> Body | None:
    """The explicit-mode body being traced (``nm.shard_map``), or None."""
    return _body.value


@contextlib.contextmanager
def body_context(body: Body) -> Iterator[None]:
    """Run a ``shard_map`` body: collectives find ``body``; layers' ``nm.shard`` calls do
    nothing, since a local block has nothing to constrain."""
    with _body(body), _mapping(None):
        yield


def block_parts() -> FrozenMapping:
    """``{axis name: (part, parts)}``: the code being traced computes part ``part`` of ``parts``
    equal parts of this device's block along that axis (explicit mode's batch split)."""
    return _parts.value


@contextlib.contextmanager
def part_of_block(name: str, part: int, parts: int) -> Iterator[None]:
    """Trace code that sees part ``part`` of ``parts`` of this device's block along ``name``."""
    with _parts(FrozenMapping({**block_parts(), name: (part, parts)})):
        yield


def current_order() -> Any:
    """The collective order of the batch-split piece being traced (``_local.CollectiveOrder``), or None."""
    return _order.get()


@contextlib.contextmanager
def order_context(order: Any) -> Iterator[None]:
    """Trace one piece under ``order``. Trace-local: it holds the tracers of the trace being built."""
    token = _order.set(order)
    try:
        yield
    finally:
        _order.reset(token)


# ---- switches of named.nn ---------------------------------------------------------------------


def current_layer_driver() -> Any:
    """The driver every ``Stacked`` run now uses (``nn.explicit_layers``), or None (GSPMD)."""
    return _layer_driver.value


def layer_driver_context(driver: Any) -> contextlib.AbstractContextManager:
    """Run every ``Stacked`` traced inside with ``driver`` (hashable; None: as usual)."""
    return _layer_driver(driver)


def current_attention() -> str:
    """What ``dot_product_attention(implementation="auto")`` means here (``nn.attention_implementation``)."""
    return _attention.value


def attention_context(implementation: str) -> contextlib.AbstractContextManager:
    """Make ``"auto"`` mean ``implementation`` for the calls inside."""
    return _attention(implementation)
