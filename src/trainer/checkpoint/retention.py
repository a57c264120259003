"""Which checkpoints a run keeps, applied after each commit.

Retention looks only at checkpoints up to the step just saved: ``keep_last`` counts those, and a
checkpoint of a later step is never counted nor deleted. Those can only be left by an earlier
launch that got further (the trainer refuses to resume behind a good one, see ``rundir``), and
counting them would make a run prune its own newest checkpoints.

A *temporary* checkpoint (time-based, ``checkpoint.every_minutes``, or written on a stop
signal) is not counted by ``keep_last``; it is deleted once a newer checkpoint commits, unless
``keep_every`` keeps its step.

Deleting is atomic where the storage allows it: a local ``step_<N>`` is renamed aside and then
removed; on an object store the commit record goes first (from then on the checkpoint is not
trusted), then its other objects. Leftovers of crashed saves and deletions are removed too.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path

from .read import list_checkpoints, read_commit, uncommitted_steps
from .store import COMMIT_FILE, CheckpointError, Location, ObjectPath, delete_objects, delete_prefix

LEFTOVER_DIR = re.compile(r"^step_\d+\.(tmp|deleting|replaced)-[0-9a-f]+$")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_temporary(path: Location) -> bool:
    try:
        return bool(read_commit(path).get("temporary", False))
    except CheckpointError:
        return False  # unreadable: treated as permanent, so never deleted for being temporary


def doomed(steps: dict[int, bool], newest: int, keep_last: int | None, keep_every: int | None) -> list[int]:
    """The steps to delete, given ``step -> temporary`` of the committed checkpoints up to ``newest``."""
    permanent = sorted(s for s, temp in steps.items() if not temp)
    keep = {newest}
    keep.update(permanent if keep_last is None else permanent[-keep_last:])
    if keep_every:
        keep.update(s for s in steps if s % keep_every == 0)
    return sorted(s for s in steps if s < newest and s not in keep)


def apply_retention(ckdir: Location, newest: int, keep_last: int | None, keep_every: int | None) -> None:
    found = [(s, p) for s, p in list_checkpoints(ckdir.parent, subdir=ckdir.name) if s <= newest]
    steps = {s: _is_temporary(p) for s, p in found}
    gone = doomed(steps, newest, keep_last, keep_every)
    if isinstance(ckdir, ObjectPath):
        _delete_objects(ckdir, gone)
        return
    for s in gone:
        doomed_dir = ckdir / f"step_{s}.deleting-{uuid.uuid4().hex[:12]}"
        os.rename(ckdir / f"step_{s}", doomed_dir)  # atomic: never a half-deleted step_<s>
        shutil.rmtree(doomed_dir, ignore_errors=True)
    for entry in ckdir.iterdir():  # leftovers of crashed saves and deletions
        if LEFTOVER_DIR.match(entry.name) and entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
    fsync_dir(ckdir)


def _delete_objects(ckdir: ObjectPath, gone: list[int]) -> None:
    for s in gone:
        delete_objects(ckdir / f"step_{s}", [COMMIT_FILE])  # first: from now on it is not trusted
    for s in gone:
        delete_prefix(ckdir / f"step_{s}")
    for name in uncommitted_steps(ckdir):  # saves that never committed, deletions that stopped
        delete_prefix(ckdir / name)
