"""Multi-process start-up: ``jax.distributed.initialize`` before any other JAX call."""

from __future__ import annotations

import os

from .config import ConfigError, DistributedConfig

_ENV = {
    "coordinator_address": "NAMED_COORDINATOR",
    "num_processes": "NAMED_NUM_PROCESSES",
    "process_id": "NAMED_PROCESS_ID",
}


def settings(cfg: DistributedConfig) -> dict | None:
    """The keyword arguments for jax.distributed.initialize, or None for a single process.

    Values come from the config, else from NAMED_* variables (set by ``named-launch``);
    with ``initialize: true`` and nothing given, JAX's own auto-detection (SLURM, TPU pods,
    Open MPI, ...) fills them in.
    """
    kw = {}
    for field, env in _ENV.items():
        value = getattr(cfg, field)
        if value is None and env in os.environ:
            value = os.environ[env]
            value = int(value) if field != "coordinator_address" else value
        if value is not None:
            kw[field] = value
    if os.environ.get("NAMED_HEARTBEAT_TIMEOUT"):
        heartbeat = int(os.environ["NAMED_HEARTBEAT_TIMEOUT"])
    else:
        heartbeat = cfg.heartbeat_timeout_s
    timeouts = {"initialization_timeout": cfg.initialization_timeout_s, "heartbeat_timeout_seconds": heartbeat}
    if cfg.local_device_ids is not None:
        kw["local_device_ids"] = list(cfg.local_device_ids)
    if not kw and not cfg.initialize:
        return None
    if kw and not {"coordinator_address", "num_processes", "process_id"} <= kw.keys() and not cfg.initialize:
        missing = sorted({"coordinator_address", "num_processes", "process_id"} - kw.keys())
        raise ConfigError(f"distributed: {', '.join('distributed.' + m for m in missing)} missing (or set initialize: true for auto-detection)")
    return {**kw, **timeouts}


def maybe_initialize(cfg: DistributedConfig) -> bool:
    """Start jax.distributed when configured; on CPU use gloo collectives across processes."""
    kw = settings(cfg)
    if kw is None:
        return False
    import jax

    if os.environ.get("JAX_PLATFORMS", "").startswith("cpu") or os.environ.get("NAMED_CPU_COLLECTIVES"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**kw)
    return True
