"""The models the trainer knows, by config type: class, positions, FLOPs, (de)serialised config."""

from __future__ import annotations

import dataclasses

from named.models import gpt2, llama

from .config import ConfigError

_MODELS = {
    "gpt2": (gpt2.Gpt2Config, gpt2.Gpt2LMHeadModel, gpt2.flops_per_token, lambda c: c.n_positions),
    "llama": (llama.LlamaConfig, llama.LlamaLMHeadModel, llama.flops_per_token, lambda c: c.max_position_embeddings),
}


def _entry(model_cfg):
    for name, entry in _MODELS.items():
        if isinstance(model_cfg, entry[0]):
            return name, entry
    raise ConfigError(f"unknown model config {type(model_cfg).__name__}; known: {', '.join(_MODELS)}")


def model_type(model_cfg) -> str:
    return _entry(model_cfg)[0]


def model_class(model_cfg):
    return _entry(model_cfg)[1][1]


def flops_per_token(model_cfg, seq_len: int) -> float:
    return _entry(model_cfg)[1][2](model_cfg, seq_len)


def max_positions(model_cfg) -> int:
    return _entry(model_cfg)[1][3](model_cfg)


def model_config_from_dict(d: dict):
    d = dict(d)
    kind = d.pop("type", None)
    if kind not in _MODELS:
        raise ConfigError(f"model config type {kind!r} is not one of {', '.join(_MODELS)}")
    cls = _MODELS[kind][0]
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - names
    if unknown:
        raise ConfigError(f"model config has unknown fields {sorted(unknown)} for {kind}")
    return cls(**d)
