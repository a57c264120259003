"""The sections of a config, every key declared once: each section is a dataclass whose fields are
its keys; the annotation gives a key's type, the default its default, and ``key(...)`` (``rules``)
the values it may take beyond its type, whether a resumed run may change it, and one line of doc.
``TrainConfig`` holds the sections; the ``data`` section is declared in ``data_section``, ``lora``
and ``quantization`` in ``adapt``. What is derived from these declarations (the rules table, the
keys a resume may change, the keys table, ``--help``) and reading a config are in ``train_config``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import draccus

from named.models.registry import FAMILIES

from .adapt import LoraConfig, QuantizationConfig
from .data_section import DataConfig
from .location import CHECKSUMS
from .rules import NONEMPTY, Key, above, at_least, between, key, one_of

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
    gather: str = key(
        "auto",
        one_of("auto", "per_use"),
        free=True,
        doc="auto mode, FSDP: `auto`: GSPMD gathers the weights and sums their gradients; `per_use`: each linear "
        "layer gathers its weight where it uses it and reduce-scatters its gradient there, one weight at a time "
        "(less memory; docs/benchmarks.md section 4)",
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
        doc="`config`: the mesh, mappings, mode, gather, remat, microbatches and loss blocks as given; `auto`: "
        "named-train takes the layout `named-plan --search` ranks first for the machine it starts on (the run's "
        "config.yaml records it; a resume keeps it)",
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
