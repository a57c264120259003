"""wandb is optional: a run with ``tracker.wandb_mode: disabled`` (the default) never imports
it, and one that asks for it without the package installed is refused with a ConfigError
naming ``tracker.wandb_mode``, before the run directory is created or anything compiles."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from named.trainer.config import ConfigError, TrackerConfig, load_config
from named.trainer.loop.trackers import check_trackers
from named.trainer.loop.train import train

ROOT = Path(__file__).resolve().parents[1]
NANO = ROOT / "config/gpt2_nano.yaml"


@pytest.fixture
def no_wandb(monkeypatch):
    """As if wandb were not installed: ``import wandb`` raises ImportError."""
    monkeypatch.setitem(sys.modules, "wandb", None)


def _cfg(tmp_path: Path, mode: str):
    (tmp_path / "code.txt").write_text("\n".join(f"def f_{i}(a):\n    return a * {i}\n" for i in range(200)))
    args = {
        "trainer.num_train_steps": 1,
        "trainer.train_batch_size": 8,
        "trainer.log_interval": 1,
        "trainer.eval_interval": 0,
        "trainer.sample_interval": 0,
        "trainer.progress_bar": "false",
        "trainer.run_dir": str(tmp_path / "run"),
        "model.n_layer": 1,
        "model.n_head": 2,
        "model.n_embd": 16,
        "model.n_positions": 32,
        "data.train": f"[{tmp_path / 'code.txt'}]",
        "data.seq_len": 16,
        "data.val_fraction": 0.0,
        "data.cache_dir": str(tmp_path / "cache"),
        "checkpoint.interval": 0,
        "checkpoint.save_at_end": "false",
        "tracker.console": "false",
        "tracker.wandb_mode": mode,
    }
    return load_config(NANO, [x for k, v in args.items() for x in (f"--{k}", str(v))])


@pytest.mark.parametrize("mode", ["offline", "online"])
def test_asking_for_wandb_without_it_is_a_config_error(no_wandb, mode):
    with pytest.raises(ConfigError, match=rf"tracker\.wandb_mode='{mode}' needs the wandb package.*named-jax\[wandb\]"):
        check_trackers(TrackerConfig(wandb_mode=mode))
    check_trackers(TrackerConfig(wandb_mode="disabled"))


def test_a_run_refuses_before_writing_anything(no_wandb, tmp_path):
    with pytest.raises(ConfigError, match=r"tracker\.wandb_mode='offline'"):
        train(_cfg(tmp_path, "offline"))
    assert not (tmp_path / "run").exists()


def test_a_run_without_wandb_never_imports_it(no_wandb, tmp_path):
    result = train(_cfg(tmp_path, "disabled"))  # an import of wandb anywhere would raise here
    assert len(result.losses) == 1 and (tmp_path / "run" / "metrics.jsonl").exists()
