"""Tokenising a cache build's shards on a Ray cluster: ``named-data build --ray ADDRESS``.

``RayShards`` is a ``ShardRunner`` (``_shards``): every piece still missing (a file, or a run of
row groups of a large Parquet file) becomes one Ray task of one CPU that writes its shard with
the same ``write_shard`` the local build uses, into the same shard folder. So the cache is byte
for byte the local build's, and a build that is killed (the driver, or the whole cluster) and run
again tokenises only the shards that are missing. A task whose worker process or node dies is
retried by Ray (``max_retries``); its half-written shard is a temp file that never becomes the
shard, and goes with the shard folder. A task that fails on bad input is not retried: its
DataError, naming the file, is raised here once the build's other tasks are cancelled.

Ray tasks run wherever the cluster has free CPUs, so every node must see the sources and
``data.cache_dir`` at the same paths (a shared file system) and have this package installed.
Ray is an optional extra: ``pip install 'named-jax[ray]'``.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from named import NamedError

from ..config.data_section import DataError
from ._shards import Piece, Progress, write_shard
from ._tokenizer import Tokenizer

log = logging.getLogger(__name__)

_CONNECT_TIMEOUT_S = 10
_SETTLE_S = 60  # how long a failed build waits for its cancelled tasks to stop


class ClusterError(NamedError, RuntimeError):
    """A Ray task failed for a reason other than its input (its worker or node died more than
    ``max_retries`` times): the cluster's fault, not the data's (``named-data`` exits 1)."""


def _import_ray():
    try:
        import ray
    except ImportError as e:
        raise DataError("building on a Ray cluster needs Ray: pip install 'named-jax[ray]'") from e
    return ray


class RayShards:
    """Tokenise shards as Ray tasks on the cluster at ``address`` (``"auto"``: the one this machine
    belongs to, as ``ray start`` left it; ``host:6379``: that head node; ``ray://host:10001``: a
    Ray client; ``"local"``: a new Ray on this machine alone). A Ray already initialised in this
    process (``ray.init(...)``) is used as it is.

    Args:
        address: the cluster, as ``ray.init(address=...)`` takes it.
        max_retries: how many times a task whose worker died is run again.
    """

    def __init__(self, address: str = "auto", *, max_retries: int = 3):
        if address not in ("auto", "local"):
            _host_port(address)
        self.address, self.max_retries = address, max_retries

    def connect(self) -> None:
        """Join the cluster now (``named-data build`` does, before reading any source), or raise
        DataError naming the address."""
        ray = _import_ray()
        if ray.is_initialized():
            return
        _check_reachable(self.address)
        try:
            ray.init(address=self.address, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise DataError(
                f"cannot join the Ray cluster at {self.address!r} (--ray): {e}; start one with `ray start --head` "
                "(and `ray start --address HEAD:6379` on the other nodes), or give its address"
            ) from e
        log.info("joined the Ray cluster at %r: %s CPUs", self.address, ray.cluster_resources().get("CPU", 0))

    def __call__(
        self, jobs: Sequence[tuple[Piece, Path]], tokenizer: Tokenizer, dtype: np.dtype, progress: Progress
    ) -> None:
        if not jobs:
            return
        self.connect()
        ray = _import_ray()
        task = ray.remote(_ray_shard).options(num_cpus=1, max_retries=self.max_retries, retry_exceptions=False)
        shared = ray.put(tokenizer)  # once into the object store, not once per task
        pieces = {task.remote(piece, str(shard), dtype.name, shared): piece for piece, shard in jobs}
        pending = list(pieces)
        try:
            while pending:
                ready, pending = ray.wait(pending, num_returns=1)
                for ref in ready:
                    progress.done(pieces[ref].nbytes, self._result(ray, ref, pieces[ref]))
        except BaseException:
            for ref in pending:  # those not started never start; those running are interrupted
                ray.cancel(ref)
            # ... and waited for, so that no task of this build writes a shard after it has raised
            ray.wait(pending, num_returns=len(pending), timeout=_SETTLE_S)
            raise

    def _result(self, ray, ref, piece: Piece) -> int:
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, DataError):  # bad input, named by the task: as a local build raises it
                raise e.cause from None
            raise
        except ray.exceptions.RayError as e:
            raise ClusterError(
                f"the Ray task tokenising {piece} failed on every try ({self.max_retries + 1}): {e}; the shards "
                "already written are kept, so running the build again goes on from them"
            ) from e


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    if not host or not port.isdigit():
        raise DataError(f"--ray {address!r}: give 'auto', 'local', HOST:PORT or ray://HOST:PORT")
    return host, int(port)


def _check_reachable(address: str) -> None:
    """A ``host:port`` address answers within seconds (Ray itself would retry it for minutes)."""
    if address in ("auto", "local"):
        return
    try:
        socket.create_connection(_host_port(address), timeout=_CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise DataError(
            f"cannot reach the Ray cluster at {address!r} (--ray): {e.strerror or e}; is `ray start --head` "
            "running there, and the port open?"
        ) from e


def _ray_shard(piece: Piece, shard: str, dtype_name: str, tokenizer: Tokenizer) -> int:
    """One Ray task: ``piece`` tokenised into ``shard``."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one task per CPU already
    return write_shard(Path(shard), piece, tokenizer, np.dtype(dtype_name))
