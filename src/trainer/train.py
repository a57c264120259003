"""The training loop: sharded init, a named_jit train step with donation and gradient
accumulation, eval, samples, checkpoints and metrics.

    named-train --config_path config/gpt2_nano.yaml
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from named import models
import named as nm
from named.nn.loss import next_token_loss
from named.nn.precision import cast_for_compute, get_policy

from . import checkpoint as ckpt
from .config import ConfigError, TrainConfig, data_parallel_size, dump_config, to_mapping
from .data import Batch, TrainBatches, build_data, eval_batches, load_tokenizer
from .optim import build_optimizer, schedule
from .registry import flops_per_token, max_positions, model_class, model_type
from .trackers import Trackers, log, setup_logging

Batch_, Pos, Microbatch = nm.Axis("batch", 1), "position", "microbatch"

# bf16 dense peak per device (FLOP/s), for MFU. docs/benchmarks.md states the sources.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "TPU v4": 275e12, "TPU v5 lite": 197e12,
              "TPU v5p": 459e12, "TPU v6 lite": 918e12}


class TrainingError(RuntimeError):
    """The run cannot go on (a NaN under nan_policy=stop, for example); the message says where."""


@dataclasses.dataclass
class TrainResult:
    losses: list[float]
    final_step: int
    model: Any
    opt_state: Any
    run_dir: Path


def peak_flops(cfg: TrainConfig) -> float | None:
    if cfg.trainer.peak_flops_per_device:
        return cfg.trainer.peak_flops_per_device
    kind = jax.devices()[0].device_kind
    return next((v for k, v in PEAK_FLOPS.items() if k.lower() in kind.lower()), None)


def _check_against_mesh(cfg: TrainConfig, mesh, model_cfg, seq_len: int) -> None:
    shape = dict(mesh.shape)
    dp = data_parallel_size(cfg, shape)
    mb = cfg.trainer.train_batch_size // cfg.trainer.microbatches
    if mb % dp:
        raise ConfigError(
            f"the microbatch of {mb} sequences (trainer.train_batch_size={cfg.trainer.train_batch_size} / "
            f"trainer.microbatches={cfg.trainer.microbatches}) does not split over the {dp} devices of the batch mesh axes"
        )
    if cfg.trainer.train_batch_size % jax.process_count():
        raise ConfigError(f"trainer.train_batch_size={cfg.trainer.train_batch_size} does not split over {jax.process_count()} processes")
    max_pos = max_positions(model_cfg)
    if seq_len > max_pos:
        raise ConfigError(f"data.seq_len={seq_len} is longer than the model's {max_pos} positions (model.n_positions / max_position_embeddings)")


# Axes of activations that no parameter has; a mapping may name these and the parameters' axes.
_ACTIVATION_AXES = ("batch", "position", "key_position")


def _check_mappings(cfg: TrainConfig, shapes, mesh, compute, param, model_cfg) -> None:
    """Both mappings name only axes the model has, and every axis they split divides evenly:
    the parameters' axes under both mappings, and batch / position under the compute mapping.
    Checked on ``jax.eval_shape`` output, so before anything is compiled."""
    sizes: dict[str, set[int]] = {}
    for x in jax.tree.leaves(shapes, is_leaf=nm.is_named_array):
        for a in getattr(x, "axes", ()):
            sizes.setdefault(a.name, set()).add(a.size)
    micro = cfg.trainer.train_batch_size // cfg.trainer.microbatches
    for name, n in zip(_ACTIVATION_AXES, (micro, cfg.data.seq_len, cfg.data.seq_len)):
        sizes.setdefault(name, set()).add(n)
    for key, mapping in (("mesh.param_mapping", param), ("mesh.compute_mapping", compute)):
        for name in mapping:
            if name not in sizes:
                raise ConfigError(f"{key}.{name}: the {model_type(model_cfg)} model has no axis {name!r}; "
                                  f"its axes are {', '.join(sorted(sizes))}")
    try:
        nm.check_sharding(shapes, param, mesh)  # every parameter's layout, leaf by leaf
    except nm.ShardingError as e:
        raise ConfigError(f"mesh.param_mapping: {e}") from None
    for name in compute:
        for n in sorted(sizes[name]):
            try:
                nm.pspec_for((nm.Axis(name, n),), compute, mesh)
            except nm.ShardingError as e:
                raise ConfigError(f"mesh.compute_mapping: {e}") from None


def _check_sample_length(cfg: TrainConfig, tokenizer, model_cfg) -> None:
    t = cfg.trainer
    if not t.sample_interval:
        return
    n = len(tokenizer.encode(t.sample_prompt) or [tokenizer.eos_id]) + t.sample_tokens
    if n > max_positions(model_cfg):
        raise ConfigError(f"a sample of trainer.sample_tokens={t.sample_tokens} after the prompt trainer.sample_prompt "
                          f"({n - t.sample_tokens} tokens) needs {n} positions; the model has {max_positions(model_cfg)}")


def make_train_step(model_cls, optimizer, policy, cfg: TrainConfig, compute, param):
    """The jitted step: microbatched loss and gradients (exactly the full-batch mean over
    tokens), clipping and AdamW; a non-finite loss or gradient leaves the state untouched."""
    n_micro = cfg.trainer.microbatches
    skip_bad = cfg.trainer.nan_policy == "skip"

    def loss_sum(model, batch, key):
        m = cast_for_compute(model, policy)
        logits = m(batch["input_ids"], segment_ids=batch["segment_ids"], key=key)
        per_token = next_token_loss(logits, batch["input_ids"], loss_mask=batch["loss_mask"], reduction="none")
        return per_token.sum().scalar(), batch["loss_mask"][Pos, :-1].astype(jnp.float32).sum().scalar()

    grad_fn = eqx.filter_value_and_grad(loss_sum, has_aux=True)

    def step(model, opt_state, batch, key):
        split = {k: v.unflatten_axis("batch", (nm.Axis(Microbatch, n_micro), nm.Axis("batch", v.axis_size("batch") // n_micro)))
                 for k, v in batch.items()}
        keys = nm.named(jax.random.split(key, n_micro), (Microbatch,))

        def accumulate(acc, mb, k):
            (s, c), g = grad_fn(model, nm.shard(mb), k.array)
            return jax.tree.map(jnp.add, acc, (s, c, g))

        zero = (jnp.zeros(()), jnp.zeros(()), jax.tree.map(jnp.zeros_like, eqx.filter(model, eqx.is_array)))
        total, count, grads = nm.fold(accumulate, Microbatch)(zero, split, keys)
        count = jnp.maximum(count, 1.0)
        loss = total / count
        grads = jax.tree.map(lambda g: g / count, grads)
        grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
        updates, new_opt = optimizer.update(grads, opt_state, model)
        new_model = eqx.apply_updates(model, updates)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        if skip_bad:
            new_model, new_opt = jax.tree.map(lambda new, old: jnp.where(finite, new, old), (new_model, new_opt), (model, opt_state))
        return new_model, new_opt, {"loss": loss, "grad_norm": grad_norm, "finite": finite, "tokens": count}

    return nm.named_jit(step, axis_resources=compute, out_axis_resources=param, donate_args=(True, True, False, False))


def make_eval_step(policy, compute):
    def eval_step(model, batch):
        m = cast_for_compute(model, policy)
        logits = m(batch["input_ids"], segment_ids=batch["segment_ids"])
        per_token = next_token_loss(logits, batch["input_ids"], loss_mask=batch["loss_mask"], reduction="none")
        return per_token.sum().scalar(), batch["loss_mask"][Pos, :-1].astype(jnp.float32).sum().scalar()

    return nm.named_jit(eval_step, axis_resources=compute)


def device_batch(batch: Batch, mesh, compute, global_rows: int) -> dict[str, nm.NamedArray]:
    """This process's rows -> global NamedArrays laid out by the compute mapping."""
    out = {}
    for name in ("input_ids", "segment_ids", "loss_mask"):
        local = np.asarray(getattr(batch, name))
        axes = (nm.Axis("batch", global_rows), nm.Axis(Pos, local.shape[1]))
        sharding = nm.sharding_for(axes, compute, mesh)
        arr = jax.make_array_from_process_local_data(sharding, local, (global_rows, local.shape[1]))
        out[name] = nm.NamedArray(arr, axes)
    return out


def build_run(cfg: TrainConfig):
    """Every check that bad input can fail, before anything is compiled or written: the
    cheap ones first (tokenizer, model config, mesh, mappings against the parameters'
    shapes, the checkpoint to resume from), then the data (which may tokenise) and the
    batch order. ``train`` creates the run directory only after this returns."""
    t = cfg.trainer
    run_dir = Path(t.run_dir)
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.data.eos_token)
    vocab = tokenizer.vocab_size
    model_cfg = cfg.model.model_config(vocab_size=int(math.ceil(vocab / 128) * 128))
    if model_cfg.vocab_size < vocab:
        raise ConfigError(f"model.vocab_size={model_cfg.vocab_size} is smaller than the tokenizer's {vocab} tokens")
    mesh = nm.make_mesh(cfg.mesh.shape)
    compute, param = to_mapping(cfg.mesh.compute_mapping), to_mapping(cfg.mesh.param_mapping)
    _check_against_mesh(cfg, mesh, model_cfg, cfg.data.seq_len)
    _check_sample_length(cfg, tokenizer, model_cfg)
    model_cls = model_class(model_cfg)
    try:
        shapes = jax.eval_shape(lambda: model_cls.init(model_cfg, key=jax.random.key(0)))
    except (ValueError, nm.NamedError) as e:
        raise ConfigError(f"model: {e}") from None
    _check_mappings(cfg, shapes, mesh, compute, param, model_cfg)
    restore_from = _checkpoint_to_load(t, run_dir)
    if restore_from is not None:  # a resume with another model or optimizer fails here, not after init
        opt_shapes = jax.eval_shape(build_optimizer(cfg.optimizer, t.num_train_steps).init, shapes)
        ckpt.check_restorable(restore_from, (shapes, opt_shapes))
    data = build_data(cfg.data, tokenizer)
    train_batches = TrainBatches(data.train, batch_size=t.train_batch_size, seed=t.seed,
                                 process_index=jax.process_index(), process_count=jax.process_count())
    return data, train_batches, model_cfg, model_cls, mesh, compute, param, run_dir, restore_from


def train(cfg: TrainConfig) -> TrainResult:
    t = cfg.trainer
    data, train_batches, model_cfg, model_cls, mesh, compute, param, run_dir, restore_from = build_run(cfg)
    pid = jax.process_index()
    run_dir.mkdir(parents=True, exist_ok=True)
    setup_logging(run_dir, pid)
    if pid == 0:
        (run_dir / "config.yaml").write_text(dump_config(cfg))
        (run_dir / "model_config.json").write_text(json.dumps({"type": model_type(model_cfg), **dataclasses.asdict(model_cfg)}, indent=1))
    policy = get_policy(t.precision)
    optimizer = build_optimizer(cfg.optimizer, t.num_train_steps)
    lr_at = schedule(cfg.optimizer, t.num_train_steps)
    trackers = Trackers(cfg.tracker, run_dir, pid, json.loads(json.dumps(dataclasses.asdict(cfg), default=str)))
    checkpointer = ckpt.Checkpointer(run_dir, keep_last=cfg.checkpoint.keep_last, keep_every=cfg.checkpoint.keep_every)
    key = jax.random.key(t.seed)
    init_key, data_key = jax.random.split(key)

    with nm.set_mesh(mesh), contextlib.ExitStack() as stack:
        model = nm.named_jit(model_cls.init, axis_resources=param)(model_cfg, key=init_key)
        opt_state = nm.named_jit(optimizer.init, axis_resources=param)(model)
        start = 0
        if restore_from is not None:
            (model, opt_state), meta = ckpt.restore(restore_from, (model, opt_state))
            start = int(meta["step"])
            log.info(f"resumed from {restore_from} at step {start}")
        train_step = make_train_step(model_cls, optimizer, policy, cfg, compute, param)
        eval_step = make_eval_step(policy, compute)
        flops_tok = flops_per_token(model_cfg, cfg.data.seq_len)
        peak = peak_flops(cfg)
        n_dev = len(jax.devices())
        losses: list[float] = []
        progress = _progress(t, start, pid, stack)
        window_t, window_tokens = time.perf_counter(), 0.0
        step = start
        for step in range(start, t.num_train_steps):
            log.debug("step %d: process %d reads data rows %s", step, pid, train_batches.indices(step).tolist())
            batch = device_batch(train_batches.batch_at(step), mesh, compute, t.train_batch_size)
            model, opt_state, metrics = train_step(model, opt_state, batch, jax.random.fold_in(data_key, step))
            loss = float(metrics["loss"])
            check_finite(step + 1, metrics, t.nan_policy, checkpointer.latest)
            losses.append(loss)
            window_tokens += float(metrics["tokens"])
            done = step + 1
            if progress is not None:
                progress.update(1)
                progress.set_postfix(loss=f"{loss:.3f}")
            if t.log_interval and (done % t.log_interval == 0 or done == t.num_train_steps):
                elapsed = time.perf_counter() - window_t
                steps_in_window = (done - start) % t.log_interval or t.log_interval
                tok_s = window_tokens / elapsed
                row = {"loss": loss, "lr": float(lr_at(step)), "grad_norm": float(metrics["grad_norm"]),
                       "tokens_per_s": tok_s, "step_time_s": elapsed / steps_in_window}
                if peak:
                    row["mfu"] = tok_s * flops_tok / (peak * n_dev)
                trackers.log(done, row)
                window_t, window_tokens = time.perf_counter(), 0.0
            if data.validation is not None and t.eval_interval and (done % t.eval_interval == 0 or done == t.num_train_steps):
                trackers.log(done, {"loss": _evaluate(eval_step, model, data.validation, t, mesh, compute)}, prefix="eval")
            if t.sample_interval and (done % t.sample_interval == 0 or done == t.num_train_steps):
                trackers.text(done, "sample", sample_text(model, data.tokenizer, t.sample_prompt, t.sample_tokens,
                                                          temperature=0.8, top_k=40, key=jax.random.key(t.seed)))
            if cfg.checkpoint.interval and done % cfg.checkpoint.interval == 0 and done != t.num_train_steps:
                checkpointer.save(done, (model, opt_state), _metadata(done, cfg))
        if cfg.checkpoint.save_at_end and t.num_train_steps > start:
            checkpointer.save(t.num_train_steps, (model, opt_state), _metadata(t.num_train_steps, cfg))
        checkpointer.wait()
        checkpointer.close()
    trackers.close()
    return TrainResult(losses, t.num_train_steps, model, opt_state, run_dir)


def check_finite(step: int, metrics: dict, nan_policy: str, last_checkpoint=None) -> bool:
    """Whether step ``step`` (numbered as in the logs and checkpoints: the update that made
    step_<step>) was finite. If not: ``stop`` raises TrainingError naming the step and
    ``last_checkpoint()`` (which lets a save in flight commit first), ``skip`` warns (the
    train step has already kept the old state) and returns False."""
    if bool(metrics["finite"]):
        return True
    what = f"non-finite loss or gradient in step {step} (loss={float(metrics['loss'])}, grad_norm={float(metrics['grad_norm'])})"
    if nan_policy == "stop":
        try:
            last = last_checkpoint() if last_checkpoint is not None else None
        except ckpt.CheckpointError as e:  # the save in flight failed: report both
            last = f"unknown ({e})"
        raise TrainingError(f"{what}; stopped (trainer.nan_policy=stop); the last committed checkpoint is {last}")
    log.warning(f"{what}; update skipped, parameters and optimizer state unchanged (trainer.nan_policy=skip)")
    return False


def _metadata(step: int, cfg: TrainConfig) -> dict:
    # The data position is the step: TrainBatches.batch_at(step) needs nothing else, and the
    # RNG is derived from (seed, step), so nothing else has to be saved to resume exactly.
    return {"step": step, "data_step": step, "seed": cfg.trainer.seed}


def _checkpoint_to_load(t, run_dir: Path):
    if t.load_checkpoint is None:
        return None
    if t.load_checkpoint == "auto":
        return ckpt.latest_checkpoint(run_dir)  # verified; corrupted newer ones are skipped with a warning
    path = Path(t.load_checkpoint)
    path = path if path.is_absolute() else run_dir / path
    ckpt.verify_checkpoint(path)  # an explicit checkpoint must be whole: CheckpointError names the bad file
    return path


def _evaluate(eval_step, model, validation, t, mesh, compute) -> float:
    total = count = 0.0
    for i, b in enumerate(eval_batches(validation, batch_size=t.train_batch_size,
                                       process_index=jax.process_index(), process_count=jax.process_count())):
        if t.eval_batches and i >= t.eval_batches:
            break
        s, c = eval_step(model, device_batch(b, mesh, compute, t.train_batch_size))
        total, count = total + float(s), count + float(c)
    return total / max(count, 1.0)


def sample_text(model, tokenizer, prompt: str, n_tokens: int, *, temperature: float = 0.0, top_k: int | None = None,
                key=None) -> str:
    ids = tokenizer.encode(prompt) or [tokenizer.eos_id]
    prompt_ids = nm.named(jnp.asarray([ids], jnp.int32), ("batch", Pos))
    out = models.generate(model, prompt_ids, n_tokens, temperature=temperature, top_k=top_k, key=key)
    return prompt + tokenizer.decode([int(i) for i in np.asarray(out.array)[0, len(ids):]])


def _progress(t, start: int, pid: int, stack: contextlib.ExitStack):
    """A progress bar on process 0 when stderr is a terminal (in logs it would be noise); while
    it is up, console log lines are written above it instead of through it."""
    if not t.progress_bar or pid != 0 or not sys.stderr.isatty():
        return None
    from tqdm.auto import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    bar = stack.enter_context(tqdm(total=t.num_train_steps, initial=start, desc="train", unit="step", leave=False,
                                   dynamic_ncols=True))
    stack.enter_context(logging_redirect_tqdm(loggers=[log]))
    return bar
