"""Every config value against its field's type annotation and ``RULES``, key by key.

``load_config`` runs these on the merged YAML + CLI values before draccus converts them (draccus
reads YAML's true as the integer 1 and lets null into any field), and ``validate_static`` again on
the decoded config, defaults included. Each failure raises ``ConfigError`` naming the key. The
sections themselves live in ``config``; nothing here knows them.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from typing import Any

import draccus

from ._rules import INT_LIMIT, ConfigError, _rule


_KINDS = {bool: ("true or false", "booleans"), int: ("an integer", "integers"), float: ("a number", "numbers"),
          str: ("a string", "strings")}


def _without_none(tp) -> tuple[Any, bool]:
    """The annotation with ``None`` taken out of it, and whether it was there."""
    args = typing.get_args(tp)
    if type(None) not in args:
        return tp, False
    rest = tuple(a for a in args if a is not type(None))
    return (rest[0] if len(rest) == 1 else typing.Union[rest]), True


def _describe(tp) -> str:
    base, nullable = _without_none(tp)
    args = typing.get_args(base)
    if base in _KINDS:
        text = _KINDS[base][0]
    elif typing.get_origin(base) is typing.Union:  # data.train: a path (string) or a named source (mapping)
        text = " or ".join(_describe(a) for a in sorted(args, key=lambda a: a is not str))
    elif typing.get_origin(base) is list and typing.get_origin(args[0]) is typing.Union:
        text = "a list of " + " or ".join(_KINDS[a][1] if a in _KINDS else "mappings"
                                          for a in sorted(typing.get_args(args[0]), key=lambda a: a is not str))
    elif typing.get_origin(base) is list:
        text = f"a list of {_KINDS.get(args[0], ('', 'values'))[1]}"
    elif typing.get_origin(base) is dict:
        text = f"a mapping of names to {_KINDS.get(args[1], ('', 'values'))[1]}"
    else:
        text = "a mapping of keys"
    return text + (" or null" if nullable else "")


def _show(value) -> str:
    if value is None:
        return "null (None)"
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    kind = {int: "an integer", float: "a number", str: "a string", list: "a list", dict: "a mapping"}
    return f"{value!r} ({kind.get(type(value), type(value).__name__)})"


def _is_number_text(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _has_type(base, value) -> bool:
    if base is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):  # YAML's true is a bool, never the integer 1
        return False
    if base is int:
        return isinstance(value, int)
    if base is float:  # YAML 1.1 reads 1e-3 (no dot) as a string; draccus converts it
        return isinstance(value, (int, float)) or (isinstance(value, str) and _is_number_text(value))
    if base is str:
        return isinstance(value, str)
    origin = typing.get_origin(base)
    if origin is typing.Union:
        return any(_has_type(a, value) for a in typing.get_args(base))
    if origin in (list, dict):
        return isinstance(value, origin)
    return True


def _flow_hint(key: str) -> str:
    name = key.rsplit(".", 1)[-1]
    if ":" not in name:
        return ""
    k, v = name.split(":", 1)
    return f"; YAML reads {{{name}}} as the key {name!r} with no value: write {{{k}: {v}}}, with a space after the colon"


def _check_value(tp, value, key: str) -> None:
    """A value (from YAML and the CLI, or already decoded) against its annotation and RULES."""
    base, nullable = _without_none(tp)
    if value is None:
        if nullable:
            return
        raise ConfigError(f"{key} must be {_describe(tp)}, got {_show(value)}{_flow_hint(key)}")
    if base is Any:
        return
    if not _has_type(base, value):
        raise ConfigError(f"{key} must be {_describe(tp)}, got {_show(value)}")
    if typing.get_origin(base) is list:
        for i, item in enumerate(value):
            _check_value(typing.get_args(base)[0], item, f"{key}[{i}]")
    elif typing.get_origin(base) is dict:
        for k, item in value.items():
            if not isinstance(k, str):
                raise ConfigError(f"{key}: the key {k!r} must be a name (a string)")
            _check_value(typing.get_args(base)[1], item, f"{key}.{k}")
    elif base is float:
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number, got {value}")
    rule = _rule(key, value)
    if base is int and abs(value) > INT_LIMIT and (rule is None or rule.high is None):
        raise ConfigError(f"{key} must be at most {INT_LIMIT} in size (JAX counts positions, steps and sizes in "
                          f"int32), got {value}")
    if rule is not None:
        rule.check(value, key)


def _is_section(tp) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _join(key: str, name) -> str:
    return f"{key}.{name}" if key else str(name)


def _choice_section(cls, value, key: str):
    """The chosen dataclass and its keys, from ``{type: ..., ...}`` or a decoded section (the
    model section: a draccus ChoiceRegistry, one type per family)."""
    if not isinstance(value, dict):
        return type(value), value
    known = cls.get_known_choices()
    name = value.get("type")
    if name is None:
        raise ConfigError(f"{key}.type missing; add `type: {next(iter(known))}` to the {key} section "
                          f"(registered types: {', '.join(known)})")
    if not isinstance(name, str) or name not in known:
        raise ConfigError(f"{key}.type {name!r} is not a registered {key} type; registered: {', '.join(known)}")
    return known[name], {k: v for k, v in value.items() if k != "type"}


def unknown_key(names: list[str], name, key: str, flag: str | None = None) -> ConfigError:
    """The one message for a key that is not among ``names``, the keys of section ``key``, with the
    nearest one suggested. ``flag``: the command-line flag it came from (``trainr.seed`` for
    ``trainr``), shown, and corrected, whole."""
    def show(k: str) -> str:
        return f"--{k}{flag[len(_join(key, name)):]}" if flag is not None else k

    near = difflib.get_close_matches(str(name), names, n=1)
    hint = f"; did you mean {show(_join(key, near[0]))}?" if near else ""
    where = f"the {key} section" if key else "the config"
    return ConfigError(f"{show(_join(key, name))} is not a key of {where}{hint} (its keys: {', '.join(names)})")


def check_flag_keys(root, key: str, chosen_type) -> None:
    """The dotted ``key`` of a command-line flag (``trainer.num_train_steps``) against the sections
    under the dataclass ``root``, refused as a YAML key would be (``unknown_key``).
    ``chosen_type(section_key)`` is the ``type`` given for a choice section (``model``), or None."""
    cls, at = root, ""
    parts = key.split(".")
    for i, name in enumerate(parts):
        if isinstance(cls, type) and issubclass(cls, draccus.ChoiceRegistry):
            known = cls.get_known_choices()
            if name == "type":
                return
            if chosen_type(at) not in known:  # any family's key, until the type is known
                names = sorted({f.name for c in known.values() for f in dataclasses.fields(c)} | {"type"})
                if name not in names:
                    raise unknown_key(names, name, at, flag=key)
                return
            cls = known[chosen_type(at)]
            names = ["type", *(f.name for f in dataclasses.fields(cls))]
        else:
            names = [f.name for f in dataclasses.fields(cls)]
        if name not in names:
            raise unknown_key(names, name, at, flag=key)
        at = _join(at, name)
        tp = _without_none(typing.get_type_hints(cls)[name])[0]
        if not _is_section(tp) and i + 1 < len(parts):
            raise ConfigError(f"--{key} is not a key: {at} takes one value ({_describe(tp)}); give it whole: --{at} VALUE")
        cls = tp


def _check_section(cls, value, key: str) -> None:
    """A section (a dict from YAML and the CLI, or a dataclass) against its dataclass, key by key."""
    if issubclass(cls, draccus.ChoiceRegistry):
        cls, value = _choice_section(cls, value, key)
    if isinstance(value, dict):
        names = [f.name for f in dataclasses.fields(cls)]
        for name in value:
            if name not in names:
                raise unknown_key(names, name, key)
        items = list(value.items())
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
    else:
        raise ConfigError(f"{key} must be a mapping of keys, got {_show(value)}")
    hints = typing.get_type_hints(cls)
    for name, item in items:
        section = _without_none(hints[name])[0]  # an optional section (lora) is checked when given
        if _is_section(section) and item is not None:
            _check_section(section, item, _join(key, name))
        else:
            _check_value(hints[name], item, _join(key, name))


def check_values(obj, key: str) -> None:
    """A dataclass built elsewhere (a model config read back from a run directory) against its
    annotations and RULES, its keys named under ``key``."""
    _check_section(type(obj), obj, key)


def _nullable(root, key: str) -> bool:
    """Whether the dotted ``key`` under the dataclass ``root`` may be null."""
    *sections, name = key.split(".")
    cls: Any = root
    for section in sections:
        cls = _without_none(typing.get_type_hints(cls).get(section))[0]
    tp = typing.get_type_hints(cls).get(name) if _is_section(cls) else None
    return tp is not None and _without_none(tp)[1]
