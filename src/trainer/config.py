"""The training configuration: draccus dataclasses read from YAML with CLI overrides.

    named-train --config_path config/gpt2_nano.yaml --trainer.num_train_steps 50

``load_config`` is the one validation layer for values: a YAML file must be safe YAML with no
key given twice; every value is checked against its field's type annotation before draccus
converts it (no ``true`` for an integer, no null where the annotation has no ``None``, no
unknown key); then every value against ``RULES`` (ranges and names, declared once in ``_rules``)
and the few rules that tie two keys together. Each failure raises ``ConfigError`` naming the key.
The per-value checks are in ``config_check``, the ``lora`` and ``quantization`` sections in
``config_adapt`` (both re-exported here); the checks that need the devices, the tokenizer or the
model's shapes are in ``checks.py``.

A mapping given on the CLI (``--mesh.param_mapping '{}'``) replaces the YAML's; draccus alone would merge them.
"""

from __future__ import annotations

import argparse
import contextvars
import dataclasses
import os
import re
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import draccus
import draccus.cfgparsing
import draccus.parsers.decoding
import yaml

from named.models.registry import FAMILIES

from . import pretrained
from ._rules import RULES, ConfigError  # ConfigError and RULES: also this module's public face
from .config_adapt import LoraConfig, QuantizationConfig  # re-exported: sections of TrainConfig
from .config_check import _check_section, _join, _nullable, check_flag_keys, check_values  # noqa: F401  (check_values: re-exported)
from .data import DataConfig, DataError


# ---- sections -------------------------------------------------------------------------


@dataclass
class TrainerConfig:
    """Steps, batch and cadence.

    Args:
        num_train_steps: optimizer steps; 0 runs every check and trains (and writes) nothing.
        train_batch_size: sequences per optimizer step, over all processes.
        microbatches: the batch is split into this many microbatches whose gradients are
            accumulated (the step equals the full-batch step).
        seed: one seed for init, data order and dropout.
        eval_interval / eval_batches: evaluate every N steps (0: never) on this many batches (of each
            source of a mixture; 0: all of them).
        sample_interval / sample_tokens / sample_prompt: print a greedy sample every N steps.
        log_interval: log every N steps.
        run_dir: where logs and checkpoints go.
        load_checkpoint: ``auto`` (default): resume the run that run_dir holds, from its
            newest good checkpoint, when its config.yaml matches on every setting that
            defines the trajectory, refuse (ConfigError listing them) when not, and start a
            new run in an empty or absent run_dir; a checkpoint another run saved (a shared
            checkpoint.base) is refused. A checkpoint path inside the checkpoint root: resume
            from it, with the same check (refused if newer checkpoints exist), even when another
            run saved it (the way to continue one on purpose). null: a new run
            only, refused if run_dir already holds one. No value ever writes over an earlier
            run (docs/trainer.md, "Run directories").
        precision: jmp policy, e.g. ``params=float32,compute=bfloat16,output=float32``.
        nan_policy: ``stop`` (raise, naming the step) or ``skip`` (drop the update).
        peak_flops_per_device: for MFU when the device is not in the built-in table.
        loss_block_size: null (default): the loss reads the model's full logits. A divisor of the
            vocab size: the loss makes the logits this many vocab entries at a time from the final
            hidden states (``nn.blockwise_next_token_loss``), so the ``[batch, position, vocab]``
            logits and their gradient never exist; the same loss, less memory.
    """

    num_train_steps: int = 100
    train_batch_size: int = 16
    microbatches: int = 1
    seed: int = 0
    eval_interval: int = 50
    eval_batches: int = 4
    sample_interval: int = 0
    sample_tokens: int = 64
    sample_prompt: str = "def "
    log_interval: int = 10
    run_dir: str = "runs/default"
    load_checkpoint: str | None = "auto"
    precision: str = "params=float32,compute=float32,output=float32"
    nan_policy: str = "stop"
    peak_flops_per_device: float | None = None
    loss_block_size: int | None = None
    progress_bar: bool = True
    stop_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGINT", "SIGUSR1"])  # save, exit 128+signal


@dataclass
class MeshConfig:
    """Device mesh and the two mappings (axis name -> mesh axis, list of mesh axes, or null)."""

    shape: dict[str, int] = field(default_factory=lambda: {"data": -1})
    compute_mapping: dict[str, Any] = field(default_factory=lambda: {"batch": "data"})
    param_mapping: dict[str, Any] = field(default_factory=dict)
    mode: str = "auto"  # auto: GSPMD places the collectives; explicit: the layer stack runs per device (docs/explicit.md)
    batch_split: int = 1  # explicit mode: each layer runs on this many equal parts of each device's microbatch


@dataclass
class OptimizerConfig:
    """AdamW with a schedule; weight decay skips norms and biases (arrays of one axis)."""

    learning_rate: float = 3e-4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    epsilon: float = 1e-8
    max_grad_norm: float | None = 1.0
    schedule: str = "cosine"  # cosine | linear | constant | wsd
    warmup_steps: float = 0  # steps of linear warmup; below 1: that fraction of trainer.num_train_steps
    decay_fraction: float = 0.2  # wsd: share of steps in the final decay
    min_lr_ratio: float = 0.1

    def warmup(self, num_steps: int) -> int:
        """Warmup in steps: ``warmup_steps``, or that fraction of ``num_steps`` when it is below 1
        (so a shorter run, ``--trainer.num_train_steps 20``, keeps a proportionate warmup)."""
        w = self.warmup_steps
        return round(w * num_steps) if 0 < w < 1 else int(w)


@dataclass
class CheckpointConfig:
    interval: int = 0  # steps between saves; 0: only at the end
    keep_last: int = 2
    keep_every: int | None = None
    save_at_end: bool = True
    every_minutes: float | None = None  # also a temporary checkpoint this often (deleted by the next one)
    base: str | None = None  # checkpoints in <base>/checkpoints (a path, s3:// or gs://); null: in trainer.run_dir


@dataclass
class TrackerConfig:
    console: bool = True
    jsonl: bool = True
    wandb_mode: str = "disabled"  # disabled | offline | online
    wandb_project: str = "named"


@dataclass
class DistributedConfig:
    """``jax.distributed`` settings; all null means one process (or JAX's auto-detection
    when ``initialize`` is true, e.g. under SLURM)."""

    initialize: bool = False
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: list[int] | None = None
    initialization_timeout_s: int = 300
    heartbeat_timeout_s: int = 100  # a peer silent this long makes the others fail, not hang


@dataclass(frozen=True)
class ModelChoice(draccus.ChoiceRegistry):
    """``model: {type: <a family of named.models.registry.FAMILIES>, ...fields of that family's config}``."""

    def model_config(self, vocab_size: int):
        raise NotImplementedError

    def model_class(self):
        raise NotImplementedError


def _as_choice(name: str, base_cfg: type):
    frozen = base_cfg.__dataclass_params__.frozen  # type: ignore[attr-defined]

    @ModelChoice.register_subclass(name)
    @dataclass(frozen=frozen)
    class Choice(ModelChoice, base_cfg):  # type: ignore[misc, valid-type]
        vocab_size: int | None = None  # null: the tokenizer's vocabulary, rounded up to a multiple of 128
        init_from_hf: str | None = None  # a Hugging Face folder: its config and weights (see finetune.resolve)

        def model_config(self, vocab_size: int):
            values = {f.name: getattr(self, f.name) for f in dataclasses.fields(base_cfg)}
            if values.get("vocab_size") is None:
                values["vocab_size"] = vocab_size
            return base_cfg(**values)

    Choice.__name__ = Choice.__qualname__ = f"{base_cfg.__name__}Section"
    return Choice


# one YAML model.type per family of the models registry
SECTIONS = {name: _as_choice(name, family.config_cls) for name, family in FAMILIES.items()}
Gpt2Section, LlamaSection = SECTIONS["gpt2"], SECTIONS["llama"]


@dataclass
class TrainConfig:
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    model: ModelChoice = field(default_factory=Gpt2Section)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    tracker: TrackerConfig = field(default_factory=TrackerConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    lora: LoraConfig | None = None
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)


def rules_table() -> str:
    """RULES as the markdown rows docs/trainer.md shows."""
    return "\n".join(f"| `{key}` | {rule}{', or null' if _nullable(TrainConfig, key) else ''} |"
                     for key, rule in RULES.items())


def _decode_train_config(raw, path=()):
    # draccus' own conversion turns YAML's true into the integer 1 and lets null into any
    # field, so the merged YAML + CLI values are checked against the annotations first.
    for (section, name), value in _REPLACE.get().items():
        if isinstance(raw, dict):
            raw = {**raw, section: {**(raw.get(section) or {}), name: value}}
    if isinstance(raw, dict):
        raw = pretrained.resolve(raw)  # model.init_from_hf: the folder's architecture and tokenizer
    _check_section(TrainConfig, raw, "")
    return draccus.parsers.decoding.decode_dataclass(TrainConfig, raw, path)


# A mapping given on the command line replaces the YAML's (draccus would merge the two, so
# `--mesh.param_mapping '{}'` would silently keep FSDP). load_config collects them here for the
# decoder above; a ContextVar keeps concurrent loads apart.
_REPLACE: contextvars.ContextVar[dict] = contextvars.ContextVar("named_config_replace", default={})
_MAPPING_FIELDS = {(section, name) for section, cls in typing.get_type_hints(TrainConfig).items()
                   if dataclasses.is_dataclass(cls)
                   for name, tp in typing.get_type_hints(cls).items() if typing.get_origin(tp) is dict}


def _cli_flags(args: list[str]) -> list[tuple[str, str]]:
    """``(key, value text)`` for every ``--key value`` and ``--key=value`` in ``args``, the key
    without its dashes (``trainer.num_train_steps``)."""
    out = []
    for i, a in enumerate(args):
        if not a.startswith("--"):
            continue
        key, eq, inline = a[2:].partition("=")
        nxt = args[i + 1] if i + 1 < len(args) else ""
        out.append((key, inline if eq else ("" if nxt.startswith("--") else nxt)))
    return out


def _mapping_overrides(flags: list[tuple[str, str]]) -> dict[tuple[str, str], Any]:
    """``{(section, field): value}`` for every CLI override of a dict-valued field."""
    out = {}
    for key, text in flags:
        if key.count(".") != 1:
            continue
        section, name = key.split(".")
        if (section, name) not in _MAPPING_FIELDS:
            continue
        try:
            loader = _ConfigLoader(text)
            try:
                value = loader.get_single_data() if text.strip() else None
            finally:
                loader.dispose()
        except (yaml.YAMLError, ConfigError) as e:
            raise ConfigError(f"--{section}.{name}: {text!r} is not a YAML mapping ({e}); write e.g. '{{embed: data}}'") from None
        if not isinstance(value, dict):
            raise ConfigError(f"--{section}.{name} must be a mapping like '{{embed: data}}' ('{{}}' for none), got {text!r}")
        out[(section, name)] = value
    return out


draccus.parsers.decoding.decode.register(TrainConfig, _decode_train_config)


# ---- loading and validation -------------------------------------------------------------


def load_config(config_path: str | os.PathLike | None, args: Sequence[str] = ()) -> TrainConfig:
    """Parse YAML + CLI overrides into a TrainConfig; every failure is a ConfigError (or the
    DataError a ``data`` field raises), naming the file, key or flag."""
    args = list(args)
    content = _check_config_file(Path(config_path)) if config_path is not None else {}
    flags = _cli_flags(args)
    for key, _ in flags:  # before argparse, whose "unrecognized arguments" would blame the file
        if key and key not in _DRACCUS_FLAGS:
            check_flag_keys(TrainConfig, key, lambda section: _chosen_type(section, flags, content))
    where = _origin("", flags, config_path)
    token = _REPLACE.set(_mapping_overrides(flags))
    try:
        cfg = draccus.parse(TrainConfig, config_path, args=args, exit_on_error=False)
    except (DataError, ConfigError):
        raise
    except draccus.utils.ParsingError as e:
        inner = None if isinstance(e, draccus.utils.DecodingError) else _raised_in_post_init(e)
        if isinstance(inner, (DataError, ConfigError)):
            raise inner from None  # a data field's own check: its message names the key
        if inner is not None:
            section = _section_of(e)
            raise ConfigError(f"bad configuration{_origin(section, flags, config_path)}: {section}: {inner}") from None
        raise ConfigError(f"bad configuration{where}: {e}") from None
    except (draccus.utils.DecodingError, draccus.utils.DraccusException, argparse.ArgumentError, ValueError, TypeError) as e:
        argv = isinstance(e, argparse.ArgumentError) or str(e).startswith("unrecognized arguments")  # argparse's
        raise ConfigError(f"bad configuration{' on the command line' if argv else where}: {e}") from None
    except OSError as e:  # draccus opens a CLI value that starts with "include" as a file to include
        raise ConfigError(f"bad configuration{where}: {e}") from None
    finally:
        _REPLACE.reset(token)
    validate_static(cfg)
    # Last, so that a snippet without a model still reports its own mistakes first.
    if "model" not in content and not any(a == "--model" or a.startswith(("--model.", "--model=")) for a in args):
        known = ", ".join(ModelChoice.get_known_choices())
        raise ConfigError(f"model: missing{where}; add `model: {{type: gpt2, ...}}` with that model's fields "
                          f"(registered types: {known})")
    return cfg


_DRACCUS_FLAGS = ("config_path", "help")  # draccus' own flags, not config keys


def _chosen_type(section: str, flags: list[tuple[str, str]], content: dict) -> str | None:
    """The ``type`` of the choice section ``section`` (``model``): the command line's, else the file's."""
    given = [v for k, v in flags if k == f"{section}.type"]
    if given:
        return given[-1]
    value: Any = content
    for name in section.split("."):
        value = value.get(name) if isinstance(value, dict) else None
    return value.get("type") if isinstance(value, dict) else None


def _origin(section: str, flags: list[tuple[str, str]], config_path) -> str:
    """Where the values of ``section`` (all of them for "") came from, for a message that cannot
    name one key: the command line's flags of that section, and the file for the rest."""
    given = [f"--{k} {v}".rstrip() for k, v in flags
             if k and k not in _DRACCUS_FLAGS and (not section or k == section or k.startswith(section + "."))]
    if not given:
        return f" in {config_path}" if config_path else ""
    rest = f", the rest{f' of {section}' if section else ''} from {config_path}" if config_path else ""
    return f" ({', '.join(given)} on the command line{rest})"


class _ConfigLoader(yaml.SafeLoader):
    """Safe YAML that refuses a key given twice in one mapping (PyYAML, and so draccus, keep
    the last one silently). Being safe, it also refuses draccus' ``!include`` and Python tags."""

    def construct_document(self, node):
        _refuse_duplicates(node, "")
        return super().construct_document(node)


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
            raise ConfigError(f"{what} {_join(key, name)} is given twice, at lines {seen[name]} and "
                              f"{k.start_mark.line + 1}; YAML would keep only the last")
        if name is not None:
            seen[name] = k.start_mark.line + 1
        _refuse_duplicates(v, _join(key, name) if name is not None else key)


def _check_config_file(path: Path) -> dict:
    """The file's content: it exists and holds safe YAML, a mapping of sections with no key given
    twice (draccus' own messages for an empty or malformed file do not say which file or where)."""
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise ConfigError(f"config file {str(path)!r} {what}")
    try:
        with open(path, encoding="utf-8") as f:
            loader = _ConfigLoader(f)
            try:
                content = loader.get_single_data()
            finally:
                loader.dispose()
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
            f"config file {str(path)!r} holds a {type(content).__name__}; it must be a mapping of sections "
            f"({', '.join(f.name for f in dataclasses.fields(TrainConfig))})"
        )
    for section, value in content.items():
        if not isinstance(value, dict):
            raise ConfigError(f"config file {str(path)!r}: section {section!r} must be a mapping of keys, got {value!r}")
    return content


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


def validate_static(cfg: TrainConfig) -> None:
    """Checks that need neither devices nor data: every value, defaults included, against its
    annotation and RULES, then the rules that tie two keys together."""
    _check_section(TrainConfig, cfg, "")
    t, o = cfg.trainer, cfg.optimizer
    if t.train_batch_size % t.microbatches:
        raise ConfigError(
            f"trainer.train_batch_size={t.train_batch_size} is not divisible by trainer.microbatches={t.microbatches}"
        )
    if cfg.mesh.batch_split > 1 and cfg.mesh.mode != "explicit":
        raise ConfigError(f"mesh.batch_split={cfg.mesh.batch_split} needs mesh.mode: explicit (auto mode leaves the "
                          f"schedule to XLA); set --mesh.mode explicit or mesh.batch_split: 1")
    if o.warmup_steps >= 1 and o.warmup_steps != int(o.warmup_steps):
        raise ConfigError(f"optimizer.warmup_steps={o.warmup_steps} must be a whole number of steps, or a fraction "
                          "of the run below 1 (0.1: a tenth of trainer.num_train_steps)")
    if t.num_train_steps and o.warmup(t.num_train_steps) > t.num_train_steps:  # 0 steps: a check-only run
        raise ConfigError(f"optimizer.warmup_steps={o.warmup_steps:g} is longer than trainer.num_train_steps="
                          f"{t.num_train_steps}: lower it (--optimizer.warmup_steps {max(t.num_train_steps // 10, 1)}) "
                          "or give a fraction of the run (--optimizer.warmup_steps 0.1)")
    from named.nn.precision import get_policy

    try:
        get_policy(t.precision)
    except Exception as e:  # noqa: BLE001 - reported with the key
        raise ConfigError(f"trainer.precision: {e}") from None
    for name, mapping in (("mesh.compute_mapping", cfg.mesh.compute_mapping), ("mesh.param_mapping", cfg.mesh.param_mapping)):
        for k, v in mapping.items():
            ok = v is None or isinstance(v, str) or (isinstance(v, (list, tuple)) and all(isinstance(m, str) for m in v))
            if not ok:
                raise ConfigError(f"{name}.{k} must be a mesh axis name, a list of them, or null; got {v!r}")
        for k, v in mapping.items():
            for m in [v] if isinstance(v, str) else (v or []):
                if m not in cfg.mesh.shape:
                    raise ConfigError(
                        f"{name}.{k} names mesh axis {m!r}, which mesh.shape {dict(cfg.mesh.shape)} does not have"
                    )
    from .checkpoint_store import CheckpointError, inside, location

    try:  # checkpoints live under checkpoint.base when it is set, else under trainer.run_dir
        root = location(cfg.checkpoint.base) if cfg.checkpoint.base else Path(t.run_dir)
    except CheckpointError as e:
        raise ConfigError(f"checkpoint.base {e}") from None
    where = f"checkpoint.base {cfg.checkpoint.base!r}" if cfg.checkpoint.base else f"trainer.run_dir {t.run_dir!r}"
    if t.load_checkpoint not in (None, "auto") and inside(root, t.load_checkpoint) is None:
        raise ConfigError(f"trainer.load_checkpoint {t.load_checkpoint!r} is outside {where}")


def data_parallel_size(cfg: TrainConfig, mesh_shape: dict[str, int]) -> int:
    """How many ways the batch axis is split by the compute mapping."""
    v = cfg.mesh.compute_mapping.get("batch")
    axes = [v] if isinstance(v, str) else list(v or [])
    n = 1
    for a in axes:
        n *= mesh_shape[a]
    return n


def to_mapping(m: dict[str, Any]) -> dict[str, Any]:
    return {k: (tuple(v) if isinstance(v, list) else v) for k, v in m.items()}


def dump_config(cfg: TrainConfig) -> str:
    # An optional section that is off (lora: null) is left out: load_config reads every section as
    # a mapping, and a run directory written before the section existed still compares equal.
    encoded = {k: v for k, v in draccus.encode(cfg).items() if v is not None}
    return draccus.cfgparsing.save_config(encoded)
