"""What every benchmark shares: 8 fake CPU devices, the machine and version record that goes
into each JSON result, alternating timers, and counts read from optimized HLO.

Import this module before jax: it sets ``XLA_FLAGS`` so the CPU backend shows 8 devices.
"""

from __future__ import annotations

import collections
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

# Must precede the first `import jax` anywhere in the process (jax reads it once).
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# and what named-train adds for CPU devices (docs/trainer.md): thread pools sized for 8 devices' collectives
from named.internal import safe_cpu_env  # noqa: E402 - imports jax, which reads both only when it starts

os.environ.update(safe_cpu_env(os.environ))

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

# The GPT-2 every CPU comparison uses (issue 9): 4 layers, embed 256, seq 256, batch 16, vocab 8192.
SMALL_GPT2 = dict(n_layer=4, n_head=4, n_embd=256, n_positions=256, vocab_size=8192)
SEQ, BATCH = 256, 16
MESH = {"data": 8}
PARAM_MAPPING = {"embed": "data"}  # FSDP: weights and optimizer state split along embed
COMPUTE_MAPPING = {"batch": "data"}  # activations split along batch
LEARNING_RATE = 1e-3


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    """Where and on what code a number was measured. ``dirty_src`` is ``git status --porcelain src``
    (when not empty, the library measured is the working tree, not exactly ``commit``)."""
    import jax

    versions = {"python": platform.python_version(), "jax": jax.__version__}
    from importlib import metadata

    for dist in ("jaxlib", "equinox", "optax", "numpy", "tensorstore"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    dirty = (
        []
        if os.environ.get("BENCH_COMMIT")
        else [line.strip() for line in _git("status", "--porcelain", "--", "src").splitlines()]
    )
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "backend": jax.default_backend(),
        "devices": len(jax.devices()),
        "device_kind": jax.devices()[0].device_kind,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "pjrt_nproc": os.environ.get("PJRT_NPROC"),  # XLA:CPU's thread pools (collective_safe_env)
        "versions": versions,
        # A copy of the tree without .git (the GPU machine's) takes the commit from BENCH_COMMIT.
        # (its copy may carry a stale .git: BENCH_COMMIT, when set, wins)
        "commit": os.environ.get("BENCH_COMMIT") or _git("rev-parse", "--short=12", "HEAD"),
        "dirty_src": dirty,
        "load_average_at_start": load_average(),
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def load_average() -> list[float]:
    """The 1-, 5- and 15-minute load averages, rounded."""
    return [round(x, 2) for x in os.getloadavg()]


def command_line() -> str:
    rel = os.path.relpath(sys.argv[0], ROOT)
    # the project's venv as the docs write it; any other interpreter (a GPU image's) by its name
    python = ".venv/bin/python" if Path(sys.executable).parent == ROOT / ".venv" / "bin" else Path(sys.executable).name
    # the device tool's output folder as the docs write it, not as this machine spells it
    out = os.environ.get("OUT")
    return " ".join([python, rel, *(a.replace(out, "$OUT") if out else a for a in sys.argv[1:])])


def write_result(name: str, result: dict, out_dir: str | os.PathLike | None = None) -> Path:
    """``bench/results/<name>.json`` (or under ``out_dir``), with the load average at the end added."""
    out = Path(out_dir) if out_dir else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    result = {**result}
    result.setdefault("machine", {})["load_average_at_end"] = load_average()
    path = out / f"{name}.json"
    path.write_text(json.dumps(result, indent=2, sort_keys=False) + "\n")
    print(f"wrote {os.path.relpath(path, ROOT) if path.is_relative_to(ROOT) else path}")
    return path


# ---- timing ------------------------------------------------------------------------------


def block(tree):
    import jax

    return jax.block_until_ready(tree)


def summary(times: list[float]) -> dict:
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "n": len(times),
        "all_s": [round(t, 5) for t in times],
    }


def alternate(sides: dict, rounds: int, per_round: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Time ``per_round`` calls of each side, taking turns (A B A B ...) for ``rounds`` rounds.

    ``sides`` maps a name to a zero-argument callable that runs one step and blocks until it is
    done; taking turns spreads the drift of a shared, noisy machine over both sides alike.
    Returns wall-clock seconds and this process's CPU seconds (all its threads) per step: on
    a machine that others load, CPU time is the steadier measure of the work a step costs.
    """
    wall: dict[str, list[float]] = {k: [] for k in sides}
    cpu: dict[str, list[float]] = {k: [] for k in sides}
    for r in range(rounds):
        for name, step in sides.items():
            for _ in range(per_round):
                t0, c0 = time.perf_counter(), time.process_time()
                step()
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
        print(
            f"  round {r + 1}/{rounds}: "
            + ", ".join(
                f"{k} {statistics.median(v[-per_round:]):.4f}s (cpu {statistics.median(cpu[k][-per_round:]):.3f}s)"
                for k, v in wall.items()
            ),
            flush=True,
        )
    return wall, cpu


# ---- optimized HLO ----------------------------------------------------------------------------

# "%name = shape opcode(operands), attrs"; the shape may be a tuple "(f32[2]{0}, s32[])".
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\(")
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|f8\w*)\[([\d,]*)\]")
_BYTES = {"pred": 1, "bf16": 2}
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


def _nbytes(shape_text: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(shape_text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        size = _BYTES.get(dtype) or (int(dtype[1:]) // 8 if dtype[1:].isdigit() else 1)
        total += n * size
    return total


def hlo_stats(hlo_text: str) -> dict:
    """Opcode counts of an optimized HLO module (fused bodies included) and, per collective
    kind (async ``-start`` halves folded in), how many and the bytes of their results."""
    ops: collections.Counter = collections.Counter()
    coll = {k: {"count": 0, "bytes": 0} for k in COLLECTIVES}
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        shape, op = m.groups()
        ops[op] += 1
        base = op[: -len("-start")] if op.endswith("-start") else op
        if base in coll:
            coll[base]["count"] += 1
            coll[base]["bytes"] += _nbytes(shape)
    return {
        "total_instructions": sum(ops.values()),
        "fusions": ops["fusion"],
        "collectives": coll,
        "opcodes": dict(sorted(ops.items())),
    }


def cost_stats(compiled) -> dict:
    """XLA's own cost analysis of a compiled program: FLOPs, bytes accessed and transcendentals
    per device (a loop's body counted once, whatever its trip count)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return {k: float(cost.get(k, 0.0)) for k in ("flops", "bytes accessed", "transcendentals")}


def memory_stats(compiled) -> dict:
    """``compiled.memory_analysis()`` in bytes, with per-device peak = temp + argument + output − alias."""
    m = compiled.memory_analysis()
    keys = (
        "temp_size_in_bytes",
        "argument_size_in_bytes",
        "output_size_in_bytes",
        "alias_size_in_bytes",
        "generated_code_size_in_bytes",
    )
    out = {k: int(getattr(m, k)) for k in keys}
    out["peak_bytes"] = (
        out["temp_size_in_bytes"]
        + out["argument_size_in_bytes"]
        + out["output_size_in_bytes"]
        - out["alias_size_in_bytes"]
    )
    return out


# ---- the trainer's step: what every benchmark of a train step runs ---------------------------------


def trainer_config(base: str, over: dict):
    """``config/<base>`` loaded with ``over`` (``{"model.n_layer": 4, ...}``) given as command-line
    overrides, so that every value goes through the trainer's own checks."""
    from named.trainer.config import load_config

    return load_config(ROOT / "config" / base, [x for k, v in over.items() for x in (f"--{k}", str(v))])


PRECISION = {
    "f32": "params=float32,compute=float32,output=float32",
    "bf16": "params=float32,compute=bfloat16,output=float32",
}
# The optimizer of every CPU comparison: the trainer's AdamW with its defaults (betas 0.9 / 0.95,
# eps 1e-8, weight decay 0.1 off norms and biases, global-norm clipping at 1.0) at a constant rate.
OPTIMIZER = {"optimizer.learning_rate": LEARNING_RATE, "optimizer.schedule": "constant", "optimizer.warmup_steps": 0}


def _flow(d: dict) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in d.items()) + "}"


def step_config(
    model: dict,
    *,
    batch: int,
    seq: int,
    dtype: str = "f32",
    base: str = "gpt2_small.yaml",
    mesh: dict = MESH,
    param_mapping: dict = PARAM_MAPPING,
    compute_mapping: dict = COMPUTE_MAPPING,
    over: dict | None = None,
):
    """The trainer config of the CPU comparisons: ``model`` (the fields of ``base``'s family) on
    the FSDP layout above (or ``mesh``, ``param_mapping``, ``compute_mapping``), one microbatch of ``batch`` rows
    of ``seq`` tokens, ``dtype`` compute (``PRECISION``), ``OPTIMIZER``; ``over``: more dotted keys."""
    return trainer_config(
        base,
        {
            **{f"model.{k}": v for k, v in model.items()},
            "data.seq_len": seq,
            "mesh.shape": _flow(mesh),
            "mesh.param_mapping": _flow(param_mapping),
            "mesh.compute_mapping": _flow(compute_mapping),
            "trainer.train_batch_size": batch,
            "trainer.microbatches": 1,
            "trainer.sample_interval": 0,
            "trainer.precision": PRECISION[dtype],
            **OPTIMIZER,
            **(over or {}),
        },
    )


def compile_trainer_step(cfg) -> dict:
    """The trainer's step for ``cfg`` lowered and compiled on abstract inputs (``plan.abstract_train_step``:
    nothing is initialised), after ``jax.clear_caches()``: ``lower_s``, ``compile_s``, the
    ``compiled`` program and ``params`` (the model's parameter count)."""
    import jax

    import named as nm
    from named.trainer.commands.plan import abstract_train_step
    from named.trainer.loop.checks import checked_setup

    s = checked_setup(cfg)
    step, args = abstract_train_step(cfg, s)
    jax.clear_caches()
    with nm.set_mesh(s.mesh):
        t0 = time.perf_counter()
        lowered = step.lower(*args)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
    return {"lower_s": t1 - t0, "compile_s": t2 - t1, "compiled": compiled, "params": count_params(s.shapes)}


def count_params(tree) -> int:
    import jax
    import numpy as np

    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree) if hasattr(x, "shape"))


# ---- the step named-train runs ----------------------------------------------------------------


class TrainerStep:
    """The trainer's compiled step (``train.make_train_step``: microbatched loss and gradient,
    clipping, AdamW, the finite checks, donated state) and the state it trains, built by the loop's
    builder (``state.run_state``) from a loaded config on fixed token rows ``ids`` (``[batch, seq]``
    int32), each row one document. Every benchmark that times "a train step" times this one, not a
    copy of it. ``segments=False`` leaves ``segment_ids`` out of the batch (then attention has no segment mask).
    """

    def __init__(self, cfg, ids, segments: bool = True):
        import jax
        import numpy as np

        from named.trainer.data import Batch
        from named.trainer.loop.checks import checked_setup
        from named.trainer.loop.state import run_state
        from named.trainer.loop.stop import flags_layout
        from named.trainer.loop.train import device_batch, make_train_step

        s = checked_setup(cfg)
        t = cfg.trainer
        self.setup, self.mesh = s, s.mesh
        state = run_state(cfg, s, jax.random.key(0))  # the loop's own builder
        self.model, self.opt_state = state.model, state.opt_state
        rows = Batch(ids, np.zeros_like(ids), np.ones_like(ids, dtype=bool))
        self.batch = device_batch(rows, s.mesh, s.compute_mapping, t.train_batch_size)
        if not segments:
            del self.batch["segment_ids"]
        layout = flags_layout(s.mesh)
        self.flags = jax.device_put(np.zeros(layout.shape, np.int32), layout.sharding)
        self.step = make_train_step(cfg, s, state.optimizer)
        self.key = jax.random.key(1)
        self.losses: list[float] = []

    def lower(self):
        """The step lowered for the current state (tracing: where our Python runs)."""
        import named as nm

        with nm.set_mesh(self.mesh):
            return self.step.lower(self.model, self.opt_state, self.batch, self.key, self.flags)

    def compile(self):
        """The step's compiled program for the current state (what the first ``run`` then uses)."""
        return self.lower().compile()

    def run(self, wait: bool = True):
        """One step; ``wait``: block until it is done and record its loss (as the loop's
        logging would), else return its metrics unread (steps then queue up back to back)."""
        import named as nm

        with nm.set_mesh(self.mesh):
            self.model, self.opt_state, metrics = self.step(
                self.model, self.opt_state, self.batch, self.key, self.flags
            )
        if wait:
            block((self.model, self.opt_state, metrics))
            self.losses.append(float(metrics["loss"]))
        return metrics
