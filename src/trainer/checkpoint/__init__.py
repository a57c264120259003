"""Checkpoints: asynchronous, atomically committed, checksummed, restorable onto any mesh,
on a local disk or in an object store (``s3://``, ``gs://``).

This package's ``__init__`` is the public surface of checkpoint files (``from named.trainer import
checkpoint as ckpt``); the work is split along its seams:

- ``store``: where checkpoints live (tensorstore kvstore specs, object reads and writes), shared
  helpers; the one rule from a path or URL to a place lies in ``config.location``, where
  ``load_config`` uses it too, and ``CheckpointError`` in ``config.errors``, with the trainer's
  other error types;
- ``write``: the snapshot to host memory, writing and committing (``Checkpointer``);
- ``read``: finding, verifying and restoring;
- ``checksum``: the check each file carries (crc32c or sha256); ``chunks``: whole chunks read and
  written as their bytes, without tensorstore;
- ``retention``: which checkpoints are kept after a commit.

Beside them, what a run keeps on disk: ``rundir`` (a run directory: new run or resume, its lock
and identity) and ``run_places`` (run directories, checkpoint folders and checkpoints recognised
from outside).

Layout of one checkpoint, ``<run_dir>/checkpoints/step_<N>/``::

    arrays/00000.model.embed.weight/zarr.json     one zarr v3 array per array leaf
    arrays/00000.model.embed.weight/c/3/0         one chunk file per saved shard
    ...
    commit.json                                   written last; its presence is the commit

(On an object store the arrays lie under ``step_<N>/data-<token>/arrays/``: see
``write``.) ``commit.json`` holds the format tag, the step, whether the checkpoint
is temporary, the user's JSON metadata (data position, RNG key data, config, ...), every leaf
of the tree in flatten order (its key path, and for arrays the directory, shape, dtype, chunk
shape and NamedArray axis names; Python scalars are stored inline), the checksum (``checksum``:
crc32c, or sha256 where asked for) and size of every file of the checkpoint, and a sha256 of its
own content.

Why zarr v3 with one chunk per shard, and not OCDBT: a chunk is then exactly one shard
of the saving mesh, so every file is written by exactly one process (the owner of the
shard with ``replica_id == 0``), that process can checksum and fsync exactly the files
it wrote, and a corrupted file is named precisely (leaf and chunk). OCDBT packs many
arrays into shared data files and, across processes, needs either a coordinator server
or a per-process database plus a merge step, and its files cannot be attributed to a
leaf. The price is one file per shard and leaf, fine at the scales this project runs.
Chunks are stored uncompressed: float weights barely compress and the CPU time is
better spent on the step. We write with tensorstore directly rather than through
``jax.experimental.array_serialization`` because the commit protocol (per-file
checksums, rename, retention) is ours, and that module's commit machinery would have
to be worked around rather than used.
"""

from __future__ import annotations

from ..config.errors import CheckpointError
from ..config.location import Location, ObjectPath, inside, is_remote, location
from .read import (
    check_restorable,
    latest_checkpoint,
    list_checkpoints,
    read_commit,
    restore,
    uncommitted_steps,
    verify_checkpoint,
)
from .store import COMMIT_FILE, CheckpointWarning, check_access, checkpoint_dir
from .write import Checkpointer, save_checkpoint

__all__ = [
    "COMMIT_FILE",
    "CheckpointError",
    "CheckpointWarning",
    "Checkpointer",
    "Location",
    "ObjectPath",
    "check_access",
    "check_restorable",
    "checkpoint_dir",
    "inside",
    "is_remote",
    "latest_checkpoint",
    "list_checkpoints",
    "location",
    "read_commit",
    "restore",
    "save_checkpoint",
    "uncommitted_steps",
    "verify_checkpoint",
]
