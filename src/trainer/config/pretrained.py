"""``model.init_from_hf``: a run whose model is a Hugging Face folder's (a local folder, or the
snapshot of a Hub id, ``hub.folder``).

``resolve(raw)`` rewrites the merged YAML + CLI values before they are checked and decoded:
the model section becomes the folder's architecture in full (its ``type`` and every field of
its config.json, so config.yaml records what was trained and a resume needs no folder),
with only the keys in ``SAFE_OVERRIDES`` taken from the YAML. A key that would change the
architecture is refused naming it, unless it repeats the folder's value. The tokenizer is the
folder's (``tokenizer.json``; ``data.tokenizer`` is then the same value: the folder or the pinned
Hub id) unless ``data.tokenizer`` names another.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from named.models.hf import CheckpointFormatError, read_config

from . import hub
from .errors import ConfigError

# What a fine-tune may change without changing the function the weights compute: regularisation
# and memory. Anything else (a width, a norm epsilon, the RoPE base) would silently make the
# pretrained weights compute something else.
SAFE_OVERRIDES = ("dropout", "remat")
KEY = "model.init_from_hf"


def folder(value: str) -> Path:
    """The local folder ``model.init_from_hf`` names: the folder itself, or a Hub id's snapshot."""
    return hub.folder(value, KEY)


def folder_config(folder: Path) -> tuple[str, Any]:
    """The family name and our config for ``folder``'s config.json, as a ConfigError on ``KEY``."""
    try:
        family, config, _ = read_config(folder)
    except CheckpointFormatError as e:
        raise ConfigError(f"{KEY}: {e}") from None
    return family.name, config


def _as_yaml(value):
    """A config field as YAML gives it (tuples as lists, nested dataclasses as mappings)."""
    if dataclasses.is_dataclass(value):
        return {f.name: _as_yaml(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple):
        return [_as_yaml(v) for v in value]
    return value


def resolve(raw: dict) -> dict:
    """``raw`` (the merged config values) with an ``init_from_hf`` model section made whole."""
    model = raw.get("model")
    if not isinstance(model, dict) or model.get("init_from_hf") is None:
        return raw
    value = model["init_from_hf"]
    if not isinstance(value, str):
        return raw  # the type check that follows names the key
    local = folder(value)
    name, config = folder_config(local)
    given_type = model.get("type")
    if given_type is not None and given_type != name:
        raise ConfigError(
            f"model.type={given_type!r}, but {KEY}={value!r} holds a {name} model "
            "(leave model.type out to take the folder's)"
        )
    fields = {f.name: _as_yaml(getattr(config, f.name)) for f in dataclasses.fields(config)}
    for key, given in model.items():
        if key in ("type", "init_from_hf") or key in SAFE_OVERRIDES and key in fields:
            continue
        if key in fields and given != fields[key]:
            safe = ", ".join(k for k in SAFE_OVERRIDES if k in fields)
            raise ConfigError(
                f"model.{key}={given!r}: {KEY} takes the architecture from {local}/config.json "
                f"({key}={fields[key]!r}); a fine-tune may set only {safe}"
            )
    merged = {**fields, **{k: v for k, v in model.items() if k != "type"}, "type": name}
    data = dict(raw.get("data") or {})
    if "tokenizer" not in data:
        if not (local / "tokenizer.json").is_file():
            raise ConfigError(f"{KEY}: {local} has no tokenizer.json; name a tokenizer with data.tokenizer")
        data["tokenizer"] = value
    return {**raw, "model": merged, "data": data}
