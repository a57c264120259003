"""AdamW with warmup + cosine / linear / constant / warmup-stable-decay schedules, gradient
clipping, and a weight-decay mask that skips norms and biases; fp8 scaling state is set from its
gradient, outside all of these (``with_overwrites``)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import named as nm
from named import nn

from ..config import OptimizerConfig, TrainConfig
from .model_init import trainable


def numbers(cfg: OptimizerConfig, num_steps: int) -> dict[str, int | float]:
    """The numbers of a run's optimizer that runs of one model often differ in: the schedule's (peak
    and final learning rate, warmup, the spans of its parts), the weight decay and the clipping norm.
    The train step takes them as inputs of its program (``Optimizer``), so runs that differ only in
    them share one compiled step. What XLA would fold were they constants is folded here, as it
    folds it (sums in Python's float64 as optax takes them, a division by a span as a product with
    its float32 reciprocal, products of constants as one float32 constant), so the step computes
    bit for bit what it computed with them as constants (``tests/test_optim.py`` compares)."""
    f32 = np.float32
    lr, warm = cfg.learning_rate, cfg.warmup(num_steps)
    horizon = cfg.horizon(num_steps)
    end = lr * cfg.min_lr_ratio
    rest = max(horizon - warm, 1)
    decay = max(int(round(horizon * cfg.decay_fraction)), 1)  # wsd's final decay
    out = {
        "lr": lr,
        "end": end,
        "lr_minus_end": lr - end,
        "min_lr_ratio": cfg.min_lr_ratio,
        "half_of_one_minus_min_lr_ratio": float(f32(0.5) * f32(1 - cfg.min_lr_ratio)),
        "warmup": warm,
        "rest": rest,
        "stable": max(rest - decay, 0),
        "decay": decay,
        **{f"per_{k}": float(f32(1) / f32(max(v, 1))) for k, v in (("warmup", warm), ("rest", rest), ("decay", decay))},
        "pi_per_rest": float(f32(np.pi) * (f32(1) / f32(rest))),
    }
    if cfg.max_grad_norm is not None:
        out["max_grad_norm"] = cfg.max_grad_norm
    if cfg.weight_decay:  # zero: no decay term at all (optax leaves it out), so zero is no number here
        out["weight_decay"] = cfg.weight_decay
    return out


def schedule_of(kind: str, n: dict) -> optax.Schedule:
    """The learning rate by step (an int32 count) of schedule ``kind`` from ``numbers``: linear warmup
    to ``lr``, then the chosen shape down to ``end`` over ``rest`` steps, flat after it (wsd: flat for
    ``stable`` steps, then a linear decay over ``decay``). The formulas are optax's
    (``linear_schedule``, ``cosine_decay_schedule``, ``join_schedules``) written over numbers that
    may be traced; a warmup of 0 steps is the same program, its branch never chosen."""

    def linear(init_minus_end, end, span):  # optax.linear_schedule(init, end, n[span]), n[span] > 0
        def f(count):
            frac = 1 - jnp.clip(count, 0, n[span]) * n[f"per_{span}"]
            return init_minus_end * frac + end

        return f

    def cosine(count):  # optax.cosine_decay_schedule(lr, rest, alpha=min_lr_ratio)
        cos = 1 + jnp.cos(jnp.minimum(count, n["rest"]) * n["pi_per_rest"])
        return n["lr"] * (cos * n["half_of_one_minus_min_lr_ratio"] + n["min_lr_ratio"])

    def constant(count):
        return n["lr"]

    def wsd(count):
        decay = linear(n["lr_minus_end"], n["end"], "decay")
        return jnp.where(count < n["stable"], n["lr"], decay(count - n["stable"]))

    main = {"cosine": cosine, "linear": linear(n["lr_minus_end"], n["end"], "rest"), "constant": constant}.get(
        kind, wsd
    )
    warmup = linear(0.0 - n["lr"], n["lr"], "warmup")
    return lambda count: jnp.where(count < n["warmup"], warmup(count), main(count - n["warmup"]))


def schedule(cfg: OptimizerConfig, num_steps: int) -> optax.Schedule:
    """Learning rate by step in a run of ``num_steps``: linear warmup (``cfg.warmup``) to ``learning_rate``, then
    the chosen shape down to ``min_lr_ratio * learning_rate`` at the schedule's horizon (``cfg.horizon``:
    ``num_steps`` unless ``schedule_steps`` is set), flat after it (wsd: flat, then a linear decay over
    the last ``decay_fraction`` of the horizon). Computed as the train step computes it."""
    n = as_inputs(numbers(cfg, num_steps))
    return lambda step: _rate(cfg.schedule, n, jnp.asarray(step, jnp.int32))


@functools.partial(jax.jit, static_argnums=0)
def _rate(kind: str, n: dict, count):  # one program per kind for every run the process logs
    return schedule_of(kind, n)(count)


def as_inputs(n: dict) -> dict:
    """``numbers`` as arrays of the dtypes and weak types that Python numbers take in a trace
    (int32, float32), which a compiled program takes as inputs instead of constants."""
    return {k: jnp.asarray(v) for k, v in n.items()}


def decay_mask(params):
    """True for weights that get weight decay: every array except biases and the parameters of
    modules that declare ``no_weight_decay = True`` (LayerNorm, RMSNorm, an fp8 Linear's state)."""

    def is_leaf(x):
        return isinstance(x, nm.NamedArray) or getattr(type(x), "no_weight_decay", False)

    def leaf(path, x):
        if getattr(type(x), "no_weight_decay", False):
            return jax.tree.map(lambda _: False, x)
        decay = not any(getattr(k, "name", None) == "bias" for k in path)
        if isinstance(x, nm.NamedArray):
            return nm.NamedArray(decay, x.axes)
        return decay

    return jax.tree_util.tree_map_with_path(leaf, params, is_leaf=is_leaf)


def _times(grads, scale):
    """Each gradient times the scalar ``scale``, in the gradient's dtype."""
    return jax.tree.map(lambda g: g * jnp.asarray(scale, g.dtype), grads)


def scaled_norm(grads, scale) -> jax.Array:
    """The global norm of ``grads`` times ``scale``, each gradient scaled before it is squared (a
    sum over the tokens times a loss scale can be large enough that its square overflows float32,
    where the mean's cannot); XLA computes the product inside the reduction, writing nothing."""
    return optax.tree.norm(_times(grads, scale))


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """``optax.clip_by_global_norm``'s rule (gradients whose global norm exceeds ``max_norm`` are
    scaled down to it; its empty state, so saved optimizer states are unchanged) written as one
    scalar factor times each gradient: XLA folds that product into the moments' updates instead of
    keeping a clipped full-size copy of every gradient beside the gradient (optax's
    ``select(norm < max, g, g / norm * max)`` reads both).

    ``grad_scale`` (an extra argument, 1 when left out) is a factor the gradients still need: the
    train step hands in its accumulated sums with one over their token count (and the loss scale)
    here, so each gradient is multiplied once, inside the moments' update, rather than divided into
    a full-size copy first (``bench/memory.py``, 613M parameters: 1.089 -> 1.079 of the floor)."""

    def update(updates, state, params=None, *, grad_scale=1.0, **extra):
        del params, extra
        norm = scaled_norm(updates, grad_scale)
        factor = grad_scale * jnp.where(norm < max_norm, 1.0, max_norm / norm)
        return _times(updates, factor), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


def _scaled_first(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """``inner`` after each gradient is multiplied by the ``grad_scale`` extra argument (what
    ``clip_by_global_norm`` does itself, for a chain without clipping); no state of its own."""

    def update(updates, state, params=None, *, grad_scale=1.0, **extra):
        del extra
        return inner.update(_times(updates, grad_scale), state, params)

    return optax.GradientTransformationExtraArgs(inner.init, update)


@dataclasses.dataclass(frozen=True, eq=False)  # hashed as itself, like an optax transformation
class Optimizer:
    """The run's optimizer (``build_optimizer``) as its ``numbers`` and the optax transformation
    ``transformation(numbers)`` makes of them: ``init`` and ``update`` use its own numbers (an optax
    transformation like any other), and the train step passes them in as inputs, so that runs
    differing only in them share one compiled program. Its state is optax's ``adamw`` state. Its
    transformations take a ``grad_scale`` extra argument, a factor the gradients still need
    (``clip_by_global_norm``)."""

    numbers: dict
    transformation: Callable[[dict], optax.GradientTransformation]

    def init(self, params):
        return self.transformation(self.numbers).init(params)

    def update(self, updates, state, params=None, **extra):
        return self.transformation(self.numbers).update(updates, state, params, **extra)


def build_optimizer(cfg: OptimizerConfig, num_steps: int) -> Optimizer:
    """AdamW (optax's) after clipping, with ``schedule``'s learning rate and ``decay_mask``'s weight
    decay, for a run of ``num_steps``. Betas and epsilon stay constants of the program."""

    def transformation(n: dict) -> optax.GradientTransformation:
        adamw = optax.adamw(
            schedule_of(cfg.schedule, n),
            b1=cfg.beta1,
            b2=cfg.beta2,
            eps=cfg.epsilon,
            weight_decay=n.get("weight_decay", 0.0),
            mask=decay_mask,
        )
        if "max_grad_norm" in n:
            return with_overwrites(optax.chain(clip_by_global_norm(n["max_grad_norm"]), adamw))
        return with_overwrites(_scaled_first(optax.chain(adamw)))

    return Optimizer(numbers(cfg, num_steps), transformation)


def with_overwrites(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """``inner`` for every leaf but the state an fp8 Linear learns through its gradient
    (``nn.Fp8State``): ``inner`` never sees it (no clipping, moments or weight decay), and its
    update sets it to the value its gradient carries (``nn.overwrite_updates``). A model without
    such state gets ``inner`` unchanged, optimizer state included."""

    def init(params):
        return inner.init(nn.without_overwrites(params))

    def update(updates, state, params=None, **extra):
        inner_updates, state = optax.with_extra_args_support(inner).update(
            nn.without_overwrites(updates), state, nn.without_overwrites(params), **extra
        )
        return nn.overwrite_updates(inner_updates, updates, params), state

    return optax.GradientTransformationExtraArgs(init, update)


# ---- the optimizer state of a run: one helper for every place that builds or restores it ----------


def trainable_part(cfg: TrainConfig, model):
    """The leaves of ``model`` the optimizer updates (``model_init.trainable``), None elsewhere:
    what gradients are taken of and optimizer state is kept for."""
    return eqx.filter(model, trainable(cfg, model), is_leaf=nm.is_named_array)


def init_opt_state(cfg: TrainConfig, model, optimizer: optax.GradientTransformation | None = None):
    """The run's optimizer state for ``model`` (real, or ``jax.eval_shape`` leaves for the shapes
    a resume checks and the plan counts): state for the trainable leaves only."""
    optimizer = optimizer if optimizer is not None else build_optimizer(cfg.optimizer, cfg.trainer.num_train_steps)
    state = optimizer.init(trainable_part(cfg, model))
    # dynamic loss scaling: the scale and its count of finite steps are saved and resumed with the state
    return (state, nn.DynamicLossScale()) if cfg.trainer.loss_scale == "dynamic" else state
