"""Multi-process start-up: ``jax.distributed.initialize`` before any other JAX call.

What happens when a process dies (measured on CPU with gloo, jax 0.10, see docs/multihost.md):

- a peer that is *gone* (killed, crashed) closes its sockets: the next cross-process
  collective in every other process fails at once with ``JaxRuntimeError: Gloo ... Connection
  closed by peer``;
- a peer that is *frozen* (SIGSTOP, a hung host) or gone while the others are not in a
  collective stops sending heartbeats: after ``heartbeat_timeout_s`` the coordination service
  tells every process, and JAX terminates each of them with ``LOG(FATAL)`` (SIGABRT, exit
  code 134 or -6), printing "The following tasks are unhealthy (stopped sending heartbeats)".

Either way nothing waits forever. ``exit_now`` is the last piece: a process that fails must
not run JAX's exit-time shutdown barrier, which would wait ``shutdown_timeout`` (300 s) for
peers that are dead or blocked in a collective on it.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

from named import NamedError

from ..config import RULES, ConfigError, DistributedConfig


class DistributedError(NamedError, RuntimeError):
    """jax.distributed started, but the processes cannot compute together (a collective failed)."""


_ENV = {
    "coordinator_address": "NAMED_COORDINATOR",
    "num_processes": "NAMED_NUM_PROCESSES",
    "process_id": "NAMED_PROCESS_ID",
}
HEARTBEAT_ENV = "NAMED_HEARTBEAT_TIMEOUT"


def _env_int(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} must be an integer") from None


def settings(cfg: DistributedConfig) -> dict | None:
    """The keyword arguments for jax.distributed.initialize, or None for a single process.

    Values come from the config, else from NAMED_* variables (set by ``named-launch``);
    with ``initialize: true`` and nothing given, JAX's own auto-detection (SLURM, TPU pods,
    Open MPI, ...) fills them in. NAMED_HEARTBEAT_TIMEOUT (seconds) overrides
    ``distributed.heartbeat_timeout_s``.
    """
    kw, where = {}, {}
    for field, env in _ENV.items():
        value, where[field] = getattr(cfg, field), f"distributed.{field}"
        if value is None and os.environ.get(env):
            value = os.environ[env] if field == "coordinator_address" else _env_int(env)
            where[field] = env
        elif value is not None and field == "num_processes" and os.environ.get(env):
            _check_count(value, env)
        if value is not None:
            kw[field] = value
    for field in ("num_processes", "process_id"):  # values from the environment meet the config's rules too
        RULES[f"distributed.{field}"].check(kw.get(field), where[field])
    if "process_id" in kw and "num_processes" in kw and kw["process_id"] >= kw["num_processes"]:
        raise ConfigError(
            f"{where['process_id']}={kw['process_id']} must be below "
            f"{where['num_processes']}={kw['num_processes']} (process ids count from 0)"
        )
    if "coordinator_address" in kw:
        _check_address(kw["coordinator_address"], where["coordinator_address"])
    heartbeat = _env_int(HEARTBEAT_ENV) if os.environ.get(HEARTBEAT_ENV) else cfg.heartbeat_timeout_s
    RULES["distributed.heartbeat_timeout_s"].check(heartbeat, f"distributed.heartbeat_timeout_s (or {HEARTBEAT_ENV})")
    timeouts = {"initialization_timeout": cfg.initialization_timeout_s, "heartbeat_timeout_seconds": heartbeat}
    if cfg.local_device_ids is not None:
        kw["local_device_ids"] = list(cfg.local_device_ids)
    if not kw and not cfg.initialize:
        return None
    needed = {"coordinator_address", "num_processes", "process_id"}
    if kw and not needed <= kw.keys() and not cfg.initialize:
        missing = sorted(needed - kw.keys())
        raise ConfigError(
            f"distributed: {', '.join('distributed.' + m for m in missing)} "
            "missing (or set initialize: true for auto-detection)"
        )
    return {**kw, **timeouts}


def _check_count(value: int, env: str) -> None:
    """A process count that both the config and the launcher give is one count: processes told
    to wait for more peers than were started would wait until the coordinator gives up on them."""
    given = _env_int(env)
    if given != value:
        raise ConfigError(
            f"distributed.num_processes={value} in the config, but the launcher started {given} processes "
            f"({env}={given}): the run would wait for processes that were never started. Remove "
            f"distributed.num_processes from the config (the launcher's count is used) or launch with --nproc {value}"
        )


def checked_settings(cfg: DistributedConfig) -> dict | None:
    """``settings``, refusing ``initialize: true`` without a coordinator where JAX would find none
    (named-train and named-plan both call it, before anything starts)."""
    kw = settings(cfg)
    if (
        kw is not None
        and "coordinator_address" not in kw
        and not os.environ.get("JAX_COORDINATOR_ADDRESS")
        and not _cluster_detected()
    ):
        raise ConfigError(
            "distributed.initialize is true, but distributed.coordinator_address is not set and JAX detects no cluster "
            "(SLURM, Open MPI, Kubernetes, Cloud TPU) to take it from: set distributed.coordinator_address, "
            "distributed.num_processes and distributed.process_id, or start the processes with named-launch"
        )
    return kw


def _check_address(address: str, where: str) -> None:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{where} {address!r} must be host:port, e.g. 10.0.0.1:1234")


def _cluster_detected() -> bool:
    """Whether jax.distributed.initialize would find the coordinator itself (JAX's own test)."""
    from named.internal import cluster_detected

    return cluster_detected()


def maybe_initialize(cfg: DistributedConfig) -> bool:
    """Start jax.distributed when configured; on CPU use gloo collectives across processes.

    Returns whether it started (the caller then owes ``exit_now`` on failure)."""
    kw = checked_settings(cfg)
    if kw is None:
        return False
    import jax

    if os.environ.get("JAX_PLATFORMS", "").startswith("cpu") or os.environ.get("NAMED_CPU_COLLECTIVES"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(**kw)
    except (ValueError, TypeError) as e:  # jax checks its arguments before it connects to anything
        raise ConfigError(
            f"distributed: jax.distributed.initialize refused the settings: {e} (distributed.coordinator_address, "
            "distributed.num_processes, distributed.process_id)"
        ) from None
    if jax.process_count() > 1:
        connect_collectives()
    return True


def connect_collectives() -> None:
    """Run one collective over every device of every process, right after start-up.

    Two reasons. It fails early, naming the cause, when the processes cannot reach each other.
    And on CPU, gloo connects a group of devices at its first collective, each process waiting
    at most 30 s (fixed in XLA) for the others to arrive; processes that start the first train
    step up to a compile apart (one compiles, another hits the compilation cache, or a loaded
    machine) would miss that window. Here they arrive together (backend start-up is a barrier);
    later programs over the same devices reuse the connection and wait without that deadline.
    """
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()), ("all",))
    local = np.ones(len(jax.local_devices()), np.float32)
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, PartitionSpec("all")), local)
    try:
        total = float(jax.jit(lambda v: v.sum(), out_shardings=NamedSharding(mesh, PartitionSpec()))(x))
    except Exception as e:  # noqa: BLE001 - re-raised with what it means
        raise DistributedError(
            f"jax.distributed started, but a collective across the {jax.process_count()} processes failed: {e}"
        ) from e
    if total != len(jax.devices()):
        raise DistributedError(
            f"a sum over all {len(jax.devices())} devices of {jax.process_count()} processes gave {total}"
        )


def exit_now(code: int) -> NoReturn:
    """Leave at once with ``code``: flush output and logs, skip JAX's shutdown barrier.

    At exit JAX waits at a barrier for every process (up to its 300 s shutdown timeout). A
    process that failed alone would sit there while its peers sit in a collective waiting for
    it; exiting now closes its sockets, so they fail within seconds instead. An asynchronous
    checkpoint still being written is abandoned; its ``.tmp-`` directory is never committed.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    logging.shutdown()
    os._exit(code)


def peer_failed(e: BaseException) -> bool:
    """Whether ``e`` is what this process sees when another one died or was stopped: a collective
    whose connection broke (gloo), or the coordination service's error. Not a bug of this process:
    its traceback (all inside jax) says nothing that the one-line error does not."""
    text = f"{type(e).__name__}: {e}".lower()
    return "gloo" in text or "coordination service" in text or "connection" in text


def describe_failure(e: BaseException) -> str:
    """A one-paragraph error for a failure in a multi-process run, naming this process."""
    import jax

    where = f"process {jax.process_index()} of {jax.process_count()}"
    text = f"{type(e).__name__}: {e}".strip()
    if peer_failed(e):
        return (
            f"{where}: a collective across processes failed; another process has most likely died or "
            f"been stopped (see its output, or <run_dir>/logs/process_<i>.log). {text}"
        )
    return f"{where}: {text}"
