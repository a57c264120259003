"""The training configuration read: draccus dataclasses from YAML with CLI overrides.

    named-train --config_path config/gpt2_nano.yaml --trainer.num_train_steps 50

Every key is declared once, as its section's dataclass field (``sections``). From these
declarations come the rules table (``RULES``), the keys a resume may change
(``TRAJECTORY_FREE``), the docs' keys table (``keys_table``) and ``--help``, here.

``load_config`` reads a config in a straight line: the YAML file (safe YAML, no key given twice),
the command line's ``--key value`` overrides (each replaces the file's value at its key, a mapping
too; draccus alone would merge them), each Hugging Face Hub id fetched and pinned to its commit
(``pinning``), the Hugging Face folder of ``model.init_from_hf``, every
value against its declaration (no ``true`` for an integer, no null where the annotation has no
``None``, no unknown key, each key's rule), draccus' decoding into the dataclasses, then the
checks that tie keys together (``validate_static``). Each failure raises ``ConfigError`` naming
the key (or the ``DataError`` of the data section's own checks). The checks that need the
devices, the tokenizer or the model's shapes are in ``loop/checks.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import draccus
import draccus.cfgparsing
import draccus.parsers.decoding

import named as nm

from . import pinning, pretrained
from .check import check_flag_keys, check_section, describe_type
from .errors import CheckpointError, ConfigError, DataError  # ConfigError: also this module's public face
from .location import inside, location
from .read import (
    CONFIG_NAME,
    CONFIG_PATH,
    HELP,
    Flag,
    check_flag_values,
    config_file,
    override,
    read_file,
    read_flags,
    read_value,
)
from .rules import Key, Rule, declared, one_of
from .sections import ModelChoice, TrainConfig

# ---- what the declarations give -------------------------------------------------------------


@dataclass(frozen=True)
class Declared:
    """One key as declared: its dotted name, annotation, default and Key."""

    name: str
    annotation: Any
    default: Any  # dataclasses.MISSING where it has none of its own (a model family's field)
    key: Key


_MODEL_INTEGERS = "model.<every integer>"


def declarations() -> list[Declared]:
    """Every key of TrainConfig, section by section in the order of the fields."""
    out = []
    for section in dataclasses.fields(TrainConfig):
        tp = typing.get_type_hints(TrainConfig)[section.name]  # a section, or an optional one (lora)
        cls = next(a for a in (tp, *typing.get_args(tp)) if isinstance(a, type) and dataclasses.is_dataclass(a))
        if issubclass(cls, ModelChoice):
            out += _model_declarations()
            continue
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if declared(f) is None:  # found at import: RULES below walks every key
                raise ConfigError(
                    f"{section.name}.{f.name} is declared without key(...): give it its rule, whether "
                    "a resumed run may change it, and a line of doc"
                )
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            out.append(Declared(f"{section.name}.{f.name}", hints[f.name], default, declared(f)))
    return out


def _model_declarations() -> list[Declared]:
    """The model section: ``type``, the section's own keys, then what ``field_keys`` and
    ``integer_key`` declare of the families' fields (typed as the first family that has each)."""
    families = list(ModelChoice.get_known_choices().values())
    own = [f for f in dataclasses.fields(families[0]) if declared(f) is not None]
    hints = typing.get_type_hints(families[0])
    out = [
        Declared(
            "model.type",
            str,
            dataclasses.MISSING,
            Key(
                "a model family (docs/models.md), then that family's config fields",
                one_of(*ModelChoice.get_known_choices()),
            ),
        )
    ]
    out += [Declared(f"model.{f.name}", hints[f.name], f.default, declared(f)) for f in own]
    out.append(Declared(_MODEL_INTEGERS, int, dataclasses.MISSING, ModelChoice.integer_key))
    for name, k in ModelChoice.field_keys.items():
        tp = next(typing.get_type_hints(c)[name] for c in families if name in {f.name for f in dataclasses.fields(c)})
        out.append(Declared(f"model.{name}", tp, dataclasses.MISSING, k))
    return out


# The allowed values of every key beyond its type (docs/trainer.md shows them in its keys table).
# On top of these: every number must be finite, every integer fit int32 unless its rule bounds it,
# and the rules that tie two keys together are in validate_static; the data section checks its own
# keys (DataError, data_section), and the checks that need devices or the model's shapes are in loop/checks.py.
RULES: dict[str, Rule] = {d.name: d.key.rule for d in declarations() if d.key.rule is not None}


def _free_keys() -> tuple[str, ...]:
    """The keys a resumed run may change, a section by its name when every key of it may."""
    by_section: dict[str, list[Declared]] = {}
    for d in declarations():
        by_section.setdefault(d.name.split(".")[0], []).append(d)
    out: list[str] = []
    for section, keys in by_section.items():
        free = [d.name for d in keys if d.key.free]
        out += [section] if len(free) == len(keys) else free
    return tuple(out)


# Settings a resumed run may change: layout and performance knobs (a checkpoint restores onto any
# mesh), cadence, bookkeeping and the length of the run (each declared ``free``). Every other key
# (model, data, optimizer, precision, seed, batch size, microbatches, and any key added later
# without ``free=True``) defines the trajectory and must match the run's config.yaml (rundir).
TRAJECTORY_FREE = _free_keys()


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def keys_table() -> str:
    """Every key as the markdown table docs/trainer.md shows (a test keeps the two equal)."""
    rows = ["| key | type | default | allowed | on resume | what it is |", "|---|---|---|---|---|---|"]
    for d in declarations():
        default = "" if d.default is dataclasses.MISSING else f"`{json.dumps(d.default)}`"
        allowed = str(d.key.rule) if d.key.rule is not None else ""
        resume = "may change" if d.key.free else "must match"
        rows.append(
            f"| `{d.name}` | {describe_type(d.annotation)} | {_cell(default)} | {_cell(allowed)} | {resume} | "
            f"{_cell(d.key.doc)} |"
        )
    return "\n".join(rows)


def help_text() -> str:
    """``named-train --help``: how to give a config, then every key, from the declarations."""
    lines = [
        "usage: named-train (--config NAME | --config_path FILE) [--section.key VALUE ...]",
        "",
        "Every key can be given as --section.key VALUE (a YAML value; a mapping replaces the file's):",
    ]
    for d in declarations():
        default = "" if d.default is dataclasses.MISSING else f"; default {json.dumps(d.default)}"
        allowed = f", {d.key.rule}" if d.key.rule is not None else ""
        lines.append(f"  --{d.name}: {describe_type(d.annotation)}{allowed}{default}")
        lines.append(f"      {d.key.doc}")
    return "\n".join(lines)


# ---- loading ------------------------------------------------------------------------------


def load_config(config_path: str | os.PathLike | None, args: Sequence[str] = ()) -> TrainConfig:
    """Parse YAML + CLI overrides into a TrainConfig; every failure is a ConfigError (or the
    DataError a ``data`` field raises), naming the file, key or flag. ``--help`` prints every key
    and exits. One straight line, each step on the last one's values (the module docstring)."""
    config_path, flags, stray = _command_line(list(args), config_path)
    raw = read_file(Path(config_path), [f.name for f in dataclasses.fields(TrainConfig)]) if config_path else {}
    _override(raw, flags, stray)
    raw = pinning.pin_config(raw)  # each Hugging Face Hub id fetched and pinned to its commit
    raw = pretrained.resolve(raw)  # model.init_from_hf: the folder's architecture and tokenizer
    check_section(TrainConfig, raw, "")
    cfg = _decode(raw, flags, config_path)
    validate_static(cfg)
    # Last, so that a snippet without a model still reports its own mistakes first.
    if "model" not in raw:
        known = ", ".join(ModelChoice.get_known_choices())
        raise ConfigError(
            f"model: missing{_origin('', flags, config_path)}; add `model: {{type: gpt2, ...}}` with "
            f"that model's fields (registered types: {known})"
        )
    return cfg


def _command_line(args: list[str], config_path) -> tuple[Any, list[Flag], list[str]]:
    """The config file (``--config_path FILE`` or ``--config NAME`` among the flags names it too),
    the flags that set keys, and the words that are no flag's. ``--help`` prints every key and exits."""
    flags, stray = read_flags(args)
    if any(f.key == HELP for f in flags):
        print(help_text())
        raise SystemExit(0)  # protocol: --help exits, as argparse's does
    given = {f.key: f.text for f in flags if f.key in (CONFIG_PATH, CONFIG_NAME)}
    check_flag_values([f for f in flags if f.key in given], [])  # --config_path without its file
    if given:
        config_path = config_file(given.get(CONFIG_PATH), given.get(CONFIG_NAME))
    return config_path, [f for f in flags if f.key not in (CONFIG_PATH, CONFIG_NAME)], stray


def _override(raw: dict, flags: list[Flag], stray: list[str]) -> None:
    """Each flag's value in ``raw`` at its key, replacing the file's. Every flag's key is checked
    first (argparse's refusals would blame the file), then each value read as YAML."""
    annotations = {f.key: check_flag_keys(TrainConfig, f.key, lambda s: _chosen_type(s, flags, raw)) for f in flags}
    check_flag_values(flags, stray)
    for f in flags:
        value = read_value(f, mapping=typing.get_origin(annotations[f.key]) is dict)
        _check_choice(f, value, annotations[f.key])
        override(raw, f.key, value)


def _check_choice(flag: Flag, value, annotation) -> None:
    """``--model.type NAME``: a registered name (``check_flag_keys`` gives their Literal)."""
    if typing.get_origin(annotation) is typing.Literal and value not in typing.get_args(annotation):
        section = flag.key.rpartition(".")[0]
        raise ConfigError(
            f"--{flag.key} {value!r} is not a registered {section} type; registered: "
            f"{', '.join(typing.get_args(annotation))}"
        )


def _decode(raw: dict, flags: list[Flag], config_path) -> TrainConfig:
    """The checked values as dataclasses (draccus); a section's own check (a ``__post_init__``)
    is reported as the section's, blamed on where its values came from."""
    try:
        return draccus.parsers.decoding.decode(TrainConfig, raw)
    except (DataError, ConfigError):
        raise
    except draccus.utils.ParsingError as e:
        inner = None if isinstance(e, draccus.utils.DecodingError) else _raised_in_post_init(e)
        if isinstance(inner, (DataError, ConfigError)):
            raise inner from None  # a data field's own check: its message names the key
        if inner is not None:
            section = _section_of(e)
            raise ConfigError(f"bad configuration{_origin(section, flags, config_path)}: {section}: {inner}") from None
        raise ConfigError(f"bad configuration{_origin('', flags, config_path)}: {e}") from None
    except (draccus.utils.DraccusException, ValueError, TypeError) as e:
        raise ConfigError(f"bad configuration{_origin('', flags, config_path)}: {e}") from None


def _chosen_type(section: str, flags: list[Flag], content: dict) -> str | None:
    """The ``type`` of the choice section ``section`` (``model``): the command line's, else the file's."""
    given = [f.text for f in flags if f.key == f"{section}.type"]
    if given:
        return given[-1]
    value: Any = content
    for name in section.split("."):
        value = value.get(name) if isinstance(value, dict) else None
    return value.get("type") if isinstance(value, dict) else None


def _origin(section: str, flags: list[Flag], config_path) -> str:
    """Where the values of ``section`` (all of them for "") came from, for a message that cannot
    name one key: the command line's flags of that section, and the file for the rest."""
    given = [str(f) for f in flags if not section or f.key == section or f.key.startswith(section + ".")]
    if not given:
        return f" in {config_path}" if config_path else ""
    rest = f", the rest{f' of {section}' if section else ''} from {config_path}" if config_path else ""
    return f" ({', '.join(given)} on the command line{rest})"


def _raised_in_post_init(e: BaseException) -> BaseException | None:
    """The error a config dataclass's ``__post_init__`` raised, which draccus wraps in a
    ParsingError that only names the class."""
    cause = e.__cause__ or e.__context__
    while cause is not None and isinstance(cause, draccus.utils.DraccusException):
        cause = cause.__cause__ or cause.__context__
    return cause if isinstance(cause, (ValueError, TypeError)) else None


def _section_of(e: BaseException) -> str:
    m = re.search(r"class (\w+)", str(e))
    name = m.group(1) if m else ""
    for f in dataclasses.fields(TrainConfig):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None  # type: ignore[misc]
        if type(default).__name__ == name or (f.name == "model" and name.endswith("Section")):
            return f.name
    return name or "config"


# ---- the rules that tie keys together -------------------------------------------------------


def validate_static(cfg: TrainConfig) -> None:
    """The checks that tie two keys together and need neither devices nor data (each key's own
    values were checked against its declaration before decoding)."""
    t, o = cfg.trainer, cfg.optimizer
    if t.train_batch_size % t.microbatches:
        raise ConfigError(
            f"trainer.train_batch_size={t.train_batch_size} is not divisible by trainer.microbatches={t.microbatches}"
        )
    if bool(t.eval_harness_tasks) != bool(t.eval_harness_interval):
        raise ConfigError(
            "trainer.eval_harness_tasks and trainer.eval_harness_interval go together: "
            + (
                f"set --trainer.eval_harness_interval N to score {', '.join(t.eval_harness_tasks)}"
                if t.eval_harness_tasks
                else f"trainer.eval_harness_interval={t.eval_harness_interval} names no tasks "
                "(--trainer.eval_harness_tasks '[task, ...]')"
            )
        )
    if cfg.mesh.batch_split > 1 and cfg.mesh.mode != "explicit":
        raise ConfigError(
            f"mesh.batch_split={cfg.mesh.batch_split} needs mesh.mode: explicit (auto mode leaves the "
            f"schedule to XLA); set --mesh.mode explicit or mesh.batch_split: 1"
        )
    if cfg.mesh.gather == "per_use" and cfg.mesh.mode == "explicit":
        raise ConfigError(
            "mesh.gather: per_use is for mesh.mode: auto (explicit mode gathers each layer's weights itself); "
            "set --mesh.gather auto or --mesh.mode auto"
        )
    if o.warmup_steps >= 1 and o.warmup_steps != int(o.warmup_steps):
        raise ConfigError(
            f"optimizer.warmup_steps={o.warmup_steps} must be a whole number of steps, or a fraction "
            "of the run below 1 (0.1: a tenth of trainer.num_train_steps)"
        )
    span = o.horizon(t.num_train_steps)
    if t.num_train_steps and o.warmup(t.num_train_steps) > span:  # 0 steps: a check-only run
        what = "trainer.num_train_steps" if o.schedule_steps is None else "optimizer.schedule_steps"
        raise ConfigError(
            f"optimizer.warmup_steps={o.warmup_steps:g} is longer than {what}="
            f"{span}: lower it (--optimizer.warmup_steps {max(span // 10, 1)}) "
            "or give a fraction of the run (--optimizer.warmup_steps 0.1)"
        )
    from named.nn.precision import get_policy

    try:
        get_policy(t.precision)
    except Exception as e:  # noqa: BLE001 - reported with the key
        raise ConfigError(f"trainer.precision: {e}") from None
    for name, mapping in (
        ("mesh.compute_mapping", cfg.mesh.compute_mapping),
        ("mesh.param_mapping", cfg.mesh.param_mapping),
    ):
        for axis, target in mapping.items():  # entry by entry, to name the key
            try:  # the library's own check, against the mesh's axis names (their sizes need the devices)
                nm.check_mapping({axis: target}, cfg.mesh.shape)
            except nm.ShardingError as e:
                raise ConfigError(f"{name}.{axis}: {e}") from None
    checkpoint_root(cfg)  # checkpoint.base: a path, or a URL of a scheme we write to
    named_checkpoint(cfg)


# ---- where checkpoints live: the one rule ---------------------------------------------------


def checkpoint_root_setting(cfg: TrainConfig) -> tuple[str, str]:
    """The key that says where this run's checkpoints live (in ``<root>/checkpoints``), and its
    value: ``checkpoint.base`` when it is set, else ``trainer.run_dir``."""
    if cfg.checkpoint.base:
        return "checkpoint.base", cfg.checkpoint.base
    return "trainer.run_dir", cfg.trainer.run_dir


def checkpoint_root(cfg: TrainConfig):
    """The checkpoint root (``checkpoint_root_setting``) as a place: ``checkpoint.base`` is a path
    or an ``s3://`` / ``gs://`` URL, ``trainer.run_dir`` always a local path."""
    root_key, value = checkpoint_root_setting(cfg)
    if root_key == "trainer.run_dir":
        return Path(value)
    try:
        return location(value)
    except CheckpointError as e:
        raise ConfigError(f"{root_key} {e}") from None


def named_checkpoint(cfg: TrainConfig):
    """The checkpoint ``trainer.load_checkpoint`` names, as a place inside the checkpoint root
    (relative to it, or absolute), None for ``auto`` and null; ConfigError when it lies outside."""
    value = cfg.trainer.load_checkpoint
    if value in (None, "auto"):
        return None
    path = inside(checkpoint_root(cfg), value)
    if path is None:
        root_key, root = checkpoint_root_setting(cfg)
        raise ConfigError(f"trainer.load_checkpoint {value!r} is outside {root_key} {root!r}")
    return path


def data_parallel_size(cfg: TrainConfig, mesh_shape: dict[str, int]) -> int:
    """How many ways the batch axis is split by the compute mapping."""
    v = cfg.mesh.compute_mapping.get("batch")
    axes = [v] if isinstance(v, str) else list(v or [])
    n = 1
    for a in axes:
        n *= mesh_shape[a]
    return n


def dump_config(cfg: TrainConfig) -> str:
    # An optional section that is off (lora: null) is left out: load_config reads every section as
    # a mapping, and a run directory written before the section existed still compares equal.
    encoded = {k: v for k, v in draccus.encode(cfg).items() if v is not None}
    return draccus.cfgparsing.save_config(encoded)
