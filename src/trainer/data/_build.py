"""The ``data`` config section and the one call that turns it into train/validation splits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ._cache import cached_tokens
from ._errors import DataError
from ._packing import Sequences, TokenStream
from ._sources import BIN_DTYPES, STDLIB, SourceFile, check_token_ids, open_pretokenized, resolve_sources
from ._tokenizer import Tokenizer, check_tokenizer, load_tokenizer


@dataclass(frozen=True)
class DataConfig:
    """Where the tokens come from and how they are cut.

    Args:
        train: source specs: paths, globs, or ``"stdlib"`` (the embedded default corpus).
        validation: separate validation sources; when empty, the last ``val_fraction`` of
            the train sequences is held out instead.
        val_fraction: share of sequences held out for validation (0 for none).
        tokenizer: ``"byte"`` or a local ``tokenizer.json`` (or a folder holding one).
        eos_token: end-of-document token of an HF tokenizer when it cannot be found.
        seq_len: tokens per packed sequence.
        bin_dtype: token dtype of ``.bin`` files (``.npy`` files say their own).
        cache_dir: where tokenised text is cached.
        stdlib_bytes: how much of the standard library the ``"stdlib"`` corpus takes.
    """

    train: list[str] = field(default_factory=lambda: [STDLIB])
    validation: list[str] = field(default_factory=list)
    val_fraction: float = 0.05
    tokenizer: str = "byte"
    eos_token: str | None = None
    seq_len: int = 256
    bin_dtype: str = "uint16"
    cache_dir: str = "~/.cache/named/data"
    stdlib_bytes: int = 8_000_000

    def __post_init__(self):
        for key in ("train", "validation"):
            for i, spec in enumerate(getattr(self, key)):
                if not isinstance(spec, str) or not spec:
                    raise DataError(f"data.{key}[{i}] must be a non-empty path, glob or 'stdlib', got {spec!r}")
        if self.seq_len < 2:
            raise DataError(f"data.seq_len must be at least 2 (a token and its target), got {self.seq_len}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise DataError(f"data.val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.bin_dtype not in BIN_DTYPES:
            raise DataError(f"data.bin_dtype must be one of {BIN_DTYPES}, got {self.bin_dtype!r}")
        if self.stdlib_bytes < 1:
            raise DataError(f"data.stdlib_bytes must be positive, got {self.stdlib_bytes}")


@dataclass(frozen=True)
class Data:
    tokenizer: Tokenizer
    train: Sequences
    validation: Sequences | None


def build_data(cfg: DataConfig, tokenizer: Tokenizer | None = None) -> Data:
    """Load the tokenizer, check every source, tokenise (or reuse the cache), and split.

    Every check that needs no tokenising (tokenizer file, globs, pre-tokenised headers and
    ids, of train and validation sources alike) runs before any tokenising starts.
    """
    if not cfg.train:  # checked here, not in DataConfig: token_stream takes a config for its settings alone
        raise DataError("data.train is empty; list at least one file, glob or 'stdlib'")
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.tokenizer, cfg.eos_token)
    checked = [_checked_sources(specs, tokenizer, cfg) for specs in (cfg.train, cfg.validation) if specs]
    streams = [_token_stream(*c, tokenizer, cfg) for c in checked]
    train = _nonempty(Sequences(streams[0], cfg.seq_len), "train")
    if cfg.validation:
        return Data(tokenizer, train, _nonempty(Sequences(streams[1], cfg.seq_len), "validation"))
    rows = len(train)
    n_val = max(1, round(rows * cfg.val_fraction)) if cfg.val_fraction > 0 else 0
    if n_val >= rows:
        raise DataError(
            f"the corpus gives only {rows} sequences of {cfg.seq_len} tokens: too few to hold out "
            f"data.val_fraction={cfg.val_fraction} and still train; add data or lower data.seq_len"
        )
    validation = Sequences(train.stream, cfg.seq_len, rows - n_val, n_val) if n_val else None
    return Data(tokenizer, Sequences(train.stream, cfg.seq_len, 0, rows - n_val), validation)


def token_stream(specs: Sequence[str], tokenizer: Tokenizer, cfg: DataConfig) -> TokenStream:
    """All tokens of ``specs``: text and JSONL documents first (one cache file), then the
    pre-tokenised files in order."""
    return _token_stream(*_checked_sources(specs, tokenizer, cfg), tokenizer, cfg)


def _checked_sources(specs: Sequence[str], tokenizer: Tokenizer, cfg: DataConfig):
    check_tokenizer(tokenizer)
    files = resolve_sources(specs, stdlib_bytes=cfg.stdlib_bytes)
    pretokenized = [
        (f, open_pretokenized(f, bin_dtype=cfg.bin_dtype, vocab_size=None)) for f in files if f.pretokenized
    ]
    for f, tokens in pretokenized:  # headers and sizes of all files first: they are cheap
        check_token_ids(tokens, tokenizer.vocab_size, f.path)
    return [f for f in files if not f.pretokenized], [tokens for _, tokens in pretokenized]


def _token_stream(
    text: list[SourceFile], pretokenized: list[np.ndarray], tokenizer: Tokenizer, cfg: DataConfig
) -> TokenStream:
    arrays = [cached_tokens(text, tokenizer, cfg.cache_dir)] if text else []
    return TokenStream(arrays + pretokenized, tokenizer.eos_id)


def _nonempty(seqs: Sequences, split: str) -> Sequences:
    if len(seqs) == 0:
        raise DataError(
            f"the {split} data holds {len(seqs.stream)} tokens, fewer than one sequence of data.seq_len={seqs.seq_len}"
        )
    return seqs
