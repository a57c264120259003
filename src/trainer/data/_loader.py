"""Batch order: shuffled, resumable train batches and padded evaluation batches, per process.

The train order is a seeded permutation of the split's rows, a fresh one per epoch
(``numpy`` PCG64 seeded by ``(seed, epoch)``); batch ``b`` of an epoch is the permuted rows
``[b*B, (b+1)*B)`` and the rows left over at the end of an epoch are skipped that epoch.
Step ``s`` therefore maps to ``(epoch, b) = divmod(s, batches_per_epoch)`` by arithmetic:
resuming at any step reads exactly that step's batch and replays nothing, so the loader's
whole state is the step number. With several processes the rows of each global batch are
split contiguously: process ``p`` of ``P`` gets rows ``[p*B/P, (p+1)*B/P)`` and reads only
their tokens. A weighted mixture of sources (``_mixture``) has its own order, also computed
from ``(seed, step)`` alone, and the same split between processes.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ..config.data_section import DataError
from ._binpack import PackedSequences
from ._mixture import JoinedRows, Mixture, MixtureOrder
from ._packing import Batch, Sequences, padding_rows


def _check_processes(batch_size: int, process_index: int, process_count: int) -> int:
    if batch_size < 1:
        raise DataError(f"batch size must be at least 1, got {batch_size}")
    if process_count < 1 or not 0 <= process_index < process_count:
        raise DataError(f"process_index {process_index} is not in [0, process_count={process_count})")
    if batch_size % process_count:
        raise DataError(f"batch size {batch_size} is not divisible by the {process_count} processes that share it")
    return batch_size // process_count


class TrainBatches:
    """The train batches of one process, in seeded shuffled order, for any step.

    Args:
        sequences: the train split, or a weighted mixture of named splits.
        batch_size: rows of the *global* batch (all processes together).
        seed: fixes the order; the same seed gives the same batches on every run.
        process_index, process_count: this process and how many share each global batch.
    """

    def __init__(
        self,
        sequences: Sequences | PackedSequences | Mixture,
        *,
        batch_size: int,
        seed: int,
        process_index: int = 0,
        process_count: int = 1,
    ):
        self.local_batch_size = _check_processes(batch_size, process_index, process_count)
        # A mixture's sources repeat by epochs of their own, so it needs no batch's worth of rows.
        self._mixture = MixtureOrder(sequences, batch_size, seed) if isinstance(sequences, Mixture) else None
        if self._mixture is None and len(sequences) < batch_size:
            raise DataError(
                f"the train split has {len(sequences)} sequences of {sequences.seq_len} tokens, fewer than one "
                f"batch of {batch_size}; add data or lower the batch size or data.seq_len"
            )
        self.sequences = sequences
        self.batch_size, self.seed = batch_size, seed
        self.process_index, self.process_count = process_index, process_count
        self.batches_per_epoch = max(len(sequences) // batch_size, 1)
        self._epoch: int | None = None
        self._perm: np.ndarray | None = None

    def global_indices(self, step: int) -> np.ndarray:
        """Row indices (into the split) of the whole global batch at ``step``."""
        if step < 0:
            raise DataError(f"step must be non-negative, got {step}")
        if self._mixture is not None:
            return self._mixture.global_indices(step)
        epoch, b = divmod(step, self.batches_per_epoch)
        return self._permutation(epoch)[b * self.batch_size : (b + 1) * self.batch_size]

    def indices(self, step: int) -> np.ndarray:
        """Row indices of this process's part of the batch at ``step``."""
        lo = self.process_index * self.local_batch_size
        return self.global_indices(step)[lo : lo + self.local_batch_size]

    def batch_at(self, step: int) -> Batch:
        """This process's rows of the global batch at ``step``: ``[local_batch_size, seq_len]``."""
        return self.sequences.rows(self.indices(step))

    def tokens_by_source(self, step: int) -> dict[str, int]:
        """Tokens each source of a mixture has given to the batches before ``step`` (all
        processes together), keyed ``tokens/<name>`` for the trackers; empty for one source."""
        if self._mixture is None:
            return {}
        rows = self._mixture.rows_before(step)
        return {f"tokens/{name}": int(n) * self.sequences.seq_len for name, n in zip(self.sequences.names, rows)}

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            rng = np.random.default_rng([self.seed % (1 << 63), epoch])
            self._perm, self._epoch = rng.permutation(len(self.sequences)), epoch
        return self._perm


def num_eval_batches(sequences: Sequences | PackedSequences | JoinedRows, batch_size: int) -> int:
    return -(-len(sequences) // batch_size)


def eval_batches(
    sequences: Sequences | PackedSequences | JoinedRows,
    *,
    batch_size: int,
    process_index: int = 0,
    process_count: int = 1,
) -> Iterator[Batch]:
    """Every row of ``sequences`` once, in order, this process's part of each global batch.

    The last global batch is filled with padding rows (no loss), so every process sees the
    same number of batches of the same shape.
    """
    local = _check_processes(batch_size, process_index, process_count)
    n = len(sequences)
    for b in range(num_eval_batches(sequences, batch_size)):
        lo = b * batch_size + process_index * local
        real = np.arange(lo, min(lo + local, n))
        batch = sequences.rows(real)
        if len(real) < local:
            pad = padding_rows(local - len(real), sequences.seq_len, sequences.pad_id)
            batch = Batch(*(np.concatenate([a, p]) for a, p in zip(batch, pad)))
        yield batch
