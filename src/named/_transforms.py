"""Transforms over named axes: vmap, scan, fold, and nmap (the positional escape hatch); grad
and value_and_grad of a function whose loss is a 0-d NamedArray.

Rule shared by vmap, scan and fold (Haliax's): a NamedArray leaf that has the mapped/scanned
axis is mapped over it and, inside, has that axis removed; a plain array with at least one
dimension is mapped over its first dimension (whose size must be the axis'), so that
``jax.random.split(key, n)`` gives each step its own key; any other leaf (NamedArrays without
the axis, 0-d arrays, static Python values) is passed whole to every step. ``scan``'s
``is_scanned=`` changes which leaves are scanned. NamedArray outputs get the axis back in
front; plain-array outputs get a leading dimension.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax

from ._axis import (
    ArgumentError,
    ArgumentTypeError,
    Axis,
    AxisError,
    AxisSelection,
    AxisSelector,
    NamedError,
    as_selectors,
    format_axes,
    name_of,
    union,
)
from ._core import NamedArray, is_named_array, unchecked
from ._nested_scan import nested_scan
from ._remat import Remat, with_remat


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, jnp.ndarray)) or (
        hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, NamedArray)
    )


def is_named_or_shaped_array_like(x) -> bool:
    """The default of ``scan(is_scanned=)``: NamedArrays (those with the axis), and plain arrays
    with at least one dimension (along their first)."""
    return isinstance(x, NamedArray) or (_is_array(x) and len(x.shape) >= 1)


def _predicate(is_scanned) -> Callable[[Any], bool]:
    if isinstance(is_scanned, bool):
        return lambda _: is_scanned
    if not callable(is_scanned):
        raise ArgumentError(f"is_scanned takes a bool or a function of a leaf, got {is_scanned!r}")
    return is_scanned


class MappedSplit:
    """The leaves of a pytree split into those mapped over ``axis`` and the rest. ``is_scanned``
    (None: NamedArrays only, as the explicit layer scan wants) picks the mapped leaves."""

    def __init__(self, tree, axis: AxisSelector, what: str, is_scanned: Callable[[Any], bool] | None = None):
        flat, self.treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_named_array)
        self.leaves = [leaf for _, leaf in flat]
        name = name_of(axis)
        self.name = name
        self.size = axis.size if isinstance(axis, Axis) else None
        self.mapped: list[int] = []
        self.inner_axes: dict[int, tuple[Axis, ...] | None] = {}  # None: a plain array
        self.positions: dict[int, int] = {}
        sizes: list[tuple[int, str]] = []
        for k, leaf in enumerate(self.leaves):
            if isinstance(leaf, NamedArray):
                if name not in leaf.names or (is_scanned is not None and not is_scanned(leaf)):
                    continue
                i = leaf.names.index(name)
                self.inner_axes[k] = leaf.axes[:i] + leaf.axes[i + 1 :]
                sizes.append((leaf.axes[i].size, f"one input {format_axes(leaf.axes)}"))
            elif is_scanned is not None and _is_array(leaf) and is_scanned(leaf):
                if not leaf.shape:
                    raise AxisError(
                        f"{what}: the plain array at {place_of(flat[k][0])} has no dimension to map over "
                        f"{name!r}; pass it whole (is_scanned=) or give it a leading dimension"
                    )
                i = 0
                self.inner_axes[k] = None
                sizes.append((leaf.shape[0], f"the plain array at {place_of(flat[k][0])} (its first dimension)"))
            else:
                continue
            self.mapped.append(k)
            self.positions[k] = i
        for n, where in sizes:
            if self.size is None:
                self.size = n
            elif n != self.size:
                hint = (
                    (
                        "; a plain array is mapped along its first dimension: wrap one that every step shares with "
                        "nm.named(...), or close over it"
                    )
                    if "plain" in where
                    else ""
                )
                raise AxisError(f"{what}: axis {name!r} has size {n} in {where} but {self.size} elsewhere{hint}")
        if self.size is None:
            raise AxisError(f"{what}: no input has axis {name!r}; pass an Axis with a size to map over a new axis")

    def mapped_arrays(self, front: bool) -> list:
        out = []
        for k in self.mapped:
            leaf = self.leaves[k]
            arr = leaf.array if isinstance(leaf, NamedArray) else leaf
            out.append(jnp.moveaxis(arr, self.positions[k], 0) if front else arr)
        return out

    def rebuild(self, mapped_values: Sequence) -> Any:
        leaves = list(self.leaves)
        for k, v in zip(self.mapped, mapped_values):
            axes = self.inner_axes[k]
            leaves[k] = v if axes is None else unchecked(v, axes)
        return jax.tree.unflatten(self.treedef, leaves)


def place_of(path) -> str:
    """A leaf's place in ``(args, kwargs)``: ``args[1]``, ``kwargs['key']``, ``args[0].w``."""
    if len(path) >= 2 and isinstance(path[0], jax.tree_util.SequenceKey):
        head = "args" if path[0].idx == 0 else "kwargs"
        return head + jax.tree_util.keystr(path[1:])
    return jax.tree_util.keystr(path) or "the input"


class MappedOutputs:
    """Records the structure of a traced function's outputs, returns their arrays, and puts the
    mapped axis back on them afterwards."""

    def __init__(self):
        self.treedef = None
        self.kinds: list = []
        self.statics: dict[int, Any] = {}

    def strip(self, tree) -> list:
        leaves, self.treedef = jax.tree.flatten(tree, is_leaf=is_named_array)
        arrays, self.kinds = [], []
        for k, leaf in enumerate(leaves):
            if isinstance(leaf, NamedArray):
                self.kinds.append(leaf.axes)
                arrays.append(leaf.array)
            elif _is_array(leaf):
                self.kinds.append(None)
                arrays.append(leaf)
            else:
                self.kinds.append("static")
                self.statics[k] = leaf
        return arrays

    def restore(self, arrays: Sequence, new_axis: Axis) -> Any:
        it = iter(arrays)
        leaves = []
        for k, kind in enumerate(self.kinds):
            if kind == "static":
                leaves.append(self.statics[k])
            elif kind is None:
                leaves.append(next(it))
            else:
                if new_axis.name in {a.name for a in kind}:
                    raise AxisError(
                        f"an output already has axis {new_axis.name!r} {format_axes(kind)}; it cannot be added again"
                    )
                leaves.append(unchecked(next(it), (new_axis,) + kind))
        return jax.tree.unflatten(self.treedef, leaves)


def vmap(fn: Callable, axis: AxisSelection) -> Callable:
    """Vectorise ``fn`` over named ``axis`` (or several, outermost first).

    Inputs with the axis are mapped (and lose it inside ``fn``), plain arrays along their first
    dimension; everything else is shared. The axis name is also the collective axis name
    inside (``lax.axis_index(name)``).
    """
    sels = as_selectors(axis)
    if len(sels) != 1:
        if not sels:
            raise AxisError("vmap needs at least one axis")
        inner = vmap(fn, sels[1:])
        return vmap(inner, sels[0])
    (sel,) = sels

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        split = MappedSplit((args, kwargs), sel, f"vmap over {name_of(sel)!r}", is_named_or_shaped_array_like)
        outs = MappedOutputs()

        def body(*mapped):
            a, kw = split.rebuild(mapped)
            return outs.strip(fn(*a, **kw))

        in_axes = tuple(split.positions[k] for k in split.mapped)
        result = jax.vmap(body, in_axes=in_axes, out_axes=0, axis_size=split.size, axis_name=split.name)(
            *split.mapped_arrays(front=False)
        )
        return outs.restore(result, Axis(split.name, split.size))

    return wrapped


def _weakly_typed(x) -> bool:
    """A weakly typed value (from a Python number) may take another dtype: lax.scan promotes a
    carry that starts as one."""
    aval = jax.typeof(x.array if isinstance(x, NamedArray) else x)
    return bool(getattr(aval, "weak_type", False))


def _same_carry(before, after, what: str):
    """``after`` (a step's new carry) laid out as ``before`` (the carry it got), or an AxisError
    that names each leaf whose axes or dtype changed. A carry keeps its type from step to step;
    lax.scan would report a change as a mismatch of positional shapes, naming no axis. A carry
    that only comes back with its axes in another order is put back in order."""
    b_leaves, b_def = jax.tree_util.tree_flatten_with_path(before, is_leaf=is_named_array)
    a_leaves, a_def = jax.tree.flatten(after, is_leaf=is_named_array)
    if a_def != b_def:
        raise AxisError(
            f"{what}: the step returned a carry of another structure than it got ({a_def} instead of "
            f"{b_def}); each step must return the carry it takes, changed in value only"
        )
    changed, out = [], []
    for (path, b), a in zip(b_leaves, a_leaves):
        if isinstance(b, NamedArray) != isinstance(a, NamedArray):
            kinds = [
                f"a NamedArray {format_axes(v.axes)}"
                if isinstance(v, NamedArray)
                else f"a plain array of shape {tuple(v.shape)}"
                if hasattr(v, "shape")
                else f"a {type(v).__name__}"
                for v in (b, a)
            ]
            changed.append(f"{jax.tree_util.keystr(path) or 'the carry'} {kinds[0]} -> {kinds[1]}")
            out.append(a)
            continue
        if isinstance(b, NamedArray) and isinstance(a, NamedArray):
            if a.axes != b.axes and set(a.axes) == set(b.axes):
                a = a.rearrange(b.names)
            if a.axes != b.axes:
                changed.append(
                    f"{jax.tree_util.keystr(path) or 'the carry'} {format_axes(b.axes)} -> {format_axes(a.axes)}"
                )
        if hasattr(a, "dtype") and hasattr(b, "dtype") and a.dtype != b.dtype and not _weakly_typed(b):
            changed.append(f"{jax.tree_util.keystr(path) or 'the carry'} dtype {b.dtype} -> {a.dtype}")
        out.append(a)
    if changed:
        raise AxisError(
            f"{what}: the step changed the carry it passes on: {'; '.join(changed)}. Each step must "
            "return the carry with the axes (and dtype) it got; a stack whose blocks change them is an "
            "nn.BlockSeq, not an nn.Stacked"
        )
    return jax.tree.unflatten(b_def, out)


def scan(
    fn: Callable,
    axis: AxisSelector,
    *,
    remat=None,
    reverse: bool = False,
    unroll: int | bool | None = 1,
    is_scanned: bool | Callable[[Any], bool] = is_named_or_shaped_array_like,
) -> Callable:
    """``scan(f, axis)(init, *xs)``: ``f(carry, *x_slices) -> (carry, y)`` over ``axis``.

    Inputs with ``axis`` are sliced along it, plain arrays along their first dimension;
    others are passed whole to every step (``is_scanned``, a bool or a function of a leaf,
    narrows which leaves are scanned). The stacked ``y`` gets ``axis`` in front.

    ``remat`` checkpoints each step with a ``Remat`` policy (a string, ``True``, or Haliax's
    ``ScanCheckpointPolicy``); ``Remat(every=k)`` scans groups of ``k`` steps, each group
    checkpointed whole. ``unroll`` is ``lax.scan``'s (``None`` is 1). The carry keeps its axes and
    dtypes from step to step: a step that changes them raises an AxisError naming the leaves and
    axes that changed (one that returns them in another order is put back in order).
    """
    scanned = _predicate(is_scanned)
    unroll = _unroll(unroll)

    @functools.wraps(fn)
    def wrapped(init, *args, **kwargs):
        what = f"scan over {name_of(axis)!r}"
        split = MappedSplit((args, kwargs), axis, what, scanned)
        outs = MappedOutputs()
        policy = Remat.parse(remat, split.size)

        def body(carry, mapped):
            a, kw = split.rebuild(mapped)
            new, y = fn(carry, *a, **kw)
            return _same_carry(carry, new, what), outs.strip(y)

        step = with_remat(body, policy)
        xs, n = split.mapped_arrays(front=True), split.size
        k = 1 if policy is None else policy.every
        if k > 1 and n % k:
            raise NamedError(
                f"remat every={k} groups steps {k} at a time, but {split.name!r} has {n}: pick a divisor of {n}"
            )
        # every=k: only every k-th carry is kept (nested_scan's own backward pass); a carry or
        # output that is not a float falls back to groups of k steps checkpointed whole
        nested = None if k == 1 else nested_scan(body, init, xs, n, k, reverse=reverse)
        if k == 1:
            carry, ys = lax.scan(step, init, xs, length=n, reverse=reverse, unroll=unroll)
        elif nested is not None:
            carry, ys = nested
        else:

            def group(carry, chunk):  # k steps, checkpointed whole: only the group's input is kept
                return lax.scan(step, carry, chunk, length=k, reverse=reverse, unroll=unroll)

            group = eqx.filter_checkpoint(group, policy=None, prevent_cse=False)
            chunks = [x.reshape((n // k, k) + x.shape[1:]) for x in xs]
            carry, ys = lax.scan(group, init, chunks, length=n // k, reverse=reverse)
            ys = [y.reshape((n,) + y.shape[2:]) for y in ys]
        return carry, outs.restore(ys, Axis(split.name, n))

    return wrapped


def _unroll(unroll):
    if unroll is None:
        return 1
    if isinstance(unroll, bool):
        return unroll
    if not isinstance(unroll, int) or unroll < 1:
        raise ArgumentError(f"unroll must be an int >= 1 or a bool, got {unroll!r}")
    return unroll


def fold(
    fn: Callable,
    axis: AxisSelector,
    *,
    remat=None,
    reverse: bool = False,
    unroll: int | bool | None = 1,
    is_scanned: bool | Callable[[Any], bool] = is_named_or_shaped_array_like,
) -> Callable:
    """``fold(f, axis)(init, *xs)``: ``f(carry, *x_slices) -> carry`` over ``axis``; returns the
    carry. The arguments are ``scan``'s."""

    def step(carry, *a, **kw):
        return fn(carry, *a, **kw), None

    scanned = scan(step, axis, remat=remat, reverse=reverse, unroll=unroll, is_scanned=is_scanned)

    @functools.wraps(fn)
    def wrapped(init, *args, **kwargs):
        return scanned(init, *args, **kwargs)[0]

    return wrapped


def map(
    fn: Callable,
    axis: AxisSelector,
    *,
    remat=None,
    reverse: bool = False,
    unroll: int | bool | None = 1,
    is_mapped: bool | Callable[[Any], bool] = is_named_or_shaped_array_like,
) -> Callable:
    """``map(f, axis)(*xs)``: ``f`` applied to each slice along ``axis`` one after another (a
    scan without a carry, as ``jax.lax.map``; Haliax's ``hax.map``), to bound the memory that
    ``vmap`` would use at once. The results are stacked along ``axis``."""
    scanned = scan(
        lambda _, *a, **kw: (None, fn(*a, **kw)),
        axis,
        remat=remat,
        reverse=reverse,
        unroll=unroll,
        is_scanned=is_mapped,
    )

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        return scanned(None, *args, **kwargs)[1]

    return wrapped


def nmap(fn: Callable, *, consume: AxisSelection = (), produce: AxisSelection | None = None) -> Callable:
    """Run a positional function over named arrays.

    ``fn`` sees each NamedArray argument as a plain array whose dimensions are the ``consume``
    axes it has, in that order; it is vectorised over every other named axis (union of the
    arguments, first-seen order). ``fn``'s output dimensions are named ``produce`` (default:
    ``consume``; sizes are read from the output). Non-NamedArray arguments are passed as they are.

    ``nm.nmap(jnp.fft.rfft, consume="seq", produce="freq")(x)``
    """
    consumed = [name_of(a) for a in as_selectors(consume)]
    produced = [name_of(a) for a in as_selectors(produce)] if produce is not None else list(consumed)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        named_pos = [i for i, a in enumerate(args) if isinstance(a, NamedArray)]
        if not named_pos:
            raise AxisError("nmap: no NamedArray argument")
        had = {a.name for i in named_pos for a in args[i].axes}
        absent = [n for n in consumed if n not in had]
        if absent:  # fn would be handed arrays without the dimensions it consumes
            raise AxisError(
                f"nmap: consume names {absent}, which no argument has (their axes: "
                f"{', '.join(format_axes(args[i].axes) for i in named_pos)})"
            )
        batch = union(*(tuple(ax for ax in args[i].axes if ax.name not in consumed) for i in named_pos))
        # Lay every named argument out as [its batch axes in global order..., its consumed axes].
        prepared = {}
        for i in named_pos:
            x = args[i]
            b = [a.name for a in batch if a.name in x.names]
            c = [n for n in consumed if n in x.names]
            prepared[i] = (x.rearrange(tuple(b + c)).array, {a for a in b})

        def call(*arrays):
            full = list(args)
            for i, arr in zip(named_pos, arrays):
                full[i] = arr
            return fn(*full, **kwargs)

        f = call
        for ax in reversed(batch):
            in_axes = tuple(0 if ax.name in prepared[i][1] else None for i in named_pos)
            f = jax.vmap(f, in_axes=in_axes, out_axes=0)
        out = f(*(prepared[i][0] for i in named_pos))

        def name_leaf(leaf):
            extra = leaf.ndim - len(batch)
            if extra != len(produced):
                raise AxisError(
                    f"nmap: the function returned {extra} positional dimensions but produce names {len(produced)} "
                    f"({produced}); pass produce= with one name per output dimension"
                )
            new = tuple(Axis(n, int(s)) for n, s in zip(produced, leaf.shape[len(batch) :]))
            return NamedArray(leaf, tuple(batch) + new)

        return jax.tree.map(name_leaf, out)

    return wrapped


# ---- gradients of a named loss -------------------------------------------------------------------


def _loss_value(out, what: str):
    """The 0-d jax array a gradient is taken of. A 0-d NamedArray (what every full reduction
    returns) is unwrapped; one with axes is refused with the fix, which ``jax.grad`` would only
    call "not a scalar-output function"."""
    if isinstance(out, NamedArray):
        if out.axes:
            raise AxisError(
                f"{what}: the function returned a NamedArray with axes {format_axes(out.axes)}, but a gradient "
                "is taken of one number: reduce it first (loss.mean(), "
                "loss.sum(...)) to a NamedArray without axes"
            )
        out = out.array
    dtype = getattr(out, "dtype", None)
    if dtype is not None and not jnp.issubdtype(dtype, jnp.floating):
        raise ArgumentTypeError(
            f"{what}: the loss has dtype {dtype}; a gradient is taken of a floating loss (cast the "
            "inputs or the loss to float first)"
        )
    return out


def value_and_grad(fn: Callable, *, has_aux: bool = False) -> Callable:
    """``eqx.filter_value_and_grad(fn)`` for a loss that is a NamedArray: ``fn`` may return a 0-d
    NamedArray (or ``(loss, aux)`` with ``has_aux``), which ``jax.grad`` refuses unless it is
    turned into a ``jax.Array`` with ``.scalar()``; a loss that still has axes raises an AxisError
    naming them. The gradient is with respect to the floating arrays of the first argument (a
    model, a NamedArray, a pytree of them), as in equinox; the value comes back as ``fn`` gave it."""
    return _value_and_grad(fn, has_aux, "nm.value_and_grad")


def _value_and_grad(fn: Callable, has_aux: bool, caller: str) -> Callable:
    what = f"{caller}({getattr(fn, '__name__', 'fn')})"
    named_out = []

    def scalar_fn(*args, **kwargs):
        out = fn(*args, **kwargs)
        if has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise ArgumentTypeError(
                    f"{what}: has_aux=True needs the function to return (loss, aux), got {type(out).__name__}"
                )
            loss, aux = out
        else:
            loss, aux = out, None
        named_out[:] = [isinstance(loss, NamedArray)]
        loss = _loss_value(loss, what)
        return (loss, aux) if has_aux else loss

    inner = eqx.filter_value_and_grad(scalar_fn, has_aux=has_aux)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        value, grads = inner(*args, **kwargs)
        if has_aux:
            loss, aux = value
            return ((unchecked(loss, ()) if named_out[0] else loss), aux), grads
        return (unchecked(value, ()) if named_out[0] else value), grads

    return wrapped


def grad(fn: Callable, *, has_aux: bool = False) -> Callable:
    """The gradient part of :func:`value_and_grad`: ``grads``, or ``(grads, aux)`` with ``has_aux``."""
    vg = _value_and_grad(fn, has_aux, "nm.grad")

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        value, grads = vg(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    return wrapped
