"""The training loop's step time before and after it stopped waiting for the device each step.

    .venv/bin/python bench/loop_overlap.py --before-rev 70c9326   # the loop as of that commit vs this tree

"Before" is ``train.py`` at ``--before-rev`` (``src/trainer/loop/train.py``, or ``src/trainer/train.py``
before the trainer's sub-packages; read with ``git show``, loaded as a module of this tree's
``named.trainer``, so everything but the file itself is the same code);
"after" is the working tree's. Both train the same model on the same data with
``named.trainer.loop.train``, taking turns (before-after, then after-before, ...), for ``--repeats`` pairs.
A run's step time is the median of the ``step_time_s`` its log lines report (the wall time of a
log window over its steps), leaving out the first window, which holds the compile. No eval,
samples or checkpoints, so the windows hold training steps only.

Two sizes: ``nano`` is ``config/gpt2_nano.yaml`` (4 layers, embed 128, batch 16 × 128 tokens),
``tiny`` a 1-layer, embed-32 model whose steps are short enough that the host's share (batch
preparation, dispatch, the per-step read) shows.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import _common as C  # sets XLA_FLAGS before jax is imported

SIZES = {
    "nano": {},
    "tiny": {
        "model.n_layer": 1,
        "model.n_head": 2,
        "model.n_embd": 32,
        "model.n_positions": 64,
        "data.seq_len": 32,
        "trainer.train_batch_size": 8,
    },
}


# Before the trainer was grouped into sub-packages its files lay side by side: train.py at
# src/trainer/train.py imported `.checks`, `.config`, `from . import rundir`, ... Such a file is
# loaded beside this tree's modules under those flat names.
_FLAT_NAMES = {
    "checks": "loop.checks",
    "hardware": "loop.hardware",
    "loss": "loop.loss",
    "model_init": "loop.model_init",
    "optim": "loop.optim",
    "registry": "loop.registry",
    "stop": "loop.stop",
    "trackers": "loop.trackers",
    "rundir": "checkpoint.rundir",
}


def _before_module(rev: str):
    """``train.py`` at ``rev`` as a module beside this tree's (its relative imports resolve to this
    tree's trainer package), from before or after the trainer's sub-packages."""
    for path, package in (  # noqa: B007 - the pair found is used after the loop
        ("src/trainer/loop/train.py", "named.trainer.loop"),
        ("src/trainer/train.py", "named.trainer"),
    ):
        got = subprocess.run(["git", "-C", str(C.ROOT), "show", f"{rev}:{path}"], capture_output=True, text=True)
        if got.returncode == 0:
            break
    else:
        raise SystemExit(f"--before-rev {rev}: no src/trainer/loop/train.py or src/trainer/train.py there")
    if package == "named.trainer":
        for flat, now in _FLAT_NAMES.items():
            sys.modules[f"named.trainer.{flat}"] = importlib.import_module(f"named.trainer.{now}")
    path = Path(tempfile.mkdtemp(prefix="named-loop-before-")) / "train_before.py"
    path.write_text(got.stdout)
    spec = importlib.util.spec_from_file_location(f"{package}._train_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _cfg(size: str, steps: int, log_interval: int, run_dir: Path, cache: Path):
    over = {
        "trainer.num_train_steps": steps,
        "trainer.log_interval": log_interval,
        "trainer.eval_interval": 0,
        "trainer.sample_interval": 0,
        "trainer.progress_bar": "false",
        "trainer.run_dir": str(run_dir),
        "checkpoint.interval": 0,
        "checkpoint.save_at_end": "false",
        "tracker.console": "false",
        "data.cache_dir": str(cache),
        "data.stdlib_bytes": 1_000_000,
        **SIZES[size],
    }
    return C.trainer_config("gpt2_nano.yaml", over)


def _step_times(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train/step_time_s"] for r in rows if "train/step_time_s" in r][1:]  # the first window compiles


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before-rev", default="HEAD", help="git revision whose train.py is 'before'")
    ap.add_argument("--sizes", nargs="+", choices=tuple(SIZES), default=list(SIZES))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--log-interval", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from named.trainer.loop import train as after

    sides = {"before": _before_module(args.before_rev), "after": after}
    work = Path(tempfile.mkdtemp(prefix="named-loop-"))
    result = {
        "benchmark": "loop_overlap",
        "command": C.command_line(),
        "machine": C.machine(),
        "before_rev": subprocess.run(
            ["git", "-C", str(C.ROOT), "rev-parse", "--short=12", args.before_rev], capture_output=True, text=True
        ).stdout.strip(),
        "protocol": f"{args.repeats} pairs of runs per size (before-after, after-before, ...), "
        f"{args.steps} steps each, log every {args.log_interval}; a run's step time is the median of its log "
        "windows but the first",
        "sizes": {},
    }
    for size in args.sizes:
        runs = {"before": [], "after": []}
        for r in range(args.repeats):
            # before/after, then after/before: a drift over the process's life (its caches grow
            # with every run) must not favour one side
            for side in ("before", "after") if r % 2 == 0 else ("after", "before"):
                module = sides[side]
                run_dir = work / f"{size}-{side}-{r}"
                module.train(_cfg(size, args.steps, args.log_interval, run_dir, work / "cache"))
                runs[side].append(statistics.median(_step_times(run_dir)))
                print(f"  {size} pair {r + 1} {side}: {runs[side][-1] * 1e3:.2f} ms/step", flush=True)
        med = {k: statistics.median(v) for k, v in runs.items()}
        result["sizes"][size] = {
            "config": SIZES[size],
            "step_s_per_run": runs,
            "step_s_median": med,
            "after_over_before": med["after"] / med["before"],
            "per_pair_after_over_before": [a / b for a, b in zip(runs["after"], runs["before"])],
        }
        print(
            f"{size}: before {med['before'] * 1e3:.2f} ms/step, after {med['after'] * 1e3:.2f} ms/step, "
            f"after/before {med['after'] / med['before']:.3f}",
            flush=True,
        )
    C.write_result("loop_overlap", result, args.out)
    return result


if __name__ == "__main__":
    main()
