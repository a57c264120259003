"""Stopping a run on a signal, and time-based checkpoints, agreed by every process.

On one of ``trainer.stop_signals`` (SIGTERM, SIGINT and SIGUSR1 by default) the trainer
finishes the step in flight, saves a checkpoint, waits for it to commit and exits with
``128 + signal number`` (143 for SIGTERM, 130 for SIGINT, 138 for SIGUSR1): "preempted,
resumable" (``trainer.load_checkpoint: auto`` resumes it). A second signal ends the process at
once with the same code; the commit protocol guarantees that the newest committed checkpoint is
whole whatever is cut short.

Agreement without a per-step blocking sync: in a run of several processes, each step every
process contributes two small integers (the signal it caught, or 0; and, on process 0 alone,
how many ``checkpoint.every_minutes`` periods have passed) to a max over all devices, a tiny
collective dispatched right after the train step. Its result is read one step later, when it
is normally ready (the host then waits for step k while step k+1 is already queued on the
device), so every process sees the same value for step k at the same point of its loop, and
all stop or save at the same step. One process catching the signal is enough. In a run of one
process the flags are read directly, with no device work at all.
"""

from __future__ import annotations

import os
import signal
import time
from collections import deque

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .trackers import log

__all__ = ["StopRequests", "exit_code"]


def exit_code(signum: int) -> int:
    """The exit status of a run stopped by ``signum``: ``128 + signum``, as a shell reports a signal."""
    return 128 + int(signum)


class StopRequests:
    """Signal handlers for the duration of a ``with`` block, and the agreed per-step decisions.

    Args:
        names: signal names to handle (``trainer.stop_signals``).
        every_minutes: time-based checkpoint period, or None.
        mesh: the run's mesh (all global devices): the flags are reduced over it when
            ``jax.process_count() > 1``.
    """

    def __init__(self, names: list[str], every_minutes: float | None, mesh):
        self.signals = [getattr(signal, n) for n in names]
        self.period_s = every_minutes * 60 if every_minutes else None
        self.caught = 0  # the first signal caught here (0: none)
        self._t0 = time.monotonic()
        self._periods_saved = self._periods_seen = 0
        self._old: dict = {}
        self._multi = jax.process_count() > 1
        self._pending: deque = deque()
        if self._multi:
            self._sharding = NamedSharding(mesh, PartitionSpec(mesh.axis_names))
            self._rows = len(self._sharding.addressable_devices)
            self._global = (mesh.devices.size, 2)
            self._reduce = jax.jit(lambda x: x.max(axis=0), out_shardings=NamedSharding(mesh, PartitionSpec()))

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
            os.write(2, f"named-train: second signal ({name}): stopping now, without saving; the newest committed "
                        f"checkpoint is whole\n".encode())
            os._exit(exit_code(self.caught))
        self.caught = signum
        log.warning(f"got {name}: finishing the step in flight, then saving a checkpoint and exiting with "
                    f"{exit_code(signum)} (a second signal stops at once)")

    def _local(self) -> tuple[int, int]:
        periods = 0
        if self.period_s and jax.process_index() == 0:  # one clock decides for every process
            periods = int((time.monotonic() - self._t0) // self.period_s)
        return self.caught, periods

    def poll(self, done: int) -> tuple[int, bool]:
        """After dispatching the step that ends at ``done``: ``(signal, timed)``, the signal to stop
        on (0: go on) and whether a time-based checkpoint is due, the same on every process."""
        if not self._multi:
            signum, periods = self._local()
        else:
            local = np.tile(np.asarray(self._local(), np.int32), (self._rows, 1))
            flags = jax.make_array_from_process_local_data(self._sharding, local, self._global)
            self._pending.append(self._reduce(flags))
            if len(self._pending) < 2:  # the flags of the previous step decide; none yet
                return 0, False
            signum, periods = (int(v) for v in np.asarray(jax.device_get(self._pending.popleft())))
        self._periods_seen = periods
        return signum, periods > self._periods_saved

    def saved(self) -> None:
        """A checkpoint was saved at the step just polled: the next time-based one is due when
        the next period (counted from the start of this launch, on process 0) has passed."""
        self._periods_saved = self._periods_seen
