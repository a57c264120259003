"""BlockSeq: layers that may differ (types, sizes, static settings), run by a Python loop with
the interface of ``Stacked``: the same ``init`` (Haliax's curried form included), ``fold``/``scan``/
``vmap`` and their ``_via`` forms, per-layer arguments sliced along ``layers`` (plain arrays along
their first dimension), ``unroll=`` (accepted; a Python loop is unrolled), ``Remat`` policies, ``get_layer``/
``set_layer``/``unstacked``/``from_layers``. Each layer is traced on its own, so compile time
grows with depth: prefer ``Stacked`` when the blocks are alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic

import equinox as eqx
import jax

from .._axis import Axis, AxisError, NamedError
from .._remat import Remat, remat_policy, with_remat
from ._stacked import (
    M,
    argument_slices,
    as_method,
    block_init_function,
    call_block,
    check_every,
    checkpointing,
    layer_index,
    layers_axis,
    stack_layers,
)


class BlockSeq(eqx.Module, Generic[M]):
    """``Layers.size`` blocks held as a tuple and applied in order."""

    blocks: tuple
    Layers: Axis = eqx.field(static=True)
    remat: Any = eqx.field(static=True, default="none")

    def __check_init__(self):
        if len(self.blocks) != self.Layers.size:
            raise AxisError(f"BlockSeq: {len(self.blocks)} blocks but {self.Layers.name!r} has size {self.Layers.size}")
        remat_policy(self.remat, self.Layers.size)
        check_every(self.remat, self.Layers)

    @staticmethod
    def init(
        Layers: Axis,
        block_init: Callable[..., M] | Sequence[Callable[..., M]],
        *args,
        key=None,
        remat="none",
        gradient_checkpointing=None,
        prevent_cse=None,
        **kwargs,
    ):
        """``block_init(*args, key=k, **kwargs)`` for each layer, or the i-th of a list of such
        functions for layer i; the keys are those of ``Stacked.init`` (split ``Layers.size`` ways),
        so the same ``block_init`` gives the same weights. Without ``key=``, Haliax's curried
        form: ``BlockSeq.init(Layers, Block)(*args, **kwargs)`` calls ``Block.init`` with each
        layer's slice of the arguments, as ``Stacked.init`` does."""
        if not isinstance(Layers, Axis):
            raise AxisError(f"BlockSeq needs a Layers Axis with a size, got {Layers!r}")
        inits = (
            [block_init_function(block_init)] * Layers.size
            if callable(block_init)
            else [block_init_function(f) for f in block_init]
        )
        if len(inits) != Layers.size:
            raise AxisError(f"BlockSeq.init: {len(inits)} block functions for {Layers.name!r} of size {Layers.size}")
        remat = checkpointing(remat, gradient_checkpointing, prevent_cse, Layers)
        if key is None:
            if args or kwargs:
                raise NamedError(
                    "BlockSeq.init without key= is Haliax's curried form: BlockSeq.init(Layers, Block)(*args, "
                    "key=jax.random.split(key, n), ...); ours takes the block's arguments and key= at once"
                )

            def curried(*a, **kw) -> BlockSeq:
                layer = argument_slices((a, kw), Layers, "BlockSeq.init")
                return BlockSeq(
                    tuple(f(*la, **lkw) for f, (la, lkw) in zip(inits, map(layer, range(Layers.size)))), Layers, remat
                )

            return curried
        keys = jax.random.split(key, Layers.size)
        return BlockSeq(tuple(f(*args, key=k, **kwargs) for f, k in zip(inits, keys)), Layers, remat)

    @staticmethod
    def from_layers(blocks: Sequence[M], Layers: Axis | str = "layers", *, remat="none") -> BlockSeq[M]:
        blocks = tuple(blocks)
        return BlockSeq(blocks, layers_axis(Layers, len(blocks), "BlockSeq.from_layers"), remat)

    # -- running the sequence --

    def fold(self, x, *args, unroll=None, **kwargs):
        """``x = block(x, *args, **kwargs)`` for each block in order; arguments with the Layers
        axis (and plain arrays, along their first dimension) are sliced per layer, as in
        ``Stacked.fold``. ``unroll`` is accepted for Stacked's sake (the loop is unrolled)."""
        return self.fold_via(call_block, unroll=unroll)(x, *args, **kwargs)

    def scan(self, x, *args, unroll=None, **kwargs):
        """Like ``fold`` but each block returns ``(x, y)``; the ys are stacked along Layers."""
        return self.scan_via(call_block, unroll=unroll)(x, *args, **kwargs)

    def vmap(self, x, *args, **kwargs):
        """Every block applied to the same ``x`` (or its own slice of an ``x`` with Layers); stacked."""
        return self.vmap_via(call_block)(x, *args, **kwargs)

    def fold_via(self, fn: Callable | str, *, unroll=None) -> Callable:
        call = as_method(fn, "BlockSeq.fold_via")

        def step(block, carry, *a, **kw):
            return call(block, carry, *a, **kw), None

        return lambda x, *args, **kwargs: self._run(step, x, args, kwargs, with_ys=False)

    def scan_via(self, fn: Callable | str, *, unroll=None) -> Callable:
        call = as_method(fn, "BlockSeq.scan_via")
        return lambda x, *args, **kwargs: self._run(call, x, args, kwargs, with_ys=True)

    def vmap_via(self, fn: Callable | str) -> Callable:
        call = as_method(fn, "BlockSeq.vmap_via")

        def run(x, *args, **kwargs):
            outs = []
            layer = argument_slices((x, args, kwargs), self.Layers, "BlockSeq.vmap")
            for i, block in enumerate(self.blocks):
                xi, a, kw = layer(i)
                outs.append(call(block, xi, *a, **kw))
            return stack_layers(outs, self.Layers, "BlockSeq.vmap outputs")

        return run

    def _run(self, step, x, args, kwargs, *, with_ys: bool):
        def body(block, carry, *a, **kw):
            return step(block, carry, *a, **kw)

        layer = argument_slices((args, kwargs), self.Layers, "BlockSeq")

        def run_layers(carry, first: int, blocks):
            ys = []
            for i, block in enumerate(blocks, first):
                a, kw = layer(i)
                carry, y = with_remat(body, self.remat, self.Layers.size)(block, carry, *a, **kw)
                ys.append(y)
            return carry, ys

        r = Remat.parse(self.remat, self.Layers.size)
        k = 1 if r is None else r.every
        ys: list = []
        for g in range(0, len(self.blocks), k):
            # As in Stacked: a group of ``every`` layers is checkpointed whole, keeping only its input.
            group = run_layers if k == 1 else eqx.filter_checkpoint(run_layers, policy=None, prevent_cse=False)
            x, group_ys = group(x, g, self.blocks[g : g + k])
            ys += group_ys
        if not with_ys:
            return x
        return x, stack_layers(ys, self.Layers, "BlockSeq.scan outputs")

    # -- per-layer access --

    @property
    def Block(self) -> Axis:
        """Haliax's name for ``Layers``."""
        return self.Layers

    def get_layer(self, i: int) -> M:
        return self.blocks[layer_index(i, self.Layers)]

    def set_layer(self, i: int, block: M) -> BlockSeq[M]:
        blocks = list(self.blocks)
        blocks[layer_index(i, self.Layers)] = block
        return BlockSeq(tuple(blocks), self.Layers, self.remat)

    def unstacked(self) -> list[M]:
        return list(self.blocks)
