"""The check each checkpoint file carries: crc32c by default, sha256 where a user asks for it.

``commit.json`` lists every file as ``{"<check>": digest, "size": n}``: the key names the check,
so a checkpoint restores with whatever check it was saved with (every checkpoint before crc32c
became the default carries sha256). crc32c (Castagnoli; the checksum of zarr v3's ``crc32c``
codec, of GCS objects and of S3's ``x-amz-checksum-crc32c``) runs in hardware at over 10 GB/s
per core; sha256 ran at 0.5-1.6 GB/s, so that saving and restoring a checkpoint spent more CPU
on the hash than on moving the bytes (issue 45). A CRC catches what disks and networks do to
bytes (flipped bits, torn or cut writes); sha256 (``checkpoint.checksum: sha256``) also stands
against someone who changes a file on purpose and fixes up its CRC.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path

import google_crc32c
import numpy as np

from ..config import CHECKSUMS, CheckpointError

DEFAULT = CHECKSUMS[0]
PIECE = 8 << 20  # bytes read at a time when a file is hashed from disk


class _Crc32c:
    """crc32c with hashlib's ``update`` / ``hexdigest``; takes any buffer without copying it."""

    def __init__(self) -> None:
        self._crc = 0
        if google_crc32c.implementation != "c" and not _Crc32c.warned:
            _Crc32c.warned = True
            warnings.warn(
                "google-crc32c has no compiled extension on this platform: checkpoint crc32c runs in pure "
                "Python, far slower than the disk (install its wheel, or set checkpoint.checksum: sha256)",
                RuntimeWarning,
                stacklevel=3,
            )

    warned = False

    def update(self, data) -> None:
        if len(data):
            self._crc = google_crc32c.extend(self._crc, np.frombuffer(data, np.uint8))

    def hexdigest(self) -> str:
        return f"{self._crc:08x}"


_NEW = {"crc32c": _Crc32c, "sha256": hashlib.sha256}  # the checks CHECKSUMS names (tests/test_checkpoint.py)


def new(check: str):
    """A running digest of ``check`` (``update(buffer)``, ``hexdigest()``)."""
    if check not in _NEW:
        raise CheckpointError(f"unknown checksum {check!r}: one of {', '.join(CHECKSUMS)}")
    return _NEW[check]()


def digest(check: str, data) -> str:
    d = new(check)
    d.update(data)
    return d.hexdigest()


def entry(check: str, hexdigest: str, size: int) -> dict:
    """A file's entry in ``commit.json``."""
    return {check: hexdigest, "size": size}


def check_of(info: dict, where) -> str:
    """The check a file's entry carries (``where`` names the file in the error)."""
    found = [c for c in CHECKSUMS if c in info]
    if len(found) != 1:
        raise CheckpointError(f"{where}: its entry in the commit record carries no one checksum of {CHECKSUMS}")
    return found[0]


def matches(info: dict, data, where) -> bool:
    """Whether ``data`` (a buffer) has the digest ``info`` records."""
    check = check_of(info, where)
    return digest(check, data) == info[check]


def hash_file(path: Path, check: str, fsync: bool = False) -> tuple[str, int]:
    """The ``check`` digest and size of a file, read in pieces into one buffer (and fsync it)."""
    d, size = new(check), 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(min(PIECE, os.fstat(f.fileno()).st_size + 1))  # small files, small buffers
        view = memoryview(buf)
        while n := f.readinto(buf):
            d.update(view[:n])
            size += n
        if fsync:
            os.fsync(f.fileno())
    return d.hexdigest(), size
