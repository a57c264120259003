"""Weighted mixtures of named sources, and which source each row of each batch comes from.

``data.train`` may list named sources instead of plain specs::

    train:
      - {name: web, paths: [fineweb/*.parquet], weight: 3}
      - {name: code, paths: [stack/**/*.jsonl.zst], weight: 1, text_field: content}
      - {name: sft, paths: [chats.jsonl], weight: 1, format: chat}   # chat records (_chat)

Each source is tokenised into its own cache file and packed into its own rows. The batch
order is a function of ``(seed, step)`` alone, so resuming at a step replays nothing and every
process computes its own rows without talking to the others:

- **Blocks.** Global rows are grouped in blocks of ``L`` rows (a multiple of the batch size,
  at least ``BLOCK_ROWS``). Every block holds each source's exact quota (``L * weight / sum``
  rounded by largest remainder), in an order shuffled by ``(seed, block)``. So the mixture is
  exact over every block, and how many rows of each source come before any step is a sum over
  whole blocks plus one partial block: arithmetic, not a replay.
- **Sources.** The ``j``-th row taken from a source is row ``j mod N`` of a permutation of its
  ``N`` rows seeded by ``(seed, source name, j div N)``: a source that runs out starts a new
  epoch of itself, in a new order, while the others go on.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np

from ..config.data_section import DataError
from ._binpack import PackedSequences
from ._packing import Batch, Sequences

BLOCK_ROWS = 4096  # the finest share a weight can get is one row in a block of at least this many
_MIX_TAG, _SOURCE_TAG = 0x6D6978, 0x737263  # keep the block and source generators apart from the epoch order's


class JoinedRows:
    """The rows of several splits numbered as one range: part ``k`` owns rows
    ``[offsets[k], offsets[k + 1])``. ``rows`` reads any of them, like ``Sequences.rows``."""

    def __init__(self, parts: Sequence[Sequences | PackedSequences]):
        if not parts or len({s.seq_len for s in parts}) != 1:
            raise DataError("a mixture needs at least one source, all packed at the same seq_len")
        self.sources = list(parts)
        self.seq_len = parts[0].seq_len
        self.offsets = np.cumsum([0] + [len(s) for s in parts])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def num_tokens(self) -> int:
        return len(self) * self.seq_len

    @property
    def pad_id(self) -> int:
        return self.sources[0].pad_id

    def rows(self, indices: Sequence[int] | np.ndarray) -> Batch:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        which = np.searchsorted(self.offsets, idx, side="right") - 1
        out = Batch(
            np.empty((idx.size, self.seq_len), np.int32),
            np.empty((idx.size, self.seq_len), np.int32),
            np.empty((idx.size, self.seq_len), bool),
        )
        for k in np.unique(which):
            at = which == k
            part = self.sources[k].rows(idx[at] - self.offsets[k])
            for dst, src in zip(out, part):
                dst[at] = src
        return out


class Mixture(JoinedRows):
    """The train rows of several named sources (``JoinedRows``), each with its weight."""

    def __init__(self, names: Sequence[str], sources: Sequence[Sequences | PackedSequences], weights: Sequence[float]):
        super().__init__(sources)
        self.names, self.weights = list(names), [float(w) for w in weights]


def apportion(weights: Sequence[float], total: int) -> np.ndarray:
    """Integer shares of ``total`` proportional to ``weights`` (largest remainder, ties to the earlier)."""
    w = np.asarray(weights, np.float64)
    ideal = w / w.sum() * total
    share = np.floor(ideal).astype(np.int64)
    short = total - int(share.sum())
    order = sorted(range(len(w)), key=lambda k: (-(ideal[k] - share[k]), k))
    share[order[:short]] += 1
    return share


class MixtureOrder:
    """Which mixture row each position of each global batch reads (see the module docstring)."""

    def __init__(self, mixture: Mixture, batch_size: int, seed: int):
        self.mixture, self.batch_size, self.seed = mixture, batch_size, seed % (1 << 63)
        self.block = batch_size * -(-BLOCK_ROWS // batch_size)
        self.quota = apportion(mixture.weights, self.block)
        for name, w, q in zip(mixture.names, mixture.weights, self.quota):
            if w > 0 and q == 0:
                raise DataError(
                    f"data.train: source {name!r} has weight {w:g}, less than one row in {self.block} of "
                    "the mixture; raise its weight or drop it"
                )
        self._tags = [zlib.crc32(n.encode()) for n in mixture.names]
        self._block_cache: tuple[int, np.ndarray, np.ndarray] | None = None
        self._perms: list[dict[int, np.ndarray]] = [{} for _ in mixture.names]

    def global_indices(self, step: int) -> np.ndarray:
        b, o = divmod(step * self.batch_size, self.block)
        labels, ranks = self._block(b)
        src = labels[o : o + self.batch_size]
        taken = b * self.quota[src] + ranks[o : o + self.batch_size]  # how many rows each source gave before
        out = np.empty(self.batch_size, np.int64)
        for k in np.unique(src):
            at = src == k
            n = len(self.mixture.sources[k])
            epoch, row = np.divmod(taken[at], n)
            local = np.empty(row.size, np.int64)
            for e in np.unique(epoch):
                local[epoch == e] = self._permutation(k, int(e))[row[epoch == e]]
            out[at] = self.mixture.offsets[k] + local
        return out

    def rows_before(self, step: int) -> np.ndarray:
        """Rows each source has given to the batches before ``step`` (all processes together)."""
        b, o = divmod(step * self.batch_size, self.block)
        labels, _ = self._block(b)
        return b * self.quota + np.bincount(labels[:o], minlength=len(self.quota))

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        if self._block_cache is None or self._block_cache[0] != b:
            rng = np.random.default_rng([self.seed, _MIX_TAG, b])
            labels = rng.permutation(np.repeat(np.arange(len(self.quota)), self.quota))
            ranks = np.empty(self.block, np.int64)
            for k, q in enumerate(self.quota):
                ranks[labels == k] = np.arange(q)
            self._block_cache = (b, labels, ranks)
        return self._block_cache[1], self._block_cache[2]

    def _permutation(self, k: int, epoch: int) -> np.ndarray:
        perms = self._perms[k]
        if epoch not in perms:
            if len(perms) >= 2:  # a batch rarely spans more than two epochs of a source
                perms.pop(min(perms))
            rng = np.random.default_rng([self.seed, _SOURCE_TAG, self._tags[k], epoch])
            perms[epoch] = rng.permutation(len(self.mixture.sources[k]))
        return perms[epoch]
