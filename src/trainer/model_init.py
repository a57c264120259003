"""The model a run starts from, in one place for ``named-train``, ``named-plan`` and the checks.

A run's model is built in two stages:

1. the **base**: random init (``model_cls.init``) or the weights of ``model.init_from_hf``
   (read tensor by tensor straight into the parameter mapping: ``models.load_pretrained``);
2. **adapt**: the transforms the config asks for on top of it (LoRA adapters, low-precision
   linears), the same function on abstract shapes (``model_shapes``) and on the real model
   (``init_model``), so the checks, the plan and the run see one tree.

``trainable(cfg, model)`` says which leaves the optimizer updates (all arrays, unless a
transform freezes the base weights).
"""

from __future__ import annotations

from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp

import named as nm
from named.models.hf import load_pretrained

from .config import ConfigError, TrainConfig


def adapt(cfg: TrainConfig, model, key):
    """The config's transforms applied to a base model (an identity when none is configured).
    Runs under ``jax.eval_shape`` as well as for real: it may only build arrays from ``key``."""
    del cfg, key
    return model


def trainable(cfg: TrainConfig, model):
    """A pytree of bools over ``model``'s leaves: True where the optimizer updates the leaf."""
    del cfg
    return jax.tree.map(eqx.is_array, model, is_leaf=nm.is_named_array)


def model_shapes(cfg: TrainConfig, model_cls, model_cfg):
    """The run's parameters as ``jax.ShapeDtypeStruct`` leaves, without allocating or compiling."""
    def build():
        base_key, adapt_key = jax.random.split(jax.random.key(0))
        return adapt(cfg, model_cls.init(model_cfg, key=base_key), adapt_key)

    try:
        return jax.eval_shape(build)
    except (ValueError, nm.NamedError) as e:
        raise ConfigError(f"model: {e}") from None


def init_model(cfg: TrainConfig, model_cls, model_cfg, *, param, mesh, key, pretrained: bool = True,
               dtype=jnp.float32):
    """The run's model, every array laid out by the parameter mapping ``param`` on ``mesh``.
    With ``model.init_from_hf`` (and ``pretrained``), the base weights are the folder's, read in
    ``dtype``; without ``pretrained`` (a resume, about to restore every weight) they are random."""
    base_key, adapt_key = jax.random.split(key)
    if cfg.model.init_from_hf is not None and pretrained:
        _, base = load_pretrained(Path(cfg.model.init_from_hf), mapping=param, mesh=mesh, dtype=dtype)
    else:
        base = nm.named_jit(model_cls.init, mapping=param)(model_cfg, key=base_key)
    return nm.named_jit(lambda m, k: adapt(cfg, m, k), mapping=param)(base, adapt_key)
