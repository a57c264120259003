"""Work folders that a killed process leaves behind, and how the next run tells them apart.

A process filling a folder it will rename or remove when done (a cache build's shards, an
export's temporary folder) holds a shared ``flock`` on the folder itself while it works
(``working_in``). The kernel drops the lock when the process dies, so a folder that nobody holds
is a dead process's: ``remove_abandoned`` removes each such folder and names it. A holder takes
its lock only on the folder it made, not on one removed meanwhile (it checks the inode and makes
the folder again), so a remover never takes a folder from under a live process.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

log = logging.getLogger(__name__)

_MAKE_TRIES = 100  # a folder removed each time it is made: give up, raising the last FileNotFoundError


@contextlib.contextmanager
def working_in(folder: Path, make: Callable[[], None]) -> Iterator[None]:
    """``make()`` the folder, then hold it until the block ends."""
    for tries in itertools.count(1):
        try:
            make()
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            if tries == _MAKE_TRIES:
                raise
            continue  # another process removed it (or its parent) while it was being made: make it again
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            if os.stat(folder).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)  # removed between make() and the lock: make it again
    try:
        yield
    finally:
        os.close(fd)


def remove_abandoned(folders: Iterable[Path], what: str) -> list[Path]:
    """Remove each of ``folders`` that no live process holds (``working_in``), logging each one as
    ``what`` left behind; return those removed."""
    removed = []
    for folder in folders:
        try:
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            continue  # gone meanwhile, or not a folder
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)  # held: a live process works in it
            continue
        try:
            shutil.rmtree(folder)
            removed.append(folder)
            log.warning("removed %s, left behind by %s that was stopped before it finished", folder, what)
        except OSError as e:
            log.warning("cannot remove %s, left behind by %s: %s", folder, what, e.strerror or e)
        finally:
            os.close(fd)
    return removed
