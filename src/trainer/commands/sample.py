"""``named-sample``: text from a checkpoint of a training run.

Every flag and path is checked before anything is restored or compiled: ``--checkpoint`` must be
a run directory with a committed checkpoint or a checkpoint folder inside one
(``<run_dir>/checkpoints/step_N``), and ``--tokens`` must fit the model's positions after the
prompt. Bad input raises ConfigError (a flag) or CheckpointError (a path), naming it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax

from .. import checkpoint as ckpt
from ..config import RULES, ConfigError, ModelChoice, load_config
from ..config.check import check_section
from ..data import load_tokenizer
from ..data.chat import prompt_ids as chat_ids
from ..data.chat import stop_token_ids
from ..loop.generate import continue_ids
from ..loop.model_init import model_shapes
from ..loop.registry import max_positions, model_class, model_config_from_dict


def check_flags(n_tokens: int, temperature: float, seed: int) -> None:
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 0:
        raise ConfigError(f"--tokens must be an integer >= 0, got {n_tokens!r}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ConfigError(f"--temperature must be a finite number >= 0 (0 decodes greedily), got {temperature}")
    RULES["trainer.seed"].check(seed, "--seed")


def _run_dir_and_checkpoint(path: Path) -> tuple[Path, Path]:
    if not path.exists():
        raise ckpt.CheckpointError(f"--checkpoint {path}: no such directory")
    if not path.is_dir():
        raise ckpt.CheckpointError(
            f"--checkpoint {path} is a file; give a run directory (its newest checkpoint is "
            "used) or a checkpoint folder <run_dir>/checkpoints/step_N"
        )
    if (path / ckpt.COMMIT_FILE).exists():
        # the run's config lies two levels up: read it only from where named-train puts it
        if path.parent.name != "checkpoints":
            raise ckpt.CheckpointError(
                f"--checkpoint {path} is a checkpoint outside a run directory; named-sample "
                "needs <run_dir>/checkpoints/step_N (or the run directory) to find the run's config"
            )
        return path.parent.parent, path
    latest = ckpt.latest_checkpoint(path)
    if latest is None:
        raise ckpt.CheckpointError(
            f"--checkpoint {path} holds no committed checkpoint; give a named-train run "
            "directory or a checkpoint folder <run_dir>/checkpoints/step_N"
        )
    return path, latest


def saved_model_config(run_dir: Path):
    path = run_dir / "model_config.json"
    if not path.is_file():
        raise ckpt.CheckpointError(f"{path} is missing: is {run_dir} a named-train run directory?")
    try:
        fields = json.loads(path.read_text())
        model_cfg = model_config_from_dict(fields)
        check_section(ModelChoice, fields, "model")  # as the model section of a config is checked
        return model_cfg
    except ConfigError as e:
        raise ckpt.CheckpointError(f"{path}: {e}") from None
    except (ValueError, TypeError, AttributeError) as e:  # not JSON, or fields of the wrong kind
        raise ckpt.CheckpointError(f"{path} is not a model config written by named-train: {e}") from None


def sample_from_checkpoint(
    path: Path, prompt: str, n_tokens: int, *, temperature: float = 0.0, seed: int = 0, chat: str | None = None
) -> str:
    """``prompt`` and its continuation; with ``chat``, the assistant's reply to that user message
    alone: the message is rendered with the run's chat template (``data.chat_template`` or the
    tokenizer folder's) and the reply ends at eos or the template's end-of-turn token."""
    check_flags(n_tokens, temperature, seed)
    if chat is not None and prompt:
        raise ConfigError("give --prompt or --chat, not both: --chat renders its message with the chat template")
    run_dir, checkpoint = _run_dir_and_checkpoint(Path(path))
    model_cfg = saved_model_config(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ckpt.CheckpointError(f"{run_dir / 'config.yaml'} is missing: is {run_dir} a named-train run directory?")
    cfg = load_config(run_dir / "config.yaml")
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.data.eos_token)
    if chat is not None:
        if not chat.strip():
            raise ConfigError("--chat: the user message is empty")
        messages = [{"role": "user", "content": chat}]
        ids = chat_ids(tokenizer, messages, chat_template=cfg.data.chat_template)
        stops = tuple(stop_token_ids(tokenizer, chat_template=cfg.data.chat_template))
        flag = "--chat (with the chat template)"
    else:
        ids, stops, flag = tokenizer.encode(prompt) or [tokenizer.eos_id], (), "--prompt"
    if len(ids) + n_tokens > max_positions(model_cfg):
        raise ConfigError(
            f"--tokens {n_tokens} after the {len(ids)} tokens of {flag} needs {len(ids) + n_tokens} "
            f"positions; the model has {max_positions(model_cfg)}"
        )
    # The checkpoint holds (model, optimizer state): the model alone is read, built as the run built it.
    target = model_shapes(cfg, model_class(model_cfg), model_cfg)
    (model, _), _ = ckpt.restore(checkpoint, (target, None), partial=True)
    new = continue_ids(model, ids, n_tokens, temperature=temperature, key=jax.random.key(seed), stop_ids=stops)
    return tokenizer.decode(new) if chat is not None else prompt + tokenizer.decode(new)
