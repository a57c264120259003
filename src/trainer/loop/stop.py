"""Stopping a run on a signal, and time-based checkpoints, agreed by every process.

On one of ``trainer.stop_signals`` (SIGTERM, SIGINT and SIGUSR1 by default) the trainer
finishes the step in flight, saves a checkpoint, waits for it to commit and exits with
``128 + signal number`` (143 for SIGTERM, 130 for SIGINT, 138 for SIGUSR1): "preempted,
resumable" (``trainer.load_checkpoint: auto`` resumes it). A second signal ends the process at
once with the same code; the commit protocol guarantees that the newest committed checkpoint is
whole whatever is cut short.

Agreement without a per-step blocking sync and without a program of its own: each step every
process puts two small integers (the signal it caught, or 0; and, on process 0 alone, how many
``checkpoint.every_minutes`` periods have passed) in its devices' rows of the train step's
``flags`` input, and the step returns their max over all devices, replicated, with its metrics
(``agree``). The loop reads step k's flags after dispatching step k+1, when it has waited for
step k anyway (two steps in flight), so every process sees the same value for step k at the
same point of its loop, and all stop or save after the same step. One process catching the
signal is enough. The flags ride in the one program per step that every process dispatches
anyway: no second collective per step, and nothing else to interleave with the step's. A run of
one process goes the same way (its flags array is made again only when the flags change), so
the path a cluster relies on is the one every test runs.
"""

from __future__ import annotations

import os
import signal
import time
from collections import deque

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .trackers import log

__all__ = ["StopRequests", "agree", "exit_code", "flags_layout"]


def exit_code(signum: int) -> int:
    """The exit status of a run stopped by ``signum``: ``128 + signum``, as a shell reports a signal."""
    return 128 + int(signum)


def flags_layout(mesh) -> jax.ShapeDtypeStruct:
    """The train step's ``flags`` input on ``mesh``: one int32 row (signal, periods) per device,
    sharded over every mesh axis, so each process fills the rows of its own devices."""
    sharding = NamedSharding(mesh, PartitionSpec(mesh.axis_names))
    return jax.ShapeDtypeStruct((mesh.devices.size, 2), jnp.int32, sharding=sharding)


def agree(flags: jax.Array) -> jax.Array:
    """Inside the train step: the max of ``flags`` over every device's row, replicated so that
    each process reads the whole value from its own devices."""
    return jax.lax.with_sharding_constraint(flags.max(axis=0), PartitionSpec())


class StopRequests:
    """Signal handlers for the duration of a ``with`` block, and the agreed per-step decisions.

    Args:
        names: signal names to handle (``trainer.stop_signals``).
        every_minutes: time-based checkpoint period, or None.
        mesh: the run's mesh (all global devices), over which the train step agrees the flags.
    """

    def __init__(self, names: list[str], every_minutes: float | None, mesh):
        self.signals = [getattr(signal, n) for n in names]
        self.period_s = every_minutes * 60 if every_minutes else None
        self.caught = 0  # the first signal caught here (0: none)
        self._t0 = time.monotonic()
        self._periods_saved = self._periods_seen = 0
        self._old: dict = {}
        self._layout = flags_layout(mesh)
        self._rows = len(self._layout.sharding.addressable_devices)
        self._made: tuple[tuple[int, int], jax.Array] | None = None  # the last flags array, and its values
        self._agreed: deque = deque()  # the steps' agreed flags, not yet read

    def __enter__(self) -> StopRequests:
        for s in self.signals:
            self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()

    def _handle(self, signum, _frame) -> None:
        name = signal.Signals(signum).name
        if self.caught:
            os.write(
                2,
                f"named-train: second signal ({name}): stopping now, without saving; the newest committed "
                f"checkpoint is whole\n".encode(),
            )
            os._exit(exit_code(self.caught))
        self.caught = signum
        log.warning(
            f"got {name}: finishing the step in flight, then saving a checkpoint and exiting with "
            f"{exit_code(signum)} (a second signal stops at once)"
        )

    def _local(self) -> tuple[int, int]:
        periods = 0
        if self.period_s and jax.process_index() == 0:  # one clock decides for every process
            periods = int((time.monotonic() - self._t0) // self.period_s)
        return self.caught, periods

    def flags(self) -> jax.Array:
        """The next train step's ``flags`` input: this process's (signal, periods) in its devices'
        rows. The flags change rarely, so the array is made again (a transfer) only when they do."""
        local = self._local()
        if self._made is None or self._made[0] != local:
            rows = np.tile(np.asarray(local, np.int32), (self._rows, 1))
            self._made = local, jax.make_array_from_process_local_data(self._layout.sharding, rows, self._layout.shape)
        return self._made[1]

    def poll(self, agreed: jax.Array) -> tuple[int, bool]:
        """After dispatching a step, with its agreed flags (its ``stop_flags`` output): ``(signal,
        timed)`` from the step before it, the signal to stop on (0: go on) and whether a time-based
        checkpoint is due, the same on every process; ``(0, False)`` after the first step of a
        launch. The step before has finished (the loop waited for it), so this read does not wait."""
        self._agreed.append(agreed)
        if len(self._agreed) < 2:
            return 0, False
        signum, periods = (int(v) for v in np.asarray(self._agreed.popleft()))
        self._periods_seen = periods
        return signum, periods > self._periods_saved

    def saved(self) -> None:
        """A checkpoint was saved at the step just polled: the next time-based one is due when
        the next period (counted from the start of this launch, on process 0) has passed."""
        self._periods_saved = self._periods_seen
