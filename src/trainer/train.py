"""The training loop: sharded init, a named_jit train step with donation and gradient
accumulation, eval, samples, checkpoints and metrics.

    named-train --config_path config/gpt2_nano.yaml
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import models
import named as nm
from named.nn.loss import next_token_loss
from named.nn.precision import cast_for_compute, get_policy

from . import checkpoint as ckpt
from .config import ConfigError, TrainConfig, data_parallel_size, dump_config, to_mapping
from .data import Batch, TrainBatches, build_data, eval_batches
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
    """Everything up to the first step: data, mesh, model and optimizer state (sharded init)."""
    t = cfg.trainer
    run_dir = Path(t.run_dir)
    data = build_data(cfg.data)
    vocab = data.tokenizer.vocab_size
    model_cfg = cfg.model.model_config(vocab_size=int(math.ceil(vocab / 128) * 128))
    if model_cfg.vocab_size < vocab:
        raise ConfigError(f"model.vocab_size={model_cfg.vocab_size} is smaller than the tokenizer's {vocab} tokens")
    mesh = nm.make_mesh(cfg.mesh.shape)
    compute, param = to_mapping(cfg.mesh.compute_mapping), to_mapping(cfg.mesh.param_mapping)
    _check_against_mesh(cfg, mesh, model_cfg, cfg.data.seq_len)
    model_cls = model_class(model_cfg)
    shapes = jax.eval_shape(lambda k: model_cls.init(model_cfg, key=k), jax.random.key(0))
    nm.check_sharding(shapes, param, mesh)  # divisibility and mesh axes, before compiling
    return data, model_cfg, model_cls, mesh, compute, param, run_dir


def train(cfg: TrainConfig) -> TrainResult:
    t = cfg.trainer
    data, model_cfg, model_cls, mesh, compute, param, run_dir = build_run(cfg)
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
    train_batches = TrainBatches(data.train, batch_size=t.train_batch_size, seed=t.seed,
                                 process_index=pid, process_count=jax.process_count())
    key = jax.random.key(t.seed)
    init_key, data_key = jax.random.split(key)

    with nm.set_mesh(mesh):
        model = nm.named_jit(model_cls.init, axis_resources=param)(model_cfg, key=init_key)
        opt_state = nm.named_jit(optimizer.init, axis_resources=param)(model)
        start = 0
        restore_from = _checkpoint_to_load(t, run_dir)
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
        progress = _progress(t, start, pid)
        window_t, window_tokens = time.perf_counter(), 0.0
        step = start
        for step in range(start, t.num_train_steps):
            batch = device_batch(train_batches.batch_at(step), mesh, compute, t.train_batch_size)
            model, opt_state, metrics = train_step(model, opt_state, batch, jax.random.fold_in(data_key, step))
            loss = float(metrics["loss"])
            if not bool(metrics["finite"]):
                if t.nan_policy == "stop":
                    raise TrainingError(f"non-finite loss or gradient at step {step} (loss={loss}); "
                                        f"the last committed checkpoint is {ckpt.latest_checkpoint(run_dir)}")
                log.warning(f"step {step}: non-finite loss or gradient; update skipped (nan_policy=skip)")
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
                trackers.text(done, "sample", sample_text(model, data.tokenizer, t.sample_prompt, t.sample_tokens))
            if cfg.checkpoint.interval and done % cfg.checkpoint.interval == 0 and done != t.num_train_steps:
                checkpointer.save(done, (model, opt_state), _metadata(done, cfg))
        if cfg.checkpoint.save_at_end and t.num_train_steps > start:
            checkpointer.save(t.num_train_steps, (model, opt_state), _metadata(t.num_train_steps, cfg))
        checkpointer.wait()
        checkpointer.close()
    if progress is not None:
        progress.close()
    trackers.close()
    return TrainResult(losses, t.num_train_steps, model, opt_state, run_dir)


def _metadata(step: int, cfg: TrainConfig) -> dict:
    # The data position is the step: TrainBatches.batch_at(step) needs nothing else, and the
    # RNG is derived from (seed, step), so nothing else has to be saved to resume exactly.
    return {"step": step, "data_step": step, "seed": cfg.trainer.seed}


def _checkpoint_to_load(t, run_dir: Path):
    if t.load_checkpoint is None:
        return None
    if t.load_checkpoint == "auto":
        return ckpt.latest_checkpoint(run_dir)
    path = Path(t.load_checkpoint)
    return path if path.is_absolute() else run_dir / path


def _evaluate(eval_step, model, validation, t, mesh, compute) -> float:
    total = count = 0.0
    for i, b in enumerate(eval_batches(validation, batch_size=t.train_batch_size,
                                       process_index=jax.process_index(), process_count=jax.process_count())):
        if t.eval_batches and i >= t.eval_batches:
            break
        s, c = eval_step(model, device_batch(b, mesh, compute, t.train_batch_size))
        total, count = total + float(s), count + float(c)
    return total / max(count, 1.0)


def sample_text(model, tokenizer, prompt: str, n_tokens: int, *, temperature: float = 0.0, key=None) -> str:
    ids = tokenizer.encode(prompt) or [tokenizer.eos_id]
    prompt_ids = nm.named(jnp.asarray([ids], jnp.int32), ("batch", Pos))
    out = models.generate(model, prompt_ids, n_tokens, temperature=temperature, key=key)
    return prompt + tokenizer.decode([int(i) for i in np.asarray(out.array)[0, len(ids):]])


def _progress(t, start: int, pid: int):
    if not t.progress_bar or pid != 0:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=t.num_train_steps, initial=start, desc="train", unit="step", leave=False, dynamic_ncols=True)
