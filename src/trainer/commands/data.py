"""``named-data``: a config's data, prepared ahead of training.

``named-data build --config NAME [--ray ADDRESS]`` tokenises every source of the config's ``data``
section into ``data.cache_dir``, exactly as ``named-train`` would on its first step, and reports
what it holds; with ``--ray`` the shards of a large corpus (``data._shards``) are tokenised on a
Ray cluster (``data._ray``), into the same bytes. A later ``named-train`` with the same ``data``
section then only memory-maps the cache.
"""

from __future__ import annotations

import numpy as np

from ..data import Data, DataConfig, RayShards, Sequences, build_data


def build(cfg: DataConfig, ray: str | None = None) -> Data:
    """The splits of ``cfg``, tokenised into its cache here or, with ``ray`` (an address or ``"auto"``),
    on that Ray cluster, joined before any source is read."""
    runner = None
    if ray is not None:
        runner = RayShards(ray)
        runner.connect()
    return build_data(cfg, runner=runner)


def build_report(cfg: DataConfig, ray: str | None = None) -> str:
    data = build(cfg, ray)
    train = data.train
    parts = list(zip(train.names, train.sources)) if not isinstance(train, Sequences) else [("", train)]
    lines = [_line("train", name, seqs) for name, seqs in parts]
    if data.validation_sources:
        lines += [_line("validation", name, seqs) for name, seqs in data.validation_sources.items()]
    elif data.validation is not None:
        lines.append(_line("validation", "", data.validation))
    caches = sorted({str(a.filename) for _, seqs in parts for a in seqs.stream.arrays if isinstance(a, np.memmap)})
    return "\n".join([*lines, f"cache ({cfg.cache_dir}):", *(f"  {c}" for c in caches)])


def _line(split: str, name: str, seqs: Sequences) -> str:
    label = f"{split} {name!r}" if name else split
    return f"{label}: {len(seqs)} sequences of {seqs.seq_len} tokens ({seqs.num_tokens} tokens)"
