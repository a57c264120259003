"""Where checkpoints may live, as a config value names it: a local path, or a key prefix in an
object store (``s3://bucket/prefix``, ``gs://bucket/prefix``).

``location`` is the one rule that turns a value into a place; any other ``scheme://`` is
refused. It lies with the config's declarations because ``load_config`` refuses a bad
``checkpoint.base`` by it before anything runs; ``named.trainer.checkpoint`` reads and writes
the places (``checkpoint.store``) and re-exports these names.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from .errors import CheckpointError

SCHEMES = ("s3", "gs")
# The checks a checkpoint file may carry, the default first: the values of the config key
# ``checkpoint.checksum`` (the module ``named.trainer.checkpoint.checksum`` computes them).
CHECKSUMS = ("crc32c", "sha256")


@dataclasses.dataclass(frozen=True)
class ObjectPath:
    """A key prefix in an object-store bucket, e.g. ``s3://bucket/runs/exp1``."""

    scheme: str
    bucket: str
    key: str = ""  # no leading or trailing '/'; "" is the bucket's root

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}" + (f"/{self.key}" if self.key else "")

    def __truediv__(self, rel: str) -> ObjectPath:
        parts = [p for p in str(rel).split("/") if p not in ("", ".")]
        if ".." in parts:
            raise CheckpointError(f"{self}: refuses the relative path {rel!r}, which leaves it ('..')")
        return ObjectPath(self.scheme, self.bucket, "/".join([self.key, *parts] if self.key else parts))

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    @property
    def parent(self) -> ObjectPath:
        return ObjectPath(self.scheme, self.bucket, self.key.rsplit("/", 1)[0] if "/" in self.key else "")

    def is_relative_to(self, other: ObjectPath) -> bool:
        return (self.scheme, self.bucket) == (other.scheme, other.bucket) and (
            not other.key or self.key == other.key or self.key.startswith(other.key + "/")
        )


Location = Path | ObjectPath


def location(value: str | os.PathLike | ObjectPath) -> Location:
    """``s3://bucket/prefix`` or ``gs://bucket/prefix`` -> ObjectPath; another ``scheme://`` ->
    CheckpointError naming it; anything else -> a local Path."""
    if isinstance(value, (Path, ObjectPath)):
        return value
    text = os.fspath(value)
    m = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", text)
    if m is None:
        return Path(text)
    scheme, rest = m.group(1).lower(), m.group(2)
    if scheme not in SCHEMES:
        raise CheckpointError(
            f"{text}: unsupported storage scheme {scheme}://; checkpoints go to a local path, "
            "s3://bucket/prefix or gs://bucket/prefix"
        )
    bucket, _, key = rest.partition("/")
    if not re.fullmatch(r"[a-z0-9][a-z0-9._-]{1,221}[a-z0-9]", bucket):
        raise CheckpointError(
            f"{text}: {bucket!r} is not a bucket name (3 or more lower-case letters, digits, '.', '-', '_')"
        )
    parts = [p for p in key.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise CheckpointError(f"{text}: the key prefix may not contain '.' or '..' parts")
    return ObjectPath(scheme, bucket, "/".join(parts))


def is_remote(loc: Location) -> bool:
    return isinstance(loc, ObjectPath)


def inside(root: Location, value: str) -> Location | None:
    """``value`` (relative to ``root``, or absolute / a URL) as a place, or None if it is outside ``root``."""
    root = location(root)
    target = location(value) if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", value) else None
    if isinstance(root, ObjectPath):
        target = target if target is not None else root / value
        return target if isinstance(target, ObjectPath) and target.is_relative_to(root) else None
    if target is not None:
        return None
    path = Path(value)
    path = path if path.is_absolute() else root / path
    return path if path.resolve().is_relative_to(root.resolve()) else None
