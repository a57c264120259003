"""A config's text, read: the YAML file and the command line's flags, before any value is checked.

``read_file`` gives the file's sections (safe YAML, a mapping of sections, no key given twice);
``read_flags`` splits the command line into ``--key value`` flags (``--key=value`` too), refusing
stray words and a flag without its value as argparse would; ``read_value`` reads one flag's value
as YAML, the way the file's values are read; ``override`` puts it in place, replacing whatever the
file held at that key (a mapping too: replace, not merge). ``config.load_config`` runs them in
that order; nothing here knows the sections.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
from pathlib import Path
from typing import Any

import yaml

from .check import join_key
from .errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Flag:
    """``--key value`` as given: the key without its dashes, the value's text (None: none given)."""

    key: str
    text: str | None

    def __str__(self) -> str:
        return f"--{self.key} {self.text or ''}".rstrip()


HELP = "help"  # --help and -h
CONFIG_PATH = "config_path"  # --config_path FILE: the file, also given among the flags (draccus' name for it)
CONFIG_NAME = "config"  # --config NAME: a file, or a config shipped with the package


def read_flags(args: list[str]) -> tuple[list[Flag], list[str]]:
    """The flags of ``args`` in order, and the words that belong to no flag. A flag's value is
    the next word unless that starts with ``--``."""
    flags: list[Flag] = []
    stray: list[str] = []
    i = 0
    while i < len(args):
        word = args[i]
        name, eq, inline = word[2:].partition("=")
        if word in ("-h", "--help"):
            flags.append(Flag(HELP, ""))
        elif not word.startswith("--") or not name:
            stray.append(word)
        elif eq:
            flags.append(Flag(name, inline))
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            flags.append(Flag(name, args[i + 1]))
            i += 1
        else:
            flags.append(Flag(name, None))
        i += 1
    return flags, stray


def check_flag_values(flags: list[Flag], stray: list[str]) -> None:
    """What argparse refused: a flag without a value, and words that are no flag's."""
    for f in flags:
        if f.text is None:
            raise ConfigError(f"bad configuration on the command line: argument --{f.key}: expected one argument")
    if stray:
        raise ConfigError(f"bad configuration on the command line: unrecognized arguments: {' '.join(stray)}")


def read_value(flag: Flag, mapping: bool) -> Any:
    """The value of ``flag``, read as YAML (an empty text stays the empty string). ``mapping``: the
    key takes a mapping (``--mesh.param_mapping '{}'``), which the value must be."""
    text = flag.text or ""
    try:
        value = _load(text, flag.key) if text.strip() else (None if mapping else text)
    except (yaml.YAMLError, ConfigError) as e:
        if mapping:
            raise ConfigError(
                f"--{flag.key}: {text!r} is not a YAML mapping ({e}); write e.g. '{{embed: data}}'"
            ) from None
        raise ConfigError(f"--{flag.key}: {text!r} is not a YAML value ({e})") from None
    if mapping and not isinstance(value, dict):
        raise ConfigError(f"--{flag.key} must be a mapping like '{{embed: data}}' ('{{}}' for none), got {text!r}")
    return value


def override(raw: dict, key: str, value: Any) -> None:
    """Set dotted ``key`` of ``raw`` to ``value``, replacing what was there, a mapping too (draccus
    would merge a mapping into the file's: ``--mesh.param_mapping '{}'`` would keep FSDP)."""
    *sections, name = key.split(".")
    for s in sections:
        if not isinstance(raw.get(s), dict):
            raw[s] = {}
        raw = raw[s]
    raw[name] = value


class _ConfigLoader(yaml.SafeLoader):
    """Safe YAML that refuses a key given twice in one mapping (PyYAML, and so draccus, keep
    the last one silently). Being safe, it also refuses draccus' ``!include`` and Python tags."""

    key = ""  # where the document sits in the config: "" for a file, a flag's key for its value

    def construct_document(self, node):
        _refuse_duplicates(node, self.key)
        return super().construct_document(node)


def _load(stream, key: str = "") -> Any:
    loader = _ConfigLoader(stream)
    loader.key = key
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _refuse_duplicates(node, key: str) -> None:
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicates(item, f"{key}[{i}]")
    if not isinstance(node, yaml.MappingNode):
        return
    seen: dict[Any, int] = {}
    for k, v in node.value:
        if k.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults` may repeat keys on purpose
            continue
        name = k.value if isinstance(k, yaml.ScalarNode) else None
        if name is not None and name in seen:
            what = "section" if not key else "key"
            raise ConfigError(
                f"{what} {join_key(key, name)} is given twice, at lines {seen[name]} and "
                f"{k.start_mark.line + 1}; YAML would keep only the last"
            )
        if name is not None:
            seen[name] = k.start_mark.line + 1
        _refuse_duplicates(v, join_key(key, name) if name is not None else key)


def read_file(path: Path, sections: list[str]) -> dict:
    """The file's content: it exists and holds safe YAML, a mapping of sections (``sections``:
    their names, for the message) with no key given twice (draccus' own messages for an empty or
    malformed file do not say which file or where)."""
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise ConfigError(f"config file {str(path)!r} {what}")
    try:
        with open(path, encoding="utf-8") as f:
            content = _load(f)
    except ConfigError as e:
        raise ConfigError(f"config file {str(path)!r}: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"config file {str(path)!r} is not valid YAML{at}: {problem}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {e}") from None
    if content is None:
        raise ConfigError(f"config file {str(path)!r} is empty; it needs at least one section (trainer:, model:, ...)")
    if not isinstance(content, dict):
        raise ConfigError(
            f"config file {str(path)!r} holds a {type(content).__name__}; it must be a mapping of "
            f"sections ({', '.join(sections)})"
        )
    for section, value in content.items():
        if not isinstance(value, dict):
            raise ConfigError(
                f"config file {str(path)!r}: section {section!r} must be a mapping of keys, got {value!r}"
            )
    return content


def shipped_configs() -> list[str]:
    """The names of the configs shipped with the package (the repository's ``config/``)."""
    return sorted(p.name[:-5] for p in importlib.resources.files("named.configs").iterdir() if p.name.endswith(".yaml"))


def resolve_config(name: str) -> str:
    """``--config NAME``: a YAML file at that path, else the shipped config of that name."""
    if Path(name).is_file():
        return name
    stem = name[:-5] if name.endswith(".yaml") else name
    if stem in shipped_configs():
        return str(importlib.resources.files("named.configs") / f"{stem}.yaml")
    raise ConfigError(f"--config {name!r} is neither a file nor a shipped config ({', '.join(shipped_configs())})")


def config_file(path: str | None, name: str | None) -> str | None:
    """The config file that ``--config_path FILE`` or ``--config NAME`` (one of them, or neither) names."""
    if path is not None and name is not None:
        raise ConfigError(f"give --{CONFIG_PATH} FILE or --{CONFIG_NAME} NAME, not both")
    return resolve_config(name) if name is not None else path
