"""Low-precision Linears, swapped into a model by ``quantize`` without touching its code.

Three kinds (``QuantConfig.kind``):

- ``"fp8"`` (training, as on H100): ``Fp8Linear`` rounds the input and the weight to
  ``float8_e4m3fn`` and the output gradient to ``float8_e5m2``, each with a per-tensor scale from
  *delayed scaling*: the scale of a step is ``max(amax history) / fp8 max``, and the step then
  records its own ``max|x|`` at the front of the history (``Fp8State``); a first step, with an
  empty history, scales by its own amax. The matmul runs on the
  dequantized values (``fp8 -> compute dtype, × scale``), the pattern XLA's GPU compiler turns
  into an fp8 GEMM; elsewhere it is an exact emulation. The backward is straight-through: the
  rounding counts as the identity.
- ``"int8"`` (dynamic): ``Int8Linear`` rounds each step's input per token (one scale per entry
  of the non-``In`` axes) and the weight per output channel to int8, multiplies in int32 and
  rescales. Its backward is the *exact float* gradient of ``x · W`` (the rounding is not
  differentiated, nor used in the backward), so training sees the float gradients.
- ``"int8_weight"`` (inference, memory): ``Int8WeightLinear`` stores the weight as int8 with
  one float scale per output channel and dequantizes it for every call.

How the fp8 state is updated: the new state is computed inside the forward and backward pass,
and handed out as the *gradient* of the state (Flax's and Haliax's "overwrite with gradient").
An optimizer must then replace, not follow, that gradient: ``without_overwrites`` hides the
state from it and ``overwrite_updates`` turns the gradient into the update that sets the new
value (``named.trainer.loop.optim`` does both). Train steps scale and sum gradients (a mean over
tokens, microbatches, clipping), so the state carries ``probe``, a leaf whose gradient is 1 per
call: the new state is the state's gradient divided by the probe's, whatever common factor
the step applied. With gradient accumulation (or a layer called twice) that ratio is the mean
over the calls of each call's new state.
"""

from __future__ import annotations

import dataclasses
import re
from functools import partial
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp

from .._axis import ArgumentError, Axis, AxisError, NamedError, as_selectors, format_axes
from .._core import NamedArray, is_named_array, unchecked
from .._einsum import dot
from .._ops import abs as nabs
from .._ops import floating, where
from .._shape import zeros
from ..partitioning import shard
from ._linear import Linear, check_input
from ._lora import LoraLinear

__all__ = [
    "KINDS",
    "Fp8Linear",
    "Fp8State",
    "Int8Linear",
    "Int8WeightLinear",
    "QuantConfig",
    "is_overwrite_state",
    "overwrite_updates",
    "quantize",
    "without_overwrites",
]

KINDS = ("fp8", "int8", "int8_weight")
HISTORY = "amax_history"  # the axis of an fp8 amax history; no mapping names it, so it is replicated
FORWARD_FP8, BACKWARD_FP8 = jnp.float8_e4m3fn, jnp.float8_e5m2
# The state's gradients are scaled by this power of two (exact, and undone by the probe) so that a
# gradient norm taken over the whole model, as train steps log, barely sees them.
_COTANGENT_SCALE = 2.0**-16


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """Which Linears ``quantize`` swaps, and for what.

    Args:
        kind: ``"fp8"``, ``"int8"`` or ``"int8_weight"`` (see the module docstring).
        targets: regular expressions searched (``re.search``) in each Linear's dotted path
            (``blocks.stacked.mlp.up``); a Linear is swapped when one matches. None: every Linear.
            Each expression must match at least one Linear.
        history: fp8 only: how many steps of amax the delayed scaling remembers.
    """

    kind: str
    targets: tuple[str, ...] | None = None
    history: int = 16

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ArgumentError(f"QuantConfig: kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if isinstance(self.history, bool) or not isinstance(self.history, int) or self.history < 1:
            raise ArgumentError(
                f"QuantConfig: history must be an integer >= 1 (steps of amax kept), got {self.history!r}"
            )
        if self.targets is not None:
            targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
            if not targets:
                raise ArgumentError(
                    "QuantConfig: targets is empty, so nothing would be quantized; None means every Linear"
                )
            for t in targets:
                try:
                    re.compile(t)
                except (re.error, TypeError) as e:
                    raise ArgumentError(f"QuantConfig: target {t!r} is not a regular expression ({e})") from None
            object.__setattr__(self, "targets", targets)


# ---- fp8 with delayed scaling -----------------------------------------------------------------------


class Fp8State(eqx.Module):
    """Delayed-scaling state of one ``Fp8Linear``: amax histories (newest first) of its input
    ``x``, its weight ``w`` and its output gradient ``g``, and the ``probe`` that counts calls
    (see the module docstring). Inside a ``Stacked``, every leaf has the layers axis too."""

    x: NamedArray
    w: NamedArray
    g: NamedArray
    probe: NamedArray
    keep_full_precision: ClassVar[bool] = True  # amax and scales stay float32 under a bf16 policy
    no_weight_decay: ClassVar[bool] = True  # history and scales, not weights
    overwrite_with_gradient: ClassVar[bool] = True  # optimizers set it from its gradient (overwrite_updates)

    @staticmethod
    def init(history: int, extra: tuple[Axis, ...] = ()) -> Fp8State:
        """Empty (zero) histories."""
        if isinstance(history, bool) or not isinstance(history, int) or history < 1:
            raise ArgumentError(f"Fp8State: history must be an integer >= 1 (steps of amax kept), got {history!r}")
        h = zeros(extra + (Axis(HISTORY, history),), jnp.float32)
        return Fp8State(h, h, h, zeros(extra, jnp.float32) + 1.0)


def _scale(history: NamedArray, amax_now: jax.Array, dtype) -> jax.Array:
    """``max(history) / fp8 max``; while the history is all zero (no step seen yet, or a tensor that
    was all zero) the current tensor's own amax stands in, so a first step is not rounded at scale 1."""
    amax = jnp.max(history.array)
    amax = jnp.where(amax > 0, amax, amax_now)
    return jnp.where(amax > 0, amax / float(jnp.finfo(dtype).max), 1.0)


def _observe(history: NamedArray, amax: jax.Array) -> NamedArray:
    h = history.array
    return unchecked(jnp.concatenate([amax.astype(h.dtype)[None], h[:-1]]), history.axes)


def _to_fp8(x: NamedArray, scale: jax.Array, dtype) -> NamedArray:
    """``x / scale`` rounded to ``dtype``; beyond its range it saturates (a float8 cast would give NaN)."""
    top = float(jnp.finfo(dtype).max)
    return unchecked(jnp.clip(x.array / scale, -top, top).astype(dtype), x.axes)


def _from_fp8(q: NamedArray, scale: jax.Array) -> NamedArray:
    """The value ``q`` stands for, in ``scale``'s dtype (the compute dtype)."""
    return unchecked(q.array.astype(scale.dtype) * scale, q.axes)


def _amax(x: NamedArray) -> jax.Array:
    return jnp.max(jnp.abs(x.array), initial=0.0).astype(jnp.float32)  # 0 for no entries (a batch of 0)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_dot(In: tuple[str, ...], x: NamedArray, w: NamedArray, state: Fp8State) -> NamedArray:
    return _fp8_fwd(In, x, w, state)[0]


def _fp8_fwd(In, x, w, state):
    ax, aw = _amax(x), _amax(w)
    # in x's and w's dtypes: the residuals carry them to the backward
    sx, sw = _scale(state.x, ax, FORWARD_FP8).astype(x.dtype), _scale(state.w, aw, FORWARD_FP8).astype(w.dtype)
    qx, qw = _to_fp8(x, sx, FORWARD_FP8), _to_fp8(w, sw, FORWARD_FP8)
    y = dot(_from_fp8(qx, sx), _from_fp8(qw, sw), axis=In)
    # fp8 residuals: the backward keeps a quarter of what a float32 Linear keeps
    return y, (qx, sx, qw, sw, _observe(state.x, ax), _observe(state.w, aw), state.g, state.probe)


def _fp8_bwd(In, res, g):
    qx, sx, qw, sw, new_x, new_w, g_history, probe = res
    ag = _amax(g)
    sg = _scale(g_history, ag, BACKWARD_FP8).astype(g.dtype)
    g_q = _from_fp8(_to_fp8(g, sg, BACKWARD_FP8), sg)
    _, pullback = jax.vjp(lambda a, b: dot(a, b, axis=In), _from_fp8(qx, sx), _from_fp8(qw, sw))
    dx, dw = pullback(g_q)
    new = Fp8State(new_x, new_w, _observe(g_history, ag), probe * 0 + 1.0)
    return dx, dw, jax.tree.map(lambda v: v * _COTANGENT_SCALE, new)


_fp8_dot.defvjp(_fp8_fwd, _fp8_bwd)


class Fp8Linear(eqx.Module):
    """A Linear whose matmul runs in fp8 with delayed scaling (see the module docstring)."""

    weight: NamedArray
    bias: NamedArray | None
    fp8: Fp8State
    In: Axis | tuple[Axis, ...] = eqx.field(static=True)
    Out: Axis | tuple[Axis, ...] = eqx.field(static=True)

    @staticmethod
    def from_linear(linear: Linear, history: int = 16) -> Fp8Linear:
        return Fp8Linear(linear.weight, linear.bias, Fp8State.init(history, _extra(linear)), linear.In, linear.Out)

    def __call__(self, x: NamedArray, *, key=None) -> NamedArray:
        check_input(self, x)
        if self.fp8.probe.axes:
            raise AxisError(
                f"Fp8Linear: its fp8 state has axes {format_axes(self.fp8.probe.axes)} (one scale per layer "
                "of a stack); call it through its Stacked, which gives each layer its own slice"
            )
        y = _fp8_dot(tuple(a.name for a in as_selectors(self.In)), x, self.weight, self.fp8)
        if self.bias is not None:
            y = y + self.bias
        return shard(y)


# ---- int8 -------------------------------------------------------------------------------------------

_INT8_MAX = 127.0


def _int8(x: NamedArray, over: tuple[str, ...]) -> tuple[NamedArray, NamedArray]:
    """``x`` rounded to int8 with one float32 scale per entry of the axes not in ``over``."""
    x = x.astype(jnp.float32)
    amax = nabs(x).max(over)
    scale = where(amax > 0, amax / _INT8_MAX, 1.0)
    scaled = x / scale  # x's axes, in x's order (the operand with more axes keeps its order)
    q = jnp.clip(jnp.round(scaled.array), -_INT8_MAX, _INT8_MAX).astype(jnp.int8)
    return unchecked(q, scaled.axes), scale


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _int8_dot(In: tuple[str, ...], x: NamedArray, w: NamedArray) -> NamedArray:
    (qx, sx), (qw, sw) = _int8(x, In), _int8(w, In)
    acc = dot(qx, qw, axis=In, preferred_element_type=jnp.int32)  # the axes, in the order a float dot gives
    y = acc.astype(jnp.float32) * sx * sw
    return y.rearrange(acc.names).astype(jnp.result_type(x.dtype, w.dtype))


def _int8_fwd(In, x, w):
    return _int8_dot(In, x, w), (x, w)


def _int8_bwd(In, res, g):
    x, w = res
    _, pullback = jax.vjp(lambda a, b: dot(a, b, axis=In), x, w)
    return pullback(g)


_int8_dot.defvjp(_int8_fwd, _int8_bwd)


class Int8Linear(eqx.Module):
    """A Linear whose matmul runs in int8: the input per token, the weight per output channel,
    both rounded at every call; the backward is the float gradient (see the module docstring)."""

    weight: NamedArray
    bias: NamedArray | None
    In: Axis | tuple[Axis, ...] = eqx.field(static=True)
    Out: Axis | tuple[Axis, ...] = eqx.field(static=True)

    @staticmethod
    def from_linear(linear: Linear) -> Int8Linear:
        return Int8Linear(linear.weight, linear.bias, linear.In, linear.Out)

    def __call__(self, x: NamedArray, *, key=None) -> NamedArray:
        check_input(self, x)
        y = _int8_dot(tuple(a.name for a in as_selectors(self.In)), x, self.weight)
        if self.bias is not None:
            y = y + self.bias
        return shard(y)


class Int8WeightLinear(eqx.Module):
    """A Linear whose weight is stored as int8 with one float ``scale`` per output channel (a
    quarter of float32's bytes); every call dequantizes it into the input's dtype. For inference:
    the int8 weight takes no gradient."""

    weight: NamedArray  # int8, axes (extra..., In..., Out...)
    scale: NamedArray  # float, the weight's axes without In
    bias: NamedArray | None
    In: Axis | tuple[Axis, ...] = eqx.field(static=True)
    Out: Axis | tuple[Axis, ...] = eqx.field(static=True)

    @staticmethod
    def from_linear(linear: Linear) -> Int8WeightLinear:
        q, scale = _int8(linear.weight, tuple(a.name for a in as_selectors(linear.In)))
        return Int8WeightLinear(q, scale.astype(linear.weight.dtype), linear.bias, linear.In, linear.Out)

    def dequantized(self, dtype=None) -> NamedArray:
        """The weight it stands for, in ``dtype`` (default: the scale's), with the weight's axis order."""
        dtype = self.scale.dtype if dtype is None else dtype
        return (self.weight.astype(dtype) * self.scale.astype(dtype)).rearrange(self.weight.names)

    def __call__(self, x: NamedArray, *, key=None) -> NamedArray:
        check_input(self, x)
        # into the input's dtype (bf16 stays bf16), float32 for an int input (not truncated to ints)
        y = dot(x, self.dequantized(floating(x.dtype)), axis=tuple(a.name for a in as_selectors(self.In)))
        if self.bias is not None:
            y = y + self.bias
        return shard(y)


QUANTIZED = (Fp8Linear, Int8Linear, Int8WeightLinear)


def _extra(linear: Linear) -> tuple[Axis, ...]:
    """The weight's axes beyond In and Out: the layers axis of each Stacked around it."""
    own = {a.name for a in as_selectors(linear.In) + as_selectors(linear.Out)}
    return tuple(a for a in linear.weight.axes if a.name not in own)


# ---- whole models ----------------------------------------------------------------------------------


def _stops(x) -> bool:
    # A LoraLinear's frozen base stays as it is: "the remaining Linears" are the ones it does not wrap.
    return isinstance(x, (Linear, LoraLinear) + QUANTIZED)


def _path(keypath) -> str:
    return jax.tree_util.keystr(keypath, simple=True, separator=".")


def quantize(model, config: QuantConfig | str):
    """``model`` with its ``nn.Linear`` modules (inside ``Stacked`` and ``BlockSeq`` too) swapped
    for quantized ones; the model's code is unchanged, since they are called as Linears are.

    ``config`` is a ``QuantConfig`` or just its kind (``"fp8"``, ``"int8"``, ``"int8_weight"``).
    The Linear inside a ``LoraLinear`` is left as it is (LoRA first, then the remaining Linears).

    Raises:
        ArgumentError: a target that matches no Linear (the model's Linears are listed), or a
            model that already holds quantized Linears (quantize the float model once).
    """
    config = QuantConfig(config) if isinstance(config, str) else config
    if not isinstance(config, QuantConfig):
        raise ArgumentError(f"quantize takes a QuantConfig or a kind ({', '.join(KINDS)}), got {config!r}")
    flat, treedef = jax.tree_util.tree_flatten_with_path(model, is_leaf=_stops)
    done = [_path(k) for k, x in flat if isinstance(x, QUANTIZED)]
    if done:
        raise ArgumentError(f"quantize: {', '.join(done)} are quantized already; quantize the float model, once")
    linears = [_path(k) for k, x in flat if type(x) is Linear]
    targets = config.targets
    if targets is not None:
        missing = [t for t in targets if not any(re.search(t, p) for p in linears)]
        if missing:
            raise ArgumentError(
                f"quantize: targets {missing} match no Linear of {type(model).__name__}; its Linears: "
                f"{', '.join(linears) or 'none'}"
            )
    scaled = [
        p
        for p in linears
        if (targets is None or any(re.search(t, p) for t in targets))
        and dict((_path(k), x) for k, x in flat)[p].reparam.active_scale != 1
    ]
    if scaled:
        raise ArgumentError(
            f"quantize: {', '.join(scaled)} scale their output (a muP reparam_cls such as "
            "OutputLinearMup), which the quantized Linears do not carry; leave them out of targets"
        )
    swap = {
        "fp8": lambda lin: Fp8Linear.from_linear(lin, config.history),
        "int8": Int8Linear.from_linear,
        "int8_weight": Int8WeightLinear.from_linear,
    }[config.kind]
    leaves = []
    for k, x in flat:
        chosen = type(x) is Linear and (targets is None or any(re.search(t, _path(k)) for t in targets))
        leaves.append(swap(x) if chosen else x)
    return jax.tree.unflatten(treedef, leaves)


# ---- the optimizer's side of the fp8 state ---------------------------------------------------------


def is_overwrite_state(x: Any) -> bool:
    """Whether ``x`` is a module an optimizer must set from its gradient (``Fp8State``)."""
    return isinstance(x, eqx.Module) and bool(getattr(type(x), "overwrite_with_gradient", False))


def without_overwrites(tree):
    """``tree`` (parameters or gradients) with every overwrite state replaced by None: what an
    optimizer's own transforms (clipping, moments, weight decay) should see."""
    if tree is None:
        return None
    return jax.tree.map(lambda x: None if is_overwrite_state(x) else x, tree, is_leaf=is_overwrite_state)


def overwrite_updates(updates, grads, params):
    """``updates`` (computed on ``without_overwrites`` trees) with, for each overwrite state of
    ``params``, the update that sets it to the value its gradient in ``grads`` carries (kept as it
    is where the layer was not called)."""
    states = [x for x in jax.tree.leaves(grads, is_leaf=is_overwrite_state) if is_overwrite_state(x)]
    if not states:
        return updates
    if params is None:
        raise NamedError(
            f"overwrite_updates: the gradients hold {len(states)} {type(states[0]).__name__}(s), whose "
            "new values replace the parameters' own: pass params= to the optimizer's update"
        )

    def node(g, u, p):
        if not is_overwrite_state(g):
            return u
        if not is_overwrite_state(p):
            raise NamedError(
                f"overwrite_updates: the gradient holds a {type(g).__name__} where the parameters hold "
                f"{type(p).__name__}; pass the parameters the gradient was taken of"
            )
        seen = g.probe > 0
        per_call = where(seen, g.probe, 1.0)

        def leaf(gl: NamedArray, pl: NamedArray) -> NamedArray:  # the probe itself: 1 -> 1
            new = where(seen, gl / per_call, pl)
            return (new - pl).rearrange(pl.names)

        return jax.tree.map(leaf, g, p, is_leaf=is_named_array)

    def is_leaf(x):
        return x is None or is_overwrite_state(x)

    return jax.tree.map(node, grads, updates, params, is_leaf=is_leaf)
