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
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout.strip()
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
    dirty = [] if os.environ.get("BENCH_COMMIT") else [line.strip() for line in _git("status", "--porcelain", "--", "src").splitlines()]
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "backend": jax.default_backend(),
        "devices": len(jax.devices()),
        "device_kind": jax.devices()[0].device_kind,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "versions": versions,
        # A copy of the tree without .git (the GPU machine's) takes the commit from BENCH_COMMIT.
        # (its copy may carry a stale .git: BENCH_COMMIT, when set, wins)
        "commit": os.environ.get("BENCH_COMMIT") or _git("rev-parse", "--short=12", "HEAD"),
        "dirty_src": dirty,
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


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
    result.setdefault("machine", {})["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
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
        print(f"  round {r + 1}/{rounds}: " + ", ".join(
            f"{k} {statistics.median(v[-per_round:]):.4f}s (cpu {statistics.median(cpu[k][-per_round:]):.3f}s)"
            for k, v in wall.items()), flush=True)
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
    return {"total_instructions": sum(ops.values()), "fusions": ops["fusion"], "collectives": coll,
            "opcodes": dict(sorted(ops.items()))}


def memory_stats(compiled) -> dict:
    """``compiled.memory_analysis()`` in bytes, with per-device peak = temp + argument + output − alias."""
    m = compiled.memory_analysis()
    keys = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
            "generated_code_size_in_bytes")
    out = {k: int(getattr(m, k)) for k in keys}
    out["peak_bytes"] = (out["temp_size_in_bytes"] + out["argument_size_in_bytes"] + out["output_size_in_bytes"]
                         - out["alias_size_in_bytes"])
    return out


# ---- the named GPT-2 train step every CPU benchmark compiles ---------------------------------


def named_train_step(config, optimizer, *, dtype: str = "f32", loss: str = "full", block_size: int = 2048):
    """A ``named_jit`` FSDP step ``(model, opt_state, ids) -> (loss, model, opt_state)``.

    ``dtype="bf16"`` keeps f32 parameters and computes in bf16 (jmp policy). ``loss="full"`` is
    ``next_token_loss`` on the logits; ``"blockwise"`` is ``blockwise_next_token_loss`` over
    ``block_size`` vocab entries at a time (GPT-2 only: the ``[batch, position, vocab]`` logits
    never exist).
    """
    import equinox as eqx

    import named as nm
    from named.nn.loss import blockwise_next_token_loss, next_token_loss
    from named.nn.precision import cast_for_compute, get_policy

    policy = get_policy("params=float32,compute=bfloat16,output=float32") if dtype == "bf16" else None

    def hidden_states(m, ids):
        # Gpt2LMHeadModel._run without the head: the model has no public hidden-states call.
        x = m.wte(ids) + m.wpe(nm.arange(ids.resolve_axis("position")))
        x, _ = m.blocks.scan(x, segment_ids=None, cache=None, pos=None, key=None)
        return m.ln_f(x)

    def loss_fn(model, ids):
        m = cast_for_compute(model, policy) if policy is not None else model
        if loss == "blockwise":
            return blockwise_next_token_loss(hidden_states(m, ids), m.wte.weight, ids, block_size=block_size).scalar()
        return next_token_loss(m(ids), ids).scalar()

    def step(model, opt_state, ids):
        value, grads = eqx.filter_value_and_grad(loss_fn)(model, ids)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return value, eqx.apply_updates(model, updates), opt_state

    return nm.named_jit(step, mapping=COMPUTE_MAPPING, out_mapping=PARAM_MAPPING,
                        donate_args=(True, True, False))


def abstract_state(model_cls, config, optimizer, mesh, batch: int, seq: int):
    """ShapeDtypeStructs, laid out by the FSDP mappings, of the model, its optimizer state and a
    batch of ids: enough to lower and compile a step without materialising anything."""
    import jax
    import jax.numpy as jnp

    import named as nm

    model = jax.eval_shape(lambda k: model_cls.init(config, key=k), jax.random.key(0))
    opt_state = jax.eval_shape(optimizer.init, model)

    def place(tree, mapping):
        def leaf(x):
            if isinstance(x, nm.NamedArray):
                sharding = nm.sharding_for(x.axes, mapping, mesh)
                return nm.NamedArray._unchecked(jax.ShapeDtypeStruct(x.array.shape, x.array.dtype, sharding=sharding), x.axes)
            if isinstance(x, jax.ShapeDtypeStruct):
                return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
            return x

        return jax.tree.map(leaf, tree, is_leaf=nm.is_named_array)

    axes = (nm.Axis("batch", batch), nm.Axis("position", seq))
    ids = nm.NamedArray._unchecked(
        jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=nm.sharding_for(axes, COMPUTE_MAPPING, mesh)), axes)
    return place(model, PARAM_MAPPING), place(opt_state, PARAM_MAPPING), ids


def count_params(tree) -> int:
    import jax
    import numpy as np

    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree) if hasattr(x, "shape"))


# ---- the step named-train runs ----------------------------------------------------------------


class TrainerStep:
    """The trainer's compiled step (``train.make_train_step``: microbatched loss and gradient,
    clipping, AdamW, the finite checks, donated state) and the state it trains, built from a
    loaded config on fixed token rows ``ids`` (``[batch, seq]`` int32), each row one document.
    Every benchmark that times "a train step" times this one, not a copy of it.
    ``segments=False`` leaves ``segment_ids`` out of the batch (then attention has no segment mask).
    """

    def __init__(self, cfg, ids, segments: bool = True):
        import jax
        import numpy as np

        import named as nm
        from named.trainer.data import Batch
        from named.trainer.loop.checks import check_against_devices
        from named.trainer.loop.model_init import init_model
        from named.trainer.loop.optim import build_optimizer, init_opt_state
        from named.trainer.loop.stop import flags_layout
        from named.trainer.loop.train import device_batch, make_train_step

        s = check_against_devices(cfg)
        t = cfg.trainer
        optimizer = build_optimizer(cfg.optimizer, t.num_train_steps)
        self.setup, self.mesh = s, s.mesh
        with nm.set_mesh(s.mesh):
            self.model = init_model(cfg, s.model_cls, s.model_cfg, param=s.param, mesh=s.mesh, key=jax.random.key(0))
            self.opt_state = nm.named_jit(lambda m: init_opt_state(cfg, m, optimizer), mapping=s.param)(self.model)
        rows = Batch(ids, np.zeros_like(ids), np.ones_like(ids, dtype=bool))
        self.batch = device_batch(rows, s.mesh, s.compute, t.train_batch_size)
        if not segments:
            del self.batch["segment_ids"]
        layout = flags_layout(s.mesh)
        self.flags = jax.device_put(np.zeros(layout.shape, np.int32), layout.sharding)
        self.step = make_train_step(cfg, s, optimizer)
        self.key = jax.random.key(1)
        self.losses: list[float] = []

    def compile(self):
        """The step's compiled program for the current state (what the first ``run`` then uses)."""
        import named as nm

        with nm.set_mesh(self.mesh):
            return self.step.lower(self.model, self.opt_state, self.batch, self.key, self.flags).compile()

    def run(self, wait: bool = True):
        """One step; ``wait``: block until it is done and record its loss (as the loop's
        logging would), else return its metrics unread (steps then queue up back to back)."""
        import named as nm

        with nm.set_mesh(self.mesh):
            self.model, self.opt_state, metrics = self.step(self.model, self.opt_state, self.batch, self.key, self.flags)
        if wait:
            block((self.model, self.opt_state, metrics))
            self.losses.append(float(metrics["loss"]))
        return metrics
