"""The training loop does not wait for the device between steps: step k+1 is dispatched (and
its batch prepared) before anything of step k is read, and the metrics of all steps since the
last read come to the host together, only where something needs them (a log line, eval, a
sample, a checkpoint, the end). The NaN policy stays exact: it looks at every step's
``finite`` flag at the next read point, and ``stop`` names the first bad step.

The loop's reads are observed from outside: the real train step runs, but the metrics it
hands back are wrapped in a tripwire that records each read (any conversion to a host value)
with its step number, next to the dispatch of each step and the preparation of each batch.
The one read between read points is a step's agreed stop flags (``stop_flags``, recorded as
"flags"), once per step, after the loop has waited for that step anyway.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import numpy as np
import pytest

from named.trainer.config import load_config
from named.trainer.loop import train as train_mod
from named.trainer.loop.cadence import MAX_IN_FLIGHT, TrainingError
from named.trainer.loop.train import train

ROOT = Path(__file__).resolve().parents[1]
NANO = ROOT / "config/gpt2_nano.yaml"
CORPUS = "\n".join(f"def h_{i}(a, b):\n    return a + b * {i}\n" for i in range(300))
# A learning rate whose first update makes every later step overflow (as in test_nan_policy).
EXPLODE = {"optimizer.learning_rate": 1e30, "optimizer.schedule": "constant"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("loop")
    (d / "code.txt").write_text(CORPUS)
    return d


def _cfg(corpus: Path, run_dir: Path, **over):
    args = {
        "trainer.num_train_steps": 7,
        "trainer.train_batch_size": 8,
        "trainer.log_interval": 3,
        "trainer.eval_interval": 0,
        "trainer.sample_interval": 0,
        "trainer.progress_bar": "false",
        "trainer.run_dir": str(run_dir),
        "model.n_layer": 1,
        "model.n_head": 2,
        "model.n_embd": 16,
        "model.n_positions": 32,
        "data.train": f"[{corpus / 'code.txt'}]",
        "data.seq_len": 16,
        "data.val_fraction": 0.0,
        "data.cache_dir": str(corpus / "cache"),
        "optimizer.warmup_steps": 0,
        "checkpoint.interval": 0,
        "checkpoint.save_at_end": "false",
        "tracker.console": "false",
    }
    args.update(over)
    return load_config(NANO, [x for k, v in args.items() for x in (f"--{k}", str(v))])


class _Tripwire:
    """A step's metric that records every read of its value (what ``float``, ``bool`` and
    ``jax.device_get`` do) with the step it belongs to, and every wait for it (which reads
    nothing)."""

    def __init__(self, value, step: int, events: list, what: str = "read"):
        self.value, self.step, self.events, self.what = value, step, events, what

    def _read(self):
        self.events.append((self.what, self.step))
        return np.asarray(self.value)

    def __array__(self, dtype=None, copy=None):
        out = self._read()
        return out if dtype is None else out.astype(dtype)

    def __float__(self):
        return float(self._read())

    def __bool__(self):
        return bool(self._read())

    def block_until_ready(self):
        self.events.append(("wait", self.step))
        jax.block_until_ready(self.value)
        return self


@pytest.fixture
def observed(monkeypatch):
    """Events ("batch", k), ("dispatch", k), ("read", k) of the next run, and each step's loss
    as the step computed it."""
    events, losses = [], []
    real_make, real_batch = train_mod.make_train_step, train_mod.device_batch

    def make_train_step(*args, **kwargs):
        step_fn = real_make(*args, **kwargs)

        def step(*args):
            k = sum(e[0] == "dispatch" for e in events) + 1
            events.append(("dispatch", k))
            model, opt_state, metrics = step_fn(*args)
            losses.append(metrics["loss"])
            return (
                model,
                opt_state,
                {
                    name: _Tripwire(v, k, events, "flags" if name == "stop_flags" else "read")
                    for name, v in metrics.items()
                },
            )

        return step

    def device_batch(*args, **kwargs):
        events.append(("batch", sum(e[0] == "batch" for e in events) + 1))
        return real_batch(*args, **kwargs)

    monkeypatch.setattr(train_mod, "make_train_step", make_train_step)
    monkeypatch.setattr(train_mod, "device_batch", device_batch)
    return events, losses


def _collapsed(events: list) -> list:
    """The events with each run of reads or waits of one step (one per metric) written once."""
    out = []
    for e in events:
        if not (e[0] in ("read", "wait") and out and out[-1] == e):
            out.append(e)
    return out


def test_steps_are_dispatched_ahead_and_read_only_at_read_points(corpus, tmp_path, observed):
    events, step_losses = observed
    result = train(_cfg(corpus, tmp_path / "run"))
    # log_interval 3 over 7 steps: reads after steps 3, 6 and 7 (the end), nowhere else; the
    # batch of step k+1 is built after step k is dispatched and before anything is read; before
    # dispatching step k+1 the host waits only for step k-1 (MAX_IN_FLIGHT 2), so step k+1 is
    # queued while step k may still run, and then reads nothing but step k-1's stop flags (after
    # a read point, step k-1 has finished: no wait).
    assert MAX_IN_FLIGHT == 2
    expected = [
        ("batch", 1),
        ("dispatch", 1),
        ("batch", 2),
        ("dispatch", 2),
        ("batch", 3),
        ("wait", 1),
        ("flags", 1),
        ("dispatch", 3),
        ("batch", 4),
        ("wait", 2),
        ("flags", 2),
        ("read", 1),
        ("read", 2),
        ("read", 3),
        ("dispatch", 4),
        ("batch", 5),
        ("flags", 3),
        ("dispatch", 5),
        ("batch", 6),
        ("wait", 4),
        ("flags", 4),
        ("dispatch", 6),
        ("batch", 7),
        ("wait", 5),
        ("flags", 5),
        ("read", 4),
        ("read", 5),
        ("read", 6),
        ("dispatch", 7),
        ("flags", 6),
        ("read", 7),
    ]
    assert _collapsed(events) == expected
    # every step's loss is in the result, as the step computed it
    assert result.losses == [float(np.asarray(x)) for x in step_losses] and len(result.losses) == 7
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["train/loss"]) for r in rows] == [
        (3, result.losses[2]),
        (6, result.losses[5]),
        (7, result.losses[6]),
    ]
    assert all(r["train/tokens_per_s"] > 0 and r["train/step_time_s"] > 0 for r in rows)


def test_a_checkpoint_is_a_read_point(corpus, tmp_path, observed):
    events, _ = observed
    train(
        _cfg(
            corpus,
            tmp_path / "run",
            **{"trainer.num_train_steps": 4, "trainer.log_interval": 0, "checkpoint.interval": 2},
        )
    )
    # no log lines: the checkpoint after step 2 and the end are the only read points; step 2's
    # NaN check is done before its checkpoint is written
    assert _collapsed(events) == [
        ("batch", 1),
        ("dispatch", 1),
        ("batch", 2),
        ("dispatch", 2),
        ("batch", 3),
        ("wait", 1),
        ("flags", 1),
        ("read", 1),
        ("read", 2),
        ("dispatch", 3),
        ("batch", 4),
        ("flags", 2),
        ("dispatch", 4),
        ("wait", 3),
        ("flags", 3),
        ("read", 3),
        ("read", 4),
    ]


def test_stop_names_the_first_bad_step_when_read_later(corpus, tmp_path):
    run_dir = tmp_path / "run"
    cfg = _cfg(
        corpus,
        run_dir,
        **EXPLODE,
        **{"trainer.nan_policy": "stop", "trainer.num_train_steps": 6, "trainer.log_interval": 4},
    )
    # steps 2..4 are all non-finite and are first read after step 4: the error names step 2
    with pytest.raises(
        TrainingError,
        match=r"non-finite loss or gradient in step 2 \(loss=nan.*nan_policy=stop.*"
        r"the last committed checkpoint is None",
    ):
        train(cfg)
    assert not (run_dir / "metrics.jsonl").exists() or (run_dir / "metrics.jsonl").read_text() == ""


def test_skip_reports_every_bad_step_of_the_window(corpus, tmp_path):
    run_dir = tmp_path / "run"
    result = train(
        _cfg(
            corpus,
            run_dir,
            **EXPLODE,
            **{"trainer.nan_policy": "skip", "trainer.num_train_steps": 4, "trainer.log_interval": 4},
        )
    )
    assert math.isfinite(result.losses[0]) and all(math.isnan(x) for x in result.losses[1:]) and len(result.losses) == 4
    log = (run_dir / "logs" / "process_0.log").read_text()
    assert [s for s in range(1, 5) if f"non-finite loss or gradient in step {s} " in log] == [2, 3, 4]
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(result.model))


@pytest.mark.slow
def test_float16_trains_with_dynamic_loss_scaling(corpus, tmp_path):
    """float16 compute with trainer.loss_scale=dynamic: the scale starts at 2**15 and is halved on each
    overflowing step (skipped, parameters unchanged), the loss is finite and falls."""
    result = train(
        _cfg(
            corpus,
            tmp_path / "run",
            **{
                "trainer.precision": "params=float32,compute=float16,output=float32",
                "trainer.loss_scale": "dynamic",
                "trainer.num_train_steps": 8,
                "optimizer.learning_rate": 3e-3,
            },
        )
    )
    _, scaler = result.opt_state
    assert all(math.isfinite(x) for x in result.losses) and result.losses[-1] < result.losses[0]
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(result.model))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "train/loss_scale" in r]
    assert logged, rows[:1]
    # every skipped step halved the scale (2000 finite steps would double it: none here)
    skipped = sum(r["train/skipped_steps"] for r in logged)
    assert float(scaler.loss_scale) == 2.0 ** (15 - skipped) and skipped < 8
