"""Gradient checkpointing of a stack of layers, as one object: ``Remat`` says what each layer's
forward pass leaves for the backward pass (the rest is recomputed) and how often the carry
between layers is kept.

``Remat(save=..., offload=..., dots=..., every=...)``:
- ``save``: names tagged with ``checkpoint_name(x, name)`` inside the block, kept on device;
- ``offload``: tagged names kept in pinned host memory instead (GPU/TPU; the CPU backend has
  no host memory space and raises);
- ``dots``: the results of weight matmuls (dots without batch dimensions): ``"recompute"``
  (default), ``"save"`` or ``"offload"``;
- ``every``: keep the carry (a layer's input) only every ``every`` layers: the backward pass
  re-runs each group of ``every`` layers from its input (sqrt-style nested checkpointing),
  which divides the stored layer inputs by ``every`` at the cost of one more forward pass.

``Remat()`` is full rematerialisation (only the layer inputs are kept); ``None`` or ``"none"``
is no checkpointing. Strings, for config files: the shorthands ``"none"``, ``"full"``,
``"save_dots"``, ``"offload"`` (the dots to host), ``"save_names:a,b"``, optionally followed by
``key=value`` words: ``"full every=4"``, ``"save=attn_out offload=mlp_out dots=save"``.
``True`` is ``Remat()`` and ``False`` no checkpointing, as in Haliax.

``ScanCheckpointPolicy`` is Haliax's spelling of the same choices (its fields, its strings);
every ``remat=`` (and Haliax's ``gradient_checkpointing=``) takes one and reads it as a ``Remat``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
from jax.ad_checkpoint import checkpoint_name as _checkpoint_name

from ._axis import ArgumentError, ArgumentTypeError
from ._core import NamedArray, expect_named, unchecked

_DOTS = ("recompute", "save", "offload")
_HOST = ("device", "pinned_host")


def checkpoint_name(x: NamedArray, name: str) -> NamedArray:
    """Tag an activation so that a ``Remat(save=...)`` or ``Remat(offload=...)`` policy can keep it."""
    expect_named(x, "checkpoint_name")
    _tag(name, "checkpoint_name")
    return unchecked(_checkpoint_name(x.array, name), x.axes)


def _tag(name, what: str) -> None:
    if not isinstance(name, str) or not name:
        raise ArgumentTypeError(f"{what}: the name is a non-empty string (what Remat(save=...) lists), got {name!r}")


def tree_checkpoint_name(tree, name: str):
    """``checkpoint_name`` on every array of a pytree (NamedArrays and plain arrays; Haliax's)."""
    _tag(name, "tree_checkpoint_name")

    def leaf(x):
        if isinstance(x, NamedArray):
            return checkpoint_name(x, name)
        return _checkpoint_name(x, name) if eqx.is_array(x) else x

    return jax.tree.map(leaf, tree, is_leaf=lambda x: isinstance(x, NamedArray))


def _names(value, what: str) -> tuple[str, ...]:
    names = (value,) if isinstance(value, str) else tuple(value)
    bad = [n for n in names if not isinstance(n, str) or not n]
    if bad:
        raise ArgumentError(f"Remat {what} takes activation names (strings given to checkpoint_name), got {bad!r}")
    return names


@dataclasses.dataclass(frozen=True)
class Remat:
    """What the backward pass keeps from each layer (see the module docstring)."""

    save: tuple[str, ...] = ()
    offload: tuple[str, ...] = ()
    dots: str = "recompute"
    every: int = 1

    def __post_init__(self):
        object.__setattr__(self, "save", _names(self.save, "save"))
        object.__setattr__(self, "offload", _names(self.offload, "offload"))
        both = sorted(set(self.save) & set(self.offload))
        if both:
            raise ArgumentError(f"Remat: {both} are both saved and offloaded; give each name to one of them")
        if self.dots not in _DOTS:
            raise ArgumentError(f"Remat dots={self.dots!r}; use one of {', '.join(_DOTS)}")
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ArgumentError(
                f"Remat every={self.every!r}; it must be a positive int (layers per checkpointed group)"
            )

    @property
    def offloads(self) -> bool:
        return bool(self.offload) or self.dots == "offload"

    @staticmethod
    def parse(
        remat: Remat | ScanCheckpointPolicy | str | tuple | bool | None, length: int | None = None
    ) -> Remat | None:
        """The policy a ``remat=`` argument stands for; None means no checkpointing. ``length``
        (the number of layers) is needed only by a ``ScanCheckpointPolicy`` with ``nested``."""
        if remat is None or isinstance(remat, Remat):
            return remat
        if isinstance(remat, bool):
            return Remat() if remat else None
        if isinstance(remat, ScanCheckpointPolicy):
            return remat.to_remat(length)
        if isinstance(remat, tuple):
            if remat and remat[0] == "save_names":
                if len(remat) < 2:
                    raise ArgumentError("remat save_names needs at least one name: 'save_names:attn_out,mlp_out'")
                return Remat(save=remat[1:])
            raise ArgumentError(f"unknown remat policy {remat!r}; a tuple policy is ('save_names', name, ...)")
        if not isinstance(remat, str):
            raise ArgumentError(f"unknown remat policy {remat!r}; use a Remat, None or a string such as 'full'")
        return _parse_string(remat)


_SHORTHANDS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "full": {},
    "save_dots": {"dots": "save"},
    "offload": {"dots": "offload"},
}
_KEYS = ("save", "offload", "dots", "every")


def _parse_string(text: str) -> Remat | None:
    words = text.split()
    if not words:
        raise ArgumentError("empty remat policy; use none, full, save_dots, save_names:<names> or offload")
    fields: dict[str, Any] = {}
    none = False
    for i, word in enumerate(words):
        key, eq, value = word.partition("=")
        if word.startswith("save_names"):
            names = [n for n in word.partition(":")[2].split(",") if n]
            if not names:
                raise ArgumentError("remat save_names needs at least one name: 'save_names:attn_out,mlp_out'")
            fields["save"] = tuple(names)
        elif word in _SHORTHANDS and i == 0:
            shorthand = _SHORTHANDS[word]
            none = shorthand is None
            fields.update(shorthand or {})
        elif eq and key in _KEYS:
            fields[key] = (
                int(value)
                if key == "every" and value.isdigit()
                else (value if key in ("dots", "every") else tuple(n for n in value.split(",") if n))
            )
        else:
            raise ArgumentError(
                f"unknown remat policy {text!r} (at {word!r}); use none, full, save_dots, "
                f"save_names:<names> or offload, optionally followed by {', '.join(k + '=' for k in _KEYS)}"
            )
    if none:
        if len(words) > 1:
            raise ArgumentError(f"remat policy {text!r}: 'none' takes no options")
        return None
    return Remat(**fields)


def remat_policy(remat, length: int | None = None) -> Callable | None | bool:
    """The jax checkpoint policy for one layer; False means no remat at all, None full remat.
    Raises a NamedError for an unknown policy, or one that offloads on the CPU backend."""
    r = Remat.parse(remat, length)
    if r is None:
        return False
    if r.offloads and jax.default_backend() == "cpu":
        raise ArgumentError(
            f"remat {remat!r} offloads to host memory, which needs host memory spaces (GPU or TPU); "
            "the CPU backend has none"
        )
    cp = jax.checkpoint_policies
    if not r.save and not r.offload:
        return {
            "recompute": None,
            "save": cp.dots_with_no_batch_dims_saveable,
            "offload": cp.offload_dot_with_no_batch_dims(*_HOST),
        }[r.dots]
    if not r.offload:
        names = cp.save_only_these_names(*r.save)
    else:
        names = cp.save_and_offload_only_these_names(
            names_which_can_be_saved=r.save,
            names_which_can_be_offloaded=r.offload,
            offload_src=_HOST[0],
            offload_dst=_HOST[1],
        )
    if r.dots == "recompute":
        return names
    dots = cp.dots_with_no_batch_dims_saveable if r.dots == "save" else cp.offload_dot_with_no_batch_dims(*_HOST)

    # jax's save_from_both_policies takes only yes/no policies; offloading answers with where to.
    def policy(prim, *args, **params):
        if cp.dots_with_no_batch_dims_saveable(prim, *args, **params):
            return dots(prim, *args, **params)
        return names(prim, *args, **params)

    return policy


def with_remat(fn: Callable, remat, length: int | None = None) -> Callable:
    """``fn`` checkpointed with one layer's policy (``every`` is the scan's business)."""
    policy = remat_policy(remat, length)
    if policy is False:
        return fn
    # Inside scan (or a group of layers) CSE cannot merge the recomputation away.
    return eqx.filter_checkpoint(fn, policy=policy, prevent_cse=False)


# ---- Haliax's spelling ---------------------------------------------------------------------------


def _names_or_flag(value, what: str):
    if isinstance(value, bool):
        return value
    return _names(value, what)


@dataclasses.dataclass(frozen=True)
class ScanCheckpointPolicy:
    """Haliax's gradient-checkpointing policy, read as a ``Remat`` (``Remat.parse``).

    ``save_block_internals``: ``True`` keeps everything (no checkpointing), a list of names
    is ``Remat(save=names)``; ``offload_block_internals`` is ``Remat(offload=names)``;
    ``simple`` is ``Remat()``; ``disable`` is no checkpointing; ``nested=k`` scans the layers
    as ``k`` groups, each checkpointed whole (``Remat(every=length // k)``; ``True`` picks the
    largest divisor of the length up to its square root). ``save_carries`` and ``save_inputs``
    take ``True`` or ``False`` (a layer's input is what every policy keeps; the scanned inputs
    are the weights, which are never recomputed); ``"offload"`` there is refused: offloading
    is for tagged activations here (``offload_block_internals``). ``prevent_cse`` is accepted
    and has no effect: inside a scan there is no common subexpression to protect.
    """

    save_carries: bool | str = True
    save_inputs: bool | str = False
    save_block_internals: bool | tuple[str, ...] = False
    offload_block_internals: tuple[str, ...] = ()
    prevent_cse: bool = False
    disable: bool = False
    simple: bool = False
    nested: bool | int = False

    def __post_init__(self):
        # lists become tuples, so that the policy can be a static (hashed) field of a module
        object.__setattr__(
            self, "save_block_internals", _names_or_flag(self.save_block_internals, "save_block_internals")
        )
        object.__setattr__(
            self, "offload_block_internals", _names(self.offload_block_internals, "offload_block_internals")
        )
        for what in ("save_carries", "save_inputs"):
            value = getattr(self, what)
            if value == "offload":
                raise ArgumentError(
                    f"ScanCheckpointPolicy({what}='offload'): offloading a layer's carry or inputs is not "
                    "supported; offload tagged activations with offload_block_internals=[...] "
                    "(Remat(offload=...))"
                )
            if not isinstance(value, bool):
                raise ArgumentError(f"ScanCheckpointPolicy({what}={value!r}); it takes True or False")
        if isinstance(self.nested, bool) or self.nested is None:
            return
        if not isinstance(self.nested, int) or self.nested < 1:
            raise ArgumentError(
                f"ScanCheckpointPolicy(nested={self.nested!r}); it takes a bool or a number of groups >= 1"
            )

    @staticmethod
    def from_bool_or_str(policy: bool | str) -> ScanCheckpointPolicy:
        """Haliax's shorthands: True (``simple``), False (no checkpointing), ``"recompute"`` or
        ``"full"``, ``"save_all"``, ``"nested"``. Its ``"offload"`` (carries to host) is refused."""
        table = {
            "recompute": dict(save_carries=False),
            "full": dict(save_carries=False),
            "save_all": dict(save_inputs=True, save_block_internals=True),
            "nested": dict(nested=True),
        }
        if policy is True:
            return ScanCheckpointPolicy(simple=True)
        if policy is False:
            return ScanCheckpointPolicy(disable=True)
        if policy == "offload":
            return ScanCheckpointPolicy(save_carries="offload")  # raises with the alternative
        if isinstance(policy, str) and policy in table:
            return ScanCheckpointPolicy(**table[policy])
        raise ArgumentError(
            f"unknown gradient_checkpointing {policy!r}; use True, False, 'recompute', 'full', "
            "'save_all', 'nested' or a ScanCheckpointPolicy"
        )

    def to_remat(self, length: int | None = None) -> Remat | None:
        """The ``Remat`` this policy means for a scan of ``length`` layers."""
        if self.disable:
            return None
        every = 1
        if self.nested is not False:
            if length is None:
                raise ArgumentError(
                    "ScanCheckpointPolicy(nested=...) needs the number of layers; give it to a Stacked, "
                    "a BlockSeq or nm.scan, which know it"
                )
            groups = _largest_divisor_up_to_sqrt(length) if self.nested is True else self.nested
            if length % groups:
                raise ArgumentError(
                    f"ScanCheckpointPolicy(nested={groups}): {length} layers do not split into {groups} groups"
                )
            every = length // groups
        if self.save_block_internals is True:
            if every > 1:
                raise ArgumentError(
                    "ScanCheckpointPolicy: save_block_internals=True keeps every activation, which nested "
                    "groups would recompute; give a list of names instead"
                )
            return None
        if self.simple:
            return Remat(every=every)
        return Remat(save=self.save_block_internals or (), offload=self.offload_block_internals, every=every)


def _largest_divisor_up_to_sqrt(n: int) -> int:
    return max(d for d in range(1, int(n**0.5) + 1) if n % d == 0)
