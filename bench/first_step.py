"""Time to the first step's loss of ``named-train --config gpt2_nano``, from process start, by phase.

    .venv/bin/python bench/first_step.py
    .venv/bin/python bench/first_step.py --tiny

Each launch is a fresh process running the ``named-train`` entry point (``main_train``) on the
embedded corpus for one step, with evaluation, samples and checkpoints off. The time runs from
just before the process is started to the moment its ``[train 1] loss=`` line reaches this
script. Inside, the process notes when Python starts running its code and when the trainer's
modules are imported, and sums JAX's own compile events (tracing, lowering to MLIR, XLA's
backend compile, reads from the persistent compilation cache), so a launch splits into:
interpreter start, imports, compilation, and the rest (config checks, data, model and optimizer
init, the first batch and the step itself).

Three kinds of launch take turns, ``--repeats`` rounds: without the persistent compilation
cache; with an empty cache directory (``JAX_COMPILATION_CACHE_DIR``, what a first launch with
the cache pays to fill it); and with the cache the previous launch filled (a second launch).
The cache is JAX's own, switched on by the environment variable alone, with JAX's defaults
(programs that compile in under a second are not kept).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common as C  # sets XLA_FLAGS (8 devices), which the launches inherit

CHILD = r"""
import collections, json, os, sys, time
t0 = float(os.environ["FIRST_STEP_T0"])
marks = {"python_started_s": time.time() - t0}
import jax
events = collections.defaultdict(float)
jax.monitoring.register_event_duration_secs_listener(lambda e, d, **kw: events.__setitem__(e, events[e] + d))
from named.trainer.commands.cli import main_train
marks["imported_s"] = time.time() - t0
sys.argv = ["named-train", *json.loads(os.environ["FIRST_STEP_ARGS"])]
try:
    main_train()
finally:
    print("FIRST_STEP " + json.dumps({"marks": marks, "events": events}), file=sys.stderr, flush=True)
"""

COMPILE_EVENTS = ("jaxpr_trace_duration", "jaxpr_to_mlir_module_duration", "backend_compile_duration")
CACHE_EVENTS = ("cache_retrieval_time_sec",)


def launch(args: list[str], env: dict) -> dict:
    t0 = time.time()
    env = {**env, "FIRST_STEP_T0": repr(t0), "FIRST_STEP_ARGS": json.dumps(args)}
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    first = None
    for line in proc.stdout:
        if first is None and line.startswith("[train 1] loss="):
            first = time.time() - t0
    err = proc.stderr.read()
    proc.wait()
    report = [line for line in err.splitlines() if line.startswith("FIRST_STEP ")]
    if proc.returncode != 0 or first is None or not report:
        # recorded, not raised: a launch that aborts is a result too (see docs/benchmarks.md §12)
        lines = [ln for ln in err.splitlines() if ln.startswith(("F", "E", "Traceback")) or "Error" in ln]
        return {"failed": f"exit {proc.returncode}: {(lines or err.splitlines() or [''])[0][:300]}"}
    inner = json.loads(report[-1][len("FIRST_STEP ") :])
    events = inner["events"]
    compile_s = sum(v for k, v in events.items() if k.endswith(COMPILE_EVENTS))
    cache_s = sum(v for k, v in events.items() if k.endswith(CACHE_EVENTS))
    marks = inner["marks"]
    return {
        "first_loss_s": first,
        "python_started_s": marks["python_started_s"],
        "imports_s": marks["imported_s"] - marks["python_started_s"],
        "compile_s": compile_s,
        "cache_read_s": cache_s,
        "rest_s": first - marks["imported_s"] - compile_s - cache_s,
    }


def _summary(rows: list[dict], phases) -> dict:
    ok = [run for run in rows if "failed" not in run]
    out = {p: statistics.median(run[p] for run in ok) for p in phases} if ok else {}
    return out | {"launches": len(rows), "failed": [run["failed"] for run in rows if "failed" in run], "all": rows}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="a 1-layer model of width 16 (smoke test)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    machine = C.machine()  # the load average before the run
    tmp = Path(tempfile.mkdtemp(prefix="named-bench-"))
    train = [
        "--config",
        "gpt2_nano",
        "--trainer.num_train_steps",
        "1",
        "--trainer.log_interval",
        "1",
        "--trainer.eval_interval",
        "0",
        "--trainer.sample_interval",
        "0",
        "--trainer.progress_bar",
        "false",
        "--checkpoint.interval",
        "0",
    ]
    if args.tiny:
        train += ["--model.n_layer", "1", "--model.n_embd", "16", "--model.n_head", "2"]
    base = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    runs: dict[str, list[dict]] = {"no persistent cache": [], "empty cache (first launch)": [], "warm cache": []}
    try:
        for r in range(args.repeats):
            cache = tmp / f"cache{r}"
            kinds = {
                "no persistent cache": base,
                "empty cache (first launch)": {**base, "JAX_COMPILATION_CACHE_DIR": str(cache)},
                "warm cache": {**base, "JAX_COMPILATION_CACHE_DIR": str(cache)},
            }
            for kind, env in kinds.items():
                run = launch([*train, "--trainer.run_dir", str(tmp / f"run-{r}-{len(runs[kind])}-{kind[:4]}")], env)
                runs[kind].append(run)
                said = run["failed"] if "failed" in run else f"first loss after {run['first_loss_s']:.1f}s"
                print(f"round {r + 1}: {kind}: {said}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    phases = ("first_loss_s", "python_started_s", "imports_s", "compile_s", "cache_read_s", "rest_s")
    result = {
        "benchmark": "first_step",
        "command": C.command_line(),
        "machine": machine,
        "config": "gpt2_nano" + (" (tiny: 1 layer, width 16)" if args.tiny else ""),
        "repeats": args.repeats,
        "launches": {kind: _summary(rows, phases) for kind, rows in runs.items()},
    }
    C.write_result("first_step" + ("_tiny" if args.tiny else ""), result, args.out)
    return result


if __name__ == "__main__":
    main()
