"""Mixed precision with jmp: a policy string, and casts of modules and outputs.

A policy has three dtypes: ``param`` (how weights and optimizer state are stored), ``compute``
(the dtype a forward pass runs in) and ``output`` (what a model hands back, e.g. to the loss).
The usual training recipe keeps float32 parameters and computes in bfloat16::

    policy = get_policy("params=float32,compute=bfloat16,output=float32")  # or just "bf16"

    def loss_fn(model, batch):
        compute_model = cast_for_compute(model, policy)   # differentiable: grads come back f32
        logits = cast_output(compute_model(batch), policy)
        ...

Some modules must not be cast: a norm's scale and its statistics lose too much in bfloat16. A
module class opts out by declaring ``keep_full_precision: ClassVar[bool] = True``;
:func:`cast_for_compute` then leaves that module's whole subtree in the policy's param dtype.
``LayerNorm`` and ``RMSNorm`` declare it; set it on your own modules that need it, and compute
their internal statistics in float32 (upcast the input, cast the result back).
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jmp
import numpy as np

from .._axis import ArgumentError, ArgumentTypeError

__all__ = [
    "DynamicLossScale",
    "all_finite",
    "cast_for_compute",
    "cast_output",
    "cast_to_param",
    "get_policy",
    "keeps_full_precision",
]

_DTYPES: dict[str, Any] = {}
for _names, _dtype in (
    (("float32", "f32", "fp32", "single", "full"), jnp.float32),
    (("bfloat16", "bf16"), jnp.bfloat16),
    (("float16", "f16", "fp16", "half"), jnp.float16),
    (("float64", "f64", "fp64", "double"), jnp.float64),
):
    for _n in _names:
        _DTYPES[_n] = _dtype

_KEYS = {"params": "params", "p": "params", "compute": "compute", "c": "compute", "output": "output", "o": "output"}


def _parse_dtype(text: str, part: str, spec: str):
    dtype = _DTYPES.get(text.strip().lower())
    if dtype is None:
        raise ArgumentError(
            f"unknown dtype {text.strip()!r} in {part.strip()!r} of precision policy {spec!r}; "
            f"known: {', '.join(sorted(_DTYPES))}"
        )
    return dtype


def get_policy(spec: str | jmp.Policy) -> jmp.Policy:
    """A ``jmp.Policy`` from a string (a Policy passes through unchanged).

    Grammar: comma-separated ``key=dtype`` parts, keys ``params``/``compute``/``output``
    (or ``p``/``c``/``o``), e.g. ``"params=float32,compute=bfloat16,output=float32"``.
    Omitted keys: params default to float32, compute to the params dtype, and output to the
    *params* dtype (not to compute, as in ``jmp.get_policy``): a model's outputs go to the
    loss, which wants full precision.

    A single dtype name is a shorthand for the *compute* dtype with float32 params and outputs:
    ``"bf16"`` is ``params=float32,compute=bfloat16,output=float32`` (the training recipe),
    ``"f32"`` is float32 everywhere. This differs from ``jmp.get_policy("bf16")``, which puts
    everything, parameters included, in bfloat16; write that as
    ``"params=bf16,compute=bf16,output=bf16"``. Dtype names: float32/f32/fp32/full,
    bfloat16/bf16, float16/f16/fp16/half, float64/f64 (float16 compute needs loss scaling;
    bfloat16 does not).

    Raises:
        ValueError: naming the part of ``spec`` that is not understood.
    """
    if isinstance(spec, jmp.Policy):
        return spec
    if not isinstance(spec, str):
        raise ArgumentTypeError(
            f"a precision policy is a string like 'params=float32,compute=bfloat16' or a jmp.Policy, got {spec!r}"
        )
    if "=" not in spec:
        compute = _parse_dtype(spec, spec, spec)
        return jmp.Policy(param_dtype=jnp.float32, compute_dtype=compute, output_dtype=jnp.float32)
    chosen: dict[str, Any] = {}
    for part in spec.split(","):
        if "=" not in part:
            raise ArgumentError(
                f"part {part.strip()!r} of precision policy {spec!r} is not key=dtype (keys: params, compute, output)"
            )
        key, value = part.split("=", 1)
        canonical = _KEYS.get(key.strip().lower())
        if canonical is None:
            raise ArgumentError(
                f"unknown key {key.strip()!r} in {part.strip()!r} of "
                f"precision policy {spec!r}; use params, compute or output"
            )
        if canonical in chosen:
            raise ArgumentError(f"precision policy {spec!r} sets {canonical!r} twice")
        chosen[canonical] = _parse_dtype(value, part, spec)
    params = chosen.get("params", jnp.float32)
    compute = chosen.get("compute", params)
    output = chosen.get("output", params)
    return jmp.Policy(param_dtype=params, compute_dtype=compute, output_dtype=output)


def keeps_full_precision(module: Any) -> bool:
    """Whether ``module`` declares ``keep_full_precision = True`` (its subtree is never cast down)."""
    return isinstance(module, eqx.Module) and bool(getattr(module, "keep_full_precision", False))


def _is_floating_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray)) and jnp.issubdtype(x.dtype, jnp.floating)


def _cast_floating(tree: Any, dtype) -> Any:
    """Cast the floating array leaves of ``tree`` (NamedArrays included) to ``dtype``."""

    def leaf(x):
        if _is_floating_array(x) and x.dtype != dtype:
            return jnp.asarray(x).astype(dtype)
        return x

    return jax.tree.map(leaf, tree)


def cast_for_compute(module: Any, policy: str | jmp.Policy) -> Any:
    """A copy of ``module`` (any pytree) with floating leaves in the policy's compute dtype.

    Submodules that declare ``keep_full_precision = True`` (norms, or your own modules) are
    left, whole subtree, in the policy's *param* dtype. Integer and boolean leaves and
    non-array leaves are untouched. The cast is an ``astype``, so it is differentiable: the
    gradient of a loss of the cast module with respect to the original module has the
    original (param) dtypes.

    A ``Stacked`` is cast as it runs: it keeps its stored weights and, where it recomputes its
    layers (any ``remat`` but ``"none"``) or runs in explicit mode (``explicit_layers``), casts
    each layer by this same rule as its scan reaches it, so neither a compute-dtype copy of the
    whole stack nor one of its gradient is held. Without recomputation in auto mode the backward
    pass keeps every layer's cast weights anyway, and the stack is cast whole when it runs.
    ``get_layer`` and ``compute_stacked()`` give the cast weights; ``.stacked`` stays as stored.
    """
    policy = get_policy(policy)

    def cast(node):
        if _casts_as_it_runs(node):
            return node.cast_as_it_runs(policy)
        if keeps_full_precision(node):
            return _cast_floating(node, policy.param_dtype)
        return _cast_floating(node, policy.compute_dtype)

    return jax.tree.map(cast, module, is_leaf=lambda n: _casts_as_it_runs(n) or keeps_full_precision(n))


def _casts_as_it_runs(node: Any) -> bool:
    """A module that casts its own weights as it runs (``Stacked``): it has ``cast_as_it_runs(policy)``."""
    return isinstance(node, eqx.Module) and callable(getattr(node, "cast_as_it_runs", None))


def cast_to_param(tree: Any, policy: str | jmp.Policy) -> Any:
    """Cast every floating leaf of ``tree`` to the policy's param dtype (e.g. at init)."""
    return _cast_floating(tree, get_policy(policy).param_dtype)


def cast_output(x: Any, policy: str | jmp.Policy) -> Any:
    """Cast the floating leaves of ``x`` (a NamedArray, array or pytree) to the policy's output dtype."""
    return _cast_floating(x, get_policy(policy).output_dtype)


# ---- dynamic loss scaling ------------------------------------------------------------------------------


def all_finite(tree: Any) -> jax.Array:
    """A 0-d boolean: every floating leaf of ``tree`` (NamedArrays included) is finite."""
    leaves = [x for x in jax.tree.leaves(tree) if _is_floating_array(x)]
    return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in leaves])) if leaves else jnp.bool_(True)


class DynamicLossScale(eqx.Module):
    """Dynamic loss scaling for float16 training (Micikevicius et al. 2018), as ``jmp.DynamicLossScale``
    computes it, as an Equinox module: it crosses ``nm.named_jit`` and ``eqx.filter_jit`` (jmp's
    own checks its leaves in ``__post_init__``, which fails when a jit rebuilds it from placeholders).

    Multiply the loss by ``scale`` before taking gradients, ``unscale`` the gradients, and keep
    ``adjust(all_finite(grads))`` for the next step, skipping the update when they are not finite:
    the scale halves (by ``factor``) on an overflow, down to ``min_loss_scale``, and doubles after
    ``period`` finite steps in a row.
    """

    loss_scale: jax.Array
    counter: jax.Array
    period: int = eqx.field(static=True, default=2000)
    factor: int = eqx.field(static=True, default=2)
    min_loss_scale: float = eqx.field(static=True, default=1.0)

    def __init__(self, loss_scale=2.0**15, counter=None, period: int = 2000, factor: int = 2, min_loss_scale=1.0):
        for what, v, ok in (("period", period, period >= 1), ("factor", factor, factor > 1)):
            if isinstance(v, bool) or not isinstance(v, int) or not ok:
                raise ArgumentError(
                    f"DynamicLossScale: {what}={v!r}; it must be an int, {'>= 1' if what == 'period' else '> 1'}"
                )
        self.loss_scale = jnp.asarray(loss_scale, jnp.float32)
        self.counter = jnp.zeros((), jnp.int32) if counter is None else jnp.asarray(counter, jnp.int32)
        self.period, self.factor, self.min_loss_scale = period, factor, float(min_loss_scale)

    def scale(self, tree: Any) -> Any:
        """``tree`` times the loss scale (each floating leaf in its own dtype)."""
        return jax.tree.map(lambda x: x * self.loss_scale.astype(x.dtype) if _is_floating_array(x) else x, tree)

    def unscale(self, tree: Any) -> Any:
        """``tree`` divided by the loss scale (each floating leaf in its own dtype)."""
        inv = 1.0 / self.loss_scale
        return jax.tree.map(lambda x: x * inv.astype(x.dtype) if _is_floating_array(x) else x, tree)

    def adjust(self, grads_finite) -> DynamicLossScale:
        """The scale for the next step, given whether this step's gradients were all finite."""
        grown = self.counter + 1 >= self.period
        up = jnp.where(grown, self.loss_scale * self.factor, self.loss_scale)
        down = jnp.maximum(self.loss_scale / self.factor, self.min_loss_scale)
        return DynamicLossScale(
            jnp.where(grads_finite, up, down),
            jnp.where(grads_finite & ~grown, self.counter + 1, 0),
            self.period,
            self.factor,
            self.min_loss_scale,
        )
