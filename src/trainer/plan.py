"""``named-plan``: what a config would do on this machine, without training or compiling."""

from __future__ import annotations

import math

import jax

import named as nm

from .config import TrainConfig, data_parallel_size, to_mapping
from .registry import flops_per_token, model_class


def plan_report(cfg: TrainConfig) -> str:
    from .data import load_tokenizer

    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.data.eos_token)
    vocab = -(-tokenizer.vocab_size // 128) * 128
    model_cfg = cfg.model.model_config(vocab_size=vocab)
    mesh = nm.make_mesh(cfg.mesh.shape)
    compute, param = to_mapping(cfg.mesh.compute_mapping), to_mapping(cfg.mesh.param_mapping)
    cls = model_class(model_cfg)
    shapes = jax.eval_shape(lambda k: cls.init(model_cfg, key=k), jax.random.key(0))
    params = nm.param_report(shapes, param, mesh)
    t = cfg.trainer
    dp = data_parallel_size(cfg, dict(mesh.shape))
    micro = t.train_batch_size // t.microbatches
    n_params = sum(math.prod(a.size for a in r.axes) for r in params.rows)
    lines = [
        f"devices: {len(jax.devices())} x {jax.devices()[0].device_kind} in {jax.process_count()} process(es)",
        f"mesh: {dict(mesh.shape)}",
        f"compute mapping: {compute}",
        f"parameter mapping: {param}",
        "",
        "parameters:",
        str(params),
        "",
        f"adam state (2 moments, float32) per device: {2 * params.bytes_per_device / 2**20:.2f} MiB; "
        f"params + grads + moments: {4 * params.bytes_per_device / 2**20:.2f} MiB per device",
        "",
        f"batch: {t.train_batch_size} sequences x {cfg.data.seq_len} tokens = {t.train_batch_size * cfg.data.seq_len} tokens/step",
        f"microbatches: {t.microbatches} of {micro} sequences; {micro // max(dp, 1)} per data-parallel group of {dp} device(s)",
        f"model: {type(model_cfg).__name__} with {n_params:,} parameters; "
        f"{flops_per_token(model_cfg, cfg.data.seq_len) / 1e9:.3f} GFLOP per token (6N + 12·L·d·T)",
    ]
    return "\n".join(lines)
