"""Where arrays live: meshes, axis mappings, sharding constraints and named_jit.

A *mapping* sends an axis name to a mesh axis, a tuple of mesh axes, or None (replicated):
``{"batch": "data", "mlp": "model"}``. A run has two: the *compute* mapping (activations,
set with ``axis_mapping``) and the *parameter* mapping (how weights and optimizer state are
stored). FSDP is parameter ``{"embed": "data"}`` + compute ``{"batch": "data"}``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Union

import equinox as eqx
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from ._axis import Axis, AxisSelection, NamedError, as_selectors, format_axes
from ._core import NamedArray, is_named_array

MeshAxes = Union[str, tuple[str, ...], None]
ResourceMapping = Mapping[str, MeshAxes]


class ShardingError(NamedError, ValueError):
    """A mapping does not fit the mesh or the array it is applied to."""


# ---- meshes --------------------------------------------------------------------------


def make_mesh(shape: Mapping[str, int], *, devices: Sequence[Any] | None = None) -> Mesh:
    """A mesh from ``{"data": -1, "model": 2}``; ``-1`` takes the devices left over.

    Axes are ``AxisType.Auto`` (GSPMD): sharding constraints set layouts rather than check them.
    """
    devices = list(devices) if devices is not None else jax.devices()
    n = len(devices)
    names = tuple(shape)
    sizes = [int(s) for s in shape.values()]
    if not names:
        raise ShardingError("make_mesh needs at least one axis, e.g. {'data': -1}")
    wild = [i for i, s in enumerate(sizes) if s == -1]
    if len(wild) > 1:
        raise ShardingError(f"mesh shape {dict(shape)}: only one axis may be -1")
    if any(s == 0 or s < -1 for s in sizes):
        raise ShardingError(f"mesh shape {dict(shape)}: sizes must be positive (or one -1)")
    known = math.prod(s for s in sizes if s != -1)
    if wild:
        if n % known:
            raise ShardingError(f"mesh shape {dict(shape)} does not fit {n} devices: {n} is not divisible by {known}")
        sizes[wild[0]] = n // known
    if math.prod(sizes) != n:
        raise ShardingError(f"mesh shape {dict(shape)} needs {math.prod(sizes)} devices but {n} are available")
    return jax.make_mesh(tuple(sizes), names, axis_types=(AxisType.Auto,) * len(names), devices=devices)


def current_mesh() -> Mesh | None:
    """The mesh of the named_jit being traced, else the one set by ``jax.set_mesh``, or None.

    Inside a plain ``jax.jit`` only the abstract mesh is known; it is returned then.
    """
    mesh = getattr(_state, "mesh", None)
    if mesh is not None:
        return mesh
    try:
        mesh = jax.sharding.get_mesh()
    except ValueError:  # inside jax.jit: jax exposes only the abstract mesh
        mesh = jax.sharding.get_abstract_mesh()
    return None if mesh is None or mesh.empty else mesh


def set_mesh(mesh: Mesh):
    """``with nm.set_mesh(mesh):`` (the same as ``jax.set_mesh``)."""
    return jax.set_mesh(mesh)


# ---- the compute mapping context ---------------------------------------------------------

_state = threading.local()


def current_mapping() -> ResourceMapping | None:
    """The compute mapping set by the innermost ``axis_mapping`` block, or None."""
    stack = getattr(_state, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def axis_mapping(mapping: ResourceMapping | None, *, merge: bool = False) -> Iterator[ResourceMapping | None]:
    """Set the compute mapping for a region. ``merge=True`` overlays it on the enclosing one."""
    if mapping is not None:
        _check_mapping_values(mapping)
        if merge and current_mapping() is not None:
            mapping = {**current_mapping(), **mapping}
        mapping = dict(mapping)
    stack = getattr(_state, "stack", None)
    if stack is None:
        stack = _state.stack = []
    stack.append(mapping)
    try:
        yield mapping
    finally:
        stack.pop()


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


def _mesh_axes(v: MeshAxes) -> tuple[str, ...]:
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,)
    return tuple(v)


def check_mapping(mapping: ResourceMapping, mesh: Mesh) -> None:
    """Every mesh axis the mapping names must exist in ``mesh``."""
    _check_mapping_values(mapping)
    for name, v in mapping.items():
        for m in _mesh_axes(v):
            if m not in mesh.shape:
                raise ShardingError(
                    f"axis {name!r} is mapped to mesh axis {m!r}, which the mesh does not have "
                    f"(mesh axes: {dict(mesh.shape)})"
                )


# ---- inference: PartitionSpec and NamedSharding for axes ---------------------------------


def _axes(x: NamedArray | AxisSelection) -> tuple[Axis, ...]:
    if isinstance(x, NamedArray):
        return x.axes
    return tuple(a for a in as_selectors(x))  # type: ignore[misc]


def pspec_for(x: NamedArray | AxisSelection, mapping: ResourceMapping | None = None, mesh: Mesh | None = None) -> PartitionSpec:
    """The PartitionSpec of an array (or of its axes) under ``mapping`` (default: current).

    With a mesh (given or current), mesh axis names and divisibility are checked.
    """
    mapping = current_mapping() if mapping is None else mapping
    mesh = mesh if mesh is not None else current_mesh()
    axes = _axes(x)
    if mapping is None:
        return PartitionSpec(*([None] * len(axes)))
    _check_mapping_values(mapping)
    used: dict[str, str] = {}
    entries = []
    for a in axes:
        name = a.name if isinstance(a, Axis) else a
        target = _mesh_axes(mapping.get(name))
        for m in target:
            if mesh is not None and m not in mesh.shape:
                raise ShardingError(
                    f"axis {name!r} is mapped to mesh axis {m!r}, which the mesh does not have (mesh axes: {dict(mesh.shape)})"
                )
            if m in used:
                raise ShardingError(
                    f"axes {used[m]!r} and {name!r} of one array are both mapped to mesh axis {m!r}; "
                    f"an array can use a mesh axis once (axes {format_axes([b for b in axes if isinstance(b, Axis)])})"
                )
            used[m] = name
        if target and mesh is not None and isinstance(a, Axis):
            parts = math.prod(mesh.shape[m] for m in target)
            if a.size % parts:
                raise ShardingError(
                    f"axis {name!r} of size {a.size} cannot be split over mesh axes {target} "
                    f"({parts} devices): {a.size} is not divisible by {parts}; change the mesh shape, "
                    f"or map {name!r} to other mesh axes (None keeps it whole)"
                )
        entries.append(None if not target else (target[0] if len(target) == 1 else target))
    return PartitionSpec(*entries)


def sharding_for(x: NamedArray | AxisSelection, mapping: ResourceMapping | None = None, mesh: Mesh | None = None) -> NamedSharding:
    """The NamedSharding of an array (or of its axes) under ``mapping`` on ``mesh`` (defaults: current)."""
    mesh = mesh if mesh is not None else current_mesh()
    if mesh is None:
        raise ShardingError("no mesh: pass mesh= or enter `with jax.set_mesh(mesh):`")
    return NamedSharding(mesh, pspec_for(x, mapping, mesh))


def infer_shardings(tree: Any, mapping: ResourceMapping | None = None, mesh: Mesh | None = None) -> Any:
    """A pytree like ``tree`` with a NamedSharding for every NamedArray's array, None elsewhere."""

    def leaf(x):
        if isinstance(x, NamedArray):
            return NamedArray._unchecked(sharding_for(x, mapping, mesh), x.axes)
        return None

    return jax.tree.map(leaf, tree, is_leaf=is_named_array)


# ---- shard: constrain or place ----------------------------------------------------------


def shard(tree: Any, mapping: ResourceMapping | None = None, mesh: Mesh | None = None) -> Any:
    """Lay out every NamedArray leaf of ``tree`` by ``mapping`` (default: the current one).

    Inside jit this is a sharding constraint; outside, a ``device_put``. Plain arrays and
    other leaves pass through. With no mapping or no mesh it does nothing.
    """
    mapping = current_mapping() if mapping is None else mapping
    mesh = mesh if mesh is not None else current_mesh()
    if mapping is None or mesh is None:
        return tree

    def leaf(x):
        if not isinstance(x, NamedArray) or not hasattr(x.array, "shape"):
            return x
        sharding = NamedSharding(mesh, pspec_for(x, mapping, mesh))
        if isinstance(x.array, jax.core.Tracer):
            arr = jax.lax.with_sharding_constraint(x.array, sharding)
        else:
            arr = jax.device_put(x.array, sharding)
        return NamedArray._unchecked(arr, x.axes)

    return jax.tree.map(leaf, tree, is_leaf=is_named_array)


# ---- named_jit -----------------------------------------------------------------------------


class _Static:
    """Hashable holder for the non-array part of a call (compared by value)."""

    __slots__ = ("treedef", "leaves")

    def __init__(self, treedef, leaves):
        self.treedef, self.leaves = treedef, tuple(leaves)

    def __hash__(self):
        return hash((self.treedef, self.leaves))

    def __eq__(self, other):
        return isinstance(other, _Static) and self.treedef == other.treedef and self.leaves == other.leaves


class _StaticOut:
    """The non-array part of a result, carried out of ``jax.jit`` in the output treedef.

    Keeping it in the treedef ties it to the trace that produced it: a result like
    ``x.shape[0]`` changes with the input shapes, which the jit cache keys on and we don't.
    It is its own aux data and compares by identity, because the value may hold NamedArray
    nodes, whose ``==`` is elementwise.
    """

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


jax.tree_util.register_pytree_node(_StaticOut, lambda s: ((), s), lambda s, _: s)


def _is_dynamic(x) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _freeze(mapping: ResourceMapping | None):
    if mapping is None:
        return None
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in mapping.items()))


def _donation_mask(args: tuple, kwargs: dict, donate_args, donate_kwargs) -> tuple[Any, Any]:
    """Boolean pytrees (over args, kwargs) from prefixes: True donates that subtree's arrays."""

    def expand(prefix, tree, what):
        if prefix is None or prefix is False:
            return jax.tree.map(lambda _: False, tree)
        if prefix is True:
            return jax.tree.map(lambda _: True, tree)
        try:
            return jax.tree.map(
                lambda p, t: jax.tree.map(lambda _: bool(p), t),
                prefix,
                tree,
                is_leaf=lambda p: p is None or isinstance(p, bool),
            )
        except ValueError as e:  # jax's message says where the structures part
            raise NamedError(
                f"{what} must be a bool, or a pytree prefix of the arguments with a bool (or None) "
                f"for each subtree; it does not match the arguments:\n{e}"
            ) from None

    if donate_args is not None and not isinstance(donate_args, bool):
        donate_args = tuple(False if d is None else d for d in donate_args)
        if len(donate_args) > len(args):
            raise NamedError(
                f"donate_args has {len(donate_args)} entries but the function got {len(args)} positional arguments"
            )
        donate_args = donate_args + (False,) * (len(args) - len(donate_args))
    return expand(donate_args, args, "donate_args"), expand(donate_kwargs, kwargs, "donate_kwargs")


@dataclasses.dataclass
class _Resources:
    axis: ResourceMapping | None
    inputs: ResourceMapping | None
    outputs: ResourceMapping | None


class NamedJitWrapped:
    """A function compiled by ``named_jit``; call it, or ``.lower(*args)`` to inspect the program."""

    def __init__(self, fn: Callable, resources: _Resources, donate_args, donate_kwargs, mesh: Mesh | None, jit_kwargs: dict):
        self._fn = fn
        self._res = resources
        self._donate_args, self._donate_kwargs = donate_args, donate_kwargs
        self._mesh = mesh

        def traced(key, donated, kept, static):
            return self._call_traced(key, donated, kept, static)

        # the compiled module is then called jit_<fn name>, which is what HLO dumps and profiles show
        traced.__name__ = traced.__qualname__ = getattr(fn, "__name__", type(fn).__name__)
        self._jitted = jax.jit(traced, static_argnums=(0, 3), donate_argnums=(1,), **jit_kwargs)
        functools.update_wrapper(self, fn)

    def _mapping(self) -> ResourceMapping | None:
        return self._res.axis if self._res.axis is not None else current_mapping()

    def _call_traced(self, key, donated, kept, static: _Static):
        _, mapping, in_mapping, out_mapping, mesh = key
        mapping = dict(mapping) if mapping is not None else None
        leaves = [d if d is not None else (k if k is not None else s) for d, k, s in zip(donated, kept, static.leaves)]
        args, kwargs = jax.tree.unflatten(static.treedef, leaves)
        prev_mesh, _state.mesh = getattr(_state, "mesh", None), mesh
        with contextlib.ExitStack() as stack:
            stack.callback(setattr, _state, "mesh", prev_mesh)
            stack.enter_context(axis_mapping(mapping))
            if in_mapping is not None:
                args, kwargs = shard((args, kwargs), dict(in_mapping), mesh)
            out = self._fn(*args, **kwargs)
            if out_mapping is not None or mapping is not None:
                out = shard(out, dict(out_mapping) if out_mapping is not None else None, mesh)
        dyn, stat = eqx.partition(out, _is_dynamic)
        return dyn, _StaticOut(stat)

    def _prepare(self, args, kwargs):
        mesh = self._mesh if self._mesh is not None else current_mesh()
        mapping = self._mapping()
        in_map = self._res.inputs
        out_map = self._res.outputs if self._res.outputs is not None else mapping
        if mesh is not None:
            for m in (mapping, in_map, out_map):
                if m is not None:
                    check_mapping(m, mesh)
        leaves, treedef = jax.tree.flatten((args, kwargs))
        dmask_a, dmask_k = _donation_mask(args, kwargs, self._donate_args, self._donate_kwargs)
        dmask = jax.tree.leaves((dmask_a, dmask_k))
        if len(dmask) != len(leaves):  # a prefix that did not cover the tree leaf for leaf
            raise NamedError("donate_args must be a prefix of the arguments' pytree (bools)")
        donated, kept, static = [], [], []
        for leaf, d in zip(leaves, dmask):
            if _is_dynamic(leaf):
                donated.append(leaf if d else None)
                kept.append(None if d else leaf)
                static.append(None)
            else:
                donated.append(None)
                kept.append(None)
                static.append(leaf)
        key = (None, _freeze(mapping), _freeze(in_map), _freeze(out_map), mesh)
        return key, donated, kept, _Static(treedef, static), mesh

    def __call__(self, *args, **kwargs):
        key, donated, kept, static, mesh = self._prepare(args, kwargs)
        ctx = jax.set_mesh(mesh) if mesh is not None and self._mesh is not None else contextlib.nullcontext()
        with ctx:
            dyn, stat = self._jitted(key, donated, kept, static)
        return eqx.combine(dyn, stat.value)

    def lower(self, *args, **kwargs):
        """``jax.stages.Lowered`` for these arguments (``.compile().as_text()`` for the HLO)."""
        key, donated, kept, static, mesh = self._prepare(args, kwargs)
        ctx = jax.set_mesh(mesh) if mesh is not None and self._mesh is not None else contextlib.nullcontext()
        with ctx:
            return self._jitted.lower(key, donated, kept, static)

    def __get__(self, instance, owner):
        if instance is None:
            return self
        bound = functools.partial(self, instance)
        bound.lower = functools.partial(self.lower, instance)  # type: ignore[attr-defined]
        return bound


def named_jit(
    fn: Callable | None = None,
    *,
    axis_resources: ResourceMapping | None = None,
    in_axis_resources: ResourceMapping | None = None,
    out_axis_resources: ResourceMapping | None = None,
    donate_args: Any = None,
    donate_kwargs: Any = None,
    mesh: Mesh | None = None,
    **jit_kwargs,
):
    """jit whose layouts come from axis names.

    - ``axis_resources``: the compute mapping while ``fn`` is traced (default: the mapping
      current at call time); layers constrain their activations to it.
    - ``in_axis_resources``: if given, NamedArray inputs are laid out by it; otherwise inputs
      keep the layout they arrive in (parameters stay in their parameter layout).
    - ``out_axis_resources``: layout of NamedArray outputs (default: ``axis_resources``).
      A jitted ``init`` with ``axis_resources=param_mapping`` is *sharded init*.
    - ``donate_args`` / ``donate_kwargs``: a bool, or a pytree prefix of bools, per argument.
    - Non-array leaves of the arguments (ints, strings, functions, static module fields) are
      static: a new value compiles a new program. Compiled programs are cached.

    Usable as ``@named_jit`` or ``@named_jit(axis_resources=...)``.
    """
    for m in (axis_resources, in_axis_resources, out_axis_resources):
        if m is not None:
            _check_mapping_values(m)
            if mesh is not None:
                check_mapping(m, mesh)
    res = _Resources(axis_resources, in_axis_resources, out_axis_resources)

    def wrap(f):
        return NamedJitWrapped(f, res, donate_args, donate_kwargs, mesh, jit_kwargs)

    return wrap if fn is None else wrap(fn)


# ---- guard rails -----------------------------------------------------------------------


@dataclasses.dataclass
class ShardingCheck:
    """Which parameters stay replicated under a mapping, and what fraction of bytes that is."""

    replicated: list[tuple[str, tuple[Axis, ...], int]]
    total_bytes: int
    replicated_bytes: int

    @property
    def replicated_fraction(self) -> float:
        return self.replicated_bytes / self.total_bytes if self.total_bytes else 0.0

    def __str__(self) -> str:
        lines = [f"{self.replicated_fraction:.1%} of {self.total_bytes:,} parameter bytes stay replicated"]
        lines += [f"  {path}: {format_axes(axes)} ({n:,} bytes)" for path, axes, n in self.replicated]
        return "\n".join(lines)


def _nbytes(x: NamedArray) -> int:
    return int(np.prod([a.size for a in x.axes], dtype=np.int64)) * np.dtype(x.dtype).itemsize


def check_sharding(
    tree: Any, mapping: ResourceMapping, mesh: Mesh, max_replicated_fraction: float | None = None
) -> ShardingCheck:
    """Report the NamedArray leaves that ``mapping`` leaves fully replicated on ``mesh``.

    Raises ShardingError, listing them, when their share of the bytes exceeds
    ``max_replicated_fraction`` (MaxText's "sharding tolerance"). Also checks every leaf's
    layout (divisibility, mesh axis names).
    """
    check_mapping(mapping, mesh)
    replicated, total, rep_bytes = [], 0, 0
    for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_named_array)[0]:
        if not isinstance(x, NamedArray):
            continue
        spec = pspec_for(x, mapping, mesh)
        n = _nbytes(x)
        total += n
        if all(s is None for s in spec):
            replicated.append((jax.tree_util.keystr(path), x.axes, n))
            rep_bytes += n
    report = ShardingCheck(replicated, total, rep_bytes)
    if max_replicated_fraction is not None and report.replicated_fraction > max_replicated_fraction:
        raise ShardingError(f"{report}\nthis exceeds max_replicated_fraction={max_replicated_fraction}")
    return report
