"""What a run's data files were, so that a resume notices when one changed.

An order that resumes exactly (``_loader``) replays the right rows only over the same tokens: a file
edited, replaced, added or removed since the run began gives other rows at the same steps. A run
records, per source file (``_build.data_files``: the files ``build_data`` reads), its size, mtime
and a SHA-256 of its first and last ``BLOCK`` bytes (the whole file when it is smaller than two
blocks); a resume compares. A file whose size or hashes differ changed; one that differs only in
mtime (copied, touched) did not.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from ..config.data_section import DataError

BLOCK = 1 << 20


def fingerprint(paths: list[Path]) -> dict[str, dict]:
    """``{path: {size, mtime_ns, sha256}}``, the hash over the first and last ``BLOCK`` bytes."""
    out = {}
    for path in paths:
        try:
            st = path.stat()
            h = hashlib.sha256()
            with open(path, "rb") as f:
                h.update(f.read(BLOCK))
                if st.st_size > BLOCK:
                    f.seek(max(st.st_size - BLOCK, BLOCK))
                    h.update(f.read(BLOCK))
        except OSError as e:
            raise DataError(f"cannot read data file {str(path)!r}: {e.strerror or e}") from None
        out[str(path)] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": h.hexdigest()}
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
        elif was.get("sha256") != now["sha256"]:
            out.append(f"{path} (same size, other content)")
    out += [f"{path} (added since)" for path in current if path not in recorded]
    return out
