"""AdamW with warmup + cosine / linear / constant / warmup-stable-decay schedules, gradient
clipping, and a weight-decay mask that skips norms and biases; fp8 scaling state is set from its
gradient, outside all of these (``with_overwrites``)."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import named as nm
from named import nn

from ..config import OptimizerConfig, TrainConfig
from .model_init import trainable


def schedule(cfg: OptimizerConfig, num_steps: int) -> optax.Schedule:
    """Learning rate by step in a run of ``num_steps``: linear warmup (``cfg.warmup``) to ``learning_rate``, then
    the chosen shape down to ``min_lr_ratio * learning_rate`` at the schedule's horizon (``cfg.horizon``:
    ``num_steps`` unless ``schedule_steps`` is set), flat after it (wsd: flat, then a linear decay over
    the last ``decay_fraction`` of the horizon)."""
    lr, warm = cfg.learning_rate, cfg.warmup(num_steps)
    num_steps = cfg.horizon(num_steps)
    end = lr * cfg.min_lr_ratio
    rest = max(num_steps - warm, 1)
    if cfg.schedule == "cosine":
        main = optax.cosine_decay_schedule(lr, rest, alpha=cfg.min_lr_ratio)
    elif cfg.schedule == "linear":
        main = optax.linear_schedule(lr, end, rest)
    elif cfg.schedule == "constant":
        main = optax.constant_schedule(lr)
    else:  # wsd
        decay = max(int(round(num_steps * cfg.decay_fraction)), 1)
        stable = max(rest - decay, 0)
        main = optax.join_schedules([optax.constant_schedule(lr), optax.linear_schedule(lr, end, decay)], [stable])
    if warm == 0:
        return main
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warm), main], [warm])


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


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """``optax.clip_by_global_norm``'s rule (gradients whose global norm exceeds ``max_norm`` are
    scaled down to it; its empty state, so saved optimizer states are unchanged) written as one
    scalar factor times each gradient: XLA folds that product into the moments' updates instead of
    keeping a clipped full-size copy of every gradient beside the gradient (optax's
    ``select(norm < max, g, g / norm * max)`` reads both)."""

    def update(updates, state, params=None):
        del params
        norm = optax.tree.norm(updates)
        factor = jnp.where(norm < max_norm, 1.0, max_norm / norm)
        return jax.tree.map(lambda g: g * factor.astype(g.dtype), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def build_optimizer(cfg: OptimizerConfig, num_steps: int) -> optax.GradientTransformation:
    parts = []
    if cfg.max_grad_norm is not None:
        parts.append(clip_by_global_norm(cfg.max_grad_norm))
    parts.append(
        optax.adamw(
            schedule(cfg, num_steps),
            b1=cfg.beta1,
            b2=cfg.beta2,
            eps=cfg.epsilon,
            weight_decay=cfg.weight_decay,
            mask=decay_mask,
        )
    )
    return with_overwrites(optax.chain(*parts))


def with_overwrites(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """``inner`` for every leaf but the state an fp8 Linear learns through its gradient
    (``nn.Fp8State``): ``inner`` never sees it (no clipping, moments or weight decay), and its
    update sets it to the value its gradient carries (``nn.overwrite_updates``). A model without
    such state gets ``inner`` unchanged, optimizer state included."""

    def init(params):
        return inner.init(nn.without_overwrites(params))

    def update(updates, state, params=None):
        inner_updates, state = inner.update(nn.without_overwrites(updates), state, nn.without_overwrites(params))
        return nn.overwrite_updates(inner_updates, updates, params), state

    return optax.GradientTransformation(init, update)


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
