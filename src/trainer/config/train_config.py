"""The training configuration: draccus dataclasses read from YAML with CLI overrides.

    named-train --config_path config/gpt2_nano.yaml --trainer.num_train_steps 50

Every key is declared once, as its section's dataclass field: the annotation gives its type, the
default its default, and ``key(...)`` the values it may take beyond its type, whether a resumed
run may change it, and one line of doc (``rules``). The rules table (``RULES``), the keys a
resume may change (``TRAJECTORY_FREE``), the docs' keys table (``keys_table``) and ``--help``
are derived from these declarations.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import draccus
import draccus.cfgparsing
import draccus.parsers.decoding

import named as nm
from named.models.registry import FAMILIES

from . import pinning, pretrained
from .adapt import LoraConfig, QuantizationConfig  # re-exported: sections of TrainConfig
from .check import check_flag_keys, check_section, describe_type
from .data_section import DataConfig
from .errors import CheckpointError, ConfigError, DataError  # ConfigError: also this module's public face
from .location import CHECKSUMS, inside, location
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
from .rules import (
    NONEMPTY,
    Key,
    Rule,
    above,
    at_least,
    between,
    declared,
    key,
    one_of,
)

# ---- sections: every key declared once ------------------------------------------------


# The vocabulary a null model.vocab_size takes: the tokenizer's, rounded up so that it splits
# over the usual mesh sizes and fills whole vector lanes.
VOCAB_MULTIPLE = 128


@dataclass
class TrainerConfig:
    """Steps, batch and cadence."""

    num_train_steps: int = key(
        100, at_least(0), free=True, doc="optimizer steps; 0 runs every check and trains (and writes) nothing"
    )
    train_batch_size: int = key(16, at_least(1), doc="sequences per optimizer step, over all processes")
    microbatches: int = key(
        1,
        at_least(1),
        doc="the batch is split into this many microbatches whose gradients are accumulated (the same step)",
    )
    # jax.random.key keeps 32 bits: 2**32 would be seed 0 again
    seed: int = key(0, between(0, 2**32 - 1), doc="one seed for init, data order and dropout")
    eval_interval: int = key(50, at_least(0), free=True, doc="evaluate every N steps (0: never)")
    eval_at_start: bool = key(
        False,
        free=True,
        doc="a new run also evaluates (validation loss, eval_harness_tasks) before its first step, logged at step 0",
    )
    eval_batches: int = key(
        4, at_least(0), free=True, doc="batches evaluated, of each source of a mixture (0: all of them)"
    )
    sample_interval: int = key(0, at_least(0), free=True, doc="print a sample every N steps (0: never)")
    sample_tokens: int = key(64, at_least(0), free=True, doc="tokens each sample adds to its prompt")
    sample_prompt: str = key("def ", free=True, doc="the prompt the samples continue")
    sample_temperature: float = key(0.8, at_least(0), free=True, doc="the samples' temperature (0: greedy)")
    sample_top_k: int | None = key(
        40, at_least(1), free=True, doc="samples draw from this many likeliest tokens (null: from all)"
    )
    eval_harness_tasks: list[str] = key(
        factory=list,
        free=True,
        doc="lm-evaluation-harness tasks scored every eval_harness_interval steps, logged as "
        "`eval_harness/<task>/<metric>` (needs `pip install 'named-jax[eval]'`; see docs/finetune.md)",
    )
    eval_harness_interval: int = key(0, at_least(0), free=True, doc="score eval_harness_tasks every N steps (0: never)")
    eval_harness_include: str | None = key(
        None, NONEMPTY, free=True, doc="a folder of task YAML files of one's own, searched before lm-eval's registry"
    )
    eval_harness_limit: int | None = key(
        None, at_least(1), free=True, doc="documents scored of each eval_harness task (null: all)"
    )
    eval_harness_files: bool = key(
        False,
        free=True,
        doc="write lm-eval's results JSON and samples of each eval_harness evaluation in "
        "`<run_dir>/eval_harness/step_<N>/`, as `named-eval --output_path --log_samples` writes them",
    )
    log_interval: int = key(10, at_least(0), free=True, doc="log every N steps (0: never)")
    run_dir: str = key(
        "runs/default", NONEMPTY, free=True, doc="where logs, config.yaml and (without checkpoint.base) checkpoints go"
    )
    load_checkpoint: str | None = key(
        "auto",
        free=True,
        doc="`auto`: resume the run in run_dir, or refuse; a "
        "checkpoint in the checkpoint root: resume from it; null: new runs only "
        "(see Run directories)",
    )
    resume_changed_data: bool = key(
        False,
        free=True,
        doc="resume even when a data file changed since the run began (refused otherwise, naming the file; "
        "see Run directories)",
    )
    precision: str = key(
        "params=float32,compute=float32,output=float32",
        doc="a jmp policy, e.g. `params=float32,compute=bfloat16,output=float32`",
    )
    nan_policy: str = key(
        "stop", one_of("stop", "skip"), free=True, doc="`stop`: raise, naming the step; `skip`: drop the update"
    )
    loss_scale: str = key(
        "none",
        one_of("none", "dynamic"),
        doc="`dynamic`: dynamic loss scaling (`nn.DynamicLossScale`) for float16 compute: a step whose "
        "gradients overflow is skipped and the scale halved; the scale is optimizer state",
    )
    peak_flops_per_device: float | None = key(
        None, above(0), free=True, doc="FLOP/s of one device for MFU, where the built-in table lacks it"
    )
    # a divisor of the vocab size (checks.check_loss_block); the same loss, less memory, like model.remat
    loss_block_size: int | None = key(
        None,
        at_least(1),
        free=True,
        doc="null: the loss reads the full logits; a divisor of the vocab: it makes "
        "them a vocab block at a time (see The loss without the full logits)",
    )
    progress_bar: bool = key(True, free=True, doc="a progress bar on process 0 when stderr is a terminal")
    stop_signals: list[str] = key(
        factory=lambda: ["SIGTERM", "SIGINT", "SIGUSR1"],
        rule=one_of("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP"),
        doc="signals that save a checkpoint and exit 128 + the signal (see Stopping and object storage)",
    )


@dataclass
class MeshConfig:
    """Device mesh and the two mappings (axis name -> mesh axis, list of mesh axes, or null)."""

    shape: dict[str, int] = key(
        factory=lambda: {"data": -1}, free=True, doc="mesh axes and their sizes; one -1 takes the devices left over"
    )
    # list before str: draccus decodes a union by trying its types in order, and str takes anything
    compute_mapping: dict[str, list[str] | str | None] = key(
        factory=lambda: {"batch": "data"},
        free=True,
        doc="axis name -> mesh axis (a list of them, or null) for activations",
    )
    param_mapping: dict[str, list[str] | str | None] = key(
        factory=dict, free=True, doc="the same for parameters and optimizer state (`{}`: replicated)"
    )
    mode: str = key(
        "auto",
        one_of("auto", "explicit"),
        free=True,
        doc="`auto`: GSPMD places the collectives; `explicit`: the layer stack runs per device (docs/explicit.md)",
    )
    batch_split: int = key(
        1,
        at_least(1),
        free=True,
        doc="explicit mode: each layer runs on this many equal parts of each device's microbatch",
    )
    layout: str = key(
        "config",
        one_of("config", "auto"),
        free=True,
        doc="`config`: the mesh, mappings, mode, remat, microbatches and loss blocks as given; `auto`: named-train "
        "takes the layout `named-plan --search` ranks first for the machine it starts on (the run's config.yaml "
        "records it; a resume keeps it)",
    )

    def __post_init__(self):
        # Every MeshConfig, decoded or built in code, holds its mappings as the library takes them.
        self.compute_mapping = mesh_mapping(self.compute_mapping)
        self.param_mapping = mesh_mapping(self.param_mapping)


def mesh_mapping(entries: dict[str, Any]) -> dict[str, Any]:
    """A mapping as the library takes it: YAML gives a list of mesh axes, the library a tuple
    (hashable: jit's caches key on mappings). The one conversion, run when a config is decoded;
    a mapping read elsewhere (the layout explorer's fields) goes through it too."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in entries.items()}


@dataclass
class OptimizerConfig:
    """AdamW with a schedule; weight decay skips every bias (a leaf named ``bias``) and the parameters
    of norm layers (modules that keep full precision), whatever their rank (``optim.decay_mask``)."""

    learning_rate: float = key(3e-4, above(0), doc="the peak learning rate")
    weight_decay: float = key(0.1, at_least(0), doc="AdamW's decoupled weight decay (not on norms and biases)")
    beta1: float = key(0.9, between(0, 1, high_open=True), doc="Adam's decay of the first moment")
    beta2: float = key(0.95, between(0, 1, high_open=True), doc="Adam's decay of the second moment")
    epsilon: float = key(1e-8, above(0), doc="Adam's epsilon")
    max_grad_norm: float | None = key(1.0, above(0), doc="clip the gradient to this global norm (null: no clipping)")
    schedule: str = key(
        "cosine",
        one_of("cosine", "linear", "constant", "wsd"),
        doc="the learning rate after warmup (`wsd`: warmup, stable, decay)",
    )
    warmup_steps: float = key(
        0, at_least(0), doc="steps of linear warmup; below 1: that fraction of trainer.num_train_steps"
    )
    decay_fraction: float = key(0.2, between(0, 1, low_open=True), doc="`wsd`: the share of steps in the final decay")
    min_lr_ratio: float = key(0.1, between(0, 1), doc="the final learning rate, as a fraction of the peak")
    schedule_steps: int | None = key(
        None,
        at_least(1),
        free=True,
        doc="the steps the schedule spans, past which it stays at its final rate (null: trainer.num_train_steps); "
        "a resume that changes trainer.num_train_steps must set it (see Run directories)",
    )

    def horizon(self, num_steps: int) -> int:
        """The steps the schedule spans in a run of ``num_steps``: ``schedule_steps`` when set."""
        return self.schedule_steps if self.schedule_steps is not None else num_steps

    def warmup(self, num_steps: int) -> int:
        """Warmup in steps: ``warmup_steps``, or that fraction of the schedule's horizon when it is
        below 1 (so a shorter run, ``--trainer.num_train_steps 20``, keeps a proportionate warmup)."""
        w = self.warmup_steps
        return round(w * self.horizon(num_steps)) if 0 < w < 1 else int(w)

    def same_schedule(self, steps_a: int, steps_b: int) -> bool:
        """Whether runs of ``steps_a`` and ``steps_b`` steps follow one learning rate step by step."""
        a, b = self.horizon(steps_a), self.horizon(steps_b)
        return a == b or (self.schedule == "constant" and self.warmup(a) == self.warmup(b))


@dataclass
class CheckpointConfig:
    """When checkpoints are saved, which are kept, and where they live."""

    interval: int = key(0, at_least(0), free=True, doc="steps between saves (0: only at the end)")
    keep_last: int = key(2, at_least(1), free=True, doc="how many of the newest checkpoints are kept")
    keep_every: int | None = key(
        None, at_least(1), free=True, doc="also keep every checkpoint whose step is a multiple of this"
    )
    save_at_end: bool = key(True, free=True, doc="save after the last step")
    every_minutes: float | None = key(
        None, above(0), free=True, doc="also a temporary checkpoint this often (deleted by the next one)"
    )
    base: str | None = key(
        None,
        NONEMPTY,
        free=True,
        doc="checkpoints in `<base>/checkpoints`: a local path, "
        "`s3://bucket/prefix` or `gs://bucket/prefix` "
        "(null: in trainer.run_dir)",
    )
    checksum: str = key(
        CHECKSUMS[0],
        one_of(*CHECKSUMS),
        free=True,
        doc="the check every checkpoint file carries: `crc32c` (in hardware, 10+ GB/s a core) "
        "or `sha256` (also against deliberate edits; about 10x the CPU)",
    )


@dataclass
class TrackerConfig:
    """Where metrics go."""

    console: bool = key(True, free=True, doc="log lines on the console")
    jsonl: bool = key(True, free=True, doc="metrics in `<run_dir>/metrics.jsonl`")
    wandb_mode: str = key(
        "disabled",
        one_of("disabled", "offline", "online"),
        free=True,
        doc="wandb: `offline` and `online` need `pip install 'named-jax[wandb]'`",
    )
    wandb_project: str = key("named", free=True, doc="the wandb project")
    tensorboard: bool = key(
        False,
        free=True,
        doc="TensorBoard event files in `<run_dir>/tensorboard` (needs `pip install 'named-jax[tensorboard]'`)",
    )


@dataclass
class DistributedConfig:
    """``jax.distributed`` settings; all null means one process (or JAX's auto-detection
    when ``initialize`` is true, e.g. under SLURM)."""

    initialize: bool = key(
        False, free=True, doc="start jax.distributed (with nothing else set: JAX's auto-detection, e.g. under SLURM)"
    )
    coordinator_address: str | None = key(None, free=True, doc="`host:port` of process 0 (null: NAMED_COORDINATOR)")
    num_processes: int | None = key(
        None, at_least(1), free=True, doc="processes of the run (null: NAMED_NUM_PROCESSES)"
    )
    process_id: int | None = key(None, at_least(0), free=True, doc="this process's id, from 0 (null: NAMED_PROCESS_ID)")
    local_device_ids: list[int] | None = key(None, free=True, doc="the devices this process uses (null: all it sees)")
    initialization_timeout_s: int = key(300, at_least(1), free=True, doc="seconds to wait for every process to join")
    heartbeat_timeout_s: int = key(
        100,
        at_least(1),
        free=True,
        doc="a peer silent this long makes the others fail, not hang (NAMED_HEARTBEAT_TIMEOUT overrides it)",
    )


@dataclass(frozen=True)
class ModelChoice(draccus.ChoiceRegistry):
    """``model: {type: <a family of named.models.registry.FAMILIES>, ...fields of that family's config}``."""

    # The section's fields are the family's config, declared in named.models, which knows nothing of
    # the trainer: what the trainer allows of them beyond their types is declared here, by name.
    field_keys: ClassVar[dict[str, Key]] = {
        "dropout": Key("dropout on the embeddings and residual branches", between(0, 1, high_open=True)),
        "layer_norm_epsilon": Key("LayerNorm's epsilon", above(0)),
        "rms_norm_eps": Key("RMSNorm's epsilon", above(0)),
        "rope_theta": Key("the RoPE base", above(0)),
        "remat": Key(
            "gradient checkpointing of each layer: an nn.Stacked policy (`none`, `full`, `save_dots`, ...)", free=True
        ),
    }
    # every integer without a key of its own: layers, widths, heads, positions (items of lists too)
    integer_key: ClassVar[Key] = Key(
        "layers, widths, heads, positions: every integer of the family's config", at_least(1)
    )

    def model_config(self, vocab_size: int):
        raise NotImplementedError

    def model_class(self):
        raise NotImplementedError


def _as_choice(name: str, base_cfg: type):
    frozen = base_cfg.__dataclass_params__.frozen  # type: ignore[attr-defined]

    @ModelChoice.register_subclass(name)
    @dataclass(frozen=frozen)
    class Choice(ModelChoice, base_cfg):  # type: ignore[misc, valid-type]
        vocab_size: int | None = key(
            None, at_least(1), doc=f"null: the tokenizer's vocabulary, rounded up to a multiple of {VOCAB_MULTIPLE}"
        )
        init_from_hf: str | None = key(
            None,
            doc="a Hugging Face folder, or a Hub id `org/name[@revision]` (recorded pinned to its commit): "
            "its architecture, weights and tokenizer (see docs/finetune.md)",
        )

        def model_config(self, vocab_size: int):
            values = {f.name: getattr(self, f.name) for f in dataclasses.fields(base_cfg)}
            if values.get("vocab_size") is None:
                values["vocab_size"] = vocab_size
            return base_cfg(**values)

    Choice.__name__ = Choice.__qualname__ = f"{base_cfg.__name__}Section"
    return Choice


# one YAML model.type per family of the models registry
SECTIONS = {name: _as_choice(name, family.config_cls) for name, family in FAMILIES.items()}


@dataclass
class TrainConfig:
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    model: ModelChoice = field(default_factory=SECTIONS["gpt2"])
    mesh: MeshConfig = field(default_factory=MeshConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    tracker: TrackerConfig = field(default_factory=TrackerConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    lora: LoraConfig | None = None
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)


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
