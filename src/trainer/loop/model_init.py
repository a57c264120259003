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

import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp

import named as nm
from named import nn
from named.models.hf import load_pretrained
from named.models.registry import family_for
from named.nn.precision import get_policy, keeps_full_precision

from ..config import ConfigError, TrainConfig
from ..config.pretrained import folder as pretrained_folder


def adapt(cfg: TrainConfig, model, key):
    """The config's transforms applied to a base model, in order (an identity when none is
    configured). Runs under ``jax.eval_shape`` as well as for real: it may only build arrays
    from ``key``, and raises ConfigError naming the key a transform cannot take."""
    model = with_lora(cfg, model, key)
    model = with_quantization(cfg, model)
    return model


def trainable(cfg: TrainConfig, model):
    """A pytree of bools over ``model`` (NamedArrays as leaves): True where the optimizer updates
    the leaf. With ``lora`` only the adapters; the base gets neither gradients nor optimizer state."""
    if cfg.lora is not None:
        return nn.lora.trainable(model)
    return jax.tree.map(lambda x: isinstance(x, nm.NamedArray) or eqx.is_array(x), model, is_leaf=nm.is_named_array)


# ---- LoRA ------------------------------------------------------------------------------------------


def hf_linears(model) -> dict[str, str]:
    """Every Linear of ``model`` (a base or an adapted one): our dotted path -> its Hugging Face
    module path, ``{i}`` for the layer (``layers.stacked.mlp.gate`` -> ``model.layers.{i}.mlp.gate_proj``)."""
    keys = family_for(model).layout.keys
    flat = jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda x: isinstance(x, (nn.Linear, nn.LoraLinear)))[0]
    out = {}
    for keypath, x in flat:
        if isinstance(x, (nn.Linear, nn.LoraLinear)):
            path = jax.tree_util.keystr(keypath, simple=True, separator=".")
            out[path] = keys[f"{path}.weight"].removesuffix(".weight")
    return out


def with_lora(cfg: TrainConfig, model, key):
    """``model`` with adapters on the Linears ``lora.targets`` names (Hugging Face module names,
    matched as PEFT's target_modules match them: the last part of the module path), the frozen
    weights in ``lora.base_dtype``."""
    lora = cfg.lora
    if lora is None:
        return model
    linears = hf_linears(model)
    order = [k.removesuffix(".weight") for k in family_for(model).layout.keys.values()]  # Hugging Face's order
    names = list(dict.fromkeys(hf.rsplit(".", 1)[-1] for hf in sorted(linears.values(), key=order.index)))
    unknown = [t for t in lora.targets if t not in names]
    if unknown:
        raise ConfigError(
            f"lora.targets: {', '.join(map(repr, unknown))} {'is' if len(unknown) == 1 else 'are'} not a "
            f"linear module of the {family_for(model).name} model; its linear modules: {', '.join(names)}"
        )
    chosen = [p for p, hf in linears.items() if hf.rsplit(".", 1)[-1] in lora.targets]
    for path in chosen:
        layer = _get(model, path)
        sides = (
            math.prod(a.size for a in nm.axis_spec_to_tuple(layer.In)),
            math.prod(a.size for a in nm.axis_spec_to_tuple(layer.Out)),
        )
        if lora.rank > min(sides):
            raise ConfigError(
                f"lora.rank={lora.rank} is larger than {linears[path].rsplit('.', 1)[-1]} ({path}: in "
                f"{sides[0]}, out {sides[1]}); a rank is at most the smaller side of every targeted layer"
            )
    param_dtype = get_policy(cfg.trainer.precision).param_dtype
    model = nn.lora.apply(
        model,
        lambda path, _: path in chosen,
        rank=lora.rank,
        alpha=lora.alpha,
        dropout=lora.dropout,
        key=key,
        dtype=param_dtype,
    )
    if lora.base_dtype != "float32":
        model = _frozen_in(model, jnp.dtype(lora.base_dtype))
    return model


def _get(model, path: str):
    return functools.reduce(getattr, path.split("."), model)


def _frozen_in(model, dtype):
    """``model`` with its frozen floating weights in ``dtype``: not the adapters, and not the
    modules that keep full precision (norms: small, and the statistics they scale want float32)."""

    def cast(tree):
        return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

    def node(x):
        if keeps_full_precision(x):
            return x
        if isinstance(x, nn.LoraLinear):
            return eqx.tree_at(lambda m: m.linear, x, cast(x.linear))
        return cast(x)

    return jax.tree.map(node, model, is_leaf=lambda x: keeps_full_precision(x) or isinstance(x, nn.LoraLinear))


# ---- low precision ---------------------------------------------------------------------------------


def with_quantization(cfg: TrainConfig, model):
    """``model`` with the Linears ``quantization.targets`` names swapped for low-precision ones
    (``nn.quantize``); those LoRA adapted keep their float base. fp8 with LoRA is refused: its
    scales are learned through gradients, and LoRA gives the base Linears none."""
    q = cfg.quantization
    if q.kind == "none":
        return model
    if q.kind == "fp8" and cfg.lora is not None:
        raise ConfigError(
            "quantization.kind=fp8 with lora: fp8 learns its scales from the gradients of the layers it "
            "quantizes, and LoRA freezes them (they get no gradients); use quantization.kind=int8, "
            "which needs no state, or train without lora"
        )
    try:
        config = nn.QuantConfig(q.kind, tuple(q.targets) if q.targets is not None else None, q.amax_history)
        return nn.quantize(model, config)
    except nm.NamedError as e:
        raise ConfigError(f"quantization.targets: {e}") from None


def layer_driver(cfg: TrainConfig, compute_mapping, param_mapping) -> nn.ExplicitStack | None:
    """How the model's layer stack runs: None (``mesh.mode: auto``, GSPMD) or, for
    ``explicit``, per device inside ``nm.shard_map`` with each layer's weights gathered there."""
    if cfg.mesh.mode != "explicit":
        return None
    return nn.ExplicitStack(param_mapping, compute_mapping, batch_split=cfg.mesh.batch_split)


def model_shapes(cfg: TrainConfig, model_cls, model_cfg):
    """The run's parameters as ``jax.ShapeDtypeStruct`` leaves, without allocating or compiling."""

    def build():
        base_key, adapt_key = jax.random.split(jax.random.key(0))
        return adapt(cfg, model_cls.init(model_cfg, key=base_key), adapt_key)

    try:
        return jax.eval_shape(build)
    except ConfigError:  # adapt's own, naming its key
        raise
    except (ValueError, nm.NamedError) as e:
        raise ConfigError(f"model: {e}") from None


def init_model(
    cfg: TrainConfig, model_cls, model_cfg, *, param_mapping, mesh, key, pretrained: bool = True, dtype=jnp.float32
):
    """The run's model, every array laid out by the parameter mapping ``param_mapping`` on ``mesh``.
    With ``model.init_from_hf`` (and ``pretrained``), the base weights are the folder's, read in
    ``dtype``; without ``pretrained`` (a resume, about to restore every weight) they are random."""
    base_key, adapt_key = jax.random.split(key)
    if cfg.model.init_from_hf is not None and pretrained:
        folder = pretrained_folder(cfg.model.init_from_hf)
        _, base = load_pretrained(folder, mapping=param_mapping, mesh=mesh, dtype=dtype)
    else:
        base = nm.named_jit(model_cls.init, mapping=param_mapping)(model_cfg, key=base_key)
    return nm.named_jit(lambda m, k: adapt(cfg, m, k), mapping=param_mapping)(base, adapt_key)
