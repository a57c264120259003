"""The one call that turns the ``data`` config section (``config.data_section``) into train/validation splits."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..config.data_section import DataConfig, DataError, SourceSpec
from ._cache import cached_chat, cached_tokens
from ._mixture import Mixture
from ._packing import Sequences, TokenStream
from ._sources import SourceFile, check_token_ids, open_pretokenized, resolve_sources
from ._tokenizer import Tokenizer, check_tokenizer, load_tokenizer
from .chat import ChatFormat

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Data:
    """The splits ``build_data`` gives. ``train`` is a ``Mixture`` when ``data.train`` names
    several sources; ``validation`` is then every source's held-out rows together, and
    ``validation_sources`` the same per source name (empty for a single source)."""

    tokenizer: Tokenizer
    train: Sequences | Mixture
    validation: Sequences | None
    validation_sources: dict[str, Sequences] = field(default_factory=dict)


def build_data(cfg: DataConfig, tokenizer: Tokenizer | None = None) -> Data:
    """Load the tokenizer, check every source, tokenise (or reuse the cache), and split.

    Every check that needs no tokenising (tokenizer file, globs, Parquet and Arrow columns,
    pre-tokenised headers and ids, of train and validation sources alike) runs before any
    tokenising starts.
    """
    if not cfg.train:  # checked here, not in DataConfig: token_stream takes a config for its settings alone
        raise DataError("data.train is empty; list at least one file, glob or 'stdlib'")
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.tokenizer, cfg.eos_token)
    train_specs = [s for s in cfg.sources("train") if s.weight > 0]
    for s in cfg.sources("train"):
        if s.weight == 0:
            log.info("data.train: source %r has weight 0 and is left out", s.name)
    val_specs = cfg.sources("validation")
    chat = _chat_format(cfg, tokenizer, [*train_specs, *val_specs])
    checked = [
        (s, _checked_sources(_spec_paths(s), tokenizer, cfg, s.text_field, _label(s, "train"), s.format))
        for s in train_specs
    ]
    val_checked = [
        (s, _checked_sources(_spec_paths(s), tokenizer, cfg, s.text_field, _label(s, "validation"), s.format))
        for s in val_specs
    ]
    train = [_sequences(s, c, tokenizer, cfg, "train", chat) for s, c in checked]
    validation = [_sequences(s, c, tokenizer, cfg, "validation", chat) for s, c in val_checked]
    if not validation and cfg.val_fraction > 0:
        held = [_hold_out(seqs, cfg, s) for s, seqs in zip(train_specs, train)]
        train, validation = [t for t, _ in held], [v for _, v in held]
        val_specs = train_specs
    if len(train) == 1:
        mixture: Sequences | Mixture = train[0]
    else:
        mixture = Mixture([s.name for s in train_specs], train, [s.weight for s in train_specs])
    val = (validation[0] if len(validation) == 1 else Sequences.concat(validation)) if validation else None
    named = {s.name: v for s, v in zip(val_specs, validation) if s.name} if len(validation) > 1 else {}
    return Data(tokenizer, mixture, val, named)


def token_stream(specs: Sequence[str], tokenizer: Tokenizer, cfg: DataConfig, text_field: str = "text") -> TokenStream:
    """All tokens of ``specs``: the documents of text, JSONL, Parquet and Arrow files first (one
    cache file), then the pre-tokenised files in order."""
    text, pretokenized, _ = _checked_sources(specs, tokenizer, cfg, text_field)
    return _token_stream(text, pretokenized, tokenizer, cfg)


def data_files(cfg: DataConfig) -> list[Path]:
    """Every file ``build_data`` reads for ``cfg``, train and validation sources, in order, each once
    (what a resume compares with the run's record: ``fingerprint``)."""
    out: dict[Path, None] = {}
    for split in ("train", "validation"):
        for spec in cfg.sources(split):
            try:
                files = resolve_sources(_spec_paths(spec), stdlib_bytes=cfg.stdlib_bytes, text_field=spec.text_field)
            except DataError as e:
                raise _named(e, _label(spec, split)) from e.__cause__
            for f in files:
                out.setdefault(f.path, None)
    return list(out)


def _spec_paths(spec: SourceSpec) -> Sequence[str]:
    """The paths, globs and folders a source reads: the one place ``build_data`` and ``data_files`` take them from."""
    return spec.paths


def _label(spec: SourceSpec, split: str) -> str:
    return f"data.{split} source {spec.name!r}: " if spec.name else ""


def _chat_format(cfg: DataConfig, tokenizer: Tokenizer, specs: Sequence[SourceSpec]) -> ChatFormat | None:
    """The template and its encoder for the chat sources (found, read and compiled before any
    tokenising), or None without chat sources."""
    if not any(s.format == "chat" for s in specs):
        return None
    fmt = ChatFormat.load(tokenizer, cfg.chat_template)
    if fmt.template is not None:
        fmt.template.compiled()
    return fmt


def _checked_sources(
    specs: Sequence[str],
    tokenizer: Tokenizer,
    cfg: DataConfig,
    text_field: str = "text",
    label: str = "",
    fmt: str = "text",
):
    check_tokenizer(tokenizer)
    try:
        files = resolve_sources(specs, stdlib_bytes=cfg.stdlib_bytes, text_field=text_field)
        if fmt == "chat":
            _check_chat_files(files)
        pretokenized = [
            (f, open_pretokenized(f, bin_dtype=cfg.bin_dtype, vocab_size=None)) for f in files if f.pretokenized
        ]
        for f, tokens in pretokenized:  # headers and sizes of all files first: they are cheap
            check_token_ids(tokens, tokenizer.vocab_size, f.path)
    except DataError as e:
        raise _named(e, label) from e.__cause__
    return [f for f in files if not f.pretokenized], [tokens for _, tokens in pretokenized], label


def _check_chat_files(files: Sequence[SourceFile]) -> None:
    for f in files:
        if f.kind != "jsonl":
            raise DataError(
                f"{str(f.path)!r} is a {f.kind} file; a chat source reads JSON Lines records "
                "(.jsonl, .json, .jsonl.gz, .jsonl.zst)"
            )


def _sequences(
    spec: SourceSpec, checked, tokenizer: Tokenizer, cfg: DataConfig, split: str, chat: ChatFormat | None = None
) -> Sequences:
    text, pretokenized, label = checked
    try:
        if spec.format == "chat":
            tokens, flags = cached_chat(text, chat, cfg.cache_dir)
            stream = TokenStream([tokens], tokenizer.eos_id, [flags])
        else:
            stream = _token_stream(text, pretokenized, tokenizer, cfg)
        return _nonempty(Sequences(stream, cfg.seq_len), split)
    except DataError as e:
        raise _named(e, label) from e.__cause__


def _hold_out(seqs: Sequences, cfg: DataConfig, spec: SourceSpec) -> tuple[Sequences, Sequences]:
    """The train rows and the last ``val_fraction`` of them, held out (contiguous, so few
    documents straddle the two)."""
    rows = len(seqs)
    n_val = max(1, round(rows * cfg.val_fraction))
    if n_val >= rows:
        raise DataError(
            f"{_label(spec, 'train')}the corpus gives only {rows} sequences of {cfg.seq_len} tokens: too few to hold "
            f"out data.val_fraction={cfg.val_fraction} and still train; add data or lower data.seq_len"
        )
    keep = rows - n_val
    return Sequences(seqs.stream, cfg.seq_len, 0, keep), Sequences(seqs.stream, cfg.seq_len, keep, n_val)


def _named(e: DataError, label: str) -> DataError:
    return DataError(f"{label}{e}") if label else e


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
