"""Run directories are owned, and never silently written over.

A second launch on a run directory resumes the run it holds when the trajectory-defining
settings match, and otherwise is refused with every differing key named, leaving the first
run's files byte-identical (hashed). One run at a time holds ``<run_dir>/.lock``; a live
holder is named, a SIGKILLed one blocks nothing. Retention never prunes a run's own
checkpoints because of later ones. ``num_train_steps: 0`` checks everything and compiles and
writes nothing. A run directory that cannot be written is named before anything compiles.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _compiles import compiles
from _procs import xla_flags

from named.trainer import checkpoint as ckpt
from named.trainer import data as data_pkg
from named.trainer.checkpoint import rundir
from named.trainer.config import ConfigError, load_config
from named.trainer.data import DataError
from named.trainer.loop.train import train

ROOT = Path(__file__).resolve().parents[1]
CORPUS = "\n".join(f"def h_{i}(a, b):\n    return a * {i} + b\n" for i in range(300))
STEPS = 2


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("rundir")
    (d / "code.txt").write_text(CORPUS)
    return d


def _args(corpus: Path, run_dir: Path, **over) -> list[str]:
    # No YAML file: trainer.load_checkpoint is the dataclass default. A constant learning rate
    # makes the trajectory independent of num_train_steps, so 2 + 2 steps equal 4.
    args = {
        "trainer.num_train_steps": STEPS,
        "trainer.train_batch_size": 8,
        "trainer.log_interval": 1,
        "trainer.eval_interval": 0,
        "trainer.sample_interval": 0,
        "trainer.progress_bar": "false",
        "trainer.run_dir": str(run_dir),
        "model.type": "gpt2",
        "model.n_layer": 1,
        "model.n_head": 2,
        "model.n_embd": 16,
        "model.n_positions": 32,
        "data.train": f"[{corpus / 'code.txt'}]",
        "data.seq_len": 16,
        "data.val_fraction": 0.0,
        "data.cache_dir": str(corpus / "cache"),
        "optimizer.warmup_steps": 0,
        "optimizer.schedule": "constant",
        "optimizer.learning_rate": 0.003,
        "checkpoint.interval": 1,
        "checkpoint.keep_last": 10,
        "tracker.console": "false",
    }
    args.update(over)
    return [x for k, v in args.items() for x in (f"--{k}", str(v))]


def _cfg(corpus: Path, run_dir: Path, **over):
    return load_config(None, _args(corpus, run_dir, **over))


def _hashes(d: Path) -> dict[str, str]:
    return {
        str(p.relative_to(d)): (hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir")
        for p in sorted(d.rglob("*"))
    }


@contextlib.contextmanager
def _no_compile():
    with compiles() as seen:
        yield
    assert seen == [], f"compiled {seen}"


def _refused(exc, match: str, cfg, run_dir: Path) -> None:
    """``train(cfg)`` raises ``exc`` matching ``match``, compiles nothing and changes no byte of run_dir."""
    before = _hashes(run_dir) if run_dir.exists() else None
    with _no_compile(), pytest.raises(exc, match=match):
        train(cfg)
    assert (_hashes(run_dir) if run_dir.exists() else None) == before


@pytest.fixture(scope="module")
def first(corpus, tmp_path_factory) -> Path:
    """A finished 2-step run with checkpoints step_1 and step_2; tests copy it before touching it."""
    run_dir = tmp_path_factory.mktemp("first") / "run"
    result = train(_cfg(corpus, run_dir))
    assert len(result.losses) == STEPS and [s for s, _ in ckpt.list_checkpoints(run_dir)] == [1, 2]
    return run_dir


def _copy(first: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(first, run_dir)
    return run_dir


def test_second_run_with_the_default_config_resumes_and_replaces_nothing(corpus, first, tmp_path):
    full = train(_cfg(corpus, tmp_path / "full", **{"trainer.num_train_steps": 4}))
    run_dir = _copy(first, tmp_path)
    kept = {k: v for k, v in _hashes(run_dir).items() if k.startswith("checkpoints/") or k == "config.yaml"}
    resumed = train(_cfg(corpus, run_dir, **{"trainer.num_train_steps": 4}))
    # the losses continue the first run's trajectory: those of an uninterrupted 4-step run
    assert resumed.losses == full.losses[STEPS:]
    assert (
        f"resumed from {run_dir / 'checkpoints' / 'step_2'} at step 2"
        in (run_dir / "logs" / "process_0.log").read_text()
    )
    after = _hashes(run_dir)
    assert {k: after[k] for k in kept} == kept  # step_1, step_2 and config.yaml: not a byte changed
    assert [s for s, _ in ckpt.list_checkpoints(run_dir)] == [1, 2, 3, 4]
    assert "trainer.num_train_steps 2 -> 4" in (run_dir / "logs" / "process_0.log").read_text()


def test_an_auto_resume_reads_each_byte_once_and_falls_back_as_it_reads(corpus, first, tmp_path, monkeypatch):
    """Resuming reads the newest checkpoint once: no chunk file is hashed from the disk before
    or after the restore (only the small zarr.json files; the chunks are checked as they are read
    into the arrays, each once). A corrupted newest checkpoint, found by that read, is skipped with
    a warning naming the file, the one before it is resumed, and the metrics logged past it are
    dropped before the steps are trained again."""
    full = train(_cfg(corpus, tmp_path / "full", **{"trainer.num_train_steps": 3}))
    hashed, chunks = [], []
    real_hash, real_whole = ckpt.read.hash_file, ckpt.read.read_whole_chunk
    monkeypatch.setattr(
        ckpt.read, "hash_file", lambda path, *a, **k: hashed.append(Path(path).name) or real_hash(path, *a, **k)
    )
    monkeypatch.setattr(ckpt.read, "read_whole_chunk", lambda *a: chunks.append(a[1]) or real_whole(*a))
    run_dir = _copy(first, tmp_path / "whole")
    assert train(_cfg(corpus, run_dir, **{"trainer.num_train_steps": 3})).losses == full.losses[STEPS:]
    assert set(hashed) == {"zarr.json"} and chunks and len(chunks) == len(set(chunks))

    run_dir = _copy(first, tmp_path / "corrupted")
    bad = next(
        p for p in sorted((run_dir / "checkpoints" / "step_2" / "arrays").rglob("*")) if p.is_file() and p.name == "0"
    )
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    with pytest.warns(ckpt.CheckpointWarning, match=re.escape(str(bad))):
        resumed = train(_cfg(corpus, run_dir, **{"trainer.num_train_steps": 3}))
    assert resumed.losses == full.losses[1:]
    log_text = (run_dir / "logs" / "process_0.log").read_text()
    assert f"resumed from {run_dir / 'checkpoints' / 'step_1'} at step 1" in log_text
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3]


@pytest.mark.parametrize(
    "over, keys",
    [
        ({"trainer.seed": 1}, [r"trainer\.seed 0 -> 1"]),
        (
            {"optimizer.learning_rate": 0.01, "model.n_embd": 32},
            [r"model\.n_embd 16 -> 32", r"optimizer\.learning_rate 0\.003 -> 0\.01"],
        ),
    ],
)
def test_second_run_with_another_trajectory_is_refused(corpus, first, tmp_path, over, keys):
    run_dir = _copy(first, tmp_path)
    _refused(
        ConfigError,
        f"{run_dir} holds a run whose config.yaml differs.*"
        + ".*".join(keys)
        + ".*restore these values.*choose another trainer.run_dir",
        _cfg(corpus, run_dir, **over),
        run_dir,
    )


def test_null_starts_new_runs_only(corpus, first, tmp_path):
    run_dir = _copy(first, tmp_path)
    _refused(
        ConfigError,
        r"already holds a run \(config.yaml, checkpoints/step_1, checkpoints/step_2\).*"
        r"load_checkpoint is null",
        _cfg(corpus, run_dir, **{"trainer.load_checkpoint": "null"}),
        run_dir,
    )


def test_shorter_second_run_is_refused_and_an_equal_one_has_nothing_to_do(corpus, first, tmp_path):
    run_dir = _copy(first, tmp_path)
    _refused(
        ConfigError,
        r"num_train_steps=1, but .*step_2 in trainer.run_dir is at step 2",
        _cfg(corpus, run_dir, **{"trainer.num_train_steps": 1}),
        run_dir,
    )
    before = _hashes(run_dir)
    with _no_compile():
        result = train(_cfg(corpus, run_dir))
    assert result.losses == [] and result.model is None and result.message.startswith("already at step 2 ")
    assert _hashes(run_dir) == before


def test_an_older_explicit_checkpoint_is_refused_when_later_ones_exist(corpus, first, tmp_path):
    run_dir = _copy(first, tmp_path)
    _refused(
        ConfigError,
        r"checkpoints/step_1'? is older than checkpoints step_2.*fork",
        _cfg(corpus, run_dir, **{"trainer.load_checkpoint": "checkpoints/step_1", "trainer.num_train_steps": 3}),
        run_dir,
    )


def test_retention_counts_only_checkpoints_up_to_the_one_saved(tmp_path):
    tree = {"w": np.arange(4, dtype=np.float32)}
    for s in (5, 6):  # left by an earlier launch that got further
        ckpt.save_checkpoint(tmp_path, s, tree, keep_last=None)
    saver = ckpt.Checkpointer(tmp_path, keep_last=2)
    for s in (1, 2, 3):
        saver.save(s, tree)
        saver.wait()
    # keep_last=2 keeps this run's 2 and 3; the later 5 and 6 are neither counted nor deleted
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [2, 3, 5, 6]


# ---- one run at a time -------------------------------------------------------------------

_HOLDER = """
import sys, time
from pathlib import Path
from named.trainer.checkpoint.rundir import RunLock
lock = RunLock(Path(sys.argv[1]))
print("locked", flush=True)
time.sleep(600)
"""


@pytest.mark.procs
def test_a_live_holder_is_named_and_a_killed_one_blocks_nothing(corpus, first, tmp_path):
    run_dir = _copy(first, tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(run_dir)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        _refused(
            ConfigError,
            f"trainer.run_dir {run_dir} is in use by another run \\(pid {holder.pid} on host ",
            _cfg(corpus, run_dir, **{"trainer.num_train_steps": 3}),
            run_dir,
        )
    finally:
        holder.send_signal(signal.SIGKILL)
        assert holder.wait(timeout=60) == -signal.SIGKILL
    # the kernel dropped the dead holder's lock: the next launch resumes
    result = train(_cfg(corpus, run_dir, **{"trainer.num_train_steps": 3}))
    assert len(result.losses) == 1 and [s for s, _ in ckpt.list_checkpoints(run_dir)] == [1, 2, 3]
    assert f"pid {os.getpid()} on host " in (run_dir / ".lock").read_text()


def test_a_second_lock_in_the_same_process_conflicts_and_release_frees_it(tmp_path):
    lock = rundir.RunLock(tmp_path)
    with pytest.raises(ConfigError, match=f"in use by another run \\(pid {os.getpid()} "):
        rundir.RunLock(tmp_path)
    lock.release()
    rundir.RunLock(tmp_path).release()


def test_a_run_that_appears_while_starting_is_not_written_over(corpus, tmp_path):
    run_dir = tmp_path / "run"
    plan = rundir.plan_run(_cfg(corpus, run_dir))  # a new run
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("trainer: {seed: 5}\n")  # another run, faster
    with pytest.raises(ConfigError, match=f"{run_dir} changed while this run was starting"):
        with rundir.claim(plan, {"config.yaml": "x"}):
            pass
    assert (run_dir / "config.yaml").read_text() == "trainer: {seed: 5}\n"


# ---- nothing to train --------------------------------------------------------------------


def test_zero_steps_checks_everything_and_compiles_and_writes_nothing(corpus, first, tmp_path):
    run_dir = tmp_path / "new"
    with _no_compile():
        result = train(_cfg(corpus, run_dir, **{"trainer.num_train_steps": 0}))
    assert result.losses == [] and result.message.startswith("checked: ") and "nothing to train" in result.message
    assert not run_dir.exists()
    # on a run directory that holds a run, the resume is checked too, and refused the same way
    old = _copy(first, tmp_path)
    before = _hashes(old)
    with _no_compile():
        result = train(_cfg(corpus, old, **{"trainer.num_train_steps": 0}))
    assert f"resume from {old / 'checkpoints' / 'step_2'}" in result.message
    _refused(
        ConfigError,
        r"trainer\.seed 0 -> 3",
        _cfg(corpus, old, **{"trainer.num_train_steps": 0, "trainer.seed": 3}),
        old,
    )
    assert _hashes(old) == before


@pytest.mark.procs
def test_zero_steps_from_the_cli_prints_one_line_and_exits_0(corpus, tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "XLA_FLAGS": xla_flags(2), "JAX_PLATFORMS": "cpu"}
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from named.trainer.commands.cli import main_train; sys.exit(main_train())",
            *_args(corpus, run_dir, **{"trainer.num_train_steps": 0}),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("checked: ") and "nothing to train" in lines[0], r.stdout
    assert not run_dir.exists()


# ---- a run directory that cannot be written ------------------------------------------------


def test_a_run_dir_that_is_a_file_is_named_before_compiling(corpus, tmp_path):
    f = tmp_path / "file"
    f.write_text("not a directory")
    _refused(ConfigError, f"trainer.run_dir {f} exists and is not a directory", _cfg(corpus, f), tmp_path)
    _refused(
        ConfigError, f"trainer.run_dir {f / 'run'} cannot be created: {f} is a file", _cfg(corpus, f / "run"), tmp_path
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").write_text("")
    _refused(
        ConfigError,
        f"{run_dir / 'checkpoints'} is a file; the trainer writes a directory there",
        _cfg(corpus, run_dir),
        run_dir,
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into a read-only directory")
def test_a_read_only_parent_is_named_before_compiling(corpus, tmp_path):
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        _refused(
            ConfigError,
            f"{parent / 'run'} cannot be created: {parent} is not writable",
            _cfg(corpus, parent / "run"),
            parent,
        )
    finally:
        parent.chmod(0o755)


def test_a_failing_mkdir_becomes_a_config_error_naming_the_path(tmp_path, monkeypatch):
    # what the up-front checks cannot know (a full disk, a race): claim() still names the path
    run_dir = tmp_path / "run"

    def refuse(self, *a, **k):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "mkdir", refuse)
    with pytest.raises(ConfigError, match=f"trainer.run_dir {run_dir}: cannot write {run_dir}: Permission denied"):
        with rundir.claim(rundir.RunPlan(run_dir, run_dir, fingerprint=(None, ())), {}):
            pass


# ---- places of other runs, and runs sharing a checkpoint base --------------------------------


def test_a_run_dir_or_base_inside_a_checkpoint_folder_is_refused(corpus, first, tmp_path):
    # the outer run's retention deletes step_<N> with everything in it; nothing inside its folder is safe
    outer = _copy(first, tmp_path)
    folder, step = outer / "checkpoints", outer / "checkpoints" / "step_1"
    _refused(
        ConfigError,
        f"trainer.run_dir {folder / 'inner'} lies inside the checkpoint folder {folder}: "
        "the retention of the run that owns it",
        _cfg(corpus, folder / "inner"),
        outer,
    )
    _refused(
        ConfigError,
        f"trainer.run_dir {step / 'inner'} lies inside the checkpoint {step}:",
        _cfg(corpus, step / "inner"),
        outer,
    )
    _refused(
        ConfigError,
        f"trainer.run_dir {folder} lies inside the checkpoint folder {folder}:",
        _cfg(corpus, folder),
        outer,
    )
    _refused(
        ConfigError,
        f"checkpoint.base {step} lies inside the checkpoint {step}: .*Choose a checkpoint.base outside",
        _cfg(corpus, tmp_path / "new", **{"checkpoint.base": str(step)}),
        outer,
    )
    assert not (tmp_path / "new").exists()


def test_an_unwritable_local_checkpoint_base_is_named_before_compiling(corpus, tmp_path):
    # with checkpoint.interval 0 the first save comes after every step was trained: found only then, all is lost
    f = tmp_path / "file"
    f.write_text("not a directory")
    run_dir = tmp_path / "run"
    bare = {"checkpoint.interval": 0}
    _refused(
        ConfigError,
        f"checkpoint.base {f} exists and is not a directory",
        _cfg(corpus, run_dir, **bare, **{"checkpoint.base": str(f)}),
        tmp_path,
    )
    _refused(
        ConfigError,
        f"checkpoint.base {f / 'b'} cannot be created: {f} is a file",
        _cfg(corpus, run_dir, **bare, **{"checkpoint.base": str(f / "b")}),
        tmp_path,
    )
    base = tmp_path / "base"
    base.mkdir()
    (base / "checkpoints").write_text("")
    _refused(
        ConfigError,
        f"checkpoint.base: {base / 'checkpoints'} is a file; the trainer writes a directory there",
        _cfg(corpus, run_dir, **bare, **{"checkpoint.base": str(base)}),
        tmp_path,
    )
    assert not run_dir.exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into a read-only directory")
def test_a_read_only_checkpoint_base_is_named_before_compiling(corpus, tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    base.chmod(0o555)
    try:
        _refused(
            ConfigError,
            f"checkpoint.base {base} is not writable",
            _cfg(corpus, tmp_path / "run", **{"checkpoint.base": str(base)}),
            tmp_path,
        )
    finally:
        base.chmod(0o755)


def _run_id(run_dir: Path) -> str:
    return json.loads((run_dir / "run.json").read_text())["id"]


def test_two_runs_sharing_a_checkpoint_base_never_resume_each_other(corpus, tmp_path):
    base, a, b = tmp_path / "base", tmp_path / "a", tmp_path / "b"
    shared = {"checkpoint.base": str(base)}
    train(_cfg(corpus, a, **shared))
    # a second run on the same base: refused, naming both runs and the keys, writing nothing
    before = _hashes(base)
    _refused(
        ConfigError,
        f"checkpoint.base {base}: the checkpoint {base / 'checkpoints' / 'step_2'} was saved by "
        f"another run \\(trainer.run_dir {a}, run id [0-9a-f]{{32}}\\), not by this one \\(trainer.run_dir {b}, "
        f"a new run\\).*checkpoint.base of its own \\(e.g. {base}/b\\).*trainer.run_dir {a}.*"
        "trainer.load_checkpoint checkpoints/step_2. Nothing was written",
        _cfg(corpus, b, **shared),
        b,
    )
    assert _hashes(base) == before
    ida = _run_id(a)
    saved = ckpt.read_commit(base / "checkpoints" / "step_2")["metadata"]["run"]
    assert saved == {"id": ida, "run_dir": str(a)}  # every checkpoint names the run that saved it
    # its own run resumes (and a run directory whose run.json was lost is still that run)
    with _no_compile():
        assert train(_cfg(corpus, a, **shared)).message.startswith("already at step 2 ")
        (a / "run.json").unlink()
        assert train(_cfg(corpus, a, **shared)).message.startswith("already at step 2 ")
    (a / "run.json").write_text(json.dumps({"id": ida}))
    # naming the checkpoint is the one way to continue another run's checkpoint on purpose
    explicit = train(
        _cfg(corpus, b, **shared, **{"trainer.load_checkpoint": "checkpoints/step_2", "trainer.num_train_steps": 3})
    )
    assert len(explicit.losses) == 1
    assert "a checkpoint of another run" in (b / "logs" / "process_0.log").read_text()
    idb = _run_id(b)
    assert idb != ida and ckpt.read_commit(base / "checkpoints" / "step_3")["metadata"]["run"]["id"] == idb
    # and the first run no longer resumes from what the second saved there
    _refused(
        ConfigError,
        f"the checkpoint {base / 'checkpoints' / 'step_3'} was saved by another run "
        f"\\(trainer.run_dir {b}, run id {idb}\\), not by this one \\(trainer.run_dir {a}, run id {ida}\\)",
        _cfg(corpus, a, **shared, **{"trainer.num_train_steps": 4}),
        a,
    )


def test_a_checkpoint_copied_into_a_new_run_dir_is_that_run_dirs(corpus, first, tmp_path):
    # the documented way to branch a run: copy a checkpoint into another run directory
    run_dir = tmp_path / "branch"
    shutil.copytree(first / "checkpoints" / "step_2", run_dir / "checkpoints" / "step_2")
    with _no_compile():
        assert train(_cfg(corpus, run_dir)).message.startswith("already at step 2 ")
    plan = rundir.plan_run(_cfg(corpus, run_dir, **{"trainer.num_train_steps": 3}))
    assert plan.restore_from == run_dir / "checkpoints" / "step_2" and plan.run_id == _run_id(first)


def test_a_failing_checkpoint_base_mkdir_names_the_key(tmp_path, monkeypatch):
    # what the up-front checks cannot know (a full disk, a race): claim() names checkpoint.base
    run_dir, base = tmp_path / "run", tmp_path / "base"
    mkdir = Path.mkdir

    def refuse(self, *a, **k):
        if self == base / "checkpoints":
            raise PermissionError(13, "Permission denied", str(self))
        return mkdir(self, *a, **k)

    monkeypatch.setattr(Path, "mkdir", refuse)
    plan = rundir.RunPlan(run_dir, base, fingerprint=(None, ()), run_id="0" * 32)
    with pytest.raises(
        ConfigError, match=f"checkpoint.base {base}: cannot create {base / 'checkpoints'}: Permission denied"
    ):
        with rundir.claim(plan, {}):
            pass
    assert not (run_dir / "run.json").exists()


def test_a_longer_resume_keeps_the_schedule_or_is_refused(corpus, tmp_path):
    """Raising num_train_steps on resume would re-stretch a cosine schedule mid-run (the learning
    rate jumping up): refused, unless optimizer.schedule_steps names the horizon to follow."""
    cosine = {"optimizer.schedule": "cosine", "optimizer.min_lr_ratio": 0.1}
    run_dir = tmp_path / "run"
    train(_cfg(corpus, run_dir, **cosine))
    _refused(  # fewer steps than the run has done: that is the fault, not the schedule
        ConfigError,
        r"trainer.num_train_steps=1, but the run is past that step: .*step_2 in trainer.run_dir is at step 2",
        _cfg(corpus, run_dir, **cosine, **{"trainer.num_train_steps": 1}),
        run_dir,
    )
    _refused(
        ConfigError,
        r"trainer.num_train_steps=4: .*schedule of 2 steps.*re-stretch it to 4 steps.*from step 3 on.*"
        r"--optimizer.schedule_steps 2.*--optimizer.schedule_steps 4",
        _cfg(corpus, run_dir, **cosine, **{"trainer.num_train_steps": 4}),
        run_dir,
    )
    train(_cfg(corpus, run_dir, **cosine, **{"trainer.num_train_steps": 4, "optimizer.schedule_steps": 2}))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lrs = {r["step"]: r["train/lr"] for r in rows if "train/lr" in r}
    assert sorted(lrs) == [1, 2, 3, 4]
    assert lrs[1] == pytest.approx(0.003) and lrs[2] < lrs[1]  # the first launch's 2-step cosine
    assert lrs[3] == lrs[4] == pytest.approx(0.003 * 0.1)  # past the kept horizon: its final rate


def test_a_data_file_edited_in_place_is_named_on_resume(corpus, tmp_path):
    """The run records its data files' sizes and hashes; a resume over an edited file is refused
    naming it (its rows would differ at the same steps), unless trainer.resume_changed_data."""
    data = tmp_path / "code.txt"
    text = CORPUS * (3 * 2**20 // len(CORPUS))  # past 3 MiB: the middle is neither the first nor the last MiB
    data.write_text(text)
    run_dir = tmp_path / "run"
    over = {"data.train": f"[{data}]"}
    train(_cfg(corpus, run_dir, **over))
    recorded = json.loads((run_dir / "data_files.json").read_text())
    assert list(recorded) == [str(data.resolve())]
    assert recorded[str(data.resolve())]["sha256"] == hashlib.sha256(text.encode()).hexdigest()
    os.utime(data, ns=(1, 1))  # touched, not changed: the same data
    assert data_pkg.changed_files(recorded, data_pkg.fingerprint([data.resolve()])) == []
    middle = len(text) // 2
    data.write_text(text[:middle] + text[middle:].replace("h_1(", "g_1(", 1))  # the same size, other tokens
    _refused(
        DataError,
        rf"data of the run in {run_dir} changed.*{data.resolve()} \(same size, other content\).*"
        r"--trainer.resume_changed_data true",
        _cfg(corpus, run_dir, **over, **{"trainer.num_train_steps": 3}),
        run_dir,
    )
    resumed = train(
        _cfg(corpus, run_dir, **over, **{"trainer.num_train_steps": 3, "trainer.resume_changed_data": True})
    )
    assert len(resumed.losses) == 1
    assert json.loads((run_dir / "data_files.json").read_text()) != recorded  # the new files are the record
    assert "resuming on changed data" in (run_dir / "logs" / "process_0.log").read_text()


def test_a_resume_without_its_data_record_is_refused_unless_told(corpus, first, tmp_path):
    """Without data_files.json a resume cannot check its data: refused naming the file, unless
    trainer.resume_changed_data, which resumes and makes the files as they are the record."""
    run_dir = _copy(first, tmp_path)
    (run_dir / "data_files.json").unlink()
    _refused(
        DataError,
        rf"the run in {run_dir} has no record of its data files \({run_dir / 'data_files.json'} is missing\).*"
        r"--trainer.resume_changed_data true",
        _cfg(corpus, run_dir, **{"trainer.num_train_steps": 3}),
        run_dir,
    )
    resumed = train(_cfg(corpus, run_dir, **{"trainer.num_train_steps": 3, "trainer.resume_changed_data": True}))
    assert len(resumed.losses) == 1 and (run_dir / "data_files.json").is_file()
    assert "resuming without data_files.json" in (run_dir / "logs" / "process_0.log").read_text()


def test_a_copied_run_dir_reads_its_own_checkpoints(corpus, first, tmp_path):
    """named-export, named-eval and named-sample find a run where it is: a copy reads the copy's
    checkpoints (its config.yaml still names the original's trainer.run_dir), and a copy whose
    original is gone still has its checkpoints."""
    from named.trainer.commands.export import read_run

    copy = _copy(first, tmp_path)
    run_dir, cfg, _, path = read_run(copy)
    assert (run_dir, Path(cfg.trainer.run_dir), path) == (copy, copy, copy / "checkpoints" / "step_2")
    assert read_run(copy, 1)[3] == copy / "checkpoints" / "step_1"
    gone = tmp_path / "gone"  # the original, deleted: its path is all the copy's config.yaml has of it
    (copy / "config.yaml").write_text((copy / "config.yaml").read_text().replace(str(first), str(gone)))
    assert read_run(copy)[3] == copy / "checkpoints" / "step_2"


@pytest.mark.parametrize("what", ["file", "broken link"])
def test_a_tensorboard_folder_in_the_way_is_named_before_anything_is_written(corpus, tmp_path, what):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    if what == "file":
        (run_dir / "tensorboard").write_text("not a folder")
        match = rf"trainer.run_dir: {run_dir / 'tensorboard'} is a file; the trainer writes a directory there"
    else:
        (run_dir / "tensorboard").symlink_to(tmp_path / "gone")
        match = rf"trainer.run_dir: {run_dir / 'tensorboard'} is a broken link \(to {tmp_path / 'gone'}\)"
    _refused(ConfigError, match, _cfg(corpus, run_dir, **{"tracker.tensorboard": True}), run_dir)


def test_a_record_of_an_older_trainer_is_compared_as_it_was_made(tmp_path):
    """Records without ``whole`` hashed a file past two MiB over its first and last MiB: the same file
    is unchanged against such a record, and a file edited there is changed."""
    data = tmp_path / "big.txt"
    content = bytes(range(256)) * (3 * 2**20 // 256)
    data.write_bytes(content)
    ends = hashlib.sha256(content[: 2**20] + content[-(2**20) :]).hexdigest()
    legacy = {str(data): {"size": len(content), "mtime_ns": 0, "sha256": ends}}
    assert data_pkg.changed_files(legacy, data_pkg.fingerprint([data])) == []
    data.write_bytes(b"x" + content[1:])
    assert data_pkg.changed_files(legacy, data_pkg.fingerprint([data])) == [f"{data} (same size, other content)"]
