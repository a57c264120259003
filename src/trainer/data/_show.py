"""Packed rows as text, with what is trained on marked (``named-data show``), in the spirit of
axolotl's preprocess debug output.

Each row is printed sample by sample (a sample is a segment of the row: one conversation under
whole packing), one line each, its text decoded with special tokens kept and newlines written as
``\\n``. ``[[...]]`` encloses the tokens that carry loss: token ``j`` does when ``loss_mask[j - 1]``
is set (it is the target of position ``j - 1``). Padding is counted, not printed. With ``ids``,
each sample's line is followed by its token ids and their labels, as transformers' ``labels``
write them: a token's own id where it carries loss, ``-100`` (ignored) where it does not.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ._binpack import PackedSequences
from ._mixture import JoinedRows
from ._packing import PAD_SEGMENT, Batch, Sequences
from ._tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

OPEN, CLOSE = "[[", "]]"
IGNORED = -100  # transformers' label for a token that carries no loss


def describe_rows(rows: Sequences | PackedSequences | JoinedRows) -> str:
    """One line on how a split is packed."""
    if isinstance(rows, PackedSequences):
        return rows.describe()
    if isinstance(rows, JoinedRows):
        return "; ".join(describe_rows(s) for s in rows.sources)
    return f"{len(rows)} rows of {rows.seq_len} tokens, concatenated and cut (samples may run across rows)"


def show_rows(
    rows: Sequences | PackedSequences | JoinedRows,
    tokenizer: Tokenizer,
    indices: Sequence[int],
    label: str = "train",
    *,
    ids: bool = False,
) -> str:
    """The rows at ``indices`` as text (see the module docstring)."""
    lines = [f"{describe_rows(rows)}", f"{OPEN}...{CLOSE}: the tokens that carry loss"]
    batch: Batch = rows.rows(np.asarray(indices, np.int64))
    for r, tokens, seg, mask in zip(indices, *batch):
        trained = np.r_[False, mask[:-1]]
        samples = [s for s in dict.fromkeys(seg.tolist()) if s != PAD_SEGMENT]
        pad = int((seg == PAD_SEGMENT).sum())
        lines.append(
            f"row {r} of {len(rows)} ({label}): {len(samples)} sample{'s' if len(samples) != 1 else ''}, "
            f"{int(trained.sum())} tokens carry loss, {pad} padding"
        )
        for k, s in enumerate(samples):
            at = np.flatnonzero(seg == s)
            lines.append(f"  {k + 1}| {_marked(tokenizer, tokens[at], trained[at])}")
            if ids:
                labels = np.where(trained[at], tokens[at], IGNORED)
                lines.append(f"   ids| {' '.join(map(str, tokens[at].tolist()))}")
                lines.append(f"labels| {' '.join(map(str, labels.tolist()))}")
    return "\n".join(lines)


def _marked(tokenizer: Tokenizer, ids: np.ndarray, trained: np.ndarray) -> str:
    """The text of ``ids`` with each run of trained tokens in brackets."""
    out = []
    cuts = np.flatnonzero(np.diff(trained.astype(np.int8))) + 1
    for run_ids, run_trained in zip(np.split(ids, cuts), np.split(trained, cuts)):
        text = _decode(tokenizer, run_ids.tolist()).replace("\n", "\\n")
        out.append(f"{OPEN}{text}{CLOSE}" if run_trained[0] else text)
    return "".join(out)


def _decode(tokenizer: Tokenizer, ids: list[int]) -> str:
    if isinstance(tokenizer, (ByteTokenizer, HFTokenizer)):
        return tokenizer.decode(ids, keep_special=True)
    return tokenizer.decode(ids)
