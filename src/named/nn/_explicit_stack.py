"""Explicit mode for a layer stack: the same ``Stacked`` blocks, driven per device.

Under ``with nn.explicit_layers(nn.ExplicitStack(param, compute)):`` every ``Stacked`` that
runs (``fold``, ``scan``, ``fold_via``, ``scan_via``) runs its whole scan inside
``nm.shard_map``: the stacked weights come in as their stored blocks (laid out by ``param``),
the carry and per-layer arguments as activation blocks (laid out by ``compute``). Per layer,
the body gathers the weight axes the parameter mapping splits (FSDP's ``embed/data`` ->
``embed``), calls the unchanged block, and moves on. Autodiff turns each gather into a
reduce-scatter of that layer's weight gradient inside the backward scan, so weight
gradients are made split and never whole for all layers.

What the backward pass keeps: the gathered weights are tagged and never saved (the backward
scan gathers each layer again, right before its gradient is made), whatever the stack's
remat policy keeps of the rest.

Supported layouts: data parallel and FSDP, i.e. a compute mapping that splits only axes no
weight has (``batch``), with any parameter mapping; activations must not be split along an
axis a layer contracts or mixes (tensor parallelism needs blocks that owe their sums, which
these blocks do not say). ``check`` refuses the rest before anything is traced.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import jax

from .._axis import NamedError
from .._core import NamedArray, is_named_array
from .._local import _split_over
from ..explicit import all_gather, shard_map
from ..partitioning import ShardingError
from ._remat import checkpoint_name, remat_policy

_GATHERED = "explicit_gathered_weight"  # the tag that keeps gathered weights out of the saved residuals

_active: contextvars.ContextVar = contextvars.ContextVar("named_explicit_stack", default=None)


@dataclasses.dataclass(frozen=True)
class ExplicitStack:
    """How to drive a ``Stacked`` in explicit mode: the stored layout of its weights
    (``param_mapping``) and the layout of its activations (``compute_mapping``)."""

    param_mapping: Mapping[str, Any]
    compute_mapping: Mapping[str, Any]
    mesh: Any = None  # default: the current mesh

    def __post_init__(self):
        object.__setattr__(self, "param_mapping", dict(self.param_mapping or {}))
        object.__setattr__(self, "compute_mapping", dict(self.compute_mapping or {}))

    def check(self, weight_axes: set[str]) -> None:
        """Refuse a compute mapping that splits an axis the weights have (tensor parallelism)."""
        split = sorted(n for n, v in self.compute_mapping.items() if v and n in weight_axes)
        if split:
            raise ShardingError(
                f"explicit mode drives the layer stack for data parallelism and FSDP: the compute mapping "
                f"splits {split}, which the layers' weights have (tensor parallelism); unmap them in the "
                f"compute mapping or use mode auto")

    def run(self, stacked, step, x, args, kwargs):
        """``stacked._run_local(step, ...)`` on every device's blocks, each layer's weights gathered."""
        self.check({n for w in jax.tree.leaves(stacked.stacked, is_leaf=is_named_array)
                    if isinstance(w, NamedArray) for n in w.names if n != stacked.Layers.name})
        keep_gathered_out = remat_policy(stacked.remat) is False

        def gathered_step(block, carry, *a, **kw):
            return step(gather_block(block), carry, *a, **kw)

        if keep_gathered_out:
            # No remat: save everything the block makes except the gathered weights, which the
            # backward scan gathers again (a layer's shards, not all layers' whole weights, stay live).
            gathered_step = jax.checkpoint(gathered_step, policy=_not_gathered, prevent_cse=False)

        def body(weights, carry, a, kw):
            token = _active.set(None)  # a Stacked inside the body runs locally
            try:
                carry, ys = type(stacked)(weights, stacked.Layers, stacked.remat)._run_local(gathered_step, carry, a, kw)
            finally:
                _active.reset(token)
            _refuse_plain_outputs(ys)
            return carry, ys

        c = self.compute_mapping
        run = shard_map(body, mesh=self.mesh, in_mapping=(self.param_mapping, c, c, c))
        return run(stacked.stacked, x, tuple(args), dict(kwargs))


def _refuse_plain_outputs(ys) -> None:
    """A plain array a layer returns (an MoE router's loss) is this device's value only, and its
    global value is not a sum or mean of those in general: refused, rather than returned wrong."""
    plain = [jax.tree_util.keystr(p) for p, y in jax.tree_util.tree_leaves_with_path(ys, is_leaf=is_named_array)
             if not isinstance(y, NamedArray) and isinstance(y, jax.Array)]
    if plain:
        raise ShardingError(
            f"explicit mode runs the layer stack per device, but the layers also return plain arrays {plain} "
            f"(such as an MoE router's losses) whose value over the whole batch one device cannot know; "
            f"use mode auto for this model")


def _not_gathered(prim, *_, **params) -> bool:
    """Save every value of a layer except its gathered weights (the gather's own result and
    the tagged copy of it)."""
    if prim.name.startswith("all_gather"):
        return False
    return not (prim.name == "name" and params.get("name") == _GATHERED)


def gather_block(block):
    """The block with every weight axis that is split in this body gathered whole, each
    gathered weight tagged so that no remat policy saves it."""
    def leaf(w):
        if not isinstance(w, NamedArray):
            return w
        split = [a.name for a in w.axes if _split_over(a)]
        if not split:
            return w
        g = all_gather(w, split)
        return checkpoint_name(g, _GATHERED)

    return jax.tree.map(leaf, block, is_leaf=is_named_array)


def active() -> ExplicitStack | None:
    """The driver every ``Stacked`` run now uses, or None (the default: GSPMD)."""
    return _active.get()


@contextlib.contextmanager
def explicit_layers(driver: ExplicitStack | None) -> Iterator[None]:
    """Run every ``Stacked`` traced inside with ``driver`` (None: as usual)."""
    if driver is not None and not isinstance(driver, ExplicitStack):
        raise NamedError(f"nn.explicit_layers takes an nn.ExplicitStack or None, got {type(driver).__name__}")
    token = _active.set(driver)
    try:
        yield
    finally:
        _active.reset(token)
