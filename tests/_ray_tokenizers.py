"""Byte tokenizers (same fingerprint, so the same cache key and bytes) that act up inside Ray
workers, for tests/test_data_ray.py. They live in a module of their own so that Ray's workers can
import them by name (the test puts this folder on their PYTHONPATH)."""

import os
import signal
from pathlib import Path

from named.trainer.data import ByteTokenizer


class Interrupted(Exception):
    pass


class KillOnce(ByteTokenizer):
    """SIGKILLs its own worker process the first time it meets a document starting with ``at``
    (``marker`` records that it did, so the retried task goes through)."""

    def __init__(self, at: str, marker: Path):
        self.at, self.marker = at, marker

    def encode_batch(self, texts):
        if any(t.startswith(self.at) for t in texts) and not self.marker.exists():
            self.marker.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        return super().encode_batch(texts)


class FailOn(ByteTokenizer):
    """Raises (not bad input: no DataError) on a document starting with ``at``."""

    def __init__(self, at: str):
        self.at = at

    def encode_batch(self, texts):
        if any(t.startswith(self.at) for t in texts):
            raise Interrupted(self.at)
        return super().encode_batch(texts)


class Recording(ByteTokenizer):
    """Appends the second word of every document it encodes to ``log``, one a line."""

    def __init__(self, log: Path):
        self.log = log

    def encode_batch(self, texts):
        with self.log.open("a") as f:
            f.write("".join(t.split(" ")[1] + "\n" for t in texts))
        return super().encode_batch(texts)
