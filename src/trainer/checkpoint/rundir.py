"""Run directories: one run owns its directory, and nothing ever writes over an earlier run.

A run directory holds one training trajectory. Before anything is compiled or written,
``plan_run`` decides what a new launch may do with ``trainer.run_dir``:

- absent or empty (no ``config.yaml``, no committed checkpoint): a new run;
- holding a run: resume it (``load_checkpoint: auto``, the default, or an explicit
  checkpoint) when its ``config.yaml`` equals the new config on every setting that defines
  the trajectory (everything except ``TRAJECTORY_FREE``: the keys declared ``free``), else
  refuse with a ConfigError listing each differing key (old -> new); ``load_checkpoint: null``
  refuses it outright;
- ``num_train_steps`` equal to the checkpoint's step: nothing to train (the caller says so
  and exits 0); below it: refused.

``claim`` then creates the directory and holds an exclusive ``flock`` on ``<run_dir>/.lock``
for the whole run (process 0 only; the kernel drops it when the process dies, so a killed
run never blocks the next), and writes ``config.yaml`` / ``model_config.json`` only where
they are absent: the first launch's config stays the run's record.

Every run has an identity: a random id in ``<run_dir>/run.json``, made by its first launch, which
every checkpoint it saves records (metadata ``run``: the id and the run directory). A resume is
refused when the checkpoint it would continue was saved by another run, which is what two runs
sharing one ``checkpoint.base`` would otherwise do to each other, naming both runs. Accepted: a
checkpoint saved before runs had ids; a run directory without ``run.json`` continuing a
checkpoint that lies inside it (copied there by hand) or that records this very run directory
(``run.json`` lost, or a new machine over the same object-store prefix), which takes that
checkpoint's id; and a checkpoint of another run named explicitly by ``trainer.load_checkpoint``.

Checkpoints live in ``<root>/checkpoints``, where the root is ``checkpoint.base`` when it is set
(a local path, ``s3://bucket/prefix`` or ``gs://bucket/prefix``) and ``trainer.run_dir`` when not
(``config.checkpoint_root``: the one rule; ``RunPlan.root`` holds its answer). The run directory
itself (lock, config.yaml, logs, metrics) is always local. A bucket that is missing or refuses
listing fails ``plan_run``, and one that refuses a write fails ``claim``, both naming the URL,
before anything is compiled; a local base that is a file, lies under one or is not writable fails
``plan_run`` naming ``checkpoint.base``. Neither the run directory nor a local base may lie inside a
checkpoint folder or a checkpoint (``run_places``): that run's retention would delete it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import itertools
import json
import math
import os
import re
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import yaml

from .. import checkpoint as ckpt
from ..config import (  # noqa: F401  (TRAJECTORY_FREE, checkpoint_root: also this module's public face)
    TRAJECTORY_FREE,
    ConfigError,
    DataError,
    TrainConfig,
    checkpoint_root,
    checkpoint_root_setting,
    dump_config,
    named_checkpoint,
)
from .run_places import (
    CHECKPOINT,
    CHECKPOINT_FOLDER,
    CONFIG_FILE,
    DATA_FILES,
    EVENTS_DIR,
    LOCK_FILE,
    METRICS_FILE,
    RUN_FILE,
    enclosing,
)

__all__ = [
    "TRAJECTORY_FREE",
    "RunPlan",
    "check_outside_checkpoints",
    "check_writable",
    "checkpoint_root",
    "claim",
    "os_error",
    "plan_run",
    "trajectory_changes",
]

# What the trainer writes in a run directory, and which kind each must be.
_ENTRIES = {
    "checkpoints": "directory",
    "logs": "directory",
    CONFIG_FILE: "file",
    "model_config.json": "file",
    METRICS_FILE: "file",
    LOCK_FILE: "file",
    RUN_FILE: "file",
    DATA_FILES: "file",
}

# Process 0 decides for every process; how long the others wait for its decision (a dead
# process 0 ends them sooner, through jax.distributed's heartbeat).
_AGREE_TIMEOUT_MS = 1800 * 1000
_DECISIONS = itertools.count()


@dataclasses.dataclass
class RunPlan:
    """What this launch does with its run directory (decided by process 0)."""

    run_dir: Path
    root: ckpt.Location  # where the checkpoints live, in <root>/checkpoints (config.checkpoint_root)
    restore_from: ckpt.Location | None = None  # the checkpoint to resume from
    step: int = 0  # its step (0: from scratch)
    # auto: restore_from is the newest checkpoint with every file there at its size, and the restore
    # reads the newest that checks out as it is read (each byte once), an older one if it does not
    fall_back: bool = False
    notes: list[str] = dataclasses.field(default_factory=list)  # logged once the run's log is open
    fingerprint: tuple | None = None  # what process 0 saw; claim() checks it again under the lock
    run_id: str | None = None  # this run's identity (run.json; decided by plan_run)

    @property
    def identity(self) -> dict:
        """What each checkpoint of this run records as its ``run`` metadata."""
        return {"id": self.run_id, "run_dir": str(self.run_dir.absolute())}


# ---- comparing configs -------------------------------------------------------------------


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _free(key: str) -> bool:
    return any(key == p or key.startswith(p + ".") for p in TRAJECTORY_FREE)


def _same(a: Any, b: Any) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


_ABSENT = "(absent)"


def _changes(saved: dict, new: dict) -> list[tuple[str, Any, Any]]:
    old, cur = _flatten(saved), _flatten(new)
    keys = sorted(set(old) | set(cur))
    return [
        (k, old.get(k, _ABSENT), cur.get(k, _ABSENT))
        for k in keys
        if not _same(old.get(k, _ABSENT), cur.get(k, _ABSENT))
    ]


def trajectory_changes(saved: dict, new: dict) -> list[tuple[str, Any, Any]]:
    """``(key, old, new)`` for every trajectory-defining setting that differs (dotted keys)."""
    return [c for c in _changes(saved, new) if not _free(c[0])]


def _show(changes: list[tuple[str, Any, Any]]) -> str:
    def value(v: Any) -> str:
        return v if v is _ABSENT else json.dumps(v, default=str)

    return ", ".join(f"{k} {value(a)} -> {value(b)}" for k, a, b in changes)


def _read_saved_config(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        saved = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ConfigError(
            f"trainer.run_dir: {path} cannot be read ({e}); it is not a config this trainer wrote. "
            "Choose another trainer.run_dir"
        ) from None
    if not isinstance(saved, dict):
        raise ConfigError(
            f"trainer.run_dir: {path} holds no mapping of config sections; choose another trainer.run_dir"
        )
    return saved


# ---- the file system -----------------------------------------------------------------


def os_error(run_dir: Path, e: OSError) -> ConfigError:
    """An OSError met while creating or writing the run directory, as a ConfigError naming the path."""
    where = e.filename or run_dir
    return ConfigError(f"trainer.run_dir {run_dir}: cannot write {where}: {e.strerror or e}")


def check_writable(run_dir: Path, key: str = "trainer.run_dir", entries: dict[str, str] = _ENTRIES) -> None:
    """The run directory (or the local checkpoint base, ``key``) is a writable directory, or can
    be created; what the trainer writes in it (``entries``) is not in the way (a file where a
    directory goes, or the reverse)."""
    if run_dir.exists() or run_dir.is_symlink():
        if not run_dir.is_dir():
            raise ConfigError(f"{key} {run_dir} exists and is not a directory")
        if not os.access(run_dir, os.W_OK | os.X_OK):
            raise ConfigError(f"{key} {run_dir} is not writable")
        for name, kind in entries.items():
            entry = run_dir / name
            if entry.is_symlink() and not entry.exists():
                raise ConfigError(
                    f"{key}: {entry} is a broken link (to {os.readlink(entry)}); the trainer writes a {kind} there"
                )
            if entry.exists() and entry.is_dir() != (kind == "directory"):
                raise ConfigError(
                    f"{key}: {entry} is a {'directory' if entry.is_dir() else 'file'}; "
                    f"the trainer writes a {kind} there"
                )
            if kind == "directory" and entry.is_dir() and not os.access(entry, os.W_OK | os.X_OK):
                raise ConfigError(f"{key}: {entry} is not writable")
        return
    parent = run_dir.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{key} {run_dir} cannot be created: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{key} {run_dir} cannot be created: {parent} is not writable")


def check_outside_checkpoints(path: Path, key: str) -> None:
    """``path`` lies in no checkpoint folder and no checkpoint (of this run or another): the
    retention of the run that owns it would delete it with everything in it."""
    found = enclosing(path, (CHECKPOINT, CHECKPOINT_FOLDER))
    if found is not None:
        kind, place = found
        raise ConfigError(
            f"{key} {path} lies inside the {kind} {place}: the retention of the run that owns it "
            f"deletes checkpoints with everything in them. Choose a {key} outside it"
        )


def _local_base(run_dir: Path, root: ckpt.Location) -> Path | None:
    """The checkpoint root when it is a local folder other than the run directory (``checkpoint.base``)."""
    if ckpt.is_remote(root):
        return None
    return None if root.absolute() == run_dir.absolute() else root


# ---- the run's identity --------------------------------------------------------------------


def _is_run_id(value: Any) -> bool:
    return isinstance(value, str) and re.fullmatch(r"[0-9a-f]{32}", value) is not None


def _read_run_id(run_dir: Path) -> str | None:
    """This run directory's id (``run.json``), None when it has none yet."""
    path = run_dir / RUN_FILE
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(
            f"trainer.run_dir: {path} cannot be read ({e}); it is not a file this trainer wrote. "
            "Choose another trainer.run_dir"
        ) from None
    run_id = data.get("id") if isinstance(data, dict) else None
    if not _is_run_id(run_id):
        raise ConfigError(
            f'trainer.run_dir: {path} holds no run id (32 hex digits under "id"); it is not a file '
            "this trainer wrote. Choose another trainer.run_dir"
        )
    return run_id


def _owner_check(cfg: TrainConfig, plan: RunPlan, commit: dict, mine: str | None) -> str | None:
    """Refuse to resume ``plan.restore_from`` when another run saved it (see the module docstring);
    return the id this run directory takes from it, if it takes one."""
    owner = commit.get("metadata", {}).get("run")
    theirs = owner.get("id") if isinstance(owner, dict) else None
    if not _is_run_id(theirs) or theirs == mine:
        return None  # saved before runs had an identity (or by hand), or by this run
    owner_dir = str(owner.get("run_dir"))
    here = plan.run_dir.absolute()
    inside = not ckpt.is_remote(plan.root) and plan.root.absolute() == here  # the run directory's own checkpoints
    if mine is None and (owner_dir == str(here) or inside):
        return theirs
    t = cfg.trainer
    if t.load_checkpoint not in (None, "auto"):  # named on purpose: the user's choice
        plan.notes.append(
            f"resuming from {plan.restore_from}, a checkpoint of another run (trainer.run_dir {owner_dir}), "
            "because trainer.load_checkpoint names it"
        )
        return None
    root_key, root = checkpoint_root_setting(cfg)
    this = f"run id {mine}" if mine else "a new run"
    rel = f"checkpoints/{Path(str(plan.restore_from)).name}"
    fix = (
        f"give this run a checkpoint.base of its own (e.g. {root.rstrip('/')}/{here.name})"
        if root_key == "checkpoint.base"
        else "give the other run a checkpoint.base of its own"
    )
    raise ConfigError(
        f"{root_key} {root}: the checkpoint {plan.restore_from} was saved by another run "
        f"(trainer.run_dir {owner_dir}, run id "
        f"{theirs}), not by this one (trainer.run_dir {plan.run_dir}, {this}). Runs that share a checkpoint folder "
        f"resume from and delete each other's checkpoints: {fix}. To continue the other run, launch it with "
        f"trainer.run_dir {owner_dir}; to start this one from that checkpoint on purpose, name it: "
        f"trainer.load_checkpoint {rel}. Nothing was written"
    )


def _fingerprint(run_dir: Path, root: ckpt.Location) -> tuple:
    cfg = run_dir / CONFIG_FILE
    digest = hashlib.sha256(cfg.read_bytes()).hexdigest() if cfg.is_file() else None
    return digest, tuple(s for s, _ in ckpt.list_checkpoints(root))


# ---- the lock ------------------------------------------------------------------------------


def _holder(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        text = ""
    return text or "a process that has not written its name yet"


def _in_use(run_dir: Path, holder: str) -> ConfigError:
    return ConfigError(
        f"trainer.run_dir {run_dir} is in use by another run ({holder}; lock {run_dir / LOCK_FILE}): two runs "
        "in one directory would delete each other's checkpoints and mix their metrics. Wait for it to end, "
        "stop it, or choose another trainer.run_dir"
    )


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def _probe_lock(run_dir: Path) -> None:
    """Fail now if a live run holds the lock. Reads only: a missing lock file is not created."""
    path = run_dir / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    except OSError as e:
        raise ConfigError(f"trainer.run_dir: cannot read the lock {path}: {e.strerror}") from None
    try:
        if not _try_lock(fd):
            raise _in_use(run_dir, _holder(path))
    finally:
        os.close(fd)  # closing drops the probe's own lock


class RunLock:
    """An exclusive ``flock`` on ``<run_dir>/.lock`` naming its holder (pid, host, start time)."""

    def __init__(self, run_dir: Path):
        path = run_dir / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        if not _try_lock(fd):
            os.close(fd)
            raise _in_use(run_dir, _holder(path))
        os.ftruncate(fd, 0)
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
        os.write(fd, f"pid {os.getpid()} on host {socket.gethostname()}, started {started}\n".encode())
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # the lock goes with the descriptor; the file stays, naming the last holder
            self._fd = None


# ---- deciding --------------------------------------------------------------------------------


def _decide(cfg: TrainConfig) -> RunPlan:
    t = cfg.trainer
    run_dir, root = Path(t.run_dir), checkpoint_root(cfg)
    plan = RunPlan(run_dir, root)
    if run_dir.is_dir():
        _probe_lock(run_dir)
    saved = _read_saved_config(run_dir / CONFIG_FILE)
    mine = _read_run_id(run_dir)
    committed = ckpt.list_checkpoints(root)
    plan.fingerprint = _fingerprint(run_dir, root)
    held = ([CONFIG_FILE] if saved is not None else []) + [f"checkpoints/step_{s}" for s, _ in committed]
    if not held and t.load_checkpoint in (None, "auto"):
        plan.run_id = mine or uuid.uuid4().hex
        return plan  # a new run
    if t.load_checkpoint is None:
        raise ConfigError(
            f"trainer.run_dir {run_dir} already holds a run ({', '.join(held)}) and trainer.load_checkpoint is null, "
            "which starts new runs only and never writes over one. To resume it, set trainer.load_checkpoint auto; "
            "to start a new run, choose another trainer.run_dir"
        )
    new = yaml.safe_load(dump_config(cfg))
    if saved is not None:
        changed = trajectory_changes(saved, new)
        if changed:
            raise ConfigError(
                f"trainer.run_dir {run_dir} holds a run whose {CONFIG_FILE} differs from this config in settings that "
                f"define the training trajectory: {_show(changed)}. To resume that run, restore these values; to start "
                "a new run, choose another trainer.run_dir. Nothing was written"
            )
        free = [c for c in _changes(saved, new) if c[0] not in ("trainer.load_checkpoint",)]
        if free:
            plan.notes.append(
                f"settings changed since {run_dir / CONFIG_FILE} (which keeps the first launch's): {_show(free)}"
            )
    if t.load_checkpoint == "auto":
        # its checksums are checked as the restore reads it (each byte read once: no verify pass first)
        newest = ckpt.latest_checkpoint(root, checksums=False)
        done = newest is not None and int(ckpt.read_commit(newest)["step"]) >= (t.num_train_steps or 0)
        # a run that is done if that checkpoint is whole reads nothing: check it whole now (a corrupted
        # one is skipped, warned, and an older one resumed)
        plan.restore_from, plan.fall_back = (ckpt.latest_checkpoint(root), False) if done else (newest, True)
        commit = ckpt.read_commit(plan.restore_from) if plan.restore_from is not None else None
    else:
        plan.restore_from = named_checkpoint(cfg)
        commit = ckpt.verify_checkpoint(plan.restore_from)  # an explicit checkpoint must be whole
        later = [f"step_{s}" for s, _ in committed if s > int(commit["step"])]
        if later:
            raise ConfigError(
                f"trainer.load_checkpoint {t.load_checkpoint!r} is older than checkpoints {', '.join(later)} in "
                f"{ckpt.checkpoint_dir(root)}; resuming from it would fork the run inside one run directory. "
                "Move the later ones out of it, or copy the checkpoint into another trainer.run_dir"
            )
    adopted = _owner_check(cfg, plan, commit, mine) if commit is not None else None
    plan.run_id = mine or adopted or uuid.uuid4().hex
    if commit is not None:
        plan.step = int(commit["step"])
        if saved is None:  # a run directory assembled by hand: the seed is all the checkpoint records
            seed = commit.get("metadata", {}).get("seed")
            if seed is not None and seed != t.seed:
                raise ConfigError(
                    f"trainer.seed: {plan.restore_from} was saved by a run with trainer.seed={seed}, this "
                    f"config has {t.seed}. To resume it, set trainer.seed {seed}; to start a new run, "
                    "choose another trainer.run_dir"
                )
            plan.notes.append(
                f"{run_dir} has no {CONFIG_FILE}: only the seed and the tensors' shapes of "
                f"{plan.restore_from} were checked against this config"
            )
    if t.num_train_steps and t.num_train_steps < plan.step:  # first: no schedule is followed past it
        raise ConfigError(
            f"trainer.num_train_steps={t.num_train_steps}, but the run is past that step: {plan.restore_from} in "
            f"trainer.run_dir is at step {plan.step}. To train on, set trainer.num_train_steps above {plan.step}; to "
            "start a new run, choose another trainer.run_dir"
        )
    if saved is not None and plan.step > 0 and t.num_train_steps:
        _check_schedule(cfg, saved, plan)
    return plan


def _check_schedule(cfg: TrainConfig, saved: dict, plan: RunPlan) -> None:
    """A resume keeps the learning-rate schedule the run has followed: a new ``num_train_steps``
    that would re-stretch it is refused unless ``optimizer.schedule_steps`` says which horizon to take."""
    o, steps = cfg.optimizer, cfg.trainer.num_train_steps
    if o.schedule_steps is not None:
        return  # an explicit horizon: the user's choice, kept or re-stretched
    saved_opt = saved.get("optimizer") if isinstance(saved.get("optimizer"), dict) else {}
    saved_steps = (saved.get("trainer") or {}).get("num_train_steps")
    if not isinstance(saved_steps, int) or not saved_steps:
        return
    span = dataclasses.replace(o, schedule_steps=saved_opt.get("schedule_steps")).horizon(saved_steps)
    if o.same_schedule(span, steps):
        return
    raise ConfigError(
        f"trainer.num_train_steps={steps}: the run in {plan.run_dir} follows a learning-rate schedule of {span} "
        f"steps (its {CONFIG_FILE}); resuming at step {plan.step} would re-stretch it to {steps} steps and change "
        f"the learning rate from step {plan.step + 1} on. To keep the run's schedule (steps past {span} at its final "
        f"rate), add --optimizer.schedule_steps {span}; to re-stretch it, add --optimizer.schedule_steps {steps}. "
        "Nothing was written"
    )


def decided_by_process_0(
    decide: Callable[[], Any],
    encode: Callable[[Any], Any] = lambda v: v,
    decode: Callable[[Any], Any] = lambda v: v,
) -> Any:
    """``decide()`` run on process 0 alone, its value (through ``encode`` to JSON and ``decode``
    back) or its error taken by every other process. For a decision read from the run directory:
    process 0 writes into it right after (``claim``), so a process that read it itself could see
    the files half-written or written, instead of as process 0 saw them."""
    if jax.process_count() == 1:
        return decide()
    from named.internal import distributed_client  # the client checkpoint.py also uses

    client = distributed_client()
    key = f"named_run_decision/{next(_DECISIONS)}"  # each process makes the same decisions in the same order
    if jax.process_index() == 0:
        try:
            value = decide()
        except Exception as e:
            client.key_value_set(key, json.dumps({"error": type(e).__name__, "message": str(e)}))
            raise
        client.key_value_set(key, json.dumps({"value": encode(value)}))
        return value
    got = json.loads(client.blocking_key_value_get(key, _AGREE_TIMEOUT_MS))
    if "error" in got:
        message = f"process 0 refused the run: {got['message']}"
        if got["error"] == "CheckpointError":
            raise ckpt.CheckpointError(message)
        if got["error"] == "DataError":
            raise DataError(message)
        raise ConfigError(message)
    return decode(got["value"])


def _plan_json(plan: RunPlan) -> dict:
    return {
        "restore_from": plan.restore_from and str(plan.restore_from),
        "step": plan.step,
        "run_dir": str(plan.run_dir),
        "root": str(plan.root),
        "run_id": plan.run_id,
    }


def _plan_from_json(got: dict) -> RunPlan:
    return RunPlan(
        Path(got["run_dir"]),
        ckpt.location(got["root"]),
        got["restore_from"] and ckpt.location(got["restore_from"]),
        got["step"],
        run_id=got["run_id"],
    )


def plan_run(cfg: TrainConfig) -> RunPlan:
    """Decide, reading only, whether this launch starts a new run, resumes the one in
    ``trainer.run_dir`` (and from which checkpoint), or is refused (ConfigError or
    CheckpointError naming the key, file or holder of the lock)."""
    run_dir = Path(cfg.trainer.run_dir)
    check_writable(run_dir, entries={**_ENTRIES, EVENTS_DIR: "directory"} if cfg.tracker.tensorboard else _ENTRIES)
    check_outside_checkpoints(run_dir, "trainer.run_dir")
    root = checkpoint_root(cfg)
    base = _local_base(run_dir, root)
    if base is not None:  # found now, not at the first save (with checkpoint.interval 0: after the whole run)
        check_writable(base, "checkpoint.base", {"checkpoints": "directory"})
        check_outside_checkpoints(base, "checkpoint.base")
    if ckpt.is_remote(root) and jax.process_index() == 0:
        ckpt.check_access(ckpt.checkpoint_dir(root), write=False)  # a missing bucket or refused listing, named
    return decided_by_process_0(lambda: _decide(cfg), _plan_json, _plan_from_json)


@contextlib.contextmanager
def claim(plan: RunPlan, files: dict[str, str], replace: tuple[str, ...] = ()) -> Iterator[None]:
    """Create the run directory and own it for the ``with`` block: process 0 holds the lock,
    checks that nothing changed since ``plan_run`` looked, and writes each of ``files``
    (name -> text) that is absent, atomically. Replaces no file but those named in ``replace``."""
    run_dir = plan.run_dir
    lock = None
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        if jax.process_index() == 0:
            lock = RunLock(run_dir)
            if _fingerprint(run_dir, plan.root) != plan.fingerprint:
                raise ConfigError(
                    f"trainer.run_dir {run_dir} changed while this run was starting (another run wrote "
                    "to it); nothing was written. Start again to resume it, or choose another trainer.run_dir"
                )
            if ckpt.is_remote(plan.root):  # credentials that may read but not write fail here, not at the first save
                ckpt.check_access(ckpt.checkpoint_dir(plan.root), write=True)
            elif plan.root != run_dir:  # a local checkpoint.base: what plan_run's checks could not know fails here
                _make_checkpoint_dir(plan.root)
            identity = {RUN_FILE: json.dumps({"id": plan.run_id}) + "\n"} if plan.run_id else {}
            for name, text in {**files, **identity}.items():
                _write_if_absent(run_dir / name, text, replace=name in replace)
    except BaseException as e:
        if lock is not None:
            lock.release()
        if isinstance(e, OSError):
            raise os_error(run_dir, e) from None
        raise
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def _make_checkpoint_dir(base: Path) -> None:
    try:
        ckpt.checkpoint_dir(base).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"checkpoint.base {base}: cannot create {e.filename or base}: {e.strerror or e}") from None


def _write_if_absent(path: Path, text: str, *, replace: bool = False) -> None:
    if path.exists() and not replace:
        return
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # under the lock: nobody else writes it meanwhile
