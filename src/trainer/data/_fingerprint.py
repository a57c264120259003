"""What a run's data files were, so that a resume notices when one changed.

An order that resumes exactly (``_loader``) replays the right rows only over the same tokens: a file
edited, replaced, added or removed since the run began gives other rows at the same steps. A run
records, per source file (``_build.data_files``: the files ``build_data`` reads), its size, mtime
and a SHA-256 of its whole content; a resume compares. A file whose size or hash differ changed;
one that differs only in mtime (copied, touched) did not. A record of an older trainer (no
``whole`` field) hashed a file larger than two MiB over its first and last MiB only: such an entry
is compared the way it was made.

Hashing reads every byte of every file (SHA-256 streams at about 1 GB/s a core): a launch hashes
each file once, for the resume's comparison and the record both (``_HASHED``: remembered within
the process while the file's inode, size, mtime and ctime stay the same; the ctime changes at any
write, even one that puts the mtime back).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from ..config.data_section import DataError

BLOCK = 1 << 20
_HASHED: dict[tuple, str] = {}  # (path, inode, size, mtime_ns, ctime_ns) -> sha256 of the content


def fingerprint(paths: list[Path]) -> dict[str, dict]:
    """``{path: {size, mtime_ns, sha256}}``, the hash over the whole file."""
    out = {}
    for path in paths:
        try:
            st = path.stat()
            key = (str(path), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            digest = _HASHED.get(key)
            if digest is None:
                h = hashlib.sha256()
                with open(path, "rb") as f:
                    while block := f.read(BLOCK):
                        h.update(block)
                digest = _HASHED[key] = h.hexdigest()
        except OSError as e:
            raise DataError(f"cannot read data file {str(path)!r}: {e.strerror or e}") from None
        out[str(path)] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest, "whole": True}
    return out


def changed_files(recorded: dict[str, dict], current: dict[str, dict]) -> list[str]:
    """One line per file that differs between two fingerprints (empty: the same data)."""
    out = []
    for path, was in recorded.items():
        now = current.get(path)
        if now is None:
            out.append(f"{path} (no longer among the data files)")
        elif not isinstance(was, dict) or was.get("size") != now["size"]:
            out.append(f"{path} (size {was.get('size') if isinstance(was, dict) else '?'} -> {now['size']} bytes)")
        elif was.get("sha256") != (now["sha256"] if was.get("whole") else _legacy_hash(Path(path), now["size"])):
            out.append(f"{path} (same size, other content)")
    out += [f"{path} (added since)" for path in current if path not in recorded]
    return out


def _legacy_hash(path: Path, size: int) -> str | None:
    """The hash an older trainer recorded: the first and last ``BLOCK`` bytes (the whole file below
    two blocks, which is the same as the whole-file hash)."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            h.update(f.read(BLOCK))
            if size > BLOCK:
                f.seek(max(size - BLOCK, BLOCK))
                h.update(f.read(BLOCK))
    except OSError:
        return None
    return h.hexdigest()
