"""Counting XLA compilations: the one listener the tests share."""

from __future__ import annotations

import contextlib

import jax


@contextlib.contextmanager
def compiles():
    """Yields a list that collects the name of every program compiled (or taken from the
    persistent compilation cache) while the block runs."""
    seen: list[str] = []

    def on_event(event: str, duration: float, **kw) -> None:
        if event.endswith(("backend_compile_duration", "cache_retrieval_time_sec")):
            seen.append(str(kw.get("fun_name")))

    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
