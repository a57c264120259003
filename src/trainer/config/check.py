"""Every config value against its field's declaration, key by key: its type annotation, and the
rule its ``key(...)`` gives (``rules``).

``load_config`` runs these on the YAML + CLI values before draccus converts them (draccus reads
YAML's true as the integer 1 and lets null into any field). Each failure raises ``ConfigError``
naming the key. The sections themselves live in ``config``; nothing here knows them.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any

from .errors import ConfigError
from .rules import INT_LIMIT, Key, declared

# ``X | Y`` and ``Optional``/``Union``: which of the two ``get_type_hints`` gives for a string
# annotation depends on what typing's caches already hold, so both are read alike.
_UNIONS = (typing.Union, types.UnionType)
_KINDS = {
    bool: ("true or false", "booleans"),
    int: ("an integer", "integers"),
    float: ("a number", "numbers"),
    str: ("a string", "strings"),
}


def _is_union(tp) -> bool:
    """``Union[A, B]`` or ``A | B`` (a types.UnionType: what annotations are written as here)."""
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _without_none(tp) -> tuple[Any, bool]:
    """The annotation with ``None`` taken out of it, and whether it was there."""
    args = typing.get_args(tp)
    if type(None) not in args:
        return tp, False
    rest = tuple(a for a in args if a is not type(None))
    return (rest[0] if len(rest) == 1 else typing.Union[rest]), True  # noqa: UP007 - a Union of a runtime tuple


def describe_type(tp) -> str:
    base, nullable = _without_none(tp)
    args = typing.get_args(base)
    if base in _KINDS:
        text = _KINDS[base][0]
    elif _is_union(base):  # data.train: a path (string) or a named source (mapping)
        text = " or ".join(describe_type(a) for a in sorted(args, key=lambda a: a is not str))
    elif typing.get_origin(base) is list and _is_union(args[0]):
        text = "a list of " + " or ".join(
            _KINDS[a][1] if a in _KINDS else "mappings"
            for a in sorted(typing.get_args(args[0]), key=lambda a: a is not str)
        )
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
    if _is_union(base):
        return any(_has_type(a, value) for a in typing.get_args(base))
    if origin is list:  # a decoded mesh mapping holds its lists as tuples (MeshConfig)
        return isinstance(value, (list, tuple))
    if origin is dict:
        return isinstance(value, dict)
    return True


def _flow_hint(key: str) -> str:
    name = key.rsplit(".", 1)[-1]
    if ":" not in name:
        return ""
    k, v = name.split(":", 1)
    return (
        f"; YAML reads {{{name}}} as the key {name!r} with no value: write {{{k}: {v}}}, with a space after the colon"
    )


def _check_value(tp, value, key: str, declaration: Key | None = None, integers: Key | None = None) -> None:
    """A value (from YAML and the CLI) against its annotation and its key's rule; ``integers``: the
    section's rule for every integer without one of its own (the model section's), items included."""
    base, nullable = _without_none(tp)
    if value is None:
        if nullable:
            return
        raise ConfigError(f"{key} must be {describe_type(tp)}, got {_show(value)}{_flow_hint(key)}")
    if base is Any:
        return
    if not _has_type(base, value):
        raise ConfigError(f"{key} must be {describe_type(tp)}, got {_show(value)}")
    if typing.get_origin(base) is list:
        for i, item in enumerate(value):
            _check_value(typing.get_args(base)[0], item, f"{key}[{i}]", integers=integers)
    elif typing.get_origin(base) is dict:
        for k, item in value.items():
            if not isinstance(k, str):
                raise ConfigError(f"{key}: the key {k!r} must be a name (a string)")
            _check_value(typing.get_args(base)[1], item, f"{key}.{k}", integers=integers)
    elif base is float:
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number, got {value}")
    rule = declaration.rule if declaration is not None else None
    if rule is None and integers is not None and isinstance(value, int) and not isinstance(value, bool):
        rule = integers.rule
    if base is int and abs(value) > INT_LIMIT and (rule is None or rule.high is None):
        raise ConfigError(
            f"{key} must be at most {INT_LIMIT} in size (JAX counts positions, steps and sizes in int32), got {value}"
        )
    if rule is not None:
        rule.check(value, key)


def declaration(cls, name: str) -> Key | None:
    """The Key of field ``name`` of the section ``cls``: the field's own (``key(...)``), else the one
    the section declares for the fields it takes from elsewhere (``field_keys``: the model
    section's, whose fields are a model family's config)."""
    f = {f.name: f for f in dataclasses.fields(cls)}.get(name)
    own = declared(f) if f is not None else None
    return own if own is not None else getattr(cls, "field_keys", {}).get(name)


def _is_choice(cls) -> bool:
    """A section with one dataclass per ``type`` (draccus' ChoiceRegistry: the model section). Read by
    its interface, so that checking the data section (which ``named.trainer.data`` does) needs no draccus."""
    return isinstance(cls, type) and hasattr(cls, "get_known_choices")


def _is_section(tp) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def join_key(key: str, name) -> str:
    return f"{key}.{name}" if key else str(name)


def _choice_section(cls, value, key: str):
    """The chosen dataclass and its keys, from ``{type: ..., ...}`` or a decoded section (the
    model section: a draccus ChoiceRegistry, one type per family)."""
    if not isinstance(value, dict):
        return type(value), value
    known = cls.get_known_choices()
    name = value.get("type")
    if name is None:
        raise ConfigError(
            f"{key}.type missing; add `type: {next(iter(known))}` to the {key} section "
            f"(registered types: {', '.join(known)})"
        )
    if not isinstance(name, str) or name not in known:
        raise ConfigError(f"{key}.type {name!r} is not a registered {key} type; registered: {', '.join(known)}")
    return known[name], {k: v for k, v in value.items() if k != "type"}


def unknown_key(names: list[str], name, key: str, flag: str | None = None) -> ConfigError:
    """The one message for a key that is not among ``names``, the keys of section ``key``, with the
    nearest one suggested. ``flag``: the command-line flag it came from (``trainr.seed`` for
    ``trainr``), shown, and corrected, whole."""

    def show(k: str) -> str:
        return f"--{k}{flag[len(join_key(key, name)) :]}" if flag is not None else k

    near = difflib.get_close_matches(str(name), names, n=1)
    hint = f"; did you mean {show(join_key(key, near[0]))}?" if near else ""
    where = f"the {key} section" if key else "the config"
    return ConfigError(f"{show(join_key(key, name))} is not a key of {where}{hint} (its keys: {', '.join(names)})")


def check_flag_keys(root, key: str, chosen_type) -> Any:
    """The dotted ``key`` of a command-line flag (``trainer.num_train_steps``) against the sections
    under the dataclass ``root``, refused as a YAML key would be (``unknown_key``); returns the
    annotation of the value it sets (for a choice section's ``type``: a ``Literal`` of the
    registered names). ``chosen_type(section_key)`` is the ``type`` given for a choice section
    (``model``), or None."""
    cls: Any = root
    at = ""
    parts = key.split(".")
    for i, name in enumerate(parts):
        if _is_choice(cls):
            known = cls.get_known_choices()
            if name == "type":
                tp = typing.Literal[tuple(known)]
                if i + 1 < len(parts):
                    raise ConfigError(
                        f"--{key} is not a key: {join_key(at, name)} takes one value (a registered "
                        f"{at} type); give it whole: --{join_key(at, name)} VALUE"
                    )
                return tp
            if chosen_type(at) not in known:  # any family's key, until the type is known
                names = sorted({f.name for c in known.values() for f in dataclasses.fields(c)} | {"type"})
                if name not in names:
                    raise unknown_key(names, name, at, flag=key)
                return Any
            cls = known[chosen_type(at)]
            names = ["type", *(f.name for f in dataclasses.fields(cls))]
        else:
            names = [f.name for f in dataclasses.fields(cls)]
        if name not in names:
            raise unknown_key(names, name, at, flag=key)
        at = join_key(at, name)
        tp = typing.get_type_hints(cls)[name]
        base = _without_none(tp)[0]
        if not _is_section(base) and i + 1 < len(parts):
            raise ConfigError(
                f"--{key} is not a key: {at} takes one value ({describe_type(base)}); give it whole: --{at} VALUE"
            )
        cls = base
    return tp


def check_section(cls, value, key: str) -> None:
    """A section (a dict from YAML and the CLI, or a dataclass) against its dataclass, key by key."""
    if _is_choice(cls):
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
    integers = getattr(cls, "integer_key", None)
    for name, item in items:
        section = _without_none(hints[name])[0]  # an optional section (lora) is checked when given
        if _is_section(section) and item is not None:
            check_section(section, item, join_key(key, name))
        else:
            _check_value(hints[name], item, join_key(key, name), declaration(cls, name), integers)
