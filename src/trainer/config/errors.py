"""The trainer's error types for bad input and failed checkpoint I/O, each naming its culprit (the
key, the file, the URL). They lie in the trainer's lowest layer so that every layer raises them:
the config's checks, the data pipeline (``named.trainer.data`` re-exports ``DataError``) and the
checkpoint files (``named.trainer.checkpoint`` re-exports ``CheckpointError``). The errors of one
layer alone (``DistributedError``, ``TrainingError``, ``ClusterError``) stay in theirs."""

from __future__ import annotations

from named import NamedError


class ConfigError(NamedError, ValueError):
    """A configuration key is unknown, missing or has a bad value; the message names it."""


class DataError(NamedError, ValueError):
    """Bad data input: a missing or corrupt file, an empty corpus, an impossible setting.

    The message always names the culprit (the file, the glob pattern, the config key) and,
    where there is one, the fix.
    """


class CheckpointError(NamedError, RuntimeError):
    """A checkpoint cannot be written, found, verified or matched to the target tree."""
