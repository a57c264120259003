"""The one call that turns the ``data`` config section (``config.data_section``) into train/validation splits."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..config.data_section import DataConfig, DataError, SourceSpec
from ._binpack import Documents, PackedSequences
from ._cache import cached_chat, cached_tokens
from ._chat import ChatRules
from ._hub import dataset_paths
from ._mixture import JoinedRows, Mixture
from ._packing import Sequences, TokenStream
from ._shards import ShardRunner
from ._sources import SourceFile, check_token_ids, open_pretokenized, resolve_sources
from ._tokenizer import Tokenizer, check_tokenizer, load_tokenizer
from .chat_template import ChatFormat

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Data:
    """The splits ``build_data`` gives. ``train`` is a ``Mixture`` when ``data.train`` names
    several sources; ``validation`` is then every source's held-out rows together, and
    ``validation_sources`` the same per source name (empty for a single source)."""

    tokenizer: Tokenizer
    train: Sequences | PackedSequences | Mixture
    validation: Sequences | PackedSequences | JoinedRows | None
    validation_sources: dict[str, Sequences | PackedSequences] = field(default_factory=dict)

    @property
    def notes(self) -> list[str]:
        """A line per whole-packed split for the log: its samples, rows and padding share."""
        return [p.describe() for p in (*_packed(self.train), *_packed(self.validation))]


def _packed(rows) -> list[PackedSequences]:
    if isinstance(rows, PackedSequences):
        return [rows]
    return [p for part in rows.sources for p in _packed(part)] if isinstance(rows, JoinedRows) else []


def build_data(cfg: DataConfig, tokenizer: Tokenizer | None = None, *, runner: ShardRunner | None = None) -> Data:
    """Load the tokenizer, check every source, tokenise (or reuse the cache), and split.

    Every check that needs no tokenising (tokenizer file, globs, Parquet and Arrow columns,
    pre-tokenised headers and ids, of train and validation sources alike) runs before any
    tokenising starts. ``runner`` tokenises the shards of every missing text cache large enough
    to be sharded (``RayShards``: on a Ray cluster); smaller ones and chat caches are built here
    in one pass either way.
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
    checked = [(s, _checked_sources(s, tokenizer, cfg, "train")) for s in train_specs]
    val_checked = [(s, _checked_sources(s, tokenizer, cfg, "validation")) for s in val_specs]
    train = [_sequences(s, c, tokenizer, cfg, "train", chat, runner, held_out=not val_specs) for s, c in checked]
    validation = [_sequences(s, c, tokenizer, cfg, "validation", chat, runner) for s, c in val_checked]
    if not validation and cfg.val_fraction > 0:
        held = [_hold_out(seqs, cfg, s) for s, seqs in zip(train_specs, train)]
        train, validation = [t for t, _ in held], [v for _, v in held]
        val_specs = train_specs
    if len(train) == 1:
        mixture: Sequences | PackedSequences | Mixture = train[0]
    else:
        mixture = Mixture([s.name for s in train_specs], train, [s.weight for s in train_specs])
    val = _joined(validation) if validation else None
    named = {s.name: v for s, v in zip(val_specs, validation) if s.name} if len(validation) > 1 else {}
    data = Data(tokenizer, mixture, val, named)
    for note in data.notes:
        log.info("%s", note)
    return data


def token_stream(
    specs: Sequence[str],
    tokenizer: Tokenizer,
    cfg: DataConfig,
    text_field: str = "text",
    *,
    runner: ShardRunner | None = None,
) -> TokenStream:
    """All tokens of ``specs``: the documents of text, JSONL, Parquet and Arrow files first (one
    cache file; a large one built in shards by ``runner`` if given), then the pre-tokenised files in order."""
    text, pretokenized, _ = _checked_sources(SourceSpec("", tuple(specs), text_field=text_field), tokenizer, cfg)
    return _token_stream(text, pretokenized, tokenizer, cfg, runner)


def data_files(cfg: DataConfig) -> list[Path]:
    """Every file ``build_data`` reads for ``cfg``, train and validation sources, in order, each once
    (what a resume compares with the run's record: ``fingerprint``)."""
    out: dict[Path, None] = {}
    for split in ("train", "validation"):
        for spec in cfg.sources(split):
            try:
                files = resolve_sources(
                    _spec_paths(spec),
                    stdlib_bytes=cfg.stdlib_bytes,
                    text_field=spec.text_field,
                    chat=spec.format == "chat",
                )
            except DataError as e:
                raise _named(e, _label(spec, split)) from e.__cause__
            for f in files:
                out.setdefault(f.path, None)
    return list(out)


def _spec_paths(spec: SourceSpec) -> Sequence[str]:
    """The paths, globs and folders a source reads (a Hugging Face dataset's split: its files in the
    Hub cache, ``_hub``): the one place ``build_data`` and ``data_files`` take them from."""
    return dataset_paths(spec) if spec.hf_dataset is not None else spec.paths


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


def _checked_sources(spec: SourceSpec, tokenizer: Tokenizer, cfg: DataConfig, split: str = "train"):
    """The source's text files and pre-tokenised arrays, every check that needs no tokenising
    done; its files are its ``paths``, or the split of its Hugging Face dataset (``_hub``)."""
    check_tokenizer(tokenizer)
    label = _label(spec, split)
    try:
        files = resolve_sources(
            _spec_paths(spec), stdlib_bytes=cfg.stdlib_bytes, text_field=spec.text_field, chat=spec.format == "chat"
        )
        if spec.format == "chat":
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
        if f.kind not in ("jsonl", "parquet", "arrow"):
            raise DataError(
                f"{str(f.shown)!r} is a {f.kind} file; a chat source reads JSON Lines records "
                "(.jsonl, .json, .jsonl.gz, .jsonl.zst) or the rows of Parquet and Arrow files"
            )


def _sequences(
    spec: SourceSpec,
    checked,
    tokenizer: Tokenizer,
    cfg: DataConfig,
    split: str,
    chat: ChatFormat | None = None,
    runner: ShardRunner | None = None,
    *,
    held_out: bool = False,
) -> Sequences | PackedSequences:
    """A source's rows, a large source's cache built in shards by ``runner`` if given; ``held_out``:
    validation will be cut from them (whole packing then packs the two parts later, each on its own)."""
    text, pretokenized, label = checked
    try:
        if spec.format == "chat":
            tokens, flags = cached_chat(text, chat, cfg.cache_dir, ChatRules.of(cfg))
            stream = TokenStream([tokens], tokenizer.eos_id, [flags])
            if cfg.chat_packing == "whole":
                if held_out and cfg.val_fraction > 0:
                    return _Unpacked(stream, Documents.of(stream), label)
                return _nonempty(_pack(stream, cfg, label, Documents.of(stream)), split)
        else:
            stream = _token_stream(text, pretokenized, tokenizer, cfg, runner)
        return _nonempty(Sequences(stream, cfg.seq_len), split)
    except DataError as e:
        raise _named(e, label) from e.__cause__


@dataclass(frozen=True)
class _Unpacked:
    """A chat source's documents before the validation share is cut from them."""

    stream: TokenStream
    documents: Documents
    label: str


def _pack(stream: TokenStream, cfg: DataConfig, label: str, docs: Documents) -> PackedSequences:
    return PackedSequences(stream, cfg.seq_len, docs, too_long=cfg.chat_too_long, label=label)


def _joined(parts: list) -> Sequences | PackedSequences | JoinedRows:
    if len(parts) == 1:
        return parts[0]
    if all(isinstance(p, Sequences) for p in parts):
        return Sequences.concat(parts)
    return JoinedRows(parts)


def _hold_out(seqs, cfg: DataConfig, spec: SourceSpec):
    """The train rows and the last ``val_fraction`` of them, held out (contiguous, so few
    documents straddle the two). Whole-packed chat holds out its last ``val_fraction`` of
    samples and packs each part on its own, so no sample is in both."""
    if isinstance(seqs, _Unpacked):
        n = len(seqs.documents)
        n_val = max(1, round(n * cfg.val_fraction))
        if n_val >= n:
            raise DataError(
                f"{_label(spec, 'train')}the source gives only {n} samples: too few to hold out "
                f"data.val_fraction={cfg.val_fraction} and still train; add data or give data.validation"
            )
        train_docs, val_docs = seqs.documents.part(0, n - n_val), seqs.documents.part(n - n_val, n)
        return (
            _nonempty(_pack(seqs.stream, cfg, seqs.label, train_docs), "train"),
            _nonempty(_pack(seqs.stream, cfg, _label(spec, "validation"), val_docs), "validation"),
        )
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
    text: list[SourceFile],
    pretokenized: list[np.ndarray],
    tokenizer: Tokenizer,
    cfg: DataConfig,
    runner: ShardRunner | None = None,
) -> TokenStream:
    arrays = [cached_tokens(text, tokenizer, cfg.cache_dir, runner)] if text else []
    return TokenStream(arrays + pretokenized, tokenizer.eos_id)


def _nonempty(seqs, split: str):
    if len(seqs) == 0 and isinstance(seqs, PackedSequences):
        raise DataError(
            f"the {split} data holds no sample that fits data.seq_len={seqs.seq_len} (data.chat_too_long=drop)"
        )
    if len(seqs) == 0:
        raise DataError(
            f"the {split} data holds {len(seqs.stream)} tokens, fewer than one sequence of data.seq_len={seqs.seq_len}"
        )
    return seqs
