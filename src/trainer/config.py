"""The training configuration: draccus dataclasses read from YAML with CLI overrides.

    named-train --config_path config/gpt2_nano.yaml --trainer.num_train_steps 50

Every check that can be made without compiling runs in ``load_config`` / ``validate``: an
unknown key, a bad value, a mesh that does not fit the devices, a mapping naming an unknown
mesh axis, a batch that does not split over the data axes or the microbatches, a sequence
longer than the model's positions. Each raises ``ConfigError`` naming the key.

Note (draccus): a dict given on the CLI is merged into the YAML dict, not substituted for it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import draccus
import draccus.cfgparsing
import yaml

from named.models.gpt2 import Gpt2Config
from named.models.llama import LlamaConfig

from .data import DataConfig, DataError


class ConfigError(ValueError):
    """A configuration key is unknown, missing or has a bad value; the message names it."""


# ---- sections -------------------------------------------------------------------------


@dataclass
class TrainerConfig:
    """Steps, batch and cadence.

    Args:
        num_train_steps: optimizer steps.
        train_batch_size: sequences per optimizer step, over all processes.
        microbatches: the batch is split into this many microbatches whose gradients are
            accumulated (the step equals the full-batch step).
        seed: one seed for init, data order and dropout.
        eval_interval / eval_batches: evaluate every N steps (0: never) on this many batches.
        sample_interval / sample_tokens / sample_prompt: print a greedy sample every N steps.
        log_interval: log every N steps.
        run_dir: where logs and checkpoints go.
        load_checkpoint: ``auto`` (newest good checkpoint in run_dir, if any), a checkpoint
            path inside run_dir, or null.
        precision: jmp policy, e.g. ``params=float32,compute=bfloat16,output=float32``.
        nan_policy: ``stop`` (raise, naming the step) or ``skip`` (drop the update).
        peak_flops_per_device: for MFU when the device is not in the built-in table.
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
    load_checkpoint: str | None = None
    precision: str = "params=float32,compute=float32,output=float32"
    nan_policy: str = "stop"
    peak_flops_per_device: float | None = None
    progress_bar: bool = True


@dataclass
class MeshConfig:
    """Device mesh and the two mappings (axis name -> mesh axis, list of mesh axes, or null)."""

    shape: dict[str, int] = field(default_factory=lambda: {"data": -1})
    compute_mapping: dict[str, Any] = field(default_factory=lambda: {"batch": "data"})
    param_mapping: dict[str, Any] = field(default_factory=dict)


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
    warmup_steps: int = 0
    decay_fraction: float = 0.2  # wsd: share of steps in the final decay
    min_lr_ratio: float = 0.1


@dataclass
class CheckpointConfig:
    interval: int = 0  # steps between saves; 0: only at the end
    keep_last: int = 2
    keep_every: int | None = None
    save_at_end: bool = True


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
    """``model: {type: gpt2 | llama, ...fields of that model's config}``."""

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

        def model_config(self, vocab_size: int):
            values = {f.name: getattr(self, f.name) for f in dataclasses.fields(base_cfg)}
            if values.get("vocab_size") in (None, 0, -1):
                values["vocab_size"] = vocab_size
            return base_cfg(**values)

    Choice.__name__ = Choice.__qualname__ = f"{base_cfg.__name__}Section"
    return Choice


Gpt2Section = _as_choice("gpt2", Gpt2Config)
LlamaSection = _as_choice("llama", LlamaConfig)


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


# ---- loading and validation -------------------------------------------------------------


def load_config(config_path: str | os.PathLike | None, args: Sequence[str] = ()) -> TrainConfig:
    """Parse YAML + CLI overrides into a TrainConfig; every failure is a ConfigError (or the
    DataError a ``data`` field raises), naming the file, key or flag."""
    if config_path is not None:
        _check_config_file(Path(config_path))
    where = f" in {config_path}" if config_path else ""
    try:
        cfg = draccus.parse(TrainConfig, config_path, args=list(args), exit_on_error=False)
    except (DataError, ConfigError):
        raise
    except draccus.utils.ParsingError as e:
        inner = None if isinstance(e, draccus.utils.DecodingError) else _raised_in_post_init(e)
        if isinstance(inner, (DataError, ConfigError)):
            raise inner from None  # a data field's own check: its message names the key
        if inner is not None:
            raise ConfigError(f"bad configuration{where}: {_section_of(e)}: {inner}") from None
        raise ConfigError(f"bad configuration{where}: {e}") from None
    except (draccus.utils.DecodingError, draccus.utils.DraccusException, argparse.ArgumentError, ValueError, TypeError) as e:
        raise ConfigError(f"bad configuration{where}: {e}") from None
    validate_static(cfg)
    return cfg


def _check_config_file(path: Path) -> None:
    """The file exists and holds a YAML mapping of sections (draccus' own messages for an
    empty or malformed file do not say which file or where)."""
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            content = draccus.cfgparsing.load_config(f, file=path)
    except (yaml.YAMLError, draccus.utils.DraccusException) as e:
        while not isinstance(e, yaml.YAMLError) and (e.__cause__ or e.__context__) is not None:
            e = e.__cause__ or e.__context__  # draccus wraps the YAML error, which says where
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


def _positive(value, key: str):
    if not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{key} must be a positive integer, got {value!r}")


def validate_static(cfg: TrainConfig) -> None:
    """Checks that need neither devices nor data."""
    t = cfg.trainer
    _positive(t.num_train_steps, "trainer.num_train_steps")
    _positive(t.train_batch_size, "trainer.train_batch_size")
    _positive(t.microbatches, "trainer.microbatches")
    if t.train_batch_size % t.microbatches:
        raise ConfigError(
            f"trainer.train_batch_size={t.train_batch_size} is not divisible by trainer.microbatches={t.microbatches}"
        )
    for key in ("eval_interval", "sample_interval", "log_interval", "eval_batches"):
        if getattr(t, key) < 0:
            raise ConfigError(f"trainer.{key} must be >= 0, got {getattr(t, key)}")
    for f in dataclasses.fields(cfg.model):
        value = getattr(cfg.model, f.name)
        if f.name == "vocab_size" and value in (None, 0, -1):
            continue  # the tokenizer's vocabulary
        if isinstance(value, int) and not isinstance(value, bool) and value <= 0:
            raise ConfigError(f"model.{f.name} must be a positive integer, got {value}")
        if f.name.endswith("dropout") and not 0 <= value < 1:
            raise ConfigError(f"model.{f.name} must be in [0, 1), got {value}")
    if t.nan_policy not in ("stop", "skip"):
        raise ConfigError(f"trainer.nan_policy must be 'stop' or 'skip', got {t.nan_policy!r}")
    from named.nn.precision import get_policy

    try:
        get_policy(t.precision)
    except Exception as e:  # noqa: BLE001 - reported with the key
        raise ConfigError(f"trainer.precision: {e}") from None
    o = cfg.optimizer
    if o.schedule not in ("cosine", "linear", "constant", "wsd"):
        raise ConfigError(f"optimizer.schedule must be cosine, linear, constant or wsd, got {o.schedule!r}")
    if o.learning_rate <= 0:
        raise ConfigError(f"optimizer.learning_rate must be > 0, got {o.learning_rate}")
    if not 0 <= o.warmup_steps <= t.num_train_steps:
        raise ConfigError(f"optimizer.warmup_steps={o.warmup_steps} must be in [0, trainer.num_train_steps]")
    if not 0 < o.decay_fraction <= 1:
        raise ConfigError(f"optimizer.decay_fraction must be in (0, 1], got {o.decay_fraction}")
    if o.max_grad_norm is not None and o.max_grad_norm <= 0:
        raise ConfigError(f"optimizer.max_grad_norm must be > 0 or null, got {o.max_grad_norm}")
    if cfg.tracker.wandb_mode not in ("disabled", "offline", "online"):
        raise ConfigError(f"tracker.wandb_mode must be disabled, offline or online, got {cfg.tracker.wandb_mode!r}")
    ck = cfg.checkpoint
    if ck.interval < 0 or ck.keep_last < 1:
        raise ConfigError("checkpoint.interval must be >= 0 and checkpoint.keep_last >= 1")
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
    if "batch" not in cfg.mesh.compute_mapping:
        pass  # pure model parallelism is allowed: every device sees the whole batch
    run_dir = Path(t.run_dir)
    if t.load_checkpoint not in (None, "auto"):
        target = Path(t.load_checkpoint)
        resolved = (run_dir / target).resolve() if not target.is_absolute() else target.resolve()
        if not resolved.is_relative_to(run_dir.resolve()):
            raise ConfigError(f"trainer.load_checkpoint {t.load_checkpoint!r} is outside trainer.run_dir {t.run_dir!r}")


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
    return draccus.dump(cfg)
