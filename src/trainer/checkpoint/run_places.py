"""What the trainer owns on a local disk, recognised from outside: run directories, checkpoint
folders and checkpoints.

Other commands must not write into them or over them: ``rundir`` refuses a ``trainer.run_dir``
or a local ``checkpoint.base`` that lies inside a checkpoint folder or a checkpoint (the owner's
retention would one day delete it with everything in it), and ``named-export`` refuses an
``--out`` that is, lies inside or holds any of them. The marks are what the trainer itself
writes, so a place is recognised whichever run made it:

- a *run directory* holds the identity ``run.json``, or ``config.yaml`` beside ``model_config.json``
  or the lock ``.lock`` (all written when a run claims it; runs older than ``run.json`` have the others);
- a *checkpoint folder* is ``<run_dir>/checkpoints``, or any folder holding a committed
  ``step_<N>`` (a ``checkpoint.base``'s ``checkpoints``);
- a *checkpoint* holds ``commit.json``, or is a ``step_<N>`` (or a save's or deletion's
  leftover) in a checkpoint folder.
"""

from __future__ import annotations

import os
from pathlib import Path

from .retention import LEFTOVER_DIR
from .store import COMMIT_FILE, STEP_DIR

CONFIG_FILE = "config.yaml"
LOCK_FILE = ".lock"
RUN_FILE = "run.json"  # the run's identity (see rundir)
DATA_FILES = "data_files.json"  # the data files' sizes and hashes when the run began (loop.train)
EVENTS_DIR = "tensorboard"  # TensorBoard's event files, with tracker.tensorboard (loop.tensorboard)
METRICS_FILE = "metrics.jsonl"  # one JSON object per line, each with the "step" it describes (loop.trackers)

RUN_DIR, CHECKPOINT_FOLDER, CHECKPOINT = "run directory", "checkpoint folder", "checkpoint"
KINDS = (CHECKPOINT, CHECKPOINT_FOLDER, RUN_DIR)  # innermost first: a checkpoint lies in a folder, in a run


def is_run_dir(p: Path) -> bool:
    return (p / RUN_FILE).is_file() or (
        (p / CONFIG_FILE).is_file() and ((p / "model_config.json").is_file() or (p / LOCK_FILE).is_file())
    )


def is_checkpoint_folder(p: Path) -> bool:
    if p.name == "checkpoints" and is_run_dir(p.parent):
        return True
    try:
        return any(STEP_DIR.match(e.name) and (e / COMMIT_FILE).is_file() for e in p.iterdir())
    except OSError:  # unreadable: nothing of ours is known to be there
        return False


def is_checkpoint(p: Path) -> bool:
    if (p / COMMIT_FILE).is_file():
        return True
    return bool(STEP_DIR.match(p.name) or LEFTOVER_DIR.match(p.name)) and is_checkpoint_folder(p.parent)


_TESTS = {CHECKPOINT: is_checkpoint, CHECKPOINT_FOLDER: is_checkpoint_folder, RUN_DIR: is_run_dir}


def kind_of(p: Path, kinds: tuple[str, ...] = KINDS) -> str | None:
    """Which of ``kinds`` the directory ``p`` is (the innermost kind first), or None."""
    if not p.is_dir():
        return None
    return next((k for k in kinds if _TESTS[k](p)), None)


def enclosing(path: Path, kinds: tuple[str, ...] = KINDS) -> tuple[str, Path] | None:
    """``(kind, place)`` of the innermost place of ``kinds`` that ``path`` (symlinks resolved) is
    or lies inside, or None."""
    p = path.resolve()
    for q in (p, *p.parents):
        kind = kind_of(q, kinds)
        if kind is not None:
            return kind, q
    return None


def held_below(folder: Path) -> tuple[str, Path] | None:
    """``(kind, place)`` of a place of ours somewhere inside ``folder`` (links not followed), or None."""
    for top, dirs, _ in os.walk(folder):
        for name in dirs:
            p = Path(top) / name
            kind = None if p.is_symlink() else kind_of(p)  # removing a folder removes a link, not its target
            if kind is not None:
                return kind, p
    return None
