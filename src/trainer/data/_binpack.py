"""Whole-sample packing: the documents of a flagged token stream (chat sources, ``_chat``) placed
whole into rows of ``seq_len`` by best-fit decreasing bin packing, so no sample is split across two
rows and none trains on a reply whose question lies in another row.

The documents are those ``START`` flags begin. One longer than a row is cut to its first
``seq_len`` tokens, dropped, or refused (``data.chat_too_long``). The plan: documents sorted by
length, longest first (ties: the earlier first); each goes into the open row with the least room
that still holds it, else opens a new row. Rows are numbered in the order they were opened. The
plan depends on the token and flag files, ``seq_len`` and the policy alone, so every process
computes the same rows, a resumed run reads the same batches, and a process reads only the
tokens of its own rows.

A row holds its documents one after another, then padding: ``segment_ids`` number the documents
0, 1, ... and are ``PAD_SEGMENT`` on padding; ``loss_mask`` is the flagged stream's
(``_packing.pack``), False on padding and at each document's last token.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..config.data_section import DataError, check_data_key
from ._packing import FLAGGED, LOSS, PAD_SEGMENT, START, Batch, TokenStream, pack

SCAN_FLAGS = 1 << 26  # flag bytes read at a time when finding documents (a memory-mapped file is never copied whole)


def _carries_loss(stream: TokenStream, start: int, stop: int) -> bool:
    """Whether a target in ``[start, stop)`` of ``stream`` carries loss (a stream without flags: all do)."""
    return any(f is None or bool((f & LOSS).any()) for _, f in stream.pieces(start, stop))


@dataclass(frozen=True)
class Documents:
    """Documents of a stream as ``[start, stop)`` token positions, in stream order."""

    starts: np.ndarray  # int64
    stops: np.ndarray  # int64

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def lengths(self) -> np.ndarray:
        return self.stops - self.starts

    def part(self, lo: int, hi: int) -> Documents:
        return Documents(self.starts[lo:hi], self.stops[lo:hi])

    @staticmethod
    def of(stream: TokenStream) -> Documents:
        """Every document of a stream whose arrays all have flags: from each ``START`` to the
        next (or the array's end)."""
        starts, stops = [], []
        for k, flags in enumerate(stream.flags):
            if flags is None:
                raise DataError("whole-sample packing needs flagged (chat) token arrays")
            first = np.concatenate(
                [np.flatnonzero(flags[c : c + SCAN_FLAGS] & START) + c for c in range(0, len(flags), SCAN_FLAGS)]
                or [[]]
            ).astype(np.int64)
            if len(flags) and (not first.size or first[0] != 0):
                raise DataError("a chat token array does not begin with a document start; delete its cache to rebuild")
            offset = int(stream.offsets[k])
            starts.append(first + offset)
            stops.append(np.append(first[1:], len(flags)) + offset)
        return Documents(np.concatenate(starts), np.concatenate(stops))


def plan_rows(lengths: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Best-fit decreasing: ``(order, row_starts)``, the document indices row by row (each row's
    in the order they were placed) and where each row begins in ``order`` (CSR, ``rows + 1``
    entries). Every length must be in ``[1, seq_len]``."""
    rows_of: list[list[int]] = []
    room_rows: dict[int, list[int]] = {}  # room left -> the rows with that much, earliest opened first
    rooms: list[int] = []  # the distinct rooms that some row has, sorted
    for d in np.argsort(-lengths, kind="stable").tolist():
        n = int(lengths[d])
        i = bisect.bisect_left(rooms, n)
        if i == len(rooms):
            row, room = len(rows_of), seq_len
            rows_of.append([])
        else:
            room = rooms[i]
            row = heapq.heappop(room_rows[room])
            if not room_rows[room]:
                del room_rows[room], rooms[i]
        rows_of[row].append(d)
        left = room - n
        if left:
            if left not in room_rows:
                bisect.insort(rooms, left)
                room_rows[left] = []
            heapq.heappush(room_rows[left], row)
    order = np.fromiter((d for r in rows_of for d in r), np.int64, count=len(lengths))
    return order, np.cumsum([0] + [len(r) for r in rows_of], dtype=np.int64)


class PackedSequences:
    """Rows of whole documents (see the module docstring); reads like ``Sequences``.

    Args:
        stream: a flagged token stream.
        seq_len: tokens per row.
        documents: the documents to pack (default: all of the stream's).
        too_long: ``truncate``, ``drop`` or ``error`` for a document longer than a row.
        label: names the source in messages and the log (``data.train source 'chat'``).
    """

    def __init__(
        self,
        stream: TokenStream,
        seq_len: int,
        documents: Documents | None = None,
        *,
        too_long: str = "truncate",
        label: str = "",
    ):
        check_data_key("seq_len", seq_len)
        docs = Documents.of(stream) if documents is None else documents
        lengths = docs.lengths
        long = lengths > seq_len
        self.num_long = int(long.sum())
        if self.num_long and too_long == "error":
            raise DataError(
                f"{label}{self.num_long} of {len(docs)} samples are longer than data.seq_len={seq_len} tokens "
                f"(the longest has {int(lengths.max())}); raise data.seq_len, or set data.chat_too_long "
                "to truncate or drop"
            )
        # a sample cut to a row whose loss tokens (a chat reply) all lie past it trains nothing
        self.num_lost = (
            0
            if too_long != "truncate"
            else sum(
                _carries_loss(stream, s + 1, e) and not _carries_loss(stream, s + 1, s + seq_len)
                for s, e in zip(docs.starts[long].tolist(), docs.stops[long].tolist())
            )
        )
        if too_long == "drop":
            docs = Documents(docs.starts[~long], docs.stops[~long])
        else:
            docs = Documents(docs.starts, np.minimum(docs.stops, docs.starts + seq_len))
        self.stream, self.seq_len, self.documents, self.too_long = stream, seq_len, docs, too_long
        self._order, self._row_starts = plan_rows(docs.lengths, seq_len)
        self.label = label

    def __len__(self) -> int:
        return len(self._row_starts) - 1

    @property
    def num_tokens(self) -> int:
        return len(self) * self.seq_len

    @property
    def pad_id(self) -> int:
        return self.stream.eos_id

    @property
    def padding_share(self) -> float:
        """The share of the rows' tokens that are padding."""
        return 1.0 - float(self.documents.lengths.sum()) / max(self.num_tokens, 1)

    def documents_of_row(self, row: int) -> np.ndarray:
        """Indices (into ``documents``) of the documents of a row, in the order it holds them."""
        return self._order[self._row_starts[row] : self._row_starts[row + 1]]

    def describe(self) -> str:
        """One line for the log: samples, rows, padding, what happened to long samples."""
        what = {"truncate": "cut to seq_len", "drop": "left out"}.get(self.too_long, "")
        long = f"; {self.num_long} longer than a row {what}" if self.num_long else ""
        if self.num_lost:
            long += (
                f", {self.num_lost} of them keeping no loss token (their reply lies past data.seq_len: "
                "they train nothing)"
            )
        return (
            f"{self.label}packed {len(self.documents)} whole samples into {len(self)} rows of {self.seq_len} "
            f"tokens: {self.padding_share:.1%} padding{long}"
        )

    def rows(self, indices: Sequence[int] | np.ndarray) -> Batch:
        """The packed rows at ``indices`` (each in ``[0, len(self))``)."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise DataError(f"row index out of range [0, {len(self)})")
        tokens = np.full((idx.size, self.seq_len), self.pad_id, np.int32)
        flags = np.zeros((idx.size, self.seq_len), np.uint8)
        used = np.zeros(idx.size, np.int64)
        for r, row in enumerate(idx.tolist()):
            at = 0
            for d in self.documents_of_row(row).tolist():
                lo, hi = int(self.documents.starts[d]), int(self.documents.stops[d])
                for piece, piece_flags in self.stream.pieces(lo, hi):
                    tokens[r, at : at + len(piece)] = piece
                    flags[r, at : at + len(piece)] = piece_flags | FLAGGED
                    at += len(piece)
            used[r] = at
        padding = np.arange(self.seq_len) >= used[:, None]
        flags[padding] = FLAGGED  # no LOSS: padding is never a target
        flags[np.flatnonzero(used < self.seq_len), used[used < self.seq_len]] |= START  # nor attends to a sample
        batch = pack(tokens, self.pad_id, None, flags)
        return Batch(batch.input_ids, np.where(padding, PAD_SEGMENT, batch.segment_ids), batch.loss_mask)
