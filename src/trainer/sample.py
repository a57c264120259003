"""``named-sample``: text from a checkpoint of a training run."""

from __future__ import annotations

import json
from pathlib import Path

import jax

from . import checkpoint as ckpt
from .config import ConfigError, load_config
from .data import load_tokenizer
from .registry import model_class, model_config_from_dict


def _run_dir_and_checkpoint(path: Path) -> tuple[Path, Path]:
    if (path / "commit.json").exists():
        return path.parent.parent, path
    latest = ckpt.latest_checkpoint(path)
    if latest is None:
        raise FileNotFoundError(f"no committed checkpoint under {path}")
    return path, latest


def sample_from_checkpoint(path: Path, prompt: str, n_tokens: int, *, temperature: float = 0.0, seed: int = 0) -> str:
    run_dir, checkpoint = _run_dir_and_checkpoint(Path(path))
    cfg_file = run_dir / "model_config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{cfg_file} is missing: is {run_dir} a named-train run directory?")
    model_cfg = model_config_from_dict(json.loads(cfg_file.read_text()))
    cfg = load_config(run_dir / "config.yaml") if (run_dir / "config.yaml").exists() else None
    if cfg is None:
        raise ConfigError(f"{run_dir / 'config.yaml'} is missing")
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.data.eos_token)
    cls = model_class(model_cfg)
    target = jax.eval_shape(lambda k: cls.init(model_cfg, key=k), jax.random.key(0))
    # The checkpoint holds (model, optimizer state); the optimizer's structure comes from the config.
    from .optim import build_optimizer

    opt_target = jax.eval_shape(build_optimizer(cfg.optimizer, cfg.trainer.num_train_steps).init, target)
    (model, _), _ = ckpt.restore(checkpoint, (target, opt_target))
    from .train import sample_text

    return sample_text(model, tokenizer, prompt, n_tokens, temperature=temperature, key=jax.random.key(seed))
