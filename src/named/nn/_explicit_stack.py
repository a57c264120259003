"""Explicit mode for a layer stack: the same ``Stacked`` blocks, driven per device on a schedule.

Under ``with nn.explicit_layers(nn.ExplicitStack(param, compute)):`` every ``Stacked`` that
runs (``fold``, ``scan``, ``fold_via``, ``scan_via``) runs its whole scan inside
``nm.shard_map``: the stacked weights come in as their stored blocks (laid out by ``param``),
the carry and per-layer arguments as activation blocks (laid out by ``compute``). The blocks
are unchanged; what the driver owns is where the collectives go:

- forward: layer ``i+1``'s weights are all-gathered (FSDP's ``embed/data`` -> ``embed``) in
  iteration ``i``, before layer ``i`` computes, into a second buffer of the scan carry; so the
  gather has layer ``i``'s compute to hide behind, and two layers' gathered weights are live.
- what is kept: each layer's input only (the carry), never a gathered weight.
- backward, a custom VJP over the whole scan, layers in reverse: layer ``i-1``'s weights are
  gathered while layer ``i`` is recomputed from its input and differentiated; layer ``i``'s
  weight gradient is reduce-scattered (the transpose of its gather) as soon as it is made, so
  the stack's gradient is only ever held split.
- batch split (``batch_split=n``): each layer runs on ``n`` equal pieces of the device's batch,
  one after another, with the pieces' collectives ordered (``_local.CollectiveOrder``) so that
  XLA does not merge them: one piece's collective has the other's compute beside it.

Layouts: the compute mapping may split ``batch`` (data parallelism; FSDP when the parameter
mapping splits weight axes the activations keep whole, which are gathered per layer) and weight
axes stored split the same way (tensor parallelism: ``mlp``/``heads`` over ``model``; expert
parallelism: ``experts``), which stay split: the blocks' contractions over them are summed by
``nm.einsum``'s ``psum`` on local blocks. ``check`` refuses other layouts before anything is traced.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from .. import _compat
from .._axis import ArgumentError, ArgumentTypeError, Axis, NamedError
from .._context import (
    FrozenMapping,
    body_context,
    check_mapping_values,
    current_body,
    current_layer_driver,
    layer_driver_context,
    part_of_block,
)
from .._core import NamedArray, is_named_array, unchecked
from .._local import CollectiveOrder, join_blocks, split_block, split_over
from .._transforms import MappedOutputs, MappedSplit, place_of
from ..explicit import all_gather, shard_map
from ..partitioning import ShardingError, mesh_axes_of
from .precision import cast_for_compute


@dataclasses.dataclass(frozen=True)
class ExplicitStack:
    """How to drive a ``Stacked`` in explicit mode: the stored layout of its weights
    (``param_mapping``) and the layout of its activations (``compute_mapping``). Frozen and
    hashable (the mappings become :class:`FrozenMapping`): ``nn.explicit_layers`` makes it part
    of every jit's cache key."""

    param_mapping: Mapping[str, Any]
    compute_mapping: Mapping[str, Any]
    mesh: Any = None  # default: the current mesh
    independent: tuple[str, ...] = ("batch",)  # activation axes the layers never mix
    batch_split: int = 1  # each layer runs on this many equal parts of the device's batch (the seed's batch split)

    def __post_init__(self):
        for field in ("param_mapping", "compute_mapping"):
            mapping = getattr(self, field) or {}
            try:
                check_mapping_values(mapping)
            except ShardingError as e:
                raise ShardingError(f"ExplicitStack {field}: {e}") from None
            object.__setattr__(self, field, FrozenMapping(mapping))
        if self.mesh is not None and not isinstance(self.mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
            raise ShardingError(
                f"ExplicitStack: mesh= takes a jax mesh (nm.make_mesh) or None (the current one), "
                f"got {type(self.mesh).__name__}"
            )
        independent = (self.independent,) if isinstance(self.independent, str) else tuple(self.independent)
        object.__setattr__(self, "independent", independent)
        if isinstance(self.batch_split, bool) or not isinstance(self.batch_split, int) or self.batch_split < 1:
            raise ArgumentError(f"ExplicitStack: batch_split={self.batch_split!r} must be a positive int (1: no split)")

    def split(self, mapping: Mapping[str, Any], name: str) -> tuple[str, ...]:
        return tuple(mesh_axes_of(mapping.get(name)))

    def check(self, weight_axes: set[str], carried_axes: set[str]) -> None:
        """Refuse layouts the unchanged blocks cannot compute per device: an activation axis
        split that a layer mixes (anything but ``independent`` axes and the weights' own axes),
        and a weight axis the compute mapping splits other than its stored layout does."""
        for n in sorted(n for n in self.compute_mapping if self.split(self.compute_mapping, n)):
            c, p = self.split(self.compute_mapping, n), self.split(self.param_mapping, n)
            if n in weight_axes and c != p:
                raise ShardingError(
                    f"explicit mode: the compute mapping splits {n!r} over {list(c)} but the parameter mapping "
                    f"{'over ' + str(list(p)) if p else 'keeps it whole'}; a weight axis that activations split "
                    f"(tensor or expert parallelism) must be stored split the same way"
                )
            if n not in weight_axes and n in carried_axes and n not in self.independent:
                raise ShardingError(
                    f"explicit mode: the compute mapping splits {n!r}, an axis the layers mix (attention over "
                    f"positions, norms over features); only {list(self.independent)} and the weights' own "
                    f"axes may be split in the layer stack"
                )

    def keeps_split(self, a: Axis) -> bool:
        """A stored weight axis the layers use split as it is (tensor/expert parallelism)."""
        return split_over(a) == self.split(self.compute_mapping, a.name)

    def run(self, stacked, step, x, args, kwargs):
        """``step(block, x, *args, **kwargs) -> (x, y)`` over the layers of ``stacked``, per device."""

        def names(tree):
            return {
                n for w in jax.tree.leaves(tree, is_leaf=is_named_array) if isinstance(w, NamedArray) for n in w.names
            }

        self.check(names(stacked.stacked) - {stacked.Layers.name}, names((x, args, kwargs)))
        for path, leaf in jax.tree_util.tree_leaves_with_path((args, kwargs), is_leaf=is_named_array):
            if not isinstance(leaf, NamedArray) and eqx.is_array(leaf) and leaf.ndim:
                # the local stack slices what names say: a plain per-layer argument would reach every layer whole
                raise ShardingError(
                    f"explicit mode: the layer argument {place_of(path)} is a plain array of "
                    f"shape {tuple(leaf.shape)}; give per-layer arguments as NamedArrays "
                    f"(nm.named(a, ({stacked.Layers.name!r}, ...))) so that each device slices them"
                )
        if self.batch_split > 1:
            cut = self.independent[0]
            whole = [
                w
                for w in jax.tree.leaves(x, is_leaf=is_named_array)
                if not (isinstance(w, NamedArray) and cut in w.names)
            ]
            if whole:
                w = whole[0]
                what = f"has axes {w.axes}" if isinstance(w, NamedArray) else "is not a NamedArray"
                raise ShardingError(
                    f"explicit mode: batch_split={self.batch_split} cuts the layers' carry along {cut!r}, but a "
                    f"carried value {what} without it"
                )

        def body(weights, carry, a, kw):
            return _PrefetchedScan(self, step, stacked.Layers, weights, a, kw, stacked.layer_cast)(carry)

        c = self.compute_mapping
        run = shard_map(body, mesh=self.mesh, in_mapping=(self.param_mapping, c, c, c))
        return run(stacked.stacked, x, tuple(args), dict(kwargs))


class _PrefetchedScan:
    """The layer scan of one body: the forward pass with a one-layer gather prefetch, and its
    custom VJP (recompute each layer from its input, reduce-scatter its weight gradient).

    Everything is kept as flat lists of raw arrays, because that is what ``lax.scan`` carries
    and ``jax.custom_vjp`` differentiates; ``MappedSplit`` knows how to put the NamedArrays back.
    """

    def __init__(self, driver: ExplicitStack, step, Layers: Axis, weights, args, kwargs, cast=None):
        # jax traces the backward pass later, outside shard_map's trace of the body: it
        # re-enters the body's context for its collectives.
        self.step, self.L, self.body = step, Layers.size, current_body()
        self.parts, self.cut = driver.batch_split, driver.independent[0]
        self.split = MappedSplit((weights, args, kwargs), Layers, "the explicit layer scan")
        n_weights = len(jax.tree.leaves(weights, is_leaf=is_named_array))
        self.weights = [j for j, k in enumerate(self.split.mapped) if k < n_weights]  # positions among mapped
        self.layered = self.split.mapped_arrays(front=True)  # weights and per-layer arguments, layers in front
        self.shared = [
            k
            for k, leaf in enumerate(self.split.leaves)
            if k not in self.split.positions and eqx.is_array(leaf if not isinstance(leaf, NamedArray) else leaf.array)
        ]
        # The dtype each weight is cast to before its gather (the stack's layer_cast, nn.cast_for_compute's
        # rule): the layer's shard is cast, so the gather and its reduce-scatter move compute-dtype bytes.
        self.cast_to: dict[int, Any] = {}
        if cast is not None:
            cast_shapes = jax.eval_shape(lambda w: cast_for_compute(w, cast), weights)
            shapes = jax.tree.leaves(cast_shapes, is_leaf=is_named_array)
            for j in self.weights:
                k = self.split.mapped[j]
                if shapes[k].dtype != self.split.leaves[k].dtype:
                    self.cast_to[j] = shapes[k].dtype
        # What each weight's gather makes whole: the axes its stored layout splits and the layers do not.
        self.gather_axes: dict[int, list[str]] = {}
        for j in self.weights:
            k = self.split.mapped[j]
            self.gather_axes[j] = [
                a.name for a in self.split.inner_axes[k] if split_over(a) and not driver.keeps_split(a)
            ]

    # -- pieces of one layer --

    def _gather(self, j: int, raw):
        """One layer's block of weight ``j`` (raw), cast for compute, gathered whole where its layout splits it."""
        if j in self.cast_to:
            raw = raw.astype(self.cast_to[j])
        names = self.gather_axes[j]
        if not names:
            return raw
        k = self.split.mapped[j]
        return all_gather(unchecked(raw, self.split.inner_axes[k]), names).array

    def _gathered_layer(self, layered, i):
        return [self._gather(j, lax.dynamic_index_in_dim(layered[j], i, keepdims=False)) for j in self.weights]

    def _call(self, gathered, carry, layer_args, shared):
        """Layer ``step`` on raw pieces: the gathered weights, the carry, this layer's slice of
        each per-layer argument and the shared arguments. Returns (carry, raw ys)."""
        leaves = list(self.split.leaves)
        it_g, it_a = iter(gathered), iter(layer_args)
        for j, k in enumerate(self.split.mapped):
            axes = self.split.inner_axes[k]
            if j in self.gather_axes:
                raw = next(it_g)
                axes = tuple(
                    a if a.name not in self.gather_axes[j] else Axis(a.name, n) for a, n in zip(axes, raw.shape)
                )
                leaves[k] = unchecked(raw, axes)
            else:
                leaves[k] = unchecked(next(it_a), axes)
        for k, v in zip(self.shared, shared):
            leaves[k] = unchecked(v, leaves[k].axes) if isinstance(leaves[k], NamedArray) else v
        block, a, kw = jax.tree.unflatten(self.split.treedef, leaves)
        with layer_driver_context(None):  # a Stacked inside a layer runs locally
            carry, y = self.step(block, carry, *a, **kw) if self.parts == 1 else self._in_parts(block, carry, a, kw)
        return carry, self.outs.strip(y)

    def _in_parts(self, block, carry, args, kwargs):
        """The layer on each of ``parts`` equal pieces of the batch, one after another in the
        program: the pieces do not depend on each other, so a scheduler is free to run one
        piece's collectives while it computes the other's (the seed's batch split). The carries
        and batched outputs are joined again; an output without the batch axis is a mean over
        the batch's tokens (an MoE router's statistics) and is averaged over the equal pieces."""
        cut, n = self.cut, self.parts

        def pieces(tree):
            leaves, treedef = jax.tree.flatten(tree, is_leaf=is_named_array)
            cols = [split_block(v, cut, n) if isinstance(v, NamedArray) and cut in v.names else [v] * n for v in leaves]
            return [jax.tree.unflatten(treedef, [c[k] for c in cols]) for k in range(n)]

        # A replicated weight that a piece uses is marked varying by jax, and autodiff sums its
        # gradient across devices per mark: marked once for all pieces, it is summed once.
        carried = frozenset().union(*(_compat.varying_axes(v) for v in jax.tree.leaves(carry)))

        def mark(w):
            missing = carried - _compat.varying_axes(w) if eqx.is_inexact_array(w) else ()
            return jax.lax.pcast(w, tuple(sorted(missing)), to="varying") if missing else w

        block = jax.tree.map(mark, block)
        outs, order = [], CollectiveOrder()
        for k, (c, a, kw) in enumerate(zip(pieces(carry), pieces(args), pieces(kwargs))):
            # piece k's collectives wait for piece k-1's (never merged); dropout draws this
            # piece's part of the whole batch's mask
            with part_of_block(cut, k, n), order.piece():
                outs.append(self.step(block, c, *a, **kw))
        return _join([o[0] for o in outs], cut), _join([o[1] for o in outs], cut)

    def _args_at(self, layered, i):
        return [
            lax.dynamic_index_in_dim(layered[j], i, keepdims=False)
            for j in range(len(self.split.mapped))
            if j not in self.gather_axes
        ]

    # -- the scan --

    def __call__(self, carry):
        self.outs = MappedOutputs()
        shared = [
            self.split.leaves[k].array if isinstance(self.split.leaves[k], NamedArray) else self.split.leaves[k]
            for k in self.shared
        ]
        carry_out, ys = self._scan(self.layered, carry, shared)
        return carry_out, self.outs.restore(ys, Axis(self.split.name, self.L))

    def _forward(self, layered, carry, shared, keep_inputs: bool):
        L = self.L

        def body(c, i):
            x, gathered = c
            # Issued before this layer computes and independent of it: the next layer's gather.
            prefetched = self._gathered_layer(layered, jnp.minimum(i + 1, L - 1))
            x_next, y = self._call(gathered, x, self._args_at(layered, i), shared)
            return (x_next, prefetched), (y, x if keep_inputs else None)

        first = self._gathered_layer(layered, 0)
        (carry, _), (ys, inputs) = lax.scan(body, (carry, first), jnp.arange(L))
        return carry, ys, inputs

    def _scan(self, layered, carry, shared):
        @jax.custom_vjp
        def scan(layered, carry, shared):
            carry, ys, _ = self._forward(layered, carry, shared, keep_inputs=False)
            return carry, ys

        def fwd(layered, carry, shared):
            # Which inputs the caller differentiates: a frozen weight (LoRA's base) gets no
            # gradient and no reduce-scatter in the backward pass.
            self.wanted = [p.perturbed and eqx.is_inexact_array(p.value) for p in layered + shared]
            layered, carry, shared = jax.tree.map(lambda p: p.value, (layered, carry, shared), is_leaf=_is_primal)
            carry_out, ys, inputs = self._forward(layered, carry, shared, keep_inputs=True)
            return (carry_out, ys), (layered, inputs, shared)

        scan.defvjp(fwd, self._backward, symbolic_zeros=True)
        return scan(layered, carry, shared)

    def _backward(self, saved, cotangents):
        cotangents = jax.tree.map(_instantiate, cotangents, is_leaf=_is_symbolic_zero)
        with body_context(self.body):
            return self._backward_in_body(saved, cotangents)

    def _backward_in_body(self, saved, cotangents):
        layered, inputs, shared = saved
        ct_carry, ct_ys = cotangents
        L = self.L
        want_layered, want_shared = self.wanted[: len(layered)], self.wanted[len(layered) :]
        want_w = [want_layered[j] for j in self.weights]
        args_j = [j for j in range(len(layered)) if j not in self.gather_axes]
        want_args = [want_layered[j] for j in args_j]

        def body(c, xs):
            ct_x, gathered, ct_shared = c
            i, x, ct_y = xs
            prefetched = self._gathered_layer(layered, jnp.maximum(i - 1, 0))
            layer_args = self._args_at(layered, i)

            def layer(w_diff, x, args_diff, shared_diff):
                return self._call(
                    _merge(gathered, w_diff, want_w),
                    x,
                    _merge(layer_args, args_diff, want_args),
                    _merge(shared, shared_diff, want_shared),
                )

            _, vjp = jax.vjp(
                layer, _only(gathered, want_w), x, _only(layer_args, want_args), _only(shared, want_shared)
            )
            ct_g, ct_x, ct_args, ct_sh = vjp((ct_x, ct_y))
            # The transpose of this layer's gathers: each weight's gradient reduce-scattered now.
            ct_w = [
                self._scatter(j, lax.dynamic_index_in_dim(layered[j], i, keepdims=False), g)
                for j, g in zip(_only(self.weights, want_w), ct_g)
            ]
            ct_shared = jax.tree.map(jnp.add, ct_shared, ct_sh)
            return (ct_x, prefetched, ct_shared), (ct_w, ct_args)

        last = self._gathered_layer(layered, L - 1)
        zero_shared = [jnp.zeros_like(v) for v in _only(shared, want_shared)]
        (ct_carry, _, ct_sh), (ct_w, ct_args) = lax.scan(
            body, (ct_carry, last, zero_shared), (jnp.arange(L), inputs, ct_ys), reverse=True
        )
        ct_layered = [None] * len(layered)  # None: no gradient (frozen, integer or key inputs)
        for j, g in zip(_only(self.weights, want_w), ct_w):
            ct_layered[j] = g
        for j, g in zip(_only(args_j, want_args), ct_args):
            ct_layered[j] = g
        return ct_layered, ct_carry, _merge(shared, ct_sh, want_shared, fill=None)

    def _scatter(self, j: int, shard, ct_gathered):
        if not self.gather_axes[j] and j not in self.cast_to:
            return ct_gathered
        _, transpose = jax.vjp(lambda s: self._gather(j, s), shard)  # the gather itself is dead code here
        return transpose(ct_gathered)[0]


def _join(outs: list, cut: str):
    """Per-piece outputs of one layer made whole: concatenated along ``cut`` where they have it,
    averaged where they are float values without it; anything else must not differ by piece."""
    flat = [jax.tree.flatten(o, is_leaf=is_named_array) for o in outs]
    joined = []
    for col in zip(*(leaves for leaves, _ in flat)):
        v = col[0]
        raw = v.array if isinstance(v, NamedArray) else v
        if isinstance(v, NamedArray) and cut in v.names:
            joined.append(join_blocks(col, cut))
        elif eqx.is_inexact_array(raw):
            mean = sum((c.array if isinstance(c, NamedArray) else c) for c in col) / len(col)
            joined.append(unchecked(mean, v.axes) if isinstance(v, NamedArray) else mean)
        elif eqx.is_array(raw):
            raise NamedError(
                f"explicit mode's batch split: a layer output of dtype {raw.dtype} without axis {cut!r} "
                f"cannot be put together from the pieces of the batch; give it the {cut!r} axis"
            )
        else:
            joined.append(v)
    return jax.tree.unflatten(flat[0][1], joined)


def _only(values, keep: list[bool]) -> list:
    return [v for v, k in zip(values, keep) if k]


def _merge(values, chosen, keep: list[bool], fill: Any = ...) -> list:
    """``values`` with the entries ``keep`` marks replaced, in order, by ``chosen`` (the
    others by ``fill`` unless it is left out)."""
    it = iter(chosen)
    return [next(it) if k else (v if fill is ... else fill) for v, k in zip(values, keep)]


def _is_primal(x) -> bool:
    return isinstance(x, CustomVJPPrimal)


def _is_symbolic_zero(x) -> bool:
    return isinstance(x, SymbolicZero)


def _instantiate(ct):
    return jnp.zeros(ct.shape, ct.dtype) if isinstance(ct, SymbolicZero) else ct


def active() -> ExplicitStack | None:
    """The driver every ``Stacked`` run now uses, or None (the default: GSPMD)."""
    return current_layer_driver()


@contextlib.contextmanager
def explicit_layers(driver: ExplicitStack | None) -> Iterator[None]:
    """Run every ``Stacked`` inside with ``driver`` (None: as usual). Like the compute mapping it is
    part of every jit's cache key: a jitted function called under another driver is traced again,
    whether the block is entered inside the function or around its call."""
    if driver is not None and not isinstance(driver, ExplicitStack):
        raise ArgumentTypeError(f"nn.explicit_layers takes an nn.ExplicitStack or None, got {type(driver).__name__}")
    with layer_driver_context(driver):
        yield
