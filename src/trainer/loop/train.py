"""The training loop: sharded init, a named_jit train step with donation and gradient
accumulation, eval, samples, checkpoints and metrics. What is due after each step and how its
metrics are read lie in ``cadence``; the validation loss in ``validation``.

    named-train --config_path config/gpt2_nano.yaml
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import named as nm
from named import nn
from named.models import flops_per_token
from named.nn.precision import cast_for_compute, get_policy

from .. import checkpoint as ckpt
from ..checkpoint import rundir
from ..checkpoint.run_places import CONFIG_FILE, DATA_FILES
from ..config import ConfigError, TrainConfig, data_parallel_size, dump_config
from ..data import (
    Batch,
    Data,
    DataError,
    LocalShards,
    TrainBatches,
    build_data,
    changed_files,
    data_files,
    fingerprint,
)
from . import hardware
from .cadence import (
    MAX_IN_FLIGHT,
    RateWindow,
    epochs_note,
    progress_bar,
    read_metrics,
    step_due,
    step_loss,
)
from .checks import Setup, checked_setup, require_harness
from .generate import sample_text
from .loss import token_losses
from .model_init import layer_driver, trainable
from .optim import Optimizer, as_inputs, scaled_norm, schedule
from .registry import max_positions, model_type
from .state import run_state
from .stop import StopRequests, agree
from .trackers import Trackers, check_trackers, log, release_logging, setup_logging
from .validation import eval_losses

Pos, Microbatch = "position", "microbatch"


@dataclasses.dataclass
class TrainResult:
    losses: list[float]
    final_step: int
    model: Any  # None when nothing was trained (then ``message`` says why)
    opt_state: Any
    run_dir: Path
    message: str = ""
    stopped_by: int = 0  # the signal that stopped the run after a committed checkpoint (0: it ran to the end)
    steps_without_loss_tokens: int = 0  # steps whose batch kept no loss token (their ``losses`` are NaN)


def peak_flops(cfg: TrainConfig) -> float | None:
    """The FLOP/s MFU is measured against: ``trainer.peak_flops_per_device``, else this device's
    dense matmul peak for the run's compute dtype (``hardware.Device.matmul_peak``)."""
    if cfg.trainer.peak_flops_per_device:
        return cfg.trainer.peak_flops_per_device
    device = hardware.local()
    return device.matmul_peak(get_policy(cfg.trainer.precision).compute_dtype)[0] if device is not None else None


def make_train_step(cfg: TrainConfig, setup: Setup, optimizer):
    """The jitted step of the model ``setup`` describes, laid out by its mappings, in the precision
    of ``trainer.precision``: microbatched loss and gradients (exactly the full-batch mean over
    tokens), clipping and ``optimizer`` (AdamW: ``optim.build_optimizer``). ``finite`` is false when
    the loss, the gradient, the update, the new parameters or the new optimizer state is not finite;
    under ``nan_policy: skip`` such a step leaves the state untouched. ``flags``
    (``stop.flags_layout``) come back agreed over every device as ``stop_flags``: the stop and save
    decisions ride in this one program. An ``optim.Optimizer``'s numbers (learning rate, schedule,
    weight decay, clipping) are inputs of the program, not constants in it: runs that differ only in
    them compile one program (and find it in the persistent compilation cache)."""
    compute_mapping, param_mapping, policy = (
        setup.compute_mapping,
        setup.param_mapping,
        get_policy(cfg.trainer.precision),
    )
    n_micro = cfg.trainer.microbatches
    skip_bad = cfg.trainer.nan_policy == "skip"
    dynamic = cfg.trainer.loss_scale == "dynamic"  # the opt state is then (state, nn.DynamicLossScale)
    lora_dropout = cfg.lora is not None and cfg.lora.dropout > 0
    driver = layer_driver(cfg, compute_mapping, param_mapping)  # None unless mesh.mode is explicit
    gathered = param_mapping if cfg.mesh.gather == "per_use" else None  # nn.gather_per_use

    def loss_sum(params, frozen, batch, key, scale):
        m = cast_for_compute(eqx.combine(params, frozen, is_leaf=nm.is_named_array), policy)
        if lora_dropout:  # the models call their linears without keys: the adapters hold theirs for this pass
            m = nn.lora.with_dropout_keys(m, jax.random.fold_in(key, 1))
        with nn.explicit_layers(driver), nn.gather_per_use(gathered):
            per_token, aux = token_losses(
                m, batch, key=key, block_size=cfg.trainer.loss_block_size, param_mapping=param_mapping
            )
        count = batch["loss_mask"][Pos, :-1].astype(jnp.float32).sum().scalar()
        total = per_token.sum().scalar()
        if aux:  # auxiliary losses (an MoE router's) are per-token means: weighted by the tokens, like the loss
            total = total + count * sum(w * v for w, v in aux.values())
        # differentiated times the loss scale (1 without loss scaling): float16 gradients then neither
        # underflow nor, at a scale dynamic scaling lowered, overflow
        return total * scale, (count, {name: v * count for name, (_, v) in aux.items()})

    grad_fn = eqx.filter_value_and_grad(loss_sum, has_aux=True)

    def step(model, opt_state, batch, key, flags, numbers):
        opt = optimizer.transformation(numbers) if numbers is not None else optimizer
        # Gradients, their accumulators and the update exist for the trainable leaves only
        # (all of them, or LoRA's adapters); the frozen rest passes through the step unchanged.
        params, frozen = eqx.partition(model, trainable(cfg, model), is_leaf=nm.is_named_array)
        inner_opt, scaler = opt_state if dynamic else (opt_state, None)
        scale = scaler.loss_scale if dynamic else jnp.float32(1.0)
        split = {
            k: v.unflatten_axis(
                "batch", (nm.Axis(Microbatch, n_micro), nm.Axis("batch", v.axis_size("batch") // n_micro))
            )
            for k, v in batch.items()
        }
        keys = nm.named(jax.random.split(key, n_micro), (Microbatch,))

        def accumulate(acc, mb, k):
            (s, (c, a)), g = grad_fn(params, frozen, nm.shard(mb), k.array, scale)
            return jax.tree.map(jnp.add, acc, (s, c, g)), a

        zero = (jnp.zeros(()), jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
        (total, count, grads), aux = nm.scan(accumulate, Microbatch)(zero, split, keys)
        tokens, count = count, jnp.maximum(count, 1.0)  # no loss token: a zero gradient (the host says so)
        loss = total / scale / count  # the scale is a power of two: exact
        # ``grads`` are sums over the tokens, times the loss scale: ``unscale`` makes them the mean's
        overflow = ~nn.all_finite(grads) if dynamic else jnp.bool_(False)
        if dynamic:  # an overflow is expected now and then: that step is skipped and the scale lowered
            grads = jax.tree.map(lambda g: jnp.where(overflow, jnp.zeros_like(g), g), grads)
        unscale = 1.0 / (count * scale)
        grad_norm = scaled_norm(grads, unscale)
        if numbers is not None:  # an optim.Optimizer: the factor joins clipping's (optim.clip_by_global_norm)
            updates, new_opt = opt.update(grads, inner_opt, params, grad_scale=unscale)
        else:
            updates, new_opt = opt.update(jax.tree.map(lambda g: g / (count * scale), grads), inner_opt, params)
        new_model = eqx.combine(eqx.apply_updates(params, updates), frozen, is_leaf=nm.is_named_array)
        # A finite loss and gradient can still make a non-finite update (a NaN learning rate,
        # an overflow in the optimizer), so the step's outputs are checked too. The update itself is
        # checked through the new parameters: p + u is finite exactly when p and u both are (IEEE),
        # and reading only p + u lets XLA write it over p (a check that read u, which weight decay
        # computes from p, kept a full-size copy of every parameter alive through the step).
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & nn.all_finite((new_model, new_opt))
        if dynamic:
            new_model, new_opt = jax.tree.map(
                lambda new, old: jnp.where(overflow, old, new), (new_model, new_opt), (model, inner_opt)
            )
            new_opt = (new_opt, scaler.adjust(~overflow))
        if skip_bad:
            new_model, new_opt = jax.tree.map(
                lambda new, old: jnp.where(finite, new, old), (new_model, new_opt), (model, opt_state)
            )
        return (
            new_model,
            new_opt,
            {
                "loss": loss,
                "grad_norm": grad_norm,
                "finite": finite,
                "tokens": tokens,
                "stop_flags": agree(flags),
                **({"loss_scale": scale, "overflow": overflow.astype(jnp.float32)} if dynamic else {}),
                **{f"aux/{name}": v.sum() / count for name, v in aux.items()},
            },
        )

    jitted = nm.named_jit(
        step, mapping=compute_mapping, out_mapping=param_mapping, donate_args=(True, True, False, False, False, False)
    )
    return TrainStep(jitted, as_inputs(optimizer.numbers) if isinstance(optimizer, Optimizer) else None)


@dataclasses.dataclass(frozen=True, eq=False)
class TrainStep:
    """``make_train_step``'s program, called (or ``lower``ed) with the run's five arguments (model,
    optimizer state, batch, key, stop flags); the optimizer's numbers go in as the sixth."""

    jitted: Any  # what nm.named_jit returns
    numbers: dict | None

    def __call__(self, model, opt_state, batch, key, flags):
        return self.jitted(model, opt_state, batch, key, flags, self.numbers)

    def lower(self, model, opt_state, batch, key, flags):
        return self.jitted.lower(model, opt_state, batch, key, flags, self.numbers)


def make_eval_step(cfg: TrainConfig, setup: Setup):
    """The jitted summed token loss of a batch and its count of loss tokens, as the train step computes them."""
    policy, block_size = get_policy(cfg.trainer.precision), cfg.trainer.loss_block_size

    def eval_step(model, batch):
        per_token, _ = token_losses(
            cast_for_compute(model, policy), batch, block_size=block_size, param_mapping=setup.param_mapping
        )
        return per_token.sum().scalar(), batch["loss_mask"][Pos, :-1].astype(jnp.float32).sum().scalar()

    return nm.named_jit(eval_step, mapping=setup.compute_mapping)


def device_batch(batch: Batch, mesh, compute_mapping, global_rows: int) -> dict[str, nm.NamedArray]:
    """This process's rows -> global NamedArrays laid out by the compute mapping."""
    out = {}
    for name in ("input_ids", "segment_ids", "loss_mask"):
        local = np.asarray(getattr(batch, name))
        axes = (nm.Axis("batch", global_rows), nm.Axis(Pos, local.shape[1]))
        sharding = nm.sharding_for(axes, compute_mapping, mesh)
        arr = jax.make_array_from_process_local_data(sharding, local, (global_rows, local.shape[1]))
        out[name] = nm.NamedArray(arr, axes)
    return out


@dataclasses.dataclass(frozen=True)
class Run:
    """What ``build_run`` checked and built: everything ``train`` needs, before anything is
    compiled or written."""

    setup: Setup  # tokenizer, model config and class, parameter shapes, mesh and both mappings
    plan: rundir.RunPlan  # new run or resume, and from which checkpoint
    data: Data
    train_batches: TrainBatches
    data_record: str  # the data files' fingerprint, for <run_dir>/data_files.json
    new_data_record: bool = False  # it replaces the run's record (a fresh start, or a resume on changed data)
    harness_tasks: Any = None  # lm-eval's TaskManager for trainer.eval_harness_tasks (None: no such tasks)


def build_run(cfg: TrainConfig) -> Run:
    """Every check that bad input can fail, before anything is compiled or written: the
    cheap ones first (tokenizer, model config, mesh, mappings against the parameters'
    shapes, the run directory and the checkpoint to resume from: ``rundir.plan_run``), then
    the data (which may tokenise) and the batch order. ``train`` creates the run directory
    only after this returns."""
    t = cfg.trainer
    check_trackers(cfg.tracker)
    setup = checked_setup(cfg)  # the checks named-plan runs too
    harness_tasks = _harness_tasks(cfg)
    plan = rundir.plan_run(cfg)  # resume, new run, or refused
    if plan.restore_from is not None:  # a resume with another model or optimizer fails here, not after init
        shapes = run_state(cfg, setup)
        ckpt.check_restorable(plan.restore_from, (shapes.model, shapes.opt_state))
    new_record = data_record_is_new(cfg, plan)  # before tokenising
    # Hosts building one shared cache at once split its pieces between them (one host: None, the default).
    shares = LocalShards(jax.process_index(), jax.process_count()) if jax.process_count() > 1 else None
    data = build_data(cfg.data, setup.tokenizer, runner=shares)
    train_batches = TrainBatches(
        data.train,
        batch_size=t.train_batch_size,
        seed=t.seed,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    record = json.dumps(fingerprint(data_files(cfg.data)), indent=1) + "\n"
    return Run(setup, plan, data, train_batches, record, new_record, harness_tasks)


def _harness_tasks(cfg: TrainConfig):
    """lm-eval's TaskManager knowing every task of ``trainer.eval_harness_tasks`` (ConfigError naming the
    key when lm-eval is not installed or a task is unknown), or None when the run scores none."""
    t = cfg.trainer
    if not t.eval_harness_tasks:
        return None
    require_harness("trainer.eval_harness_tasks")
    from .harness import task_manager

    return task_manager(t.eval_harness_tasks, t.eval_harness_include, "trainer.eval_harness_tasks")


def data_record_is_new(cfg: TrainConfig, plan: rundir.RunPlan) -> bool:
    """Whether this launch's data files replace the run directory's record of them. A resume over
    files that changed since the run began (edited, replaced, added, removed) would train on other
    rows at the same steps: refused, naming each file, unless ``trainer.resume_changed_data``.
    Process 0 decides for all: it writes the record into the run directory right after."""
    return rundir.decided_by_process_0(lambda: _data_check(cfg, plan))


def _data_check(cfg: TrainConfig, plan: rundir.RunPlan) -> bool:
    path = plan.run_dir / DATA_FILES
    if plan.restore_from is None:
        return True
    if not path.is_file():
        if not (plan.run_dir / CONFIG_FILE).is_file():  # a new run directory starting from a checkpoint
            return True  # (copied in, or named by trainer.load_checkpoint): its data begins here
        steps = cfg.trainer.num_train_steps
        if steps and plan.step >= steps:  # nothing to train: nothing that the data could change
            return False
        if not cfg.trainer.resume_changed_data:
            raise DataError(
                f"the run in {plan.run_dir} has no record of its data files ({path} is missing), so resuming at "
                f"step {plan.step} cannot check that the data is what the run trained on. Copy {DATA_FILES} from "
                "the run the checkpoint comes from, or resume on the data as it is now with "
                "--trainer.resume_changed_data true. Nothing was written"
            )
        plan.notes.append(
            f"resuming without {DATA_FILES} (trainer.resume_changed_data): the data could not be checked; "
            "the files as they are now become the record"
        )
        return True
    current = fingerprint(data_files(cfg.data))
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise DataError(f"{path} cannot be read ({e}); it is not a record this trainer wrote") from None
    changed = changed_files(recorded if isinstance(recorded, dict) else {}, current)
    if not changed:
        return False
    if not cfg.trainer.resume_changed_data:
        raise DataError(
            f"the data of the run in {plan.run_dir} changed since it began ({path}): {'; '.join(changed)}. "
            f"Resuming at step {plan.step} would train on other rows than the run's order gives. Restore the "
            "files, start a new run in another trainer.run_dir, or resume on the new data with "
            "--trainer.resume_changed_data true. Nothing was written"
        )
    plan.notes.append(f"resuming on changed data (trainer.resume_changed_data): {'; '.join(changed)}")
    return True


def train(cfg: TrainConfig) -> TrainResult:
    """Train in ``trainer.run_dir``: a new run, or the resumption of the one it holds (see
    ``rundir``). With ``num_train_steps: 0``, or a run already at ``num_train_steps``, every
    check runs and nothing is compiled or written; ``message`` says so. ``mesh.layout: auto`` is
    resolved before (``named-train`` does it: ``commands.plan_search.resolve_layout``)."""
    if cfg.mesh.layout == "auto":
        raise ConfigError(
            "mesh.layout: auto is resolved by named-train before training (commands.plan_search.resolve_layout)"
        )
    t = cfg.trainer
    run = build_run(cfg)
    plan = run.plan
    if t.num_train_steps == 0:
        resume = f", resume from {plan.restore_from}" if plan.restore_from is not None else ""
        return TrainResult(
            [],
            plan.step,
            None,
            None,
            plan.run_dir,
            message=(
                f"checked: config, tokenizer, model, mesh, mappings, run directory {plan.run_dir}{resume}, data "
                f"({len(run.data.train)} training sequences); trainer.num_train_steps=0: nothing to train, "
                "nothing written"
            ),
        )
    if plan.step >= t.num_train_steps:  # a step beyond it was refused by plan_run
        return TrainResult(
            [],
            plan.step,
            None,
            None,
            plan.run_dir,
            message=(
                f"already at step {plan.step} ({plan.restore_from}), trainer.num_train_steps={t.num_train_steps}: "
                "nothing to train, nothing written"
            ),
        )
    model_cfg = run.setup.model_cfg
    files = {
        "config.yaml": dump_config(cfg),
        "model_config.json": json.dumps({"type": model_type(model_cfg), **dataclasses.asdict(model_cfg)}, indent=1),
    }
    files[DATA_FILES] = run.data_record
    with rundir.claim(plan, files, replace=(DATA_FILES,) if run.new_data_record else ()):
        try:
            return _train(cfg, run)
        finally:
            release_logging()


def _train(cfg: TrainConfig, run: Run) -> TrainResult:
    t, plan, data, train_batches, setup = cfg.trainer, run.plan, run.data, run.train_batches, run.setup
    mesh, compute_mapping = setup.mesh, setup.compute_mapping
    run_dir, restore_from, pid = plan.run_dir, plan.restore_from, jax.process_index()
    try:
        setup_logging(run_dir, pid)
    except OSError as e:
        raise rundir.os_error(run_dir, e) from None
    for note in [*plan.notes, *data.notes, epochs_note(len(data.train), t)]:  # data.notes: padding share, per split
        log.info(note)
    lr_at = schedule(cfg.optimizer, t.num_train_steps)
    checkpointer = ckpt.Checkpointer(
        plan.root,
        keep_last=cfg.checkpoint.keep_last,
        keep_every=cfg.checkpoint.keep_every,
        checksum=cfg.checkpoint.checksum,
    )
    key = jax.random.key(t.seed)
    init_key, data_key = jax.random.split(key)

    with nm.set_mesh(mesh), contextlib.ExitStack() as stack:
        # Installed before init and compilation: a signal during them stops the run after its first step.
        stop = stack.enter_context(StopRequests(t.stop_signals, cfg.checkpoint.every_minutes, mesh))
        stopped = 0
        # A resume restores every weight from our checkpoint: the pretrained folder is not read again.
        state = run_state(cfg, setup, init_key, pretrained=restore_from is None)
        model, opt_state = state.model, state.opt_state
        start = 0
        if restore_from is not None:
            # auto: the run's newest checkpoint that checks out as it is read (each byte read once), else an older one
            source = plan.root if plan.fall_back else restore_from
            (model, opt_state), meta = ckpt.restore(source, (model, opt_state))
            start = int(meta["step"])
            if start != plan.step:  # named in the CheckpointWarning the restore gave
                log.warning(f"{restore_from} did not check out as it was read: step {start} is resumed instead")
                restore_from = ckpt.checkpoint_dir(plan.root) / f"step_{start}"
            log.info(f"resumed from {restore_from} at step {start}")
        try:  # after the restore: the metrics logged past the step it restored are dropped
            trackers = Trackers(
                cfg.tracker,
                run_dir,
                pid,
                json.loads(json.dumps(dataclasses.asdict(cfg), default=str)),
                start_step=start,
                config_text=dump_config(cfg),
            )
        except OSError as e:
            raise rundir.os_error(run_dir, e) from None
        train_step = make_train_step(cfg, setup, state.optimizer)
        eval_step = make_eval_step(cfg, setup)
        flops_tok = flops_per_token(setup.model_cfg, cfg.data.seq_len)
        peak = peak_flops(cfg)
        n_dev = len(jax.devices())
        losses: list[float] = []
        empty_steps = 0  # steps without a loss token: said, counted, their loss no number
        progress = progress_bar(t, start, pid, stack)
        harness = _harness_lm(cfg, setup, model) if run.harness_tasks is not None else None
        window = RateWindow()
        pending: list[tuple[int, dict]] = []  # (step, its metrics still on the device), oldest first

        def batch_for(step: int) -> dict[str, nm.NamedArray]:
            log.debug("step %d: process %d reads data rows %s", step, pid, train_batches.indices(step).tolist())
            return device_batch(train_batches.batch_at(step), mesh, compute_mapping, t.train_batch_size)

        if t.eval_at_start and start == 0:  # the model before any update: the baseline of the curves
            if data.validation is not None:
                evals = eval_losses(
                    lambda b: eval_step(model, device_batch(b, mesh, compute_mapping, t.train_batch_size)), data, t
                )
                trackers.log(0, evals, prefix="eval")
            if harness is not None:
                from .harness import PREFIX, evaluate

                scores, _ = evaluate(
                    harness, t.eval_harness_tasks, manager=run.harness_tasks, limit=t.eval_harness_limit
                )
                trackers.log(0, scores, prefix=PREFIX)
        batch = batch_for(start)
        for step in range(start, t.num_train_steps):
            # The step is dispatched, not waited for: until the next read point nothing below reads
            # the device but the previous step's two stop flags, once that step has finished, so the
            # host prepares the next batch while this step runs.
            model, opt_state, metrics = train_step(
                model, opt_state, batch, jax.random.fold_in(data_key, step), stop.flags()
            )
            agreed = metrics.pop("stop_flags")  # the loop's own, not a metric to track
            done = step + 1
            pending.append((done, metrics))
            if progress is not None:
                progress.update(1)
            if done < t.num_train_steps:
                batch = batch_for(done)
            if len(pending) >= MAX_IN_FLIGHT:  # wait, reading nothing, for the step before this one
                jax.block_until_ready(pending[-MAX_IN_FLIGHT][1])
            # What this step ends with is decided here and only here (a new reason to stop or save goes into step_due).
            signum, timed = stop.poll(agreed)  # the same on every process (see stop.py)
            due = step_due(done, cfg, data.validation is not None, len(pending), stop=bool(signum), timed=timed)
            if not due.read:
                continue
            steps = [s for s, _ in pending]
            rows = read_metrics(pending, t.nan_policy, checkpointer.latest)
            first = not losses and start == 0 and rows  # where the curve starts, read with the steps after it
            losses += [step_loss(s, r) for s, r in zip(steps, rows)]
            if first:
                log.info(f"step 1 (the first): loss {losses[0]!r}")
            empty_steps += sum(float(r["tokens"]) == 0 for r in rows)
            window.add(rows)
            if progress is not None:
                progress.set_postfix(loss=f"{losses[-1]:.3f}")
            if due.log:
                row = {
                    **({"loss": losses[-1]} if float(rows[-1]["tokens"]) else {}),
                    **({"steps_without_loss_tokens": empty_steps} if empty_steps else {}),
                    "lr": float(lr_at(step)),
                    "grad_norm": float(rows[-1]["grad_norm"]),
                    **window.rates(flops_tok, peak, n_dev),
                }
                row.update(  # models.forward_with_aux; trainer.loss_scale=dynamic's scale
                    {k: float(v) for k, v in rows[-1].items() if k.startswith("aux/") or k == "loss_scale"}
                )
                if "overflow" in rows[-1]:  # the steps since the last line that dynamic loss scaling skipped
                    row["skipped_steps"] = window.skipped
                row.update(train_batches.tokens_by_source(done))  # a mixture's tokens per source so far
                trackers.log(done, row)
                window = RateWindow()
            if due.eval:
                evals = eval_losses(
                    lambda b: eval_step(model, device_batch(b, mesh, compute_mapping, t.train_batch_size)), data, t
                )
                trackers.log(done, evals, prefix="eval")
            if due.harness:
                from .harness import PREFIX, evaluate, write_results

                harness.model = model
                scores, result = evaluate(
                    harness,
                    t.eval_harness_tasks,
                    manager=run.harness_tasks,
                    limit=t.eval_harness_limit,
                    samples=t.eval_harness_files,
                )
                trackers.log(done, scores, prefix=PREFIX)
                if t.eval_harness_files and jax.process_index() == 0:
                    write_results(result, run_dir / PREFIX / f"step_{done}", model_name=f"{run_dir.name}/step_{done}")
            if due.sample:
                trackers.text(
                    done,
                    "sample",
                    sample_text(
                        model,
                        data.tokenizer,
                        t.sample_prompt,
                        t.sample_tokens,
                        temperature=t.sample_temperature,
                        top_k=t.sample_top_k,
                        key=jax.random.key(t.seed),
                    ),
                )
            if due.checkpoint:
                checkpointer.save(done, (model, opt_state), _metadata(done, cfg, plan), temporary=due.temporary)
                stop.saved()
            if due.stop:
                checkpointer.wait()  # committed before the exit code says "resumable"
                log.warning(
                    f"stopped by {signal.Signals(signum).name} after step {done}; checkpoint step_{done} is "
                    f"committed; trainer.load_checkpoint auto resumes from it"
                )
                stopped = signum
                break
        if cfg.checkpoint.save_at_end and t.num_train_steps > start and not stopped:
            checkpointer.save(t.num_train_steps, (model, opt_state), _metadata(t.num_train_steps, cfg, plan))
        checkpointer.wait()
        checkpointer.close()
    trackers.close()
    return TrainResult(
        losses,
        done if stopped else t.num_train_steps,
        model,
        opt_state,
        run_dir,
        stopped_by=stopped,
        steps_without_loss_tokens=empty_steps,
    )


def _harness_lm(cfg: TrainConfig, setup: Setup, model):
    """The lm-eval model of this run: its mesh, compute mapping and precision, a microbatch of rows
    per forward pass."""
    from .harness import HarnessLM

    t = cfg.trainer
    return HarnessLM(
        model,
        setup.tokenizer,
        max_length=max_positions(setup.model_cfg),
        mesh=setup.mesh,
        mapping=setup.compute_mapping,
        policy=get_policy(t.precision),
        batch_size=t.train_batch_size // t.microbatches,
        batch_multiple=data_parallel_size(cfg, dict(setup.mesh.shape)),
    )


def _metadata(step: int, cfg: TrainConfig, plan: rundir.RunPlan) -> dict:
    # The data position is the step: TrainBatches.batch_at(step) needs nothing else, and the
    # RNG is derived from (seed, step), so nothing else has to be saved to resume exactly.
    # ``run`` says which run saved it (rundir: a resume never continues another run's checkpoint).
    return {"step": step, "data_step": step, "seed": cfg.trainer.seed, "run": plan.identity}
