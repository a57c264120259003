"""Packing: a token stream cut into fixed-length rows, with segment ids and a loss mask.

Concatenate-and-chunk: row ``j`` is tokens ``[j*seq_len, (j+1)*seq_len)`` of the stream;
the tail that does not fill a row is dropped. A document ends with its eos token (eos
belongs to the document it ends). Within a row a new segment starts after every eos and
at the first token of every file of the stream; ``segment_ids`` number the segments of a
row 0, 1, 2, ... so attention with a segment mask never crosses documents. ``loss_mask[i]``
says whether the target of position ``i`` -- the next token, ``input_ids[i + 1]`` -- is in
the same segment: it is False at eos, before a file boundary, and at the last position of
every row (its next token is not in the row). Padding rows (only in evaluation, to fill the
last batch) have ``segment_ids == -1`` and no loss.

A token array may come with *flags*, one byte per token (chat sources, ``_chat``): there a
segment starts at each token flagged ``START`` (not after eos, which a chat template may use
inside a conversation), and ``loss_mask[i]`` is also False unless token ``i + 1`` is flagged
``LOSS``. Arrays without flags are packed exactly as above.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from ..config.data_section import DataError, check_data_key

PAD_SEGMENT = -1
LOSS, START = 1, 2  # flag bits: the token is a target that carries loss; the token starts a document
FLAGGED = 4  # set by TokenStream.windows on tokens of flagged arrays


class Batch(NamedTuple):
    """Rows of packed sequences (a pytree, as a NamedTuple). Shapes ``[rows, seq_len]``."""

    input_ids: np.ndarray  # int32
    segment_ids: np.ndarray  # int32; PAD_SEGMENT on padding
    loss_mask: np.ndarray  # bool; True where input_ids[:, i + 1] is the same document's next token


class TokenStream:
    """Several token arrays (usually memory-mapped files) read as one, remembering where
    each file starts so that no segment runs across two files. ``flags`` gives, per array,
    its flag bytes (same length) or None."""

    def __init__(self, arrays: Sequence[np.ndarray], eos_id: int, flags: Sequence[np.ndarray | None] | None = None):
        if not arrays:
            raise DataError("the corpus is empty: no token arrays")
        self.arrays = list(arrays)
        self.flags = list(flags) if flags is not None else [None] * len(self.arrays)
        if len(self.flags) != len(self.arrays) or any(
            f is not None and len(f) != len(a) for a, f in zip(self.arrays, self.flags)
        ):
            raise DataError("every token array needs flags of its own length, or none")
        self.eos_id = eos_id
        self.offsets = np.cumsum([0] + [len(a) for a in self.arrays])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def pieces(self, start: int, stop: int) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """Tokens ``[start, stop)`` as views of the underlying arrays (with their flags), cut where files meet."""
        out = []
        for k, a in enumerate(self.arrays):
            lo, hi = max(start - int(self.offsets[k]), 0), min(stop - int(self.offsets[k]), len(a))
            if lo < hi:
                f = self.flags[k]
                out.append((a[lo:hi], None if f is None else f[lo:hi]))
        return out

    def windows(self, starts: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Tokens ``[start, start + length)`` for each start, as int32 ``[len(starts), length]``,
        a bool array of the same shape, True where a file begins, and the flags (with
        ``FLAGGED`` set on the tokens of flagged arrays), or None when no array has flags."""
        pos = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(length, dtype=np.int64)
        flagged = any(f is not None for f in self.flags)
        flags = np.zeros(pos.shape, np.uint8) if flagged else None
        if len(self.arrays) == 1:
            if flagged:
                flags[...] = self.flags[0][pos] | FLAGGED
            return np.asarray(self.arrays[0][pos], dtype=np.int32), np.zeros(pos.shape, bool), flags
        which = np.searchsorted(self.offsets, pos, side="right") - 1
        local = pos - self.offsets[which]
        tokens = np.empty(pos.shape, np.int32)
        for k in np.unique(which):
            at = which == k
            tokens[at] = self.arrays[k][local[at]]
            if self.flags[k] is not None:
                flags[at] = self.flags[k][local[at]] | FLAGGED
        return tokens, local == 0, flags


class Sequences:
    """Rows ``[first, first + count)`` of a token stream packed at ``seq_len`` (one split)."""

    def __init__(self, stream: TokenStream, seq_len: int, first: int = 0, count: int | None = None):
        check_data_key("seq_len", seq_len)
        total = len(stream) // seq_len
        count = total - first if count is None else count
        if not (0 <= first and 0 <= count and first + count <= total):
            raise DataError(f"rows [{first}, {first + count}) are outside the {total} rows of the stream")
        self.stream, self.seq_len, self.first, self.count = stream, seq_len, first, count

    def __len__(self) -> int:
        return self.count

    @property
    def num_tokens(self) -> int:
        return self.count * self.seq_len

    @property
    def pad_id(self) -> int:
        return self.stream.eos_id

    @staticmethod
    def concat(parts: Sequence[Sequences]) -> Sequences:
        """The rows of several splits, one after another, as one split (no copy: views of the
        same files). A cut between two parts falls at a row start, where a segment starts anyway."""
        pieces = [x for p in parts for x in p.stream.pieces(p.first * p.seq_len, (p.first + p.count) * p.seq_len)]
        arrays, flags = [a for a, _ in pieces], [f for _, f in pieces]
        return Sequences(TokenStream(arrays, parts[0].stream.eos_id, flags), parts[0].seq_len)

    def rows(self, indices: Sequence[int] | np.ndarray) -> Batch:
        """The packed rows at ``indices`` (each in ``[0, len(self))``)."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self.count):
            raise DataError(f"row index out of range [0, {self.count})")
        tokens, file_start, flags = self.stream.windows((self.first + idx) * self.seq_len, self.seq_len)
        return pack(tokens, self.stream.eos_id, file_start, flags)


def pack(
    tokens: np.ndarray, eos_id: int, file_start: np.ndarray | None = None, flags: np.ndarray | None = None
) -> Batch:
    """Segment ids and loss mask for rows of a token stream (see the module docstring)."""
    new_doc = np.zeros(tokens.shape, bool)
    new_doc[:, 1:] = tokens[:, :-1] == eos_id
    if flags is not None:
        flagged = (flags[:, 1:] & FLAGGED) != 0
        new_doc[:, 1:] = np.where(flagged, (flags[:, 1:] & START) != 0, new_doc[:, 1:])
    if file_start is not None:
        new_doc[:, 1:] |= file_start[:, 1:]
    segment_ids = np.cumsum(new_doc, axis=1, dtype=np.int32)
    loss_mask = np.zeros(tokens.shape, bool)
    loss_mask[:, :-1] = ~new_doc[:, 1:]
    if flags is not None:
        loss_mask[:, :-1] &= ~flagged | ((flags[:, 1:] & LOSS) != 0)
    return Batch(tokens.astype(np.int32, copy=False), segment_ids, loss_mask)


def padding_rows(n: int, seq_len: int, eos_id: int) -> Batch:
    return Batch(
        np.full((n, seq_len), eos_id, np.int32),
        np.full((n, seq_len), PAD_SEGMENT, np.int32),
        np.zeros((n, seq_len), bool),
    )
