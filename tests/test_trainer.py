"""The trainer end to end on 8 fake devices: loss falls, exact resume, restore onto another
mesh, gradient accumulation, and the CLI in a subprocess."""

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

import named as nm
from named.trainer import checkpoint as ckpt
from named.trainer.config import load_config
from named.trainer.loop.train import train

ROOT = Path(__file__).resolve().parents[1]

CORPUS = "\n".join(
    f"def function_{i}(x, y):\n    total = x * {i} + y\n    for k in range({i % 7 + 1}):\n        total += k\n    "
    "return total\n"
    for i in range(400)
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    (d / "code.txt").write_text(CORPUS)
    return d


def tiny_args(corpus: Path, run_dir: Path, **over) -> list[str]:
    args = {
        "trainer.num_train_steps": 20,
        "trainer.train_batch_size": 16,
        "trainer.log_interval": 5,
        "trainer.eval_interval": 0,
        "trainer.sample_interval": 0,
        "trainer.progress_bar": "false",
        "trainer.run_dir": str(run_dir),
        "model.n_layer": 2,
        "model.n_head": 2,
        "model.n_embd": 32,
        "model.n_positions": 64,
        "data.train": f"[{corpus / 'code.txt'}]",
        "data.seq_len": 32,
        "data.val_fraction": 0.05,
        "data.cache_dir": str(corpus / "cache"),
        "optimizer.warmup_steps": 2,
        "optimizer.learning_rate": 0.003,
        "checkpoint.interval": 0,
        "tracker.console": "false",
    }
    args.update(over)
    out = []
    for k, v in args.items():
        out += [f"--{k}", str(v)]
    return out


FSDP = {"mesh.shape": "{data: 8}", "mesh.param_mapping": "{embed: data}", "mesh.compute_mapping": "{batch: data}"}


def run(corpus, run_dir, config="config/gpt2_nano.yaml", **over):
    cfg = load_config(ROOT / config, tiny_args(corpus, run_dir, **over))
    return train(cfg)


@pytest.fixture(scope="module")
def fsdp_run(corpus, tmp_path_factory):
    """20 steps under FSDP, a checkpoint at the end: the uninterrupted run the resume and the restore
    onto another mesh start from or compare with (the tests that continue it copy its folder)."""
    return run(corpus, tmp_path_factory.mktemp("fsdp") / "run", **FSDP)


def test_fsdp_run_learns_and_shards(fsdp_run):
    result = fsdp_run
    losses = result.losses
    assert len(losses) == 20
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5, losses
    named = [x for x in jax.tree.leaves(result.model, is_leaf=nm.is_named_array) if isinstance(x, nm.NamedArray)]
    with_embed = [x.array for x in named if "embed" in x.names]
    assert len(with_embed) >= 5
    # FSDP ({embed: data}): every weight with an embed axis is split, so a device holds 1/8 of it.
    for x in with_embed:
        assert x.addressable_shards[0].data.size * 8 == x.size
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [5, 10, 15, 20]
    assert all(r["train/tokens_per_s"] > 0 for r in rows if "train/loss" in r)
    assert (result.run_dir / "checkpoints" / "step_20" / "commit.json").exists()


@pytest.mark.slow  # the 20-step FSDP run
def test_a_run_leaves_no_logging_behind(fsdp_run):
    """The run's log handlers end with it: its log file is complete and closed, and the trainer's
    logger is as in a new process. (A console handler left on a finished run's stdout made a later
    in-process run print "--- Logging error ---" once pytest had closed that stream.)"""
    import logging

    logger = logging.getLogger("named.trainer")
    assert logger.handlers == [] and logger.propagate and logger.level == logging.NOTSET
    assert "step 1 (the first)" in (fsdp_run.run_dir / "logs" / "process_0.log").read_text()


def test_resume_reproduces_uninterrupted_run(corpus, tmp_path, fsdp_run):
    full = fsdp_run
    first = run(
        corpus,
        tmp_path / "split",
        **{**FSDP, "trainer.num_train_steps": 20, "checkpoint.interval": 10, "checkpoint.save_at_end": "false"},
    )
    # Pretend the first run died after step 10: drop everything after the step-10 checkpoint.
    ck = tmp_path / "split" / "checkpoints"
    assert sorted(p.name for p in ck.iterdir()) == ["step_10"]
    metrics = tmp_path / "split" / "metrics.jsonl"
    with open(metrics, "a") as f:  # it logged steps 15 and 20 past its checkpoint, and died writing a line
        f.write('{"step": 21, "train/lo')
    resumed = run(corpus, tmp_path / "split", **{**FSDP, "trainer.load_checkpoint": "auto"})
    assert first.losses[:10] == full.losses[:10]
    assert resumed.losses == full.losses[10:]
    # metrics.jsonl holds each step once: the rows past step 10 are the resumed run's
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [(r["step"], r["train/loss"]) for r in rows] == [
        (5, first.losses[4]),
        (10, first.losses[9]),
        (15, resumed.losses[4]),
        (20, resumed.losses[9]),
    ]
    for a, b in zip(jax.tree.leaves(resumed.model), jax.tree.leaves(full.model)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_restore_onto_another_mesh(corpus, tmp_path, fsdp_run):
    eight = fsdp_run  # 20 steps on 8 devices, its final checkpoint at step 20
    shutil.copytree(eight.run_dir, tmp_path / "run")
    two_d = {
        "mesh.shape": "{data: 4, model: 2}",
        "mesh.param_mapping": "{embed: data, mlp: model, heads: model}",
        "mesh.compute_mapping": "{batch: data, mlp: model, heads: model}",
    }
    # two more steps on the run's schedule of 20 (a longer run must say which horizon it keeps)
    longer = {"trainer.num_train_steps": 22, "optimizer.schedule_steps": 20, "trainer.load_checkpoint": "auto"}
    more = run(corpus, tmp_path / "run", **{**two_d, **longer})
    assert len(more.losses) == 2
    # What the continued run started from: step 20 restored onto the 4x2 layout of its own state
    # is bitwise the 8-device run's final state, now split over model as well.
    (model20, opt20), meta = ckpt.restore(tmp_path / "run" / "checkpoints" / "step_20", (more.model, more.opt_state))
    assert meta["step"] == 20
    for restored, saved in zip(jax.tree.leaves((model20, opt20)), jax.tree.leaves((eight.model, eight.opt_state))):
        np.testing.assert_array_equal(np.asarray(restored), np.asarray(saved))
    w = [x for x in jax.tree.leaves(model20) if hasattr(x, "sharding") and x.ndim >= 2]
    assert any("model" in str(x.sharding.spec) for x in w)


def test_gradient_accumulation_equals_full_batch(corpus, tmp_path):
    one = run(corpus, tmp_path / "a", **{**FSDP, "trainer.num_train_steps": 4})
    four = run(
        corpus,
        tmp_path / "b",
        **{**FSDP, "trainer.num_train_steps": 4, "trainer.microbatches": 2, "mesh.shape": "{data: 8}"},
    )
    np.testing.assert_allclose(four.losses, one.losses, rtol=1e-6)
    # Parameters agree to 1e-4, not bitwise: the attention key bias has an exactly-zero true
    # gradient (softmax ignores a constant shift of the keys), so its gradient is float noise
    # that depends on the summation order, and Adam scales that noise up to real-sized updates.
    for a, b in zip(jax.tree.leaves(four.model), jax.tree.leaves(one.model)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-4)
