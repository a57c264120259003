"""Where metrics go: the console, a JSONL file in the run directory, wandb and TensorBoard.

Only process 0 writes to trackers and the console; other processes log to
``<run_dir>/logs/process_<i>.log``. wandb runs offline unless told otherwise and never
waits on the network; it is an optional dependency (``pip install 'named-jax[wandb]'``),
imported only when ``tracker.wandb_mode`` is not ``disabled``. TensorBoard event files
(``tracker.tensorboard``, ``pip install 'named-jax[tensorboard]'``) go to
``<run_dir>/tensorboard`` (``loop/tensorboard.py``).
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

from ..checkpoint.run_places import METRICS_FILE
from ..config import ConfigError, TrackerConfig
from ..data import atomic_write

log = logging.getLogger("named.trainer")


def setup_logging(run_dir: Path, process_index: int) -> None:
    """Console logging for process 0; a per-process log file for every process.

    The log files take the level in NAMED_LOG_LEVEL (default INFO); at DEBUG they also record
    the data rows each process reads at every step. The console stays at INFO.
    """
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    level = os.environ.get("NAMED_LOG_LEVEL", "INFO").upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ConfigError(f"NAMED_LOG_LEVEL={level!r}: use DEBUG, INFO, WARNING or ERROR")
    release_logging()  # a run before this one in the process
    log.setLevel(min(logging.INFO, getattr(logging, level)))
    log.propagate = False
    fh = logging.FileHandler(run_dir / "logs" / f"process_{process_index}.log")
    fh.setLevel(getattr(logging, level))
    fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(fh)
    if process_index == 0:
        ch = logging.StreamHandler(sys.stdout)
        ch.setLevel(logging.INFO)
        ch.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(ch)


def release_logging() -> None:
    """Close and remove what ``setup_logging`` installed, as a new process has it (no handler, records
    passed up to the root logger): a run's handlers end with the run, so neither its log file stays
    open nor a later run in the same process writes to the console stream of this one (a stream a
    notebook or a test may since have closed)."""
    for h in log.handlers:
        h.close()
    log.handlers.clear()
    log.setLevel(logging.NOTSET)
    log.propagate = True


def check_trackers(cfg: TrackerConfig) -> None:
    """Refuse a tracker whose package is missing: part of the checks that run before anything
    is compiled or written (every process runs them, so none is left waiting for another)."""
    if cfg.wandb_mode != "disabled":
        _require("wandb", f"tracker.wandb_mode={cfg.wandb_mode!r}", "wandb", "tracker.wandb_mode: disabled")
    if cfg.tensorboard:
        _require(
            "tensorboard.summary.writer.event_file_writer",
            "tracker.tensorboard=true",
            "tensorboard",
            "tracker.tensorboard: false",
        )


def _require(module: str, setting: str, extra: str, off: str) -> None:
    try:
        importlib.import_module(module)
    except ImportError as e:
        package = module.split(".")[0]
        raise ConfigError(
            f"{setting} needs the {package} package, which does not import ({e}): "
            f"pip install 'named-jax[{extra}]', or set {off}"
        ) from None


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.3e}"
    return str(v)


def drop_rows_after(path: Path, step: int) -> int:
    """Rewrite the per-step JSONL file ``path`` without its rows of steps after ``step``, and
    without a last line cut short, in one rename (``atomic_write``); returns how many lines went.

    A run resumed from the checkpoint of ``step`` logs every later step again; the rows its
    killed predecessor logged for them would otherwise stand beside the new ones, two values per
    step. Lines that are not such rows are kept as they are."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    with open(path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n") or _step_of(line) > step:  # a partial last line: the kill cut it
                dropped += 1
            else:
                kept.append(line)
    if dropped:
        with atomic_write(path) as f:
            f.writelines(kept)
    return dropped


def _step_of(line: bytes) -> float:
    try:
        row = json.loads(line)
    except ValueError:
        return -math.inf
    value = row.get("step") if isinstance(row, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else -math.inf


class Trackers:
    """Where the loop's metrics go. ``start_step``: the step the run starts from (a resume's
    checkpoint); rows ``metrics.jsonl`` holds for later steps are dropped first
    (``drop_rows_after``), so that each step appears once."""

    def __init__(
        self,
        cfg: TrackerConfig,
        run_dir: Path,
        process_index: int,
        config_dict: dict | None = None,
        start_step: int = 0,
        config_text: str | None = None,
    ):
        self.active = process_index == 0
        self.console = cfg.console
        self._jsonl = None
        self._wandb = None
        self._tensorboard = None
        if not self.active:
            return
        dropped = drop_rows_after(run_dir / METRICS_FILE, start_step)
        if dropped:
            log.info(
                f"{run_dir / METRICS_FILE}: dropped {dropped} line(s) past step {start_step}, written by a run "
                "that ended before its next checkpoint; this run logs those steps again"
            )
        if cfg.jsonl:
            self._jsonl = open(run_dir / METRICS_FILE, "a", encoding="utf-8")
        if cfg.wandb_mode != "disabled":
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self._wandb = wandb.init(
                project=cfg.wandb_project,
                dir=str(run_dir),
                mode=cfg.wandb_mode,
                config=config_dict,
                settings=wandb.Settings(init_timeout=30, silent=True),
            )
        if cfg.tensorboard:
            from .tensorboard import EventWriter

            self._tensorboard = EventWriter(run_dir, start_step)
            if config_text is not None:
                self._tensorboard.text(start_step, "config", config_text)

    def log(self, step: int, metrics: dict[str, Any], *, prefix: str = "train") -> None:
        if self.console or not self.active:  # processes > 0: into their own log file only
            log.info(f"[{prefix} {step}] " + "  ".join(f"{k}={_fmt(v)}" for k, v in metrics.items()))
        if not self.active:
            return
        row = {"step": step, **{f"{prefix}/{k}": v for k, v in metrics.items()}}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(row) + "\n")
            self._jsonl.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if k != "step"}, step=step)
        if self._tensorboard is not None:
            self._tensorboard.scalars(step, {k: v for k, v in row.items() if k != "step"})

    def text(self, step: int, name: str, text: str) -> None:
        if not self.active:
            return
        if self.console:
            log.info(f"[{name} {step}]\n{text}")
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, name: text}) + "\n")
            self._jsonl.flush()
        if self._tensorboard is not None:
            self._tensorboard.text(step, name, text)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._tensorboard is not None:
            self._tensorboard.close()
