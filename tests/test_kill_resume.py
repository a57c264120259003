"""Crash safety, end to end: a real training run (the ``named-train`` CLI in a subprocess, a
tiny GPT-2 on 2 fake CPU devices with FSDP) is killed with SIGKILL at seeded random moments,
during steps and inside the window of an asynchronous checkpoint write, and resumed each
time with ``--trainer.load_checkpoint auto``. Every resume must start from the newest
*committed* checkpoint (never a partial one), every committed checkpoint must stay intact,
every logged loss must equal the uninterrupted run's, and the final checkpoint must equal
the uninterrupted run's bit for bit. Also: a corrupted or truncated checkpoint is named,
and auto-resume falls back past it.

Speed: one uninterrupted reference run fills a persistent JAX compilation cache that every
later process reads (a resume then costs ~2-3 s of CPU, mostly imports), and all runs
share one token cache; test_preemption.py and test_s3_checkpoints.py share the same reference run
and caches (made once a session, whichever pytest worker first needs them). Every run has the same
number of steps: the learning-rate schedule's constants are part of the compiled step, so a run of
12 steps compiles a step of its own (measured), unless ``optimizer.schedule_steps`` fixes them.

Every subprocess imports a snapshot of ``src/`` (and reads a copy of the YAML) taken when
the session first needs it: the comparison is bitwise, so all runs must execute the same code even
if the working tree is edited while the test runs.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest
from _procs import once, shared_dir, xla_flags

from named.trainer import checkpoint as ckpt
from named.trainer.config import load_config
from named.trainer.loop.optim import build_optimizer
from named.trainer.loop.registry import model_class

pytestmark = [pytest.mark.procs, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
STEPS = 45
INTERVAL = 3
N_KILLS = 12
WRITE_DELAY_S = 0.15  # per pause of a slowed save (_SLOW_WRITES)
SEED = 20240610

CORPUS = "\n".join(
    f"def function_{i}(x, y):\n    total = x * {i} + y\n    for k in range({i % 7 + 1}):\n        total += k\n    "
    "return total\n"
    for i in range(200)
)


def _args(workdir: Path, run_dir: Path, **over) -> list[str]:
    args = {
        "trainer.num_train_steps": STEPS,
        "trainer.train_batch_size": 4,
        "trainer.log_interval": 1,
        "trainer.eval_interval": 0,
        "trainer.sample_interval": 0,
        "trainer.progress_bar": "false",
        "trainer.run_dir": str(run_dir),
        "trainer.load_checkpoint": "auto",
        "model.n_layer": 1,
        "model.n_head": 2,
        "model.n_embd": 16,
        "model.n_positions": 32,
        "mesh.shape": "{data: 2}",
        "mesh.param_mapping": "{embed: data}",
        "mesh.compute_mapping": "{batch: data}",
        "data.train": f"[{workdir / 'code.txt'}]",
        "data.seq_len": 16,
        "data.val_fraction": 0.0,
        "data.cache_dir": str(workdir / "token-cache"),
        "optimizer.warmup_steps": 2,
        "optimizer.learning_rate": 0.003,
        "checkpoint.interval": INTERVAL,
        "checkpoint.keep_last": 2,
        "tracker.console": "false",
    }
    args.update(over)
    out = ["--config_path", str(workdir / "gpt2_nano.yaml")]
    for k, v in args.items():
        out += [f"--{k}", str(v)]
    return out


def _env(workdir: Path) -> dict:
    env = dict(os.environ)
    env.update(
        {
            "XLA_FLAGS": xla_flags(2),
            "JAX_PLATFORMS": "cpu",
            # The persistent compilation cache works on CPU in jax 0.10; the thresholds make it
            # keep every program, so only the reference run compiles.
            "JAX_COMPILATION_CACHE_DIR": str(workdir / "jax-cache"),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
            "PYTHONWARNINGS": "default::UserWarning",
            "PYTHONUNBUFFERED": "1",  # the log of a killed process must hold what it printed
            "PYTHONPATH": os.pathsep.join([str(workdir / "src"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        }
    )
    return env


_MAIN = "import sys; from named.trainer.commands.cli import main_train; sys.exit(main_train())"
# A run killed inside a save's write window on purpose: the child wraps the real functions of the
# write path, so that the background writer sleeps before each array it writes (a local folder or
# objects), before the commit record (every chunk written) and after it (the record written; a
# local folder not yet renamed, an object store's stale objects not yet deleted).
_SLOW_WRITES = """
import time
from named.trainer.checkpoint import write

real_write_leaf, real_write_json, real_write_objects = write.write_leaf, write.write_json, write.write_objects

def write_leaf(*args, **kwargs):
    time.sleep({delay})
    return real_write_leaf(*args, **kwargs)

def write_json(path, obj):
    record = path.name == write.COMMIT_FILE
    time.sleep({delay} if record else 0)
    real_write_json(path, obj)
    time.sleep({delay} if record else 0)

def write_objects(folder, blobs):
    time.sleep({delay})
    real_write_objects(folder, blobs)
    time.sleep({delay} if write.COMMIT_FILE in blobs else 0)

write.write_leaf, write.write_json, write.write_objects = write_leaf, write_json, write_objects
"""


def _main(write_delay: float | None = None) -> str:
    """The child's program: named-train, its saves slowed by ``write_delay`` seconds a pause."""
    return (_SLOW_WRITES.format(delay=write_delay) if write_delay else "") + _MAIN


def _start(workdir: Path, run_dir: Path, log: Path, write_delay: float | None = None, **over) -> subprocess.Popen:
    out = open(log, "w")
    try:
        return subprocess.Popen(
            [sys.executable, "-c", _main(write_delay), *_args(workdir, run_dir, **over)],
            cwd=ROOT,
            env=_env(workdir),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    finally:
        out.close()


def _run(workdir: Path, run_dir: Path, log: Path, **over) -> str:
    proc = _start(workdir, run_dir, log, **over)
    rc = proc.wait(timeout=300)
    text = log.read_text()
    assert rc == 0, text[-3000:]
    return text


def test_runs_import_the_snapshot(workdir):
    code = (
        "import importlib.util as u; "
        "print(*(u.find_spec(m).origin for m in ('named.trainer', 'named.models', 'named')))"
    )
    r = subprocess.run([sys.executable, "-c", code], env=_env(workdir), capture_output=True, text=True, check=True)
    assert r.stdout.split() == [str(workdir / "src" / "named" / p / "__init__.py") for p in ("trainer", "models", ".")]


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    """One snapshot, token cache and compilation cache for the session, shared by this module,
    test_preemption.py and test_s3_checkpoints.py on whichever pytest worker runs them (the folder
    above each xdist worker's own temporary folder)."""
    d = shared_dir(tmp_path_factory, "kill")
    with once(d / ".snapshot") as first:
        if first:
            (d / "code.txt").write_text(CORPUS)
            # The installed layout (pyproject's package-dir): src/models and src/trainer become
            # named.models and named.trainer.
            skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
            shutil.copytree(ROOT / "src" / "named", d / "src" / "named", ignore=skip)
            for sub in ("models", "trainer"):
                shutil.copytree(ROOT / "src" / sub, d / "src" / "named" / sub, ignore=skip)
            shutil.copy(ROOT / "config/gpt2_nano.yaml", d / "gpt2_nano.yaml")
    return d


@pytest.fixture(scope="session")
def reference(workdir) -> Path:
    """The uninterrupted run (it also fills the compilation and token caches), made once a session
    for this module, test_preemption.py and test_s3_checkpoints.py: the runs compared with it never write into it (the
    tests that damage a checkpoint copy it first)."""
    run_dir = workdir / "reference"
    with once(workdir / ".reference") as first:
        if first:
            _run(workdir, run_dir, workdir / "reference.log")
    return run_dir


def _committed(run_dir: Path) -> list[int]:
    return [s for s, _ in ckpt.list_checkpoints(run_dir)]


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # the last line of a killed run may be cut short
        if "train/loss" in row:
            rows.append((row["step"], row["train/loss"]))
    return rows


def _files(path: Path) -> dict:
    return ckpt.verify_checkpoint(path)["files"]  # each file's checksum and size


def _restore_numpy(run_dir: Path, step: int, workdir: Path):
    """The checkpoint's model and optimizer state as host numpy arrays, via trainer.checkpoint.restore."""
    cfg = load_config(workdir / "gpt2_nano.yaml", _args(workdir, run_dir)[2:])
    model_cfg = cfg.model.model_config(vocab_size=384)
    cls = model_class(model_cfg)
    shapes = jax.eval_shape(lambda: cls.init(model_cfg, key=jax.random.key(0)))
    opt = jax.eval_shape(build_optimizer(cfg.optimizer, cfg.trainer.num_train_steps).init, shapes)
    target = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), (shapes, opt))
    tree, meta = ckpt.restore(run_dir / "checkpoints" / f"step_{step}", target)
    assert meta["step"] == step
    return tree


def _wait_for(cond, proc: subprocess.Popen, timeout: float = 120.0) -> bool:
    """Poll ``cond`` until true; False if the process ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.003)
    raise AssertionError("the training process made no progress in time")


def _partial_saves(run_dir: Path) -> list[str]:
    d = run_dir / "checkpoints"
    return sorted(p.name for p in d.iterdir() if ".tmp-" in p.name) if d.is_dir() else []


def _resumed_step(log_text: str) -> int | None:
    m = re.search(r"resumed from (\S+) at step (\d+)", log_text)
    if m is None:
        return None
    assert re.fullmatch(r".*/checkpoints/step_\d+", m.group(1)), m.group(1)  # never a .tmp- directory
    return int(m.group(2))


def test_sigkill_at_random_moments_resumes_exactly(workdir, reference):
    ref_losses = dict(_losses(reference))
    assert sorted(ref_losses) == list(range(1, STEPS + 1))
    ref_files = _files(reference / "checkpoints" / f"step_{STEPS}")

    rng = random.Random(SEED)
    kills: list[dict] = []
    campaigns = 0
    while len(kills) < N_KILLS:  # a campaign is one run dir, killed until it completes
        campaigns += 1
        run_dir = workdir / f"killed-{campaigns}"
        cycle = 0
        while True:
            cycle += 1
            log = workdir / f"killed-{campaigns}-{cycle}.log"
            before = _committed(run_dir)
            start = before[-1] if before else 0
            metrics_rows = len(_losses(run_dir))
            leftovers = set(_partial_saves(run_dir))  # of earlier killed processes
            mode = "finish" if len(kills) >= N_KILLS else rng.choice(["step", "write"])
            proc = _start(workdir, run_dir, log, write_delay=WRITE_DELAY_S if mode == "write" else None)
            kill = {"mode": mode, "start": start}
            if mode == "step":
                # some steps after the resumed one, plus a random fraction of a step
                target = min(start + rng.randint(1, 8), STEPS - 1)
                reached = _wait_for(lambda: any(s >= target for s, _ in _losses(run_dir)[metrics_rows:]), proc)
                time.sleep(rng.uniform(0.0, 0.02))
            elif mode == "write":
                # inside the write window of the first or the second save of this process
                save = start + INTERVAL * rng.randint(1, 2)
                if save > STEPS:
                    save = start + INTERVAL
                reached = _wait_for(
                    lambda: any(n.startswith(f"step_{save}.tmp-") for n in set(_partial_saves(run_dir)) - leftovers),
                    proc,
                )
                time.sleep(rng.uniform(0.0, 3 * WRITE_DELAY_S))
            else:
                reached = False
            if reached and proc.poll() is None:
                kill["partial"] = sorted(set(_partial_saves(run_dir)) - leftovers)  # this process's save in flight
                proc.send_signal(signal.SIGKILL)
                assert proc.wait(timeout=60) == -signal.SIGKILL
            else:
                assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
            text = log.read_text()
            # the resume came from the newest committed checkpoint before this process started
            assert _resumed_step(text) == (start or None), (start, text[-2000:])
            # every committed checkpoint is whole; the newest is what auto-resume will take
            after = _committed(run_dir)
            for s in after:
                ckpt.verify_checkpoint(run_dir / "checkpoints" / f"step_{s}")
            with warnings.catch_warnings():
                warnings.simplefilter("error", ckpt.CheckpointWarning)  # nothing corrupted to skip
                latest = ckpt.latest_checkpoint(run_dir)
            assert (latest.name if latest else None) == (f"step_{after[-1]}" if after else None)
            assert not after or after[-1] >= start  # a kill never loses a commit
            if proc.returncode != 0:
                kill["committed_after"] = after[-1] if after else 0
                kills.append(kill)
                continue
            break
        # the campaign completed: every logged loss equals the reference's, the final state is bitwise equal
        for s, loss in _losses(run_dir):
            assert loss == ref_losses[s], (s, loss, ref_losses[s])
        assert _committed(run_dir)[-1] == STEPS
        assert _files(run_dir / "checkpoints" / f"step_{STEPS}") == ref_files
        got = _restore_numpy(run_dir, STEPS, workdir)
        want = _restore_numpy(reference, STEPS, workdir)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(a, b, strict=True)
        assert len(jax.tree.leaves(got)) > 10

    modes = [k["mode"] for k in kills]
    in_write = [k for k in kills if k["partial"]]
    print(f"\n{len(kills)} SIGKILLs in {campaigns} campaign(s): {modes}")
    print(
        f"resumed from steps {[k['start'] for k in kills]}; killed "
        f"with its own partial save on disk {len(in_write)} times"
    )
    assert len(kills) >= N_KILLS
    assert "step" in modes and "write" in modes
    assert len(in_write) >= 3  # a partial checkpoint was on disk at the kill, and was never resumed from
    assert len({k["start"] for k in kills}) >= 3  # resumed from several different checkpoints (and from none)


# ---- integrity: corrupted and truncated checkpoints ------------------------------------------


def _chunk_files(step_dir: Path) -> list[Path]:
    return sorted(p for p in (step_dir / "arrays").rglob("*") if p.is_file() and p.name != "zarr.json")


def test_corrupted_and_truncated_checkpoints_are_named(workdir, reference, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    last = run_dir / "checkpoints" / f"step_{STEPS}"
    prev = run_dir / "checkpoints" / f"step_{STEPS - INTERVAL}"
    assert ckpt.latest_checkpoint(run_dir) == last
    commit = json.loads((last / "commit.json").read_text())
    assert commit["step"] == STEPS and commit["metadata"]["data_step"] == STEPS
    assert all(len(info["crc32c"]) == 8 for info in commit["files"].values())

    flipped = _chunk_files(last)[0]
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0xFF
    flipped.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match=re.escape(str(flipped))):
        ckpt.verify_checkpoint(last)
    with pytest.raises(ckpt.CheckpointError, match=re.escape(str(flipped))):
        _restore_numpy(run_dir, STEPS, workdir)
    with pytest.warns(ckpt.CheckpointWarning, match=re.escape(str(flipped))):
        assert ckpt.latest_checkpoint(run_dir) == prev

    truncated = _chunk_files(prev)[-1]
    truncated.write_bytes(truncated.read_bytes()[:-4])
    with pytest.raises(ckpt.CheckpointError, match=re.escape(str(truncated)) + ".*truncated"):
        ckpt.verify_checkpoint(prev)
    with pytest.warns(ckpt.CheckpointWarning) as record:
        assert ckpt.latest_checkpoint(run_dir) is None
    assert str(flipped) in str(record[0].message) and str(truncated) in str(record[0].message)

    missing = _chunk_files(prev)[0]
    missing.unlink()
    with pytest.raises(ckpt.CheckpointError, match=re.escape(str(missing)) + " is missing"):
        ckpt.verify_checkpoint(prev)

    commit_file = last / "commit.json"
    commit_file.write_text(commit_file.read_text().replace(f'"step": {STEPS}', f'"step": {STEPS + 1}'))
    with pytest.raises(ckpt.CheckpointError, match=re.escape(str(commit_file)) + ".*commit_sha256"):
        ckpt.verify_checkpoint(last)


def test_auto_resume_skips_a_corrupted_checkpoint_and_rewrites_it(workdir, reference, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    (run_dir / "metrics.jsonl").unlink()
    bad = _chunk_files(run_dir / "checkpoints" / f"step_{STEPS}")[-1]
    data = bytearray(bad.read_bytes())
    data[0] ^= 0x01
    bad.write_bytes(bytes(data))

    text = _run(workdir, run_dir, tmp_path / "resume.log")
    assert "CheckpointWarning" in text and str(bad) in text
    assert _resumed_step(text) == STEPS - INTERVAL
    # the last INTERVAL steps were redone exactly, and the corrupted step was replaced by a good one
    ref_losses = dict(_losses(reference))
    redone = _losses(run_dir)
    assert [s for s, _ in redone] == list(range(STEPS - INTERVAL + 1, STEPS + 1))
    assert all(loss == ref_losses[s] for s, loss in redone)
    assert _files(run_dir / "checkpoints" / f"step_{STEPS}") == _files(reference / "checkpoints" / f"step_{STEPS}")
    assert not [p for p in (run_dir / "checkpoints").iterdir() if not re.fullmatch(r"step_\d+", p.name)]


def test_a_killed_mixture_run_resumes_with_the_same_batches(workdir):
    """A weighted mixture of two sources (issue: data at real scale): killed mid-run and resumed,
    every logged loss and the final checkpoint equal the uninterrupted mixture run's, bit for
    bit; the batch of a step depends on (seed, step) alone, whichever process reads it when."""
    lines = CORPUS.splitlines(keepends=True)
    (workdir / "mix_a.txt").write_text("".join(lines[: len(lines) // 2]))
    (workdir / "mix_b.txt").write_text("".join(lines[len(lines) // 2 :]).upper())
    mix = {
        "data.train": f"[{{name: a, paths: [{workdir / 'mix_a.txt'}], weight: 3}}, "
        f"{{name: b, paths: [{workdir / 'mix_b.txt'}], weight: 1}}]"
    }
    reference = workdir / "mix-reference"
    text = _run(workdir, reference, workdir / "mix-reference.log", **mix)
    ref_losses = dict(_losses(reference))
    assert sorted(ref_losses) == list(range(1, STEPS + 1)), text[-2000:]
    tokens = [json.loads(x) for x in (reference / "metrics.jsonl").read_text().splitlines()]
    assert any("train/tokens/a" in row and "train/tokens/b" in row for row in tokens)  # both sources were read

    run_dir = workdir / "mix-killed"
    proc = _start(workdir, run_dir, workdir / "mix-killed-1.log", **mix)
    target = 2 * INTERVAL + 2  # past two committed checkpoints, between saves
    assert _wait_for(lambda: any(s >= target for s, _ in _losses(run_dir)), proc)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    resumed = _run(workdir, run_dir, workdir / "mix-killed-2.log", **mix)
    start = _resumed_step(resumed)
    assert start is not None and INTERVAL <= start <= target, resumed[-2000:]
    assert dict(_losses(run_dir)) == ref_losses  # every step, before and after the kill
    assert [s for s, _ in _losses(run_dir)] == sorted(ref_losses)  # ... once each: the replayed ones were dropped
    assert _files(run_dir / "checkpoints" / f"step_{STEPS}") == _files(reference / "checkpoints" / f"step_{STEPS}")
