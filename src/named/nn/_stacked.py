"""Stacked: a homogeneous stack of blocks stored with a leading ``layers`` axis and run with scan,
so compile time does not grow with depth; gradient checkpointing by a ``Remat`` policy.

Every way of running the stack takes the same arguments: ``x`` (the carry), then ``*args`` and
``**kwargs`` for each layer, where a NamedArray with the ``layers`` axis is sliced per layer
(per-layer keys, windows, caches), a plain array along its first dimension (Haliax's
``key=jax.random.split(key, n)``), and anything else goes whole to every layer; ``unroll=``
is ``lax.scan``'s. ``fold`` and
``scan`` call the block; ``fold_via(fn)`` and ``scan_via(fn)`` call ``fn(block, x, ...)`` or a
method by name instead (``stack.scan_via("decode")(x, cache)``). ``BlockSeq`` has the same
interface for blocks that differ, run by a Python loop.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp

from .._axis import Axis, AxisError, NamedError, format_axes, name_of
from .._core import NamedArray, is_named_array, unchecked
from .._remat import Remat, ScanCheckpointPolicy, remat_policy
from .._transforms import MappedSplit, is_named_or_shaped_array_like
from .._transforms import scan as nscan
from .._transforms import vmap as nvmap
from ._explicit_stack import active as _explicit_driver
from .precision import cast_for_compute

M = TypeVar("M", bound=eqx.Module)


# ---- helpers shared with BlockSeq -------------------------------------------------------------------


def as_method(fn: Callable | str, what: str) -> Callable:
    """``fn(block, x, *args, **kwargs)``; a string names a method of the block."""
    if callable(fn):
        return fn
    if not isinstance(fn, str):
        raise NamedError(f"{what} takes a function fn(block, x, ...) or a method name, got {fn!r}")

    def call(block, *args, **kwargs):
        method = getattr(block, fn, None)
        if not callable(method):
            raise NamedError(f"{what}({fn!r}): the block {type(block).__name__} has no method {fn!r}")
        return method(*args, **kwargs)

    return call


def call_block(block, *args, **kwargs):
    return block(*args, **kwargs)


def layer_index(i: int, Layers: Axis) -> int:
    if isinstance(i, bool) or not isinstance(i, int):
        raise NamedError(f"a layer index is an int, got {i!r}")
    if not -Layers.size <= i < Layers.size:
        raise AxisError(f"layer {i} is out of range for {Layers.name!r} of size {Layers.size}")
    return i % Layers.size


def slice_layer(tree, Layers: Axis, i):
    """Layer ``i`` of a pytree: NamedArray leaves with the Layers axis indexed, others whole."""

    def leaf(x):
        return x[Layers.name, i] if isinstance(x, NamedArray) and Layers.name in x.names else x

    return jax.tree.map(leaf, tree, is_leaf=is_named_array)


def argument_slices(tree, Layers: Axis, what: str) -> Callable[[int], Any]:
    """Layer ``i``'s arguments, by the scan's rule: NamedArrays with Layers indexed, plain arrays
    along their first dimension (sizes checked once, here), anything else whole."""
    split = MappedSplit(tree, Layers, what, is_named_or_shaped_array_like)
    xs = split.mapped_arrays(front=True)
    return lambda i: split.rebuild([x[i] for x in xs])


def _add_layers_axis(path, x, Layers: Axis):
    """Check one leaf of a block and give it (already stacked) the Layers axis."""
    if isinstance(x, NamedArray):
        if Layers.name in x.names:
            raise AxisError(f"block weight {jax.tree_util.keystr(path)} already has the layers axis {Layers.name!r}")
        return unchecked(x.array, (Layers,) + x.axes)
    if eqx.is_array(x):
        # fold/scan slice only NamedArrays along Layers: a plain array would reach every
        # layer whole, with the stacking dimension still on it.
        raise AxisError(
            f"block leaf {jax.tree_util.keystr(path)} is a plain array of shape {x.shape}; "
            "Stacked blocks hold their arrays as NamedArrays (wrap it with nm.named)"
        )
    return x


def structure_difference(a, b, path: str = "") -> str | None:
    """Where two blocks differ in structure: the first field (``.mlp.act``, ``[2]``) whose type, static
    value or set of entries is not the same, or None. Arrays are compared elsewhere (by axes)."""
    here = path or "the block"
    if is_named_array(a) or eqx.is_array(a):
        return (
            None
            if is_named_array(b) or eqx.is_array(b)
            else f"{here} is an array in one, {type(b).__name__} in the other"
        )
    if type(a) is not type(b):
        return f"{here} is {type(a).__name__} in one, {type(b).__name__} in the other"
    if dataclasses.is_dataclass(a):
        parts = [(f".{f.name}", getattr(a, f.name, None), getattr(b, f.name, None)) for f in dataclasses.fields(a)]
    elif isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{here} has {len(a)} entries in one, {len(b)} in the other"
        parts = [(f"[{i}]", x, y) for i, (x, y) in enumerate(zip(a, b))]
    elif isinstance(a, dict):
        if set(a) != set(b):
            return f"{here} has keys {sorted(map(str, a))} in one, {sorted(map(str, b))} in the other"
        parts = [(f"[{k!r}]", a[k], b[k]) for k in a]
    else:
        try:
            equal = bool(a == b)
        except Exception:  # noqa: BLE001 - a value without a plain ==: compare by identity
            equal = a is b
        return None if equal else f"{here} is {a!r} in one, {b!r} in the other"
    for name, x, y in parts:
        found = structure_difference(x, y, path + name)
        if found:
            return found
    return None


def stack_layers(trees: Sequence[Any], Layers: Axis, what: str):
    """Pytrees of one structure, one per layer, stacked leaf by leaf along a new leading Layers
    axis (plain arrays get a leading dimension; other leaves must be equal)."""
    flat = [jax.tree_util.tree_flatten_with_path(t, is_leaf=is_named_array) for t in trees]
    (first, treedef), out = flat[0], []
    for i, (_, td) in enumerate(flat[1:], 1):
        if td != treedef:
            where = structure_difference(trees[0], trees[i]) or "a different block type or static field"
            raise NamedError(
                f"{what}: layer {i} differs in structure from layer 0 ({where}): use BlockSeq for blocks that differ"
            )
    for k, (path, leaf) in enumerate(first):
        column = [leaves[k][1] for leaves, _ in flat]
        if isinstance(leaf, NamedArray):
            for i, x in enumerate(column):
                if not isinstance(x, NamedArray) or x.axes != leaf.axes:
                    got = format_axes(x.axes) if isinstance(x, NamedArray) else type(x).__name__
                    raise AxisError(
                        f"{what}: {jax.tree_util.keystr(path)} has axes {format_axes(leaf.axes)} in layer 0 "
                        f"but {got} in layer {i}"
                    )
            out.append(_add_layers_axis(path, unchecked(jnp.stack([x.array for x in column]), leaf.axes), Layers))
        elif eqx.is_array(leaf):
            out.append(jnp.stack(column))
        else:
            out.append(leaf)
    return jax.tree.unflatten(treedef, out)


def layers_axis(Layers: Axis | str, n: int, what: str) -> Axis:
    if isinstance(Layers, Axis) and Layers.size != n:
        raise AxisError(f"{what}: {n} layers given but {Layers.name!r} has size {Layers.size}")
    if n == 0:
        raise NamedError(f"{what} needs at least one layer")
    return Layers if isinstance(Layers, Axis) else Axis(name_of(Layers), n)


def check_every(remat, Layers: Axis) -> None:
    r = Remat.parse(remat, Layers.size)
    if r is not None and Layers.size % r.every:
        raise NamedError(
            f"remat every={r.every} groups layers {r.every} at a time, but {Layers.name!r} has "
            f"{Layers.size} layers: pick a divisor of {Layers.size}"
        )


def checkpointing(remat, gradient_checkpointing, prevent_cse, Layers: Axis):
    """The ``remat`` of a stack from ours or Haliax's ``gradient_checkpointing=`` (its strings mean
    what they mean in Haliax: ``"offload"`` there is not our ``"offload"``), validated."""
    del prevent_cse  # Haliax's deprecated flag; inside a scan there is no common subexpression to protect
    if gradient_checkpointing is not None:
        if remat != "none":
            raise NamedError("give remat= or Haliax's gradient_checkpointing=, not both")
        remat = (
            gradient_checkpointing
            if isinstance(gradient_checkpointing, ScanCheckpointPolicy)
            else ScanCheckpointPolicy.from_bool_or_str(gradient_checkpointing)
        )
    remat_policy(remat, Layers.size)  # an unknown policy fails here, before the (possibly large) init
    check_every(remat, Layers)
    return remat


def block_init_function(block_init) -> Callable:
    """Haliax passes the block's class (``Stacked.init(Layers, Block)``) and calls its ``init``."""
    if isinstance(block_init, type) and callable(getattr(block_init, "init", None)):
        return block_init.init
    if not callable(block_init):
        raise NamedError(
            f"a stack's block_init is a function (or a module class with a static init), got {block_init!r}"
        )
    return block_init


def curried_init(make: Callable, Layers: Axis, remat) -> Callable:
    """Haliax's curried ``Stacked.init(Layers, Block)(*args, **kwargs)``: ``make`` vmapped over
    ``Layers`` with nm.vmap's rule (a NamedArray with ``Layers`` sliced along it, a plain array
    such as ``key=jax.random.split(k, n)`` along its first dimension, anything else whole)."""

    def init(*args, **kwargs) -> Stacked:
        blocks = nvmap(make, Layers)(*args, **kwargs)  # NamedArray leaves come back with Layers in front

        def leaf(path, x):
            return x if isinstance(x, NamedArray) else _add_layers_axis(path, x, Layers)

        return Stacked(jax.tree_util.tree_map_with_path(leaf, blocks, is_leaf=is_named_array), Layers, remat)

    return init


# ---- Stacked -------------------------------------------------------------------------------------


class Stacked(eqx.Module, Generic[M]):
    """``Layers.size`` copies of one block, each weight with a leading ``Layers`` axis."""

    stacked: M
    Layers: Axis = eqx.field(static=True)
    remat: Any = eqx.field(static=True, default="none")
    # A precision policy (jmp.Policy) set by nn.cast_for_compute: each layer's weights are cast to its
    # compute dtype as the scan reaches the layer (where it recomputes its layers; explicit mode casts
    # each layer's shards before gathering them), so no cast copy of the whole stack, nor of its
    # gradient, is held. None: the layers compute with the weights as stored.
    layer_cast: Any = eqx.field(static=True, default=None)

    def __check_init__(self):
        if not isinstance(self.Layers, Axis):
            raise AxisError(f"Stacked needs a Layers Axis with a size, got {self.Layers!r}")
        remat_policy(self.remat, self.Layers.size)  # an unknown policy fails here, before anything is traced
        check_every(self.remat, self.Layers)
        # Built directly (not by init/from_layers), every array must already be stacked: a leaf
        # without the Layers axis would reach every layer whole, and get_layer would return it so.
        for path, x in jax.tree_util.tree_leaves_with_path(self.stacked, is_leaf=is_named_array):
            if isinstance(x, NamedArray):
                if self.Layers.name not in x.names:
                    raise AxisError(
                        f"Stacked: block weight {jax.tree_util.keystr(path)} {format_axes(x.axes)} lacks the "
                        f"layers axis {self.Layers.name!r}; Stacked.init and Stacked.from_layers add it"
                    )
                if x.axis_size(self.Layers.name) != self.Layers.size:
                    raise AxisError(
                        f"Stacked: block weight {jax.tree_util.keystr(path)} {format_axes(x.axes)} has "
                        f"{self.Layers.name}={x.axis_size(self.Layers.name)}, not the stack's {self.Layers.size}"
                    )
            elif eqx.is_array(x):
                _add_layers_axis(path, x, self.Layers)  # raises: a plain array cannot be sliced per layer

    @staticmethod
    def init(
        Layers: Axis,
        block_init: Callable[..., M],
        *args,
        key=None,
        remat="none",
        gradient_checkpointing=None,
        prevent_cse=None,
        **kwargs,
    ):
        """``block_init(*args, key=k, **kwargs)`` for each layer, vmapped over split keys.

        Haliax's curried form is also accepted: ``Stacked.init(Layers, Block)(*args, **kwargs)``
        (no ``key=`` here) calls ``Block.init`` with each layer's slice of the arguments (a
        NamedArray along ``Layers``, a plain array such as ``key=jax.random.split(k, n)`` along
        its first dimension; anything else whole), and ``gradient_checkpointing=`` is a
        ``ScanCheckpointPolicy`` or one of Haliax's strings.
        """
        if not isinstance(Layers, Axis):
            raise AxisError(f"Stacked needs a Layers Axis with a size, got {Layers!r}")
        remat = checkpointing(remat, gradient_checkpointing, prevent_cse, Layers)
        make = block_init_function(block_init)
        if key is None:
            if args or kwargs:
                raise NamedError(
                    "Stacked.init without key= is Haliax's curried form: Stacked.init(Layers, Block)(*args, "
                    "key=jax.random.split(key, n), ...); ours takes the block's arguments and key= at once"
                )
            return curried_init(make, Layers, remat)
        keys = jax.random.split(key, Layers.size)
        blocks = eqx.filter_vmap(lambda k: make(*args, key=k, **kwargs))(keys)
        stacked = jax.tree_util.tree_map_with_path(
            lambda p, x: _add_layers_axis(p, x, Layers), blocks, is_leaf=is_named_array
        )
        return Stacked(stacked, Layers, remat)

    @staticmethod
    def from_layers(blocks: Sequence[M], Layers: Axis | str = "layers", *, remat="none") -> Stacked[M]:
        """The stack of ``blocks`` (of one type and shape), e.g. after editing ``unstacked()``."""
        blocks = list(blocks)
        Layers = layers_axis(Layers, len(blocks), "Stacked.from_layers")
        for b in blocks:
            for path, x in jax.tree_util.tree_leaves_with_path(b, is_leaf=is_named_array):
                if not isinstance(x, NamedArray) and eqx.is_array(x):
                    _add_layers_axis(path, x, Layers)  # raises: plain arrays cannot be sliced per layer
        return Stacked(stack_layers(blocks, Layers, "Stacked.from_layers"), Layers, remat)

    @property
    def Block(self) -> Axis:
        """Haliax's name for ``Layers``."""
        return self.Layers

    # -- running the stack --

    def fold(self, x, *args, unroll=None, **kwargs):
        """``x = block(x, *args, **kwargs)`` for each layer in order. Arguments with the Layers
        axis (e.g. per-layer keys as ``nm.named(keys, "layers")``) and plain arrays (along their
        first dimension) are sliced per layer."""
        return self.fold_via(call_block, unroll=unroll)(x, *args, **kwargs)

    def scan(self, x, *args, unroll=None, **kwargs):
        """Like ``fold`` but ``block`` returns ``(x, y)``; the ys are stacked along Layers."""
        return self.scan_via(call_block, unroll=unroll)(x, *args, **kwargs)

    def vmap(self, x, *args, **kwargs):
        """Every layer applied to the same ``x`` at once (an ``x`` with the Layers axis gives each
        layer its own); the outputs are stacked along Layers."""
        return self.vmap_via(call_block)(x, *args, **kwargs)

    def fold_via(self, fn: Callable | str, *, unroll=None) -> Callable:
        """``x = fn(block, x, *args, **kwargs)`` per layer; ``fn`` may name a method of the block."""
        call = as_method(fn, "Stacked.fold_via")

        def step(block, carry, *a, **kw):
            return call(block, carry, *a, **kw), None

        return lambda x, *args, **kwargs: self._run(step, x, args, kwargs, unroll)[0]

    def scan_via(self, fn: Callable | str, *, unroll=None) -> Callable:
        """``x, y = fn(block, x, *args, **kwargs)`` per layer; returns ``x`` and the stacked ys."""
        call = as_method(fn, "Stacked.scan_via")
        return lambda x, *args, **kwargs: self._run(call, x, args, kwargs, unroll)

    def vmap_via(self, fn: Callable | str) -> Callable:
        """``fn(block, x, *args, **kwargs)`` for all layers at once, stacked along Layers."""
        call = as_method(fn, "Stacked.vmap_via")
        return lambda x, *args, **kwargs: nvmap(call, self.Layers)(self.compute_stacked(), x, *args, **kwargs)

    def compute_stacked(self) -> M:
        """The stacked block as the layers compute with it: ``stacked`` with the cast of
        ``nn.cast_for_compute`` applied (a copy of the whole stack in the compute dtype). For
        code that uses the stack whole (an MoE's experts); ``fold`` and ``scan`` cast per layer."""
        return self._cast(self.stacked)

    def cast_as_it_runs(self, policy) -> Stacked[M]:
        """This stack as ``nn.cast_for_compute(stack, policy)`` returns it: the weights as stored,
        each layer cast by ``policy`` as the stack runs (``layer_cast``). Its arrays are not checked
        again: they may be one device's shards (explicit mode rebuilds blocks from them)."""
        out = copy.copy(self)
        object.__setattr__(out, "layer_cast", policy)  # a frozen module: set on the fresh copy
        return out

    def _cast(self, block):
        return block if self.layer_cast is None else cast_for_compute(block, self.layer_cast)

    def _run(self, step, x, args, kwargs, unroll=None):
        driver = _explicit_driver()  # set by nn.explicit_layers: run the scan per device
        if driver is not None:  # it gathers each layer's shards itself, and casts them first (layer_cast)
            return driver.run(self, step, x, args, kwargs)
        remat = Remat.parse(self.remat, self.Layers.size)
        # Without recomputation the backward pass keeps every layer's cast weights anyway: the stack is
        # cast whole here (cast per layer, XLA:CPU, computing bf16 matmuls in float32, also kept float32
        # copies of them). With it, each layer is cast as the scan reaches it.
        whole = remat is None

        def body(carry, block, *a, **kw):
            return step(block if whole else self._cast(block), carry, *a, **kw)

        stacked = self.compute_stacked() if whole else self.stacked
        return nscan(body, self.Layers, remat=remat, unroll=unroll)(x, stacked, *args, **kwargs)

    # -- per-layer access --

    def get_layer(self, i: int) -> M:
        """Block ``i`` (negative counts from the end), for inspection or editing."""
        return self._cast(slice_layer(self.stacked, self.Layers, layer_index(i, self.Layers)))

    def set_layer(self, i: int, block: M) -> Stacked[M]:
        """A copy of the stack with block ``i`` replaced (it must match the others' structure and axes)."""
        i = layer_index(i, self.Layers)
        old_leaves, treedef = jax.tree_util.tree_flatten_with_path(self.stacked, is_leaf=is_named_array)
        new_leaves, new_def = jax.tree.flatten(block, is_leaf=is_named_array)
        if new_def != jax.tree.structure(self.get_layer(0), is_leaf=is_named_array):
            where = structure_difference(self.get_layer(0), block) or "a different block type or static field"
            raise NamedError(f"Stacked.set_layer: the block differs in structure from the stacked ones ({where})")
        out = []
        for (path, old), new in zip(old_leaves, new_leaves):
            if isinstance(old, NamedArray):
                if not isinstance(new, NamedArray) or new.axes != old.axes[1:]:
                    got = format_axes(new.axes) if isinstance(new, NamedArray) else type(new).__name__
                    raise AxisError(
                        f"Stacked.set_layer: {jax.tree_util.keystr(path)} "
                        f"needs axes {format_axes(old.axes[1:])}, got {got}"
                    )
                old = old.at[self.Layers.name, i].set(new)
            out.append(old)
        return dataclasses.replace(self, stacked=jax.tree.unflatten(treedef, out))

    def unstacked(self) -> list[M]:
        """The blocks one by one (for per-layer access and editing; ``from_layers`` puts them back)."""
        return [self.get_layer(i) for i in range(self.Layers.size)]
