"""Where documents come from: text files, JSONL, pre-tokenised arrays, the stdlib corpus.

A *source spec* is a string: a path, a glob (``data/**/*.txt``), or ``"stdlib"`` for the
embedded default corpus. Each matched file's kind follows from its extension: ``.jsonl``
(one JSON object per line with a ``text`` field), ``.npy`` and ``.bin`` (pre-tokenised,
taken as they are), anything else is a text file holding one document. Text must be UTF-8:
a file with a NUL byte or invalid UTF-8 is refused (naming the file and line) rather than
trained on as replacement characters.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from ._errors import DataError

STDLIB = "stdlib"
BIN_DTYPES = ("uint16", "uint32")
_SKIPPED_STDLIB_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
_SCAN_CHUNK = 1 << 24  # tokens per chunk when checking ids of a pre-tokenised file
# JSON escapes can produce lone surrogates, which no tokenizer can encode.
_SURROGATE = re.compile("[\ud800-\udfff]")

Kind = Literal["text", "jsonl", "npy", "bin"]


@dataclass(frozen=True)
class SourceFile:
    path: Path
    kind: Kind

    @property
    def pretokenized(self) -> bool:
        return self.kind in ("npy", "bin")


def resolve_sources(specs: Sequence[str], *, stdlib_bytes: int = 8_000_000) -> list[SourceFile]:
    """Expand specs into an ordered, de-duplicated file list; fail on anything missing."""
    if not specs:
        raise DataError("no data sources given; list files, globs or 'stdlib' in data.train")
    files: list[Path] = []
    for spec in specs:
        if spec == STDLIB:
            files += stdlib_files(stdlib_bytes)
        elif glob.has_magic(spec):
            matched = sorted(Path(p) for p in glob.glob(str(Path(spec).expanduser()), recursive=True))
            matched = [p for p in matched if p.is_file()]
            if not matched:
                raise DataError(f"no files match the pattern {spec!r}")
            files += matched
        else:
            path = Path(spec).expanduser()
            if path.is_dir():
                hint = f"{spec.rstrip('/')}/**/*.txt"
                raise DataError(f"data source {spec!r} is a directory; give a glob such as {hint!r}")
            if not path.exists():
                raise DataError(f"data source {spec!r} does not exist")
            if not path.is_file():
                raise DataError(f"data source {spec!r} is not a regular file")
            files.append(path)
    seen: set[Path] = set()
    out = []
    for p in files:
        p = p.resolve()
        if p not in seen:
            seen.add(p)
            out.append(SourceFile(p, _kind(p)))
    return out


def stdlib_files(max_bytes: int) -> list[Path]:
    """The default corpus: this Python's standard-library ``*.py`` files (tests and
    site-packages left out), in sorted order, up to about ``max_bytes``.

    Needs no network and is the same on every run on one machine.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    candidates = []
    for folder, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in _SKIPPED_STDLIB_DIRS]  # prunes the walk
        candidates += [Path(folder, n) for n in names if n.endswith(".py")]
    candidates.sort(key=lambda p: p.relative_to(root).as_posix())
    out, total = [], 0
    for p in candidates:
        if total >= max_bytes:
            break
        out.append(p)
        total += p.stat().st_size
    if not out:
        raise DataError(
            f"no standard-library sources under {str(root)!r} for the 'stdlib' corpus; "
            "list your own files in data.train"
        )
    return out


def iter_documents(files: Sequence[SourceFile]) -> Iterator[tuple[str, str]]:
    """``(where, text)`` for each document of the text and JSONL files, in order
    (pre-tokenised files are skipped); ``where`` is the file, or ``file:line`` in JSONL."""
    for src in files:
        if src.kind == "text":
            yield str(src.path), _read_text(src.path)
        elif src.kind == "jsonl":
            yield from _read_jsonl(src.path)


def open_pretokenized(src: SourceFile, *, bin_dtype: str, vocab_size: int | None) -> np.ndarray:
    """Memory-map a ``.npy`` or ``.bin`` token file after checking its size, dtype and ids.

    ``vocab_size=None`` skips the id scan (benchmarks on synthetic files).
    """
    tokens = _map_npy(src.path) if src.kind == "npy" else _map_bin(src.path, bin_dtype)
    if vocab_size is not None:
        check_token_ids(tokens, vocab_size, src.path)
    return tokens


def check_token_ids(tokens: np.ndarray, vocab_size: int, path: Path) -> None:
    for start in range(0, len(tokens), _SCAN_CHUNK):
        chunk = tokens[start : start + _SCAN_CHUNK]
        i = first_out_of_range(chunk, vocab_size)
        if i is not None:
            raise DataError(
                f"{str(path)!r}: token id {int(chunk[i])} at position {start + i} is outside the tokenizer's "
                f"vocabulary of {vocab_size}; was the file made with another tokenizer?"
            )


def first_out_of_range(ids: np.ndarray, vocab_size: int) -> int | None:
    """Index of the first id outside ``[0, vocab_size)``, or None; a min and a max when all are in range."""
    if ids.size == 0 or (int(ids.max()) < vocab_size and (ids.dtype.kind == "u" or int(ids.min()) >= 0)):
        return None
    return int(np.argmax((ids >= vocab_size) | (ids < 0)))


def _kind(path: Path) -> Kind:
    suffix = path.suffix.lower()
    return {".jsonl": "jsonl", ".npy": "npy", ".bin": "bin"}.get(suffix, "text")


def _read_text(path: Path) -> str:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read data file {str(path)!r}: {e.strerror}") from e
    nul = raw.find(b"\0")
    if nul >= 0:
        raise DataError(
            f"{path}:{_line_at(raw, nul)}: a NUL byte (at byte {nul}); this looks like a binary file, not UTF-8 "
            "text; give text, .jsonl, .npy or .bin files"
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{path}:{_line_at(raw, e.start)}: not valid UTF-8 (at byte {e.start}); convert the file to UTF-8"
        ) from e


def _line_at(raw: bytes, offset: int) -> int:
    return raw.count(b"\n", 0, offset) + 1


def _read_jsonl(path: Path) -> Iterator[tuple[str, str]]:
    try:
        f = path.open("rb")
    except OSError as e:
        raise DataError(f"cannot read data file {str(path)!r}: {e.strerror}") from e
    lineno = 0
    try:
        with f:
            for lineno, line in enumerate(f, start=1):
                if line.strip():
                    yield f"{path}:{lineno}", _jsonl_text(line, path, lineno)
    except OSError as e:
        raise DataError(f"cannot read data file {str(path)!r} after line {lineno}: {e.strerror}") from e


def _jsonl_text(line: bytes, path: Path, lineno: int) -> str:
    try:
        record = json.loads(line)
    except UnicodeDecodeError as e:
        raise DataError(f"{path}:{lineno}: not valid UTF-8 (at byte {e.start} of the line)") from e
    except (ValueError, RecursionError) as e:  # RecursionError: nesting deeper than the parser's stack
        raise DataError(f"{path}:{lineno}: not valid JSON ({type(e).__name__}: {e})") from e
    if not isinstance(record, dict):
        raise DataError(f"{path}:{lineno}: expected an object with a string 'text' field, got {_json_kind(record)}")
    text = record.get("text")
    if not isinstance(text, str):
        got = "no 'text' field" if "text" not in record else f"'text' is {_json_kind(text)}"
        raise DataError(f"{path}:{lineno}: expected an object with a string 'text' field; {got}")
    if _SURROGATE.search(text):
        raise DataError(f"{path}:{lineno}: the 'text' field holds a lone UTF-16 surrogate (\\ud800-\\udfff escape)")
    return text


def _json_kind(value) -> str:
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    kinds = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number"}
    return kinds.get(type(value), type(value).__name__)


def _map_npy(path: Path) -> np.ndarray:
    try:
        with path.open("rb") as f:
            version = np.lib.format.read_magic(f)
            fmt = np.lib.format
            shape, _, dtype = (fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0)(f)
            offset = f.tell()
    except (OSError, ValueError, EOFError) as e:
        raise DataError(f"{str(path)!r} is not a readable .npy file: {e}") from e
    if dtype.kind not in "iu" or len(shape) != 1:
        raise DataError(f"{str(path)!r} holds {dtype} of shape {shape}; a token file is a 1-D integer array")
    expected = offset + shape[0] * dtype.itemsize
    actual = path.stat().st_size
    if actual != expected:
        raise DataError(f"{str(path)!r} is truncated or corrupt: {actual} bytes, its header says {expected}")
    if shape[0] == 0:
        raise DataError(f"{str(path)!r} holds no tokens")
    return memmap_tokens(path, dtype, offset=offset, shape=shape)


def _map_bin(path: Path, dtype_name: str) -> np.ndarray:
    if dtype_name not in BIN_DTYPES:
        raise DataError(f"data.bin_dtype must be one of {BIN_DTYPES}, got {dtype_name!r}")
    dtype = np.dtype(dtype_name)
    try:
        size = path.stat().st_size
    except OSError as e:
        raise DataError(f"cannot read data file {str(path)!r}: {e.strerror}") from e
    if size == 0:
        raise DataError(f"{str(path)!r} holds no tokens")
    if size % dtype.itemsize:
        raise DataError(
            f"{str(path)!r} is {size} bytes, not a multiple of {dtype.itemsize} (data.bin_dtype={dtype_name}); "
            "truncated, or written with another dtype?"
        )
    return memmap_tokens(path, dtype)


def memmap_tokens(path: Path, dtype: np.dtype, **kw) -> np.memmap:
    try:
        return np.memmap(path, dtype=dtype, mode="r", **kw)
    except (OSError, ValueError) as e:
        raise DataError(f"cannot memory-map data file {str(path)!r}: {e}") from e
