"""The training configuration: every key declared once, a config read from YAML and flags, and
the checks on its values alone. The lowest layer of the trainer: it imports nothing of its siblings.

- ``errors``: the trainer's error types, ``ConfigError``, ``DataError`` and ``CheckpointError``, here
  at the bottom so that every layer raises them;
- ``rules``: how a key is declared (``key(...)``);
- ``sections``: the sections, every key declared once, and ``TrainConfig``;
- ``train_config``: ``load_config`` and the checks that tie keys together, the tables derived from
  the declarations (``RULES``, ``keys_table``, ``--help``);
- ``data_section``: the ``data`` section (``named.trainer.data`` re-exports it);
- ``layout``: the keys that lay a run out over the devices, as one value (``Layout``: the planner's
  search, the layout explorer, ``mesh.layout: auto``);
- ``location``: the rule from a value to a place for checkpoints and the checks a checkpoint file
  may carry (``CHECKSUMS``);
- ``check``, ``read``, ``adapt``, ``pretrained``: per-value checks, the YAML file and the flags,
  the ``lora`` and ``quantization`` sections, a Hugging Face folder's config;
- ``hub``, ``pinning``: Hugging Face Hub ids where a value names a folder, fetched, and pinned to
  their commit when a config is read.

Every name of ``sections`` and ``train_config`` is also this package's (``from named.trainer.config
import load_config``). These modules are imported on first use: they need draccus and the model families,
which the data pipeline, built on ``data_section`` and ``rules`` alone, must not pull in.
"""

from __future__ import annotations

import importlib

# the error types and the data section, without draccus or the models
from .data_section import DataConfig  # noqa: F401
from .errors import CheckpointError, ConfigError, DataError  # noqa: F401
from .location import CHECKSUMS  # noqa: F401


def __getattr__(name: str):
    if not name.startswith("_"):
        for module in (".sections", ".train_config"):
            module = importlib.import_module(module, __name__)
            if hasattr(module, name):
                return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")  # protocol: module __getattr__
