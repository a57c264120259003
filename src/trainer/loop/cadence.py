"""What the loop does around each step it dispatches: what is due after it (log, eval, samples,
lm-eval, a checkpoint, a stop: ``step_due``), reading the steps' metrics off the device in one
transfer with the NaN policy applied (``read_metrics``, ``check_finite``), the throughput since the
last log line (``RateWindow``), a step's loss as logged (``step_loss``), the progress bar and the
epochs note. ``train`` drives the loop with these.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time

import jax

from named import NamedError

from .. import checkpoint as ckpt
from ..config import TrainConfig
from .trackers import log


class TrainingError(NamedError, RuntimeError):
    """The run cannot go on (a NaN under nan_policy=stop, for example); the message says where."""


# Without logging, eval, samples or checkpoints, the metrics are still read this often, so that a
# non-finite step under nan_policy=stop ends the run within this many steps.
MAX_UNREAD_STEPS = 100
# Steps dispatched but maybe unfinished: two keep the device busy (one runs, the next is queued)
# while the host prepares the batch after them. Running further ahead gains nothing and queues a
# batch per step; on the 2-core CPU it was slower (docs/benchmarks.md, the loop section).
MAX_IN_FLIGHT = 2


@dataclasses.dataclass(frozen=True)
class Due:
    """What happens after step ``done`` (numbered as in the logs). Each of these waits for the
    device, so each first reads the metrics of the steps since the last read (``read``);
    every other step only dispatches."""

    log: bool
    eval: bool
    sample: bool
    checkpoint: bool
    read: bool
    harness: bool = False  # score trainer.eval_harness_tasks
    temporary: bool = False  # the checkpoint is time-based or a stop's (checkpoint.retention)
    stop: bool = False  # a stop signal: save, wait for the commit, end the run


def epochs_note(sequences: int, t) -> str:
    """How the run's steps measure against its training data: the steps of one epoch (one pass over
    the ``sequences`` training rows) and the epochs ``trainer.num_train_steps`` makes."""
    if not sequences:
        return "no training sequences: no epoch to count steps by"
    per_epoch = sequences / t.train_batch_size
    return (
        f"one epoch (every one of the {sequences} training sequences once) is {per_epoch:.4g} steps of "
        f"{t.train_batch_size} sequences; trainer.num_train_steps={t.num_train_steps} is "
        f"{t.num_train_steps / per_epoch:.4g} epochs"
    )


def step_due(
    done: int, cfg: TrainConfig, has_validation: bool, unread: int, stop: bool = False, timed: bool = False
) -> Due:
    t = cfg.trainer
    end = done == t.num_train_steps
    stop = stop and not end  # at the end the run finishes as usual

    def every(n: int) -> bool:
        return bool(n) and (done % n == 0 or end)

    log_, eval_, sample = every(t.log_interval), has_validation and every(t.eval_interval), every(t.sample_interval)
    harness = bool(t.eval_harness_tasks) and every(t.eval_harness_interval)
    if stop:  # time is short: no eval or sample before the save
        eval_ = sample = harness = False
    regular = bool(cfg.checkpoint.interval) and done % cfg.checkpoint.interval == 0 and not end  # the end: save_at_end
    checkpoint = regular or ((stop or timed) and not end)
    read = log_ or eval_ or sample or harness or checkpoint or end or unread >= MAX_UNREAD_STEPS
    return Due(
        log=log_,
        eval=eval_,
        harness=harness,
        sample=sample,
        checkpoint=checkpoint,
        read=read,
        temporary=checkpoint and not regular,
        stop=stop,
    )


def read_metrics(pending: list[tuple[int, dict]], nan_policy: str, last_checkpoint=None) -> list[dict]:
    """The metrics of the steps in ``pending`` on the host, in one transfer, with the NaN policy
    applied to each step in order (``stop`` names the first non-finite one); ``pending`` is
    emptied."""
    rows = jax.device_get([m for _, m in pending])
    for (step, _), row in zip(pending, rows):
        check_finite(step, row, nan_policy, last_checkpoint)
    pending.clear()
    return rows


class RateWindow:
    """Tokens, wall time and steps skipped by dynamic loss scaling since the last log line (read points
    in between add their steps)."""

    def __init__(self):
        self.start, self.tokens, self.steps, self.skipped = time.perf_counter(), 0.0, 0, 0

    def add(self, rows: list[dict]) -> None:
        self.tokens += sum(float(r["tokens"]) for r in rows)
        self.steps += len(rows)
        self.skipped += sum(int(r.get("overflow", 0)) for r in rows)

    def rates(self, flops_tok: float, peak: float | None, n_dev: int) -> dict:
        elapsed = time.perf_counter() - self.start
        out = {"tokens_per_s": self.tokens / elapsed, "step_time_s": elapsed / self.steps}
        if peak:
            out["mfu"] = out["tokens_per_s"] * flops_tok / (peak * n_dev)
        return out


def check_finite(step: int, metrics: dict, nan_policy: str, last_checkpoint=None) -> bool:
    """Whether step ``step`` (numbered as in the logs and checkpoints: the update that made
    step_<step>) was finite. If not: ``stop`` raises TrainingError naming the step and
    ``last_checkpoint()`` (which lets a save in flight commit first), ``skip`` warns (the
    train step has already kept the old state) and returns False."""
    if bool(metrics["finite"]):
        return True
    loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
    if math.isfinite(loss) and math.isfinite(grad_norm):
        what = (
            f"non-finite update in step {step}: the new parameters or optimizer state are not finite, although the "
            f"loss ({loss}) and gradient norm ({grad_norm}) are (a non-finite learning rate, or an overflow in the "
            "optimizer)"
        )
    else:
        what = f"non-finite loss or gradient in step {step} (loss={loss}, grad_norm={grad_norm})"
    if nan_policy == "stop":
        try:
            last = last_checkpoint() if last_checkpoint is not None else None
        except ckpt.CheckpointError as e:  # the save in flight failed: report both
            last = f"unknown ({e})"
        raise TrainingError(f"{what}; stopped (trainer.nan_policy=stop); the last committed checkpoint is {last}")
    log.warning(f"{what}; update skipped, parameters and optimizer state unchanged (trainer.nan_policy=skip)")
    return False


def step_loss(step: int, row: dict) -> float:
    """The step's loss; NaN, said in the log, for a step whose batch kept no loss token: its loss
    is no number (the loss is a mean over the loss tokens), not 0, and its gradient was zero."""
    if float(row["tokens"]):
        return float(row["loss"])
    log.warning(
        f"step {step}: no token of its batch carries loss (in a chat corpus: every reply was cut off by "
        "data.seq_len, see the build's summary), so its loss is undefined and left out of the log; its "
        "gradient was zero"
    )
    return math.nan


def progress_bar(t, start: int, pid: int, stack: contextlib.ExitStack):
    """A progress bar on process 0 when stderr is a terminal (in logs it would be noise); while
    it is up, console log lines are written above it instead of through it."""
    if not t.progress_bar or pid != 0 or not sys.stderr.isatty():
        return None
    from tqdm.auto import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    bar = stack.enter_context(
        tqdm(total=t.num_train_steps, initial=start, desc="train", unit="step", leave=False, dynamic_ncols=True)
    )
    stack.enter_context(logging_redirect_tqdm(loggers=[log]))
    return bar
