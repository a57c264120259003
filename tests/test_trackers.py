"""wandb and TensorBoard are optional: a run with ``tracker.wandb_mode: disabled`` (the default)
never imports wandb, and one that asks for a tracker without its package installed is refused
with a ConfigError naming the key, before the run directory is created or anything compiles.
With ``tracker.tensorboard`` the event files hold the scalars, the config and the samples, read
back here by TensorBoard's own reader."""

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


def _cfg(tmp_path: Path, mode: str, **more):
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
        **more,
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


def test_a_run_without_wandb_or_tensorboard_never_imports_them(no_wandb, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    result = train(_cfg(tmp_path, "disabled"))  # an import of wandb or tensorboard anywhere would raise here
    assert len(result.losses) == 1 and (tmp_path / "run" / "metrics.jsonl").exists()


def test_asking_for_tensorboard_without_it_is_a_config_error(monkeypatch, tmp_path):
    # the writer module too: a test file before this one in the worker may have imported it
    for name in ("tensorboard", "tensorboard.summary.writer.event_file_writer"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ConfigError, match=r"tracker\.tensorboard=true needs the tensorboard package.*\[tensorboard\]"):
        train(_cfg(tmp_path, "disabled", **{"tracker.tensorboard": "true"}))
    assert not (tmp_path / "run").exists()


def _events(folder: Path):
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    events = accumulator.EventAccumulator(str(folder), size_guidance={accumulator.TENSORS: 0, accumulator.SCALARS: 0})
    return events.Reload()


def _text(events, tag: str) -> dict[int, str]:
    return {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors(tag)}


def test_tensorboard_event_files_hold_scalars_config_and_samples(tmp_path):
    pytest.importorskip("tensorboard")
    more = {"tracker.tensorboard": "true", "trainer.num_train_steps": 2, "trainer.sample_interval": 2}
    result = train(_cfg(tmp_path, "disabled", **more, **{"trainer.sample_tokens": 4}))
    events = _events(tmp_path / "run" / "tensorboard")
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2]
    assert [e.value for e in loss] == pytest.approx(result.losses, rel=1e-6)
    assert "train/lr" in events.Tags()["scalars"]
    config = _text(events, "config")
    assert list(config) == [0] and "tensorboard: true" in config[0]
    (sample,) = _text(events, "sample").items()
    assert sample[0] == 2 and sample[1].startswith("```\ndef ")


def test_a_resumed_run_replaces_the_steps_logged_after_its_checkpoint(tmp_path):
    pytest.importorskip("tensorboard")
    from named.trainer.loop.tensorboard import EventWriter

    first = EventWriter(tmp_path)
    for step in (1, 2, 3, 4):
        first.scalars(step, {"train/loss": float(step)})
    first.close()  # killed after step 4, its last checkpoint at step 2
    second = EventWriter(tmp_path, start_step=2)
    second.scalars(3, {"train/loss": 30.0, "note": "not a number"})
    second.close()
    loss = _events(tmp_path / "tensorboard").Scalars("train/loss")
    assert [(e.step, e.value) for e in loss] == [(1, 1.0), (2, 2.0), (3, 30.0)]
