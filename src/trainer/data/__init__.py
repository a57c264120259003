"""Data for training: tokenizers, sources, a token cache, packing, and batch order.

    cfg = DataConfig(train=["stdlib"], seq_len=256)          # or paths, globs, folders (formats below)
    cfg = DataConfig(train=[{"name": "web", "paths": ["web/*.parquet"], "weight": 3},
                            {"name": "code", "paths": ["code/"], "weight": 1, "text_field": "content"}])
    data = build_data(cfg)                                   # checks everything, then tokenises once
    batches = TrainBatches(data.train, batch_size=32, seed=0,
                           process_index=jax.process_index(), process_count=jax.process_count())
    batch = batches.batch_at(step)                           # input_ids, segment_ids, loss_mask
    for b in eval_batches(data.validation, batch_size=32): ...

The pipeline, in the order data flows:

- **Tokenizer** (``_tokenizer``): ``ByteTokenizer`` (UTF-8 bytes + eos, vocab 257) or an HF
  ``tokenizer.json`` from a local path; both satisfy the ``Tokenizer`` protocol. ``vocab_size``
  is one more than the largest id the tokenizer can give (ids may be sparse), and every token
  array is checked against it before it reaches a model.
- **Sources** (``_sources``): paths, globs, directories, ``"stdlib"`` (this Python's
  standard-library source, the offline default corpus); text files are one document each,
  JSONL has one per line (``text`` field unless the source names another), Parquet and Arrow
  one per row of the text column (``_columnar``: row groups and record batches read lazily;
  also ``datasets``' ``save_to_disk`` folders), ``.gz``/``.zst`` text and JSONL are
  stream-decompressed (``_compressed``), ``.npy``/``.bin`` are pre-tokenised and
  memory-mapped as they are.
- **Cache** (``_cache``): text and JSONL are tokenised once into a flat token file (each
  document followed by eos; uint16 or uint32 as the vocabulary needs, the dtype in the file
  name), named by a hash of the file list and the tokenizer, written atomically, ids
  range-checked as they are written, and memory-mapped on every later run. Large corpora
  are tokenised by worker processes into shards (a file, or a run of Parquet row groups, each)
  that survive an interrupted build (``_shards``); hosts building one shared cache split the
  pieces (``LocalShards``), and ``RayShards`` tokenises them on a Ray cluster instead (``_ray``;
  ``named-data build --ray auto``), into the same bytes.
- **Packing** (``_packing``): concatenate-and-chunk (chat sources: whole samples, below). The stream is cut into rows of
  ``seq_len``; ``segment_ids`` restart the numbering in every row and step after each eos,
  so a segment-masked attention never crosses documents; ``loss_mask`` is False wherever
  the next token belongs to another document, is padding, or lies past the row's end.
  No tokens are wasted on padding in training; attention is restricted instead.
- **Split and order** (``_build``, ``_loader``): the last ``val_fraction`` of rows is the
  validation split (contiguous, so few documents straddle train and validation), unless
  separate validation sources are given. Train order is a per-epoch seeded permutation,
  computed from the step alone: resume by asking for the batch at the checkpointed step.
  Each process reads only its contiguous block of rows of every global batch.
- **Mixtures** (``_mixture``): named sources, each with its own cache and rows, drawn by
  weight in blocks whose makeup is exact and whose order follows from ``(seed, step)``; a
  source that runs out starts a new epoch of itself.
- **Chat** (``_chat``, ``chat``): a named source with ``format: chat`` reads JSONL conversations
  (``messages``, ShareGPT ``conversations``) or ``prompt``/``completion`` pairs, renders them with
  the tokenizer folder's chat template (or ``data.chat_template``) as ``transformers`` does, and
  caches a flag byte beside every token (it carries loss: ``data.loss_roles``,
  ``data.train_on_inputs``; it starts a document). Bad records are all reported, or skipped
  (``data.skip_bad_records``). Each sample is then packed whole (``_binpack``: best-fit
  decreasing into rows, padding at the end of a row, the padding share logged), or with
  ``data.chat_packing: stream`` concatenated and cut with documents starting at those flags.
  ``_show`` prints packed rows with the tokens that carry loss marked (``named-data show``).

Every bad input raises ``DataError`` naming the file, pattern or key, before tokenising
starts where it can be known then, and never leaves a partial file behind.
"""

from ..config.data_section import STDLIB, DataConfig, DataError, SourceSpec  # the section, declared with the others
from ._binpack import PackedSequences
from ._build import Data, build_data, data_files, token_stream
from ._cache import cached_tokens, token_dtype
from ._chat import ROLES
from ._encode import atomic_write, check_target
from ._fingerprint import changed_files, fingerprint
from ._leftovers import remove_abandoned, working_in
from ._loader import TrainBatches, eval_batches, num_eval_batches
from ._mixture import JoinedRows, Mixture
from ._packing import PAD_SEGMENT, Batch, Sequences, TokenStream, pack
from ._ray import ClusterError, RayShards
from ._shards import LocalShards
from ._show import show_rows
from ._sources import SourceFile, open_pretokenized, resolve_sources, stdlib_files
from ._tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, check_transformers_agrees, load_tokenizer

__all__ = [
    "show_rows",
    "PAD_SEGMENT",
    "ROLES",
    "STDLIB",
    "RayShards",
    "Batch",
    "ByteTokenizer",
    "ClusterError",
    "Data",
    "DataConfig",
    "DataError",
    "HFTokenizer",
    "JoinedRows",
    "LocalShards",
    "Mixture",
    "PackedSequences",
    "Sequences",
    "SourceFile",
    "SourceSpec",
    "TokenStream",
    "Tokenizer",
    "TrainBatches",
    "atomic_write",
    "build_data",
    "cached_tokens",
    "changed_files",
    "check_target",
    "check_transformers_agrees",
    "data_files",
    "eval_batches",
    "fingerprint",
    "load_tokenizer",
    "num_eval_batches",
    "open_pretokenized",
    "pack",
    "remove_abandoned",
    "resolve_sources",
    "stdlib_files",
    "token_dtype",
    "token_stream",
    "working_in",
]
