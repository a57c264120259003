"""Stacked: a homogeneous stack of blocks stored with a leading ``layers`` axis and run with scan,
so compile time does not grow with depth; gradient checkpointing policies by name.

Remat policies (``remat=``):
- ``"none"``: keep every intermediate for the backward pass.
- ``"full"``: keep only each block's input; recompute the block in the backward pass.
- ``"save_dots"``: keep the results of weight matmuls (dots without batch dimensions),
  recompute the rest (activations, norms, attention scores).
- ``"save_names:a,b"`` or ``("save_names", "a", "b")``: keep only values tagged with
  ``checkpoint_name(x, "a")`` inside the block.
- ``"offload"``: like ``save_dots`` but the saved values go to pinned host memory; needs a
  backend with host memory spaces (GPU/TPU), and raises on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

import equinox as eqx
import jax
from jax.ad_checkpoint import checkpoint_name as _checkpoint_name

from .._axis import Axis, AxisError, NamedError
from .._core import NamedArray, is_named_array
from .._transforms import fold as nfold, scan as nscan

M = TypeVar("M", bound=eqx.Module)


def checkpoint_name(x: NamedArray, name: str) -> NamedArray:
    """Tag an activation so that a ``save_names`` remat policy can keep it."""
    return NamedArray._unchecked(_checkpoint_name(x.array, name), x.axes)


def remat_policy(remat: str | tuple | None) -> Callable | None | bool:
    """The jax checkpoint policy for a policy name; False means no remat at all."""
    if remat is None or remat == "none":
        return False
    if isinstance(remat, str) and remat.startswith("save_names"):
        _, _, names = remat.partition(":")
        remat = ("save_names", *[n for n in names.split(",") if n])
    if isinstance(remat, tuple) and remat and remat[0] == "save_names":
        if len(remat) < 2:
            raise NamedError("remat save_names needs at least one name: 'save_names:attn_out,mlp_out'")
        return jax.checkpoint_policies.save_only_these_names(*remat[1:])
    if remat == "full":
        return None
    if remat == "save_dots":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    if remat == "offload":
        if jax.default_backend() == "cpu":
            raise NamedError("remat='offload' needs host memory spaces (GPU or TPU); the CPU backend has none")
        return jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")
    raise NamedError(f"unknown remat policy {remat!r}; use none, full, save_dots, save_names:<names> or offload")


def _with_remat(fn: Callable, remat) -> Callable:
    policy = remat_policy(remat)
    if policy is False:
        return fn
    return eqx.filter_checkpoint(fn, policy=policy, prevent_cse=False)


class Stacked(eqx.Module, Generic[M]):
    """``Layers.size`` copies of one block, each weight with a leading ``Layers`` axis."""

    stacked: M
    Layers: Axis = eqx.field(static=True)
    remat: Any = eqx.field(static=True, default="none")

    @staticmethod
    def init(Layers: Axis, block_init: Callable[..., M], *args, key, remat="none", **kwargs) -> Stacked[M]:
        """``block_init(*args, key=k, **kwargs)`` for each layer, vmapped over split keys."""
        if not isinstance(Layers, Axis):
            raise AxisError(f"Stacked needs a Layers Axis with a size, got {Layers!r}")
        remat_policy(remat)  # validate early
        keys = jax.random.split(key, Layers.size)
        blocks = eqx.filter_vmap(lambda k: block_init(*args, key=k, **kwargs))(keys)

        def add_layers(path, x):
            if isinstance(x, NamedArray):
                if Layers.name in x.names:
                    raise AxisError(f"block weight {jax.tree_util.keystr(path)} already has the layers axis {Layers.name!r}")
                return NamedArray._unchecked(x.array, (Layers,) + x.axes)
            if eqx.is_array(x):
                # fold/scan slice only NamedArrays along Layers: a plain array would reach
                # every layer whole, with the stacking dimension still on it.
                raise AxisError(f"block leaf {jax.tree_util.keystr(path)} is a plain array of shape {x.shape}; "
                                "Stacked blocks hold their arrays as NamedArrays (wrap it with nm.named)")
            return x

        return Stacked(jax.tree_util.tree_map_with_path(add_layers, blocks, is_leaf=is_named_array), Layers, remat)

    def fold(self, x, *args, **kwargs):
        """``x = block(x, *args, **kwargs)`` for each layer in order. Arguments with the Layers
        axis (e.g. per-layer keys as ``nm.named(keys, "layers")``) are sliced per layer."""

        def step(carry, block, *a, **kw):
            return block(carry, *a, **kw)

        return nfold(_with_remat(step, self.remat), self.Layers)(x, self.stacked, *args, **kwargs)

    def scan(self, x, *args, **kwargs):
        """Like ``fold`` but ``block`` returns ``(x, y)``; the ys are stacked along Layers."""

        def step(carry, block, *a, **kw):
            return block(carry, *a, **kw)

        return nscan(_with_remat(step, self.remat), self.Layers)(x, self.stacked, *args, **kwargs)

    def unstacked(self) -> list[M]:
        """The blocks one by one (for per-layer access; not for running the stack)."""

        def take(i):
            def leaf(x):
                if isinstance(x, NamedArray):
                    return NamedArray._unchecked(x.array[i], x.axes[1:])
                return x

            return jax.tree.map(leaf, self.stacked, is_leaf=is_named_array)

        return [take(i) for i in range(self.Layers.size)]
