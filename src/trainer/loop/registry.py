"""The trainer's view of ``named.models.registry`` (the one list of families): a family's name,
model class and positions for a model config, and a model config from a dict, with the trainer's
ConfigError for an unknown one. FLOPs per token: ``named.models.flops_per_token``."""

from __future__ import annotations

import dataclasses

from named.models.registry import FAMILIES, family_for

from ..config import ConfigError


def _family(model_cfg):
    try:
        return family_for(model_cfg)
    except TypeError:
        raise ConfigError(f"unknown model config {type(model_cfg).__name__}; known: {', '.join(FAMILIES)}") from None


def model_type(model_cfg) -> str:
    return _family(model_cfg).name


def model_class(model_cfg):
    return _family(model_cfg).model_cls


def max_positions(model_cfg) -> int:
    return _family(model_cfg).max_positions(model_cfg)


def model_config_from_dict(d: dict):
    d = dict(d)
    kind = d.pop("type", None)
    if kind not in FAMILIES:
        raise ConfigError(f"model config type {kind!r} is not one of {', '.join(FAMILIES)}")
    cls = FAMILIES[kind].config_cls
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - names
    if unknown:
        raise ConfigError(f"model config has unknown fields {sorted(unknown)} for {kind}")
    return cls(**d)
