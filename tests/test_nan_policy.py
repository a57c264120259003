"""Non-finite losses and gradients: ``trainer.nan_policy: stop`` ends the run with an error
naming the step (exit code 2 from the CLI), ``skip`` drops the update so that parameters
and optimizer state stay bitwise what they were.

The NaN comes from real mechanisms, not a test hook: a weight set to inf (fed straight to
``make_train_step``), and a learning rate of 1e30 in a real run, whose first update makes
the weights ~1e30 so that every later forward pass overflows. And a finite loss and gradient
with a non-finite update (a NaN learning rate, an optimizer whose state goes NaN): the check
looks at the update, the new parameters and the new optimizer state too.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _procs import xla_flags

import named as nm
from named.trainer import checkpoint as ckpt
from named.trainer.config import load_config
from named.trainer.data import pack
from named.trainer.loop.cadence import TrainingError, check_finite
from named.trainer.loop.checks import Setup
from named.trainer.loop.optim import build_optimizer
from named.trainer.loop.registry import model_class
from named.trainer.loop.stop import StopRequests
from named.trainer.loop.train import device_batch, make_train_step, train

ROOT = Path(__file__).resolve().parents[1]
NANO = ROOT / "config/gpt2_nano.yaml"
CORPUS = "\n".join(f"def g_{i}(a, b):\n    return a - b * {i}\n" for i in range(300))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("nan")
    (d / "code.txt").write_text(CORPUS)
    return d


def _args(corpus: Path, run_dir: Path, **over) -> list[str]:
    args = {
        "trainer.num_train_steps": 4,
        "trainer.train_batch_size": 8,
        "trainer.log_interval": 1,
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
        "checkpoint.interval": 1,
        "checkpoint.keep_last": 10,
        "tracker.console": "false",
    }
    args.update(over)
    return [x for k, v in args.items() for x in (f"--{k}", str(v))]


# A learning rate that makes the second step overflow (Adam's first update is ~lr per weight).
EXPLODE = {"optimizer.learning_rate": 1e30, "optimizer.schedule": "constant"}


def test_check_finite():
    ok = {"finite": np.bool_(True), "loss": np.float32(2.0), "grad_norm": np.float32(1.0)}
    bad = {"finite": np.bool_(False), "loss": np.float32(np.nan), "grad_norm": np.float32(np.inf)}
    assert check_finite(7, ok, "stop") and check_finite(7, ok, "skip")
    with pytest.raises(TrainingError, match=r"step 7 \(loss=nan, grad_norm=inf\).*nan_policy=stop.*checkpoint is None"):
        check_finite(7, bad, "stop")
    with pytest.raises(TrainingError, match=r"the last committed checkpoint is runs/x/checkpoints/step_6"):
        check_finite(7, bad, "stop", lambda: "runs/x/checkpoints/step_6")
    assert check_finite(7, bad, "skip") is False


def _setup(model_cfg, mesh, compute, param) -> Setup:
    # what make_train_step reads of a run's setup; no tokenizer or shapes: the step needs neither
    return Setup(
        tokenizer=None,
        model_cfg=model_cfg,
        model_cls=model_class(model_cfg),
        shapes=None,
        mesh=mesh,
        compute_mapping=compute,
        param_mapping=param,
    )


def test_skip_leaves_parameters_and_optimizer_state_untouched(corpus, tmp_path):
    cfg = load_config(NANO, _args(corpus, tmp_path / "unused", **{"trainer.nan_policy": "skip"}))
    model_cfg = cfg.model.model_config(vocab_size=384)
    cls = model_class(model_cfg)
    optimizer = build_optimizer(cfg.optimizer, cfg.trainer.num_train_steps)
    mesh, compute, param = nm.make_mesh({"data": -1}), {"batch": "data"}, {"embed": "data"}
    tokens = np.random.default_rng(0).integers(0, 256, (8, 16))
    with nm.set_mesh(mesh):
        model = nm.named_jit(cls.init, mapping=param)(model_cfg, key=jax.random.key(0))
        opt_state = nm.named_jit(optimizer.init, mapping=param)(model)
        step = make_train_step(cfg, _setup(model_cfg, mesh, compute, param), optimizer)
        batch = lambda: device_batch(pack(tokens, 256), mesh, compute, 8)  # noqa: E731 (donated each call)
        flags = StopRequests([], None, mesh).flags()  # no signal, no time-based checkpoint

        # one finite step first: its optimizer state has non-zero moments worth protecting
        model, opt_state, metrics = step(model, opt_state, batch(), jax.random.key(1), flags)
        assert bool(metrics["finite"])
        w = model.wte.weight
        poisoned = nm.NamedArray(w.array.at[3, 5].set(jnp.inf), w.axes)  # token 3 is in the batch
        model = eqx.tree_at(lambda m: m.wte.weight, model, poisoned)
        before = [np.array(x) for x in jax.tree.leaves((model, opt_state))]
        assert any(np.isinf(b).any() for b in before)
        model, opt_state, metrics = step(model, opt_state, batch(), jax.random.key(2), flags)
        after = [np.asarray(x) for x in jax.tree.leaves((model, opt_state))]
    assert not bool(metrics["finite"]) and not math.isfinite(float(metrics["loss"]))
    assert len(after) == len(before) > 10
    for a, b in zip(after, before):
        np.testing.assert_array_equal(a, b, strict=True)
    assert sum(np.abs(b).sum() > 0 for b in before[len(jax.tree.leaves(model)) :]) > 10  # real Adam moments


def test_skip_in_a_real_run_keeps_the_state_of_the_last_finite_step(corpus, tmp_path):
    run_dir = tmp_path / "run"
    result = train(load_config(NANO, _args(corpus, run_dir, **EXPLODE, **{"trainer.nan_policy": "skip"})))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["train/loss"] for r in rows}
    assert math.isfinite(losses[1]) and all(math.isnan(losses[s]) for s in (2, 3, 4)), losses
    log = (run_dir / "logs" / "process_0.log").read_text()
    for s in (2, 3, 4):
        assert f"non-finite loss or gradient in step {s} " in log and "update skipped" in log
    # step_1 .. step_4 were saved after steps 1..4: the three skipped steps changed no bit of
    # the model or the optimizer state (the files' checksums and sizes are equal)
    files = [ckpt.verify_checkpoint(run_dir / "checkpoints" / f"step_{s}")["files"] for s in (1, 2, 3, 4)]
    assert len(files[0]) > 10 and files[1] == files[0] and files[2] == files[0] and files[3] == files[0]
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(result.model))


@pytest.mark.procs
def test_stop_from_the_cli_names_the_step_and_exits_2(corpus, tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "XLA_FLAGS": xla_flags(2), "JAX_PLATFORMS": "cpu"}
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from named.trainer.commands.cli import main_train; sys.exit(main_train())",
            "--config_path",
            str(NANO),
            *_args(corpus, run_dir, **EXPLODE, **{"trainer.nan_policy": "stop"}),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 2, r.stderr[-3000:]
    assert "error: non-finite loss or gradient in step 2 (loss=nan" in r.stderr, r.stderr[-3000:]
    assert "trainer.nan_policy=stop" in r.stderr and "Traceback" not in r.stderr
    # the checkpoint of the last good step is committed and named in the message
    assert f"the last committed checkpoint is {run_dir / 'checkpoints' / 'step_1'}" in r.stderr
    assert [s for s, _ in ckpt.list_checkpoints(run_dir)] == [1]
    ckpt.verify_checkpoint(run_dir / "checkpoints" / "step_1")


# ---- a finite loss and gradient with a non-finite update -----------------------------------
# Config validation refuses a NaN learning rate; these set it on the dataclass afterwards, to
# test that the step itself never commits a non-finite update whatever lets one through.


def _state_scaler(factor: float) -> optax.GradientTransformation:
    """Keeps a scalar in the optimizer state, multiplied by ``factor`` at each update: a NaN
    factor makes the optimizer state non-finite while the update stays finite."""
    return optax.GradientTransformation(lambda params: jnp.ones(()), lambda u, state, params=None: (u, state * factor))


def _optimizers(cfg, how: str):
    """(a good optimizer, one whose step is non-finite in ``how``), with the same state structure."""
    steps = cfg.trainer.num_train_steps
    if how == "nan learning rate":
        return (
            build_optimizer(cfg.optimizer, steps),
            build_optimizer(dataclasses.replace(cfg.optimizer, learning_rate=float("nan")), steps),
        )
    return (
        optax.chain(build_optimizer(cfg.optimizer, steps), _state_scaler(1.0)),
        optax.chain(build_optimizer(cfg.optimizer, steps), _state_scaler(float("nan"))),
    )


@pytest.mark.parametrize("how", ["nan learning rate", "nan optimizer state"])
def test_skip_drops_a_non_finite_update_of_a_finite_step(corpus, tmp_path, how):
    cfg = load_config(NANO, _args(corpus, tmp_path / "unused", **{"trainer.nan_policy": "skip"}))
    model_cfg = cfg.model.model_config(vocab_size=384)
    cls = model_class(model_cfg)
    good, bad = _optimizers(cfg, how)
    mesh, compute, param = nm.make_mesh({"data": -1}), {"batch": "data"}, {"embed": "data"}
    tokens = np.random.default_rng(0).integers(0, 256, (8, 16))
    setup = _setup(model_cfg, mesh, compute, param)
    with nm.set_mesh(mesh):
        model = nm.named_jit(cls.init, mapping=param)(model_cfg, key=jax.random.key(0))
        opt_state = nm.named_jit(good.init, mapping=param)(model)
        batch = lambda: device_batch(pack(tokens, 256), mesh, compute, 8)  # noqa: E731 (donated each call)
        flags = StopRequests([], None, mesh).flags()  # no signal, no time-based checkpoint
        model, opt_state, metrics = make_train_step(cfg, setup, good)(
            model, opt_state, batch(), jax.random.key(1), flags
        )
        assert bool(metrics["finite"])  # real Adam moments to protect
        before = [np.array(x) for x in jax.tree.leaves((model, opt_state))]
        model, opt_state, metrics = make_train_step(cfg, setup, bad)(
            model, opt_state, batch(), jax.random.key(2), flags
        )
        after = [np.asarray(x) for x in jax.tree.leaves((model, opt_state))]
    # the loss and gradient were fine; the update was not, and it was dropped whole
    assert math.isfinite(float(metrics["loss"])) and math.isfinite(float(metrics["grad_norm"]))
    assert not bool(metrics["finite"])
    assert len(after) == len(before) > 10 and all(np.isfinite(b).all() for b in before)
    for a, b in zip(after, before):
        np.testing.assert_array_equal(a, b, strict=True)
    assert check_finite(2, metrics, "skip") is False
    with pytest.raises(TrainingError, match=r"non-finite update in step 2: .*nan_policy=stop"):
        check_finite(2, metrics, "stop")


def _nan_lr_run(corpus: Path, run_dir: Path, policy: str):
    cfg = load_config(
        NANO,
        _args(
            corpus,
            run_dir,
            **{"trainer.num_train_steps": 2, "optimizer.schedule": "constant", "trainer.nan_policy": policy},
        ),
    )
    cfg.optimizer.learning_rate = float("nan")
    return cfg


def test_a_nan_learning_rate_under_skip_commits_only_finite_checkpoints(corpus, tmp_path):
    run_dir = tmp_path / "run"
    cfg = _nan_lr_run(corpus, run_dir, "skip")
    result = train(cfg)
    log = (run_dir / "logs" / "process_0.log").read_text()
    assert all(f"non-finite update in step {s}: " in log for s in (1, 2)) and "update skipped" in log
    model_cfg = cfg.model.model_config(vocab_size=384)
    shapes = jax.eval_shape(lambda: model_class(model_cfg).init(model_cfg, key=jax.random.key(0)))
    target = jax.tree.map(
        lambda s: np.zeros(s.shape, s.dtype), (shapes, jax.eval_shape(build_optimizer(cfg.optimizer, 2).init, shapes))
    )
    for s in (1, 2):
        tree, _ = ckpt.restore(run_dir / "checkpoints" / f"step_{s}", target)
        leaves = jax.tree.leaves(tree)
        assert len(leaves) > 10 and all(np.isfinite(x).all() for x in leaves if np.issubdtype(x.dtype, np.floating))
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(result.model))


def test_a_nan_learning_rate_under_stop_names_the_step(corpus, tmp_path):
    with pytest.raises(TrainingError, match=r"non-finite update in step 1: .*stopped \(trainer.nan_policy=stop\)"):
        train(_nan_lr_run(corpus, tmp_path / "run", "stop"))
