"""``named-plan``: what a config would do on a set of devices, without training.

It runs every check ``named-train`` runs short of the data and the run directory
(``checks.checked_setup``), so it refuses the configs train refuses. By default nothing
is compiled or allocated: the mesh, every parameter's layout and bytes per device, an estimate
of the activations, and the microbatch plan. ``compile=True`` (``named-plan --compile``) also
compiles the train step on abstract inputs and reports its collectives, memory per device and
FLOPs (a few seconds for the small configs); ``plan_search`` ranks every layout that fits. The
command line (``cli.main_plan``) can plan for devices this machine does not have: ``--devices N``
stands N CPU devices in for them, ``--device-kind`` names the chip.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

import named as nm
from named import nn
from named.models import flops_per_token

from ..config import ConfigError, TrainConfig, data_parallel_size
from ..loop import hardware
from ..loop.checks import Setup, checked_setup


@dataclasses.dataclass(frozen=True)
class Target:
    """The chip planned for (None: unknown, e.g. this machine's CPU) and the memory per device."""

    device: hardware.Device | None
    memory: float | None

    @classmethod
    def of(cls, kind: str | None, memory: str | None, *, stand_ins: bool = False, calibrate: bool = False) -> Target:
        """``kind`` (else this machine's device; none for ``stand_ins``, CPU devices standing in,
        which JAX is not asked about: asking would start it) and ``memory`` (else the kind's).
        ``calibrate``: on a CPU, this machine measured (``hardware.this_cpu``) in place of no row."""
        device = hardware.find(kind) if kind is not None else None if stand_ins else hardware.local()
        if device is None and kind is None and not stand_ins and calibrate and jax.devices()[0].platform == "cpu":
            device = hardware.this_cpu()
        if kind is not None and device is None:
            raise ConfigError(f"--device-kind {kind!r} is not in the device table ({', '.join(hardware.DEVICES)})")
        budget = (
            hardware.parse_bytes(memory) if memory is not None else (device.hbm_bytes if device is not None else None)
        )
        if memory is not None and budget is None:
            raise ConfigError(f"--device-memory {memory!r} is not a size like 16GiB, 80GB or 512MiB")
        return cls(device, budget)


# What the train step keeps per layer on XLA:CPU, measured (per token and unit of width; t-way
# tensor parallelism; a heads, T positions, h wide): JAX's residuals of the layer as the compiled
# step stores them, 8 + 28/t float32 values plus 2·a·T/(h·t) of scores where the attention keeps
# them, the same for GPT-2 and Llama and for float32 and bfloat16 compute (XLA:CPU computes
# bfloat16 in float32). tests/test_plan_memory.py holds the estimate to the compiled peak.
CPU_KEPT = (8, 28, 2)  # values replicated over TP, split over TP, per score tensor element


def activation_bytes(cfg: TrainConfig, s: Setup, *, scores: bool = False, platform: str | None = None) -> float:
    """Per device, the activations one microbatch keeps for the backward pass, after Korthikanti
    et al. 2022 ("Reducing activation recomputation in large transformer models"), eq. 2 with
    tensor parallelism: ``s·b·h·(10 + 24/t)`` bytes per layer at 16-bit, for sequence length s,
    b sequences per device, width h and t-way tensor parallelism. The attention scores' share,
    ``5·a·s/(h·t)`` more for a heads, is counted only with ``scores``: the path the run takes
    (``attention_path``) says whether it keeps them (cuDNN and the blockwise path keep none).
    ``remat: full`` keeps only each layer's input (``2·s·b·h`` bytes) plus one layer's whole set
    during its recomputation; with ``every=k`` (nested) the input of every k-th layer and the k
    inputs of the group being re-run; other policies are counted as no checkpointing (an upper
    bound).
    Scaled by the compute dtype's size / 2. An estimate for a standard decoder layer;
    ``--compile`` measures the real program. On a CPU (``platform``), a layer's set is what
    XLA:CPU's compiled step keeps (``CPU_KEPT``, in float32) in place of the paper's count, which
    is for fused 16-bit kernels."""
    sizes: dict[str, int] = {}
    for x in jax.tree.leaves(s.shapes, is_leaf=nm.is_named_array):
        for a in getattr(x, "axes", ()):
            sizes.setdefault(a.name, a.size)
    layers, h, heads = sizes.get("layers", 1), sizes.get("embed", 0), sizes.get("heads", 1)
    t = cfg.trainer
    shape = dict(s.mesh.shape)
    dp = data_parallel_size(cfg, shape)
    tp_axes = s.compute_mapping.get("heads")
    tp = math.prod(shape[m] for m in ([tp_axes] if isinstance(tp_axes, str) else (tp_axes or ())))
    seq, b = cfg.data.seq_len, t.train_batch_size // t.microbatches / max(dp, 1)
    from named.nn.precision import get_policy

    scale = jnp.dtype(get_policy(t.precision).compute_dtype).itemsize / 2  # the paper's bytes are 16-bit
    if platform == "cpu":  # float32 values
        replicated, split, per_score = CPU_KEPT
        per_layer = 4 * seq * b * h * (replicated + split / tp + (per_score * heads * seq / (h * tp) if scores else 0))
    else:
        per_layer = scale * seq * b * h * (10 + 24 / tp + (5 * heads * seq / (h * tp) if scores else 0))
    r = nn.Remat.parse(getattr(cfg.model, "remat", "none"))
    inputs = scale * 2 * seq * b * h  # one layer's input, in the compute dtype
    if r is not None and r.every > 1 and layers % r.every == 0:
        # nested: every k-th layer's input, and a group's k inputs while it is re-run (each group
        # re-runs every layer in it, whatever else the policy saves: nn.Stacked's nested scan)
        total = inputs * (layers // r.every + r.every) + per_layer
    elif r == nn.Remat():
        total = inputs * layers + per_layer
    else:
        # any other policy (save_dots, save_names) keeps part of each layer, counted as all of it
        total = per_layer * layers
    return total


def _mesh_axes(mapping: dict, name: str) -> tuple[str, ...]:
    split = mapping.get(name)
    return (split,) if isinstance(split, str) else tuple(split or ())


def logits_bytes(cfg: TrainConfig, s: Setup) -> float:
    """Per device, what one microbatch's loss holds: its logits and their gradient, in float32 (the
    loss is computed in float32): ``2 · b · s · V · 4`` bytes for b sequences per device of length
    s and V vocab entries per device (the vocab over the mesh axes the compute mapping splits it
    on: tensor-parallel layouts split it over ``model``). With ``trainer.loss_block_size`` B the
    loss makes the logits a block at a time: V is B, or the device's share of the vocab where
    smaller. Where the head is stored split along ``embed`` the loss also holds it gathered, with
    its gradient made whole before the reduce-scatter: the full-logits loss (XLA gathers it for
    the logits' matmul) and the fused loss gathering it once hold both whole, the fused loss
    gathering block by block a block of each (``named.internal.head_bytes_held``, the loss's own rule).
    With more than one microbatch that head is counted twice: in the microbatch loop's body XLA
    keeps the gathered head beside its copy in the matmul's layout and the head's whole gradient
    beside its reduction (four head-sized buffers in the compiled step on XLA:CPU, where one pass
    without the loop keeps two; ``tests/test_plan_memory.py``)."""
    axes = [a for x in jax.tree.leaves(s.shapes, is_leaf=nm.is_named_array) for a in getattr(x, "axes", ())]
    vocab = next((a.size for a in axes if a.name == "vocab"), 0)
    shape = dict(s.mesh.shape)
    shards = math.prod(shape[m] for m in _mesh_axes(s.compute_mapping, "vocab"))
    t = cfg.trainer
    b = t.train_batch_size // t.microbatches / max(data_parallel_size(cfg, shape), 1)
    per_device_vocab = vocab / shards if t.loss_block_size is None else min(t.loss_block_size, vocab / shards)
    logits = 2 * b * cfg.data.seq_len * per_device_vocab * 4
    embed_over = _mesh_axes(s.param_mapping, "embed")
    if not embed_over:
        return logits
    from named.internal import head_bytes_held
    from named.nn.precision import get_policy

    tokens_over = {m for name in ("batch", "position") for m in _mesh_axes(s.compute_mapping, name)}
    vocab_over = set(_mesh_axes(s.param_mapping, "vocab"))
    rows = vocab if vocab_over & tokens_over else vocab // math.prod(shape[m] for m in vocab_over)
    return logits + (2 if t.microbatches > 1 else 1) * head_bytes_held(
        rows,
        next((a.size for a in axes if a.name == "embed"), 0),
        jnp.dtype(get_policy(t.precision).compute_dtype).itemsize,
        block_size=t.loss_block_size or 0,
        embed_shards=math.prod(shape[m] for m in embed_over),
        blocks_possible=t.loss_block_size is not None
        and set(embed_over) <= tokens_over
        and (not vocab_over or bool(vocab_over & tokens_over)),
    )


@dataclasses.dataclass(frozen=True)
class Plan:
    """What ``named-plan`` computes from shapes alone, per device: one value that the text report,
    the HTML page and the layout explorer (``explore.py``) all read."""

    cfg: TrainConfig
    setup: Setup
    target: Target
    params: nm.inspect.ParamReport
    trained: nm.inspect.ParamReport  # the trainable part: gradients (LoRA: the adapters)
    moments: nm.inspect.ParamReport  # the optimizer state
    activations: float  # bytes, ``activation_bytes``
    logits: float  # bytes, ``logits_bytes``
    attention: str  # the attention path on the target (``attention_path``)
    keeps_scores: bool  # whether that path keeps the [batch, heads, T, T] scores (counted in activations)

    @property
    def data_parallel(self) -> int:
        return data_parallel_size(self.cfg, dict(self.setup.mesh.shape))

    @property
    def gradient_bytes(self) -> float:
        """The gradients per device: with more than one microbatch, twice the trainable bytes (the
        accumulated sum, carried through the microbatch loop, beside the gradient of the microbatch
        being added to it)."""
        return self.trained.bytes_per_device * (2 if self.cfg.trainer.microbatches > 1 else 1)

    @property
    def state_bytes(self) -> float:
        """Parameters + gradients (``gradient_bytes``) + optimizer state, per device."""
        return self.params.bytes_per_device + self.gradient_bytes + self.moments.bytes_per_device

    @property
    def total_bytes(self) -> float:
        """The state, one microbatch's activations and its logits, per device: the figure checked
        against the budget."""
        return self.state_bytes + self.activations + self.logits

    @property
    def over_budget(self) -> bool:
        """The one rule of "fits" that the report, the explorer, the page and ``--search`` apply:
        ``total_bytes`` against the target's memory (the model, never a compiler's peak)."""
        return bool(self.target.memory) and self.total_bytes > self.target.memory


_PATHS = {"cudnn": "cuDNN flash", "flash": "blockwise flash", "xla": "XLA"}


def target_platform(target: Target) -> str:
    """The platform planned for: the target device's, else this machine's."""
    return target.device.platform if target.device is not None else jax.default_backend()


def attention_path(cfg: TrainConfig, target: Target) -> tuple[str, bool]:
    """The attention path ``implementation="auto"`` takes in this run on the target's kind (its
    name), and whether it keeps the [batch, heads, T, T] scores: ``nn.auto_attention``'s rule, so
    the plan counts what the run will do."""
    from named.nn.precision import get_policy

    platform = target_platform(target)
    dtype = get_policy(cfg.trainer.precision).compute_dtype
    path = nn.auto_attention(platform, cfg.data.seq_len, dtype)
    return _PATHS.get(path, path), nn.attention_keeps_scores(path)


def make_plan(cfg: TrainConfig, target: Target | None = None, s: Setup | None = None) -> Plan:
    """Check ``cfg`` against the devices (``checked_setup``, unless ``s`` is its result)
    and measure its layout from shapes; nothing is compiled."""
    from ..loop.optim import trainable_part
    from ..loop.state import run_state

    target = target if target is not None else Target(hardware.local(), None)
    s = s if s is not None else checked_setup(cfg)
    attention, scores = attention_path(cfg, target)
    platform = target_platform(target)
    return Plan(
        cfg,
        s,
        target,
        nm.param_report(s.shapes, s.param_mapping, s.mesh),
        # Gradients and the optimizer state exist for the trainable parameters only (LoRA: the adapters).
        nm.param_report(trainable_part(cfg, s.shapes), s.param_mapping, s.mesh),
        nm.param_report(run_state(cfg, s).opt_state, s.param_mapping, s.mesh),
        activation_bytes(cfg, s, scores=scores, platform=platform),
        logits_bytes(cfg, s),
        attention,
        scores,
    )


def plan_report(cfg: TrainConfig, *, compile: bool = False, target: Target | None = None) -> str:
    p = make_plan(cfg, target)
    target, s = p.target, p.setup
    model_cfg, mesh, compute_mapping, param_mapping = s.model_cfg, s.mesh, s.compute_mapping, s.param_mapping
    params, trained, moments = p.params, p.trained, p.moments
    t = cfg.trainer
    dp = p.data_parallel
    micro = t.train_batch_size // t.microbatches
    here = jax.devices()[0].device_kind
    planned = (
        f"planned for {target.device.name}"
        if target.device is not None and target.device.name.lower() not in here.lower()
        else ""
    )
    acts, state = p.activations, p.state_bytes
    lines = [
        f"devices: {len(jax.devices())} x {here} in {jax.process_count()} process(es)"
        + (f"; {planned}" if planned else ""),
        f"mesh: {dict(mesh.shape)}",
        f"compute mapping: {compute_mapping}",
        f"parameter mapping: {param_mapping}",
        "",
        "parameters:",
        str(params),
        "",
        f"adam state (2 moments) per device: {moments.bytes_per_device / 2**20:.2f} MiB"
        + (
            f" for the {trained.n_params:,} trainable parameters (lora rank {cfg.lora.rank}; "
            f"{moments.total_bytes / 2**20:.2f} MiB in all)"
            if cfg.lora is not None
            else ""
        )
        + f"; params + grads + moments: {state / 2**20:.2f} MiB per device",
        "",
        f"batch: {t.train_batch_size} sequences x {cfg.data.seq_len} tokens = "
        f"{t.train_batch_size * cfg.data.seq_len} tokens/step",
        f"microbatches: {t.microbatches} of {micro} sequences; "
        f"{micro // max(dp, 1)} per data-parallel group of {dp} device(s)",
        f"model: {type(model_cfg).__name__} with {params.n_params:,} parameters; "
        f"{flops_per_token(model_cfg, cfg.data.seq_len) / 1e9:.3f} GFLOP per token (6N + 12·L·d·T)",
        f"attention: {p.attention} ({'keeps' if p.keeps_scores else 'keeps no'} [batch, heads, T, T] scores)",
        f"activations per device (estimate, one microbatch, remat {getattr(cfg.model, 'remat', 'none')}): "
        f"{acts / 2**20:.2f} MiB; with params + grads + moments: {(acts + state) / 2**20:.2f} MiB",
        f"logits per device (estimate, one microbatch, loss blocks {t.loss_block_size or 'none'}; "
        f"float32, with their gradient and the head the fused loss gathers): {p.logits / 2**20:.2f} MiB; "
        f"in all: {p.total_bytes / 2**20:.2f} MiB"
        + (
            f" of {target.memory / 2**30:.1f} GiB per device" + (" (OVER BUDGET)" if p.over_budget else "")
            if target.memory
            else ""
        ),
    ]
    if compile:
        report = train_step_report(cfg, s)
        lines += [
            "",
            "train step (compiled on abstract inputs):",
            str(report),
            "(memory from XLA's CPU buffer assignment: a GPU or TPU build fuses, lays out and overlaps "
            "differently, so treat it as an estimate of the same program)",
        ]
        if cfg.mesh.mode != "auto":  # what the mode buys: the same step compiled in auto mode beside it
            auto = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, mode="auto"))
            lines += [
                "",
                f"mesh.mode {cfg.mesh.mode} beside auto (the same train step, per device and execution):",
                *mode_table({cfg.mesh.mode: report, "auto": train_step_report(auto, s)}),
            ]
    return "\n".join(lines)


def mode_table(reports: dict[str, nm.inspect.CompiledReport]) -> list[str]:
    """One row per collective kind and mesh axes, count and bytes under each mode, then the
    peak memory per device: compiled reports of one step side by side."""
    cells: dict[tuple[str, str], dict[str, tuple[int, int]]] = {}
    for mode, rep in reports.items():
        for kind, axes, count, nbytes, _, _ in rep.summary():
            cells.setdefault((kind, axes), {})[mode] = (count, nbytes)
    head = ["collective", "mesh axes"] + [f"{m} {what}" for m in reports for what in ("count", "bytes")]
    rows = [head]
    for (kind, axes), by_mode in sorted(cells.items()):
        row = [kind, axes]
        for m in reports:
            count, nbytes = by_mode.get(m, (0, 0))
            row += [str(count), f"{nbytes / 2**20:.2f} MiB"]
        rows.append(row)
    rows.append(
        ["peak memory", "-"] + [c for rep in reports.values() for c in ("", f"{rep.peak_bytes / 2**20:.2f} MiB")]
    )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def abstract_train_step(cfg: TrainConfig, s: Setup | None = None) -> tuple:
    """``(step, args)``: the train step ``named-train`` would run (``train.make_train_step``) and
    abstract inputs laid out as the run lays them out, from the builder the run uses
    (``state.run_state`` without a key; ``RunState.abstract_inputs``), so that
    ``step.lower(*args)`` under the run's mesh compiles it without allocating anything. ``s``: the
    result of ``checked_setup(cfg)``, when the caller has it."""
    from ..loop.state import run_state
    from ..loop.train import make_train_step

    s = s if s is not None else checked_setup(cfg)
    state = run_state(cfg, s)
    return make_train_step(cfg, s, state.optimizer), state.abstract_inputs(cfg, s)


def train_step_report(
    cfg: TrainConfig, s: Setup | None = None, compiler_options: dict | None = None
) -> nm.inspect.CompiledReport:
    """Compile the train step ``named-train`` would run on abstract inputs (``abstract_train_step``)
    and report its collectives, memory per device and FLOPs. ``compiler_options``: XLA's, for this
    compile only, as ``jax.stages.Lowered.compile`` takes them."""
    s = s if s is not None else checked_setup(cfg)
    return compiled_step_report(lowered_train_step(cfg, s), s, compiler_options)


def lowered_train_step(cfg: TrainConfig, s: Setup) -> jax.stages.Lowered:
    """The train step of ``abstract_train_step`` traced and lowered under the run's mesh (Python's
    part of a compile; ``compiled_step_report`` does XLA's, which another thread may run)."""
    step, args = abstract_train_step(cfg, s)
    with nm.set_mesh(s.mesh):
        return step.lower(*args)


def compiled_step_report(
    lowered: jax.stages.Lowered, s: Setup, compiler_options: dict | None = None
) -> nm.inspect.CompiledReport:
    """``lowered`` (``lowered_train_step``) compiled by XLA and reported (``train_step_report``)."""
    return nm.compiled_report(lowered.compile(compiler_options), mesh=s.mesh)
