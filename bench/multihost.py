"""Step time of 2 processes x 4 CPU devices (gloo) against 1 process x 8 devices, same run.

    .venv/bin/python bench/multihost.py                 # both models, 3 rounds
    .venv/bin/python bench/multihost.py --rounds 5 --models tiny

Each round trains the same FSDP run (mesh {data: 8}, param {embed: data}, compute
{batch: data}) once as 1 x 8 (``named-train``) and once as 2 x 4 (``named-launch``), taking
turns so that a change in the machine's load hits both. A run's step time is the median of
``train/step_time_s`` in its metrics.jsonl (logged every step) after the first 5 steps
(compile); the result is the median over rounds of each side and their ratio. Models:
``tiny`` is the model of tests/test_multihost.py (2 layers, embed 32, seq 32, batch 16);
``nano`` is ``make train``'s (4 layers, embed 128, seq 128, batch 16). Data: a generated
Python-like corpus, so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
CORPUS = "\n".join(
    f"def function_{i}(x, y):\n    total = x * {i} + y\n    for k in range({i % 7 + 1}):\n        total += k\n    "
    "return total\n"
    for i in range(400)
)
MODELS = {
    "tiny": {"model.n_layer": 2, "model.n_head": 2, "model.n_embd": 32, "model.n_positions": 64, "data.seq_len": 32},
    "nano": {"model.n_layer": 4, "model.n_head": 4, "model.n_embd": 128, "model.n_positions": 256, "data.seq_len": 128},
}
SKIP = 5  # steps left out of the median: compilation


def args_for(model: str, corpus: Path, run_dir: Path, steps: int) -> list[str]:
    over = {
        "trainer.num_train_steps": steps,
        "trainer.train_batch_size": 16,
        "trainer.log_interval": 1,
        "trainer.eval_interval": 0,
        "trainer.sample_interval": 0,
        "trainer.progress_bar": "false",
        "trainer.run_dir": run_dir,
        "data.train": f"[{corpus}]",
        "data.val_fraction": 0.05,
        "data.cache_dir": corpus.parent / "cache",
        "optimizer.warmup_steps": 2,
        "checkpoint.interval": 0,
        "checkpoint.save_at_end": "false",
        "tracker.console": "false",
        "mesh.shape": "{data: 8}",
        "mesh.param_mapping": "{embed: data}",
        "mesh.compute_mapping": "{batch: data}",
        **MODELS[model],
    }
    return [
        "--config_path",
        str(ROOT / "config" / "gpt2_nano.yaml"),
        *[x for k, v in over.items() for x in (f"--{k}", str(v))],
    ]


def run(layout: str, model: str, corpus: Path, run_dir: Path, steps: int) -> float:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("NAMED_") and k not in ("XLA_FLAGS", "JAX_PLATFORMS")
    }
    args = args_for(model, corpus, run_dir, steps)
    if layout == "1x8":
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
        cmd = [str(BIN / "named-train"), *args]
    else:
        cmd = [
            str(BIN / "named-launch"),
            "--nproc",
            "2",
            "--devices-per-process",
            "4",
            "--",
            str(BIN / "named-train"),
            *args,
        ]
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{layout} {model} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [row["train/step_time_s"] for row in rows if "train/step_time_s" in row and row["step"] > SKIP]
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus" / "code.txt"
        corpus.parent.mkdir()
        corpus.write_text(CORPUS)
        out = {"machine": {"cpus": os.cpu_count(), "load_before": os.getloadavg()}, "models": {}}
        for model in a.models:
            times: dict[str, list[float]] = {"1x8": [], "2x4": []}
            for r in range(a.rounds):
                for layout in ("1x8", "2x4") if r % 2 == 0 else ("2x4", "1x8"):
                    t = run(layout, model, corpus, Path(tmp) / f"{model}-{layout}-{r}", a.steps)
                    times[layout].append(t)
                    print(f"{model} round {r} {layout}: median step {t * 1e3:.1f} ms", flush=True)
            med = {k: statistics.median(v) for k, v in times.items()}
            out["models"][model] = {
                "step_s": times,
                "median_step_s": med,
                "ratio_2x4_over_1x8": med["2x4"] / med["1x8"],
            }
            print(
                f"{model}: 1x8 {med['1x8'] * 1e3:.1f} ms, 2x4 {med['2x4'] * 1e3:.1f} ms, "
                f"ratio 2x4/1x8 = {med['2x4'] / med['1x8']:.1f}",
                flush=True,
            )
        out["machine"]["load_after"] = os.getloadavg()
        out["time"] = time.strftime("%Y-%m-%d %H:%M:%S")
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
