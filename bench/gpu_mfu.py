"""Training throughput and MFU on one GPU: GPT-2 124M at seq 1024 and a Llama of about 1B at
seq 2048, with cuDNN against XLA attention, ``remat="offload"`` and explicit against auto mode.

Not run by ``make bench`` (it needs a GPU). On a GPU machine, from a clean checkout whose
``.whl/`` holds the wheels of ``bench/fetch_wheels.py`` (docs/benchmarks.md §6 has the device
call)::

    make bench-gpu GPU_OUT=$OUT                    # the whole plan below within GPU_BUDGET_S
    python3 bench/gpu_mfu.py --budget-s 540 --out $OUT

If this Python cannot import ``named`` (nothing installed but the machine's jax, equinox and
optax), the script first installs the carried wheels and this tree into a private folder,
with no package index and no dependency resolution, and puts it on the workers' PYTHONPATH.
At the end it prints the table (``report.gpu_block``) of ``gpu_mfu.json`` in ``--out``.

What one training measurement is: a worker subprocess (so XLA_FLAGS can differ per run and an
out-of-memory run only loses itself) loads the shipped config (``config/gpt2_small.yaml``,
``config/llama_1b.yaml``: f32 parameters, bf16 compute) with the run's overrides, builds the
step ``named-train`` runs (``_common.TrainerStep``: ``train.make_train_step``, AdamW, donated
state) on fixed random token rows, compiles it, runs 3 warm-up steps, then times ``--steps``
steps each waited for (the median is the figure) and ``--steps`` steps queued back to back
(as the training loop runs them: their mean is recorded beside it). Then

    tokens/s = batch · seq / median step time
    MFU      = flops_per_token · tokens/s / peak

with ``flops_per_token`` the one the trainer uses (``named.models.flops_per_token``: ``6 N + 12 L d T``, N the
matmul weights incl. the output head, L layers, d = heads · head size, T = seq; the causal mask
does *not* halve the attention term) and ``peak`` the device's dense bf16 peak from
``trainer/loop/hardware.py`` (989 TFLOP/s for the H100 and H200 SXM; the device notes here measured
769–798 TFLOP/s for an 8192³ bf16 matmul, so ~80 % MFU is the practical ceiling). On a device
the table lacks (a CPU) MFU is not computed.

Attention: ``nn.dot_product_attention`` takes cuDNN's fused kernel on GPU for bf16 and head
size ≤ 128 (the segment ids of packed rows reach it as a dense bias); an ``attention: xla`` or
``attention: flash`` run (named.nn's blockwise kernel) traces the step inside
``nn.attention_implementation``. Each run records whether its compiled program holds
the cuDNN fMHA custom call. The ``attention`` worker times attention alone (forward and
backward, GPT-2's and Llama's shapes) on both paths and checks cuDNN's output and gradients
against an f32 XLA reference.

XLA flags ("tuned", the default; "none" runs without them for comparison):

    --xla_gpu_enable_latency_hiding_scheduler=true    schedule async work to overlap compute
    --xla_gpu_enable_triton_gemm=false                cuBLAS(Lt) for matmuls instead of Triton GEMM fusions
    --xla_gpu_enable_highest_priority_async_stream=true
    --xla_gpu_enable_while_loop_double_buffering=true  overlap the next layer's work in scanned layers

plus ``XLA_PYTHON_CLIENT_MEM_FRACTION=0.92``. A flag this jaxlib does not know makes XLA abort,
so the driver first starts jax once with them and drops those it names as unknown (recorded
in the JSON as ``dropped_xla_flags``).

The plan (``PLAN``) runs in order until ``--budget-s`` runs out, the JSON written after every
run; a run without a batch takes the best batch measured so far for its model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SITE = Path(tempfile.gettempdir()) / "named-gpu-site"  # where a machine without `named` gets it

TUNED_FLAGS = [
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_enable_triton_gemm=false",
    "--xla_gpu_enable_highest_priority_async_stream=true",
    "--xla_gpu_enable_while_loop_double_buffering=true",
]
MODELS = {
    # GPT-2 small: 124M parameters with the padded 50304-token vocabulary, seq 1024.
    "gpt2": {"config": "gpt2_small.yaml", "overrides": {}, "batch": 32},
    # Llama-3.2-1B-shaped: 16 layers, hidden 2048, GQA 32/8, SwiGLU 8192, tied 128256 vocab (1.24B), seq 2048.
    "llama": {"config": "llama_1b.yaml", "overrides": {}, "batch": 8},
    # Seconds on a CPU: checks the script itself (what the smoke test runs).
    "tiny": {
        "config": "gpt2_small.yaml",
        "batch": 8,
        "overrides": {
            "model.n_layer": 2,
            "model.n_head": 2,
            "model.n_embd": 64,
            "model.n_positions": 64,
            "model.vocab_size": 384,
            "data.seq_len": 64,
        },
    },
}
# (model, settings), most wanted first. Missing settings: batch and loss_block (the trainer's
# loss_block_size) those of the model's best run so far, remat none, attention auto, mode auto,
# flags tuned.
PLAN = [
    ("attention", {}),
    ("gpt2", {"batch": 32}),
    ("llama", {"batch": 8}),
    ("gpt2", {"batch": 64}),
    ("llama", {"batch": 16, "loss_block": 8016}),  # 16 vocab blocks: no [batch, position, vocab] logits
    ("gpt2", {"attention": "flash"}),  # the blockwise kernel (named.nn's own, in XLA ops) on a GPU
    ("llama", {"attention": "flash"}),
    ("llama", {"attention": "xla"}),
    ("gpt2", {"remat": "offload"}),
    ("llama", {"remat": "offload"}),
    ("gpt2", {"mode": "explicit"}),
    ("llama", {"mode": "explicit"}),
    ("gpt2", {"attention": "xla"}),
    ("gpt2", {"remat": "full", "batch": 128}),
    ("gpt2", {"flags": "none"}),
    ("llama", {"flags": "none"}),
]
# Packed rows against rows without segment ids (cuDNN's causal kernel takes no segments: the
# trainer's batches, which carry them, otherwise run attention on the XLA path or, forced,
# on cuDNN with the segment mask as a dense bias).
SEGMENTS_PLAN = [
    ("gpt2", {"batch": 32, "attention": "cudnn"}),
    ("llama", {"batch": 8, "attention": "cudnn"}),
    ("gpt2", {"batch": 32, "segments": "none"}),
    ("llama", {"batch": 8, "segments": "none"}),
    ("gpt2", {"batch": 64, "segments": "none"}),
    ("llama", {"batch": 8, "segments": "none", "mode": "explicit"}),
]
TINY_PLAN = [
    ("attention", {}),
    ("tiny", {"batch": 8}),
    ("tiny", {"batch": 8, "loss_block": 96}),
    ("tiny", {"attention": "xla"}),
    ("tiny", {"remat": "offload"}),
    ("tiny", {"mode": "explicit"}),
]
# Attention alone: (name, batch, seq, heads, kv heads, head size); the first two are the models'.
ATTENTION_SHAPES = [("gpt2", 16, 1024, 12, 12, 64), ("llama", 8, 2048, 32, 8, 64)]
TINY_ATTENTION_SHAPES = [("tiny", 2, 64, 4, 2, 16)]


# ---- worker: one training configuration -----------------------------------------------------


def _xla_flags(spec: dict) -> str:
    return " ".join([*(spec["tuned_flags"] if spec["flags"] == "tuned" else []), *spec.get("cpu_flags", [])])


def train_worker(spec: dict) -> dict:
    import _common as C  # noqa: I001 - before jax, as everywhere in bench/

    import jax
    import numpy as np

    from named import nn
    from named.internal import cudnn_version
    from named.models import flops_per_token, num_params
    from named.trainer.loop import hardware

    m = MODELS[spec["model"]]
    over = {
        **m["overrides"],
        "trainer.train_batch_size": spec["batch"],
        "trainer.microbatches": 1,
        "trainer.sample_interval": 0,
        "model.remat": spec["remat"],
        "mesh.mode": spec["mode"],
        "mesh.shape": "{data: -1}",
        "trainer.loss_block_size": spec["loss_block"] or "null",
    }
    cfg = C.trainer_config(m["config"], over)
    seq, batch = cfg.data.seq_len, spec["batch"]
    vocab = 256  # token ids of the byte tokenizer the configs name: any valid ids do
    ids = np.random.default_rng(0).integers(0, vocab, size=(batch, seq), dtype=np.int32)
    chosen: list[str] = []
    handler = _Collect(chosen)
    logging.getLogger("named.nn").addHandler(handler)
    logging.getLogger("named.nn").setLevel(logging.DEBUG)
    # Everything inside: the choice is part of the step's jit key, so its compile and its runs share it.
    # (not the build: its checks trace the f32 model, which "cudnn" would refuse)
    t0 = time.perf_counter()
    step = C.TrainerStep(cfg, ids, segments=spec["segments"] == "packed")
    build_s = time.perf_counter() - t0
    with nn.attention_implementation(spec["attention"]):
        t0 = time.perf_counter()
        compiled = step.compile()
        compile_s = time.perf_counter() - t0
        hlo = compiled.as_text()
        cudnn = "cudnn$fmha" in hlo
        memory = C.memory_stats(compiled)
        del compiled, hlo
        for _ in range(3):
            step.run()
        waited = []
        for _ in range(spec["steps"]):
            t0 = time.perf_counter()
            step.run()
            waited.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(spec["steps"]):
            metrics = step.run(wait=False)
        C.block((step.model, step.opt_state, metrics))
        queued_s = (time.perf_counter() - t0) / spec["steps"]
        step.losses.append(float(metrics["loss"]))
    step_s = statistics.median(waited)
    fpt = flops_per_token(step.setup.model_cfg, seq)
    tokens_s = batch * seq / step_s
    device = hardware.local()
    stats = jax.devices()[0].memory_stats() or {}
    return {
        **spec,
        "seq": seq,
        "params": num_params(step.setup.model_cfg),
        "flops_per_token": fpt,
        "build_s": build_s,
        "compile_s": compile_s,
        "step_s": C.summary(waited),
        "queued_step_s": queued_s,
        "tokens_per_s": tokens_s,
        "peak_flops": device.peak_flops if device else None,
        "mfu": fpt * tokens_s / device.peak_flops if device else None,
        "cudnn_attention": cudnn,
        "attention_paths": sorted(set(chosen)),
        "losses": step.losses,
        "compiled_memory": memory,
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
        "device_kind": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "cudnn": cudnn_version(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


class _Collect(logging.Handler):
    """Keeps which path (cudnn or xla) each traced ``dot_product_attention`` took."""

    def __init__(self, into: list):
        super().__init__(logging.DEBUG)
        self.into = into

    def emit(self, record):
        found = re.match(r"dot_product_attention: (\w+) path", record.getMessage())
        if found:
            self.into.append(found.group(1))


# ---- worker: attention alone ------------------------------------------------------------------


def attention_worker(spec: dict) -> dict:
    """Forward + backward of causal attention, cuDNN's kernel against XLA's path, timed alone;
    cuDNN's output and gradients against an f32 XLA reference (relative L2 errors)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import named as nm
    from named import nn

    rows = []
    for name, b, t, h, kv, d in spec["shapes"]:
        Batch, Pos, KPos, Heads, KVHeads, Hd = (
            nm.Axis("batch", b),
            nm.Axis("position", t),
            nm.Axis("key_position", t),
            nm.Axis("heads", h),
            nm.Axis("kv_heads", kv),
            nm.Axis("head_size", d),
        )
        keys = jax.random.split(jax.random.key(0), 4)
        grouped = kv != h
        q = nm.random.normal(keys[0], (Batch, Pos, Heads, Hd))
        k = nm.random.normal(keys[1], (Batch, KPos, KVHeads if grouped else Heads, Hd))
        v = nm.random.normal(keys[2], (Batch, KPos, KVHeads if grouped else Heads, Hd))
        ct = nm.random.normal(keys[3], (Batch, Pos, Heads, Hd))

        def loss(q, k, v, impl):
            out = nn.dot_product_attention(q, k, v, causal=True, implementation=impl)
            return (out.astype(jnp.float32) * ct).sum().scalar(), out

        def fwd_bwd(impl, dtype):
            f = jax.jit(lambda q, k, v: jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v, impl))
            args = [x.astype(dtype) for x in (q, k, v)]
            return f, args

        # 4 B H T^2 D forward (two matmuls), twice that backward: the MFU formula's count (no causal halving)
        flops = 3 * 4 * b * h * t * t * d
        row = {"shape": name, "batch": b, "seq": t, "heads": h, "kv_heads": kv, "head_size": d, "flops": flops}
        ref_f, ref_args = fwd_bwd("xla", jnp.float32)
        (rq, rk, rv), rout = ref_f(*ref_args)
        ref = [np.asarray(x.array, np.float64) for x in (rout, rq, rk, rv)]
        for impl in ("cudnn", "xla"):
            try:
                f, args = fwd_bwd(impl, jnp.bfloat16)
                (gq, gk, gv), out = jax.block_until_ready(f(*args))
            except Exception as e:  # noqa: BLE001 - the CPU has no cuDNN: recorded, the other path still runs
                row[impl] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                continue
            got = [np.asarray(x.astype(jnp.float32).array, np.float64) for x in (out, gq, gk, gv)]
            errors = {
                what: float(np.linalg.norm(g - r) / np.linalg.norm(r))
                for what, g, r in zip(("out", "dq", "dk", "dv"), got, ref)
            }
            hlo = f.lower(*args).compile().as_text()
            times = []
            for _ in range(spec["repeats"]):
                t0 = time.perf_counter()
                jax.block_until_ready(f(*args))
                times.append(time.perf_counter() - t0)
            med = statistics.median(times)
            row[impl] = {
                "median_s": med,
                "min_s": min(times),
                "tflop_per_s": flops / med / 1e12,
                "relative_error_vs_f32": errors,
                "cudnn_call": "cudnn$fmha" in hlo,
            }
        if "median_s" in row.get("cudnn", {}) and "median_s" in row.get("xla", {}):
            row["xla_over_cudnn"] = row["xla"]["median_s"] / row["cudnn"]["median_s"]
        rows.append(row)
    return {**spec, "rows": rows, "device_kind": jax.devices()[0].device_kind}


def worker(spec: dict) -> dict:
    os.environ["XLA_FLAGS"] = _xla_flags(spec)
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    return attention_worker(spec) if spec["model"] == "attention" else train_worker(spec)


# ---- driver ------------------------------------------------------------------------------------


# The driver never touches the GPU (a JAX backend there would take most of its memory away
# from the workers); workers get the environment without these.
_DRIVER_ENV = {"JAX_PLATFORMS": "cpu"}


def _fingerprint() -> str:
    """What an install in SITE was made from: this tree's package sources and pyproject.toml."""
    h = hashlib.sha256()
    for f in sorted([ROOT / "pyproject.toml", *ROOT.glob("src/**/*.py"), *ROOT.glob("config/*.yaml")]):
        h.update(f.relative_to(ROOT).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def _imports(pythonpath: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update({"JAX_PLATFORMS": "cpu", **({"PYTHONPATH": pythonpath} if pythonpath else {})})
    return subprocess.run(
        [sys.executable, "-c", "import named.models, named.trainer.loop.train, jmp, draccus, optax, equinox"],
        capture_output=True,
        text=True,
        env=env,
    )


def ensure_importable(wheels: Path) -> str:
    """Make ``named`` importable by the workers; says how. Already importable (an installed
    checkout): nothing to do. Otherwise install ``wheels`` (jmp, draccus and what they need) and
    this tree into SITE, with no index and no dependency resolution (jax, equinox and optax are
    the machine's), and put SITE on PYTHONPATH; a SITE made from this same tree is reused."""
    here = _imports(os.environ.get("PYTHONPATH"))
    if here.returncode == 0:
        return "named was importable"
    if "ModuleNotFoundError" not in here.stderr:  # present but broken: installing it again would not help
        raise SystemExit(f"named does not import:\n{here.stderr[-2000:]}")
    stamp = SITE / ".named-fingerprint"
    if not (stamp.exists() and stamp.read_text() == _fingerprint() and _imports(str(SITE)).returncode == 0):
        files = sorted(wheels.glob("*.whl"))
        if not files:
            raise SystemExit(
                f"named does not import here and {wheels} holds no wheels: run bench/fetch_wheels.py "
                f"where there is a package index, and bring {wheels.name}/ along"
            )
        shutil.rmtree(SITE, ignore_errors=True)
        pip = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-index",
            "--no-deps",
            "--target",
            str(SITE),
        ]
        subprocess.run(pip + [str(f) for f in files], check=True)
        # built with the carried setuptools (on PYTHONPATH), not in an isolated build environment
        # (that would need an index for the backend's own dependencies)
        subprocess.run(
            pip + ["--no-build-isolation", "--upgrade", str(ROOT)],
            check=True,
            env={**os.environ, "PYTHONPATH": str(SITE)},
        )
        check = _imports(str(SITE))
        if check.returncode != 0:
            raise SystemExit(f"installed into {SITE}, but named still does not import:\n{check.stderr[-2000:]}")
        stamp.write_text(_fingerprint())
    os.environ["PYTHONPATH"] = str(SITE)  # the workers'
    sys.path.insert(0, str(SITE))  # this driver's (it reads named.internal)
    return f"installed from {wheels.name}/ into {SITE}"


def _worker_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in _DRIVER_ENV}


def usable_flags(flags: list[str]) -> tuple[list[str], list[str], str]:
    """(kept, dropped, backend): ``flags`` less those this jaxlib's XLA names as unknown when it
    starts, and the backend jax then chose."""
    probe = [
        sys.executable,
        "-c",
        "import jax, jax.numpy as jnp; jnp.ones(2).block_until_ready(); print(jax.default_backend())",
    ]

    def start(fl):
        return subprocess.run(
            probe, capture_output=True, text=True, timeout=300, env={**_worker_env(), "XLA_FLAGS": " ".join(fl)}
        )

    proc = start(flags)
    if proc.returncode == 0:
        return list(flags), [], proc.stdout.split()[-1]
    found = re.search(r"Unknown flags? in XLA_FLAGS:([^\n]*)", proc.stderr)
    unknown = set(re.findall(r"--(\w+)", found.group(1))) if found else set()
    dropped = [f for f in flags if f.split("=")[0].lstrip("-") in unknown]
    kept = [f for f in flags if f not in dropped]
    if dropped:
        proc = start(kept)  # XLA names the first unknown flag only: drop until it starts
        if proc.returncode != 0:
            more, again, backend = usable_flags(kept)
            return more, dropped + again, backend
        return kept, dropped, proc.stdout.split()[-1]
    raise SystemExit(f"jax does not start with XLA_FLAGS={' '.join(flags)!r}:\n{proc.stderr[-2000:]}")


def run_one(spec: dict, timeout_s: float) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout_s, 1), env=_worker_env())
    except subprocess.TimeoutExpired:
        return {**spec, "error": f"timed out after {timeout_s:.0f}s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {**spec, "error": (proc.stderr or proc.stdout)[-1500:], "wall_s": time.perf_counter() - t0}
    out = json.loads(lines[-1])
    out["wall_s"] = time.perf_counter() - t0
    return out


def best(runs: list[dict], model: str) -> dict | None:
    """The fastest successful run of ``model`` (tokens/s: the same work per token within a model)."""
    ok = [r for r in runs if r.get("model") == model and "error" not in r]
    return max(ok, key=lambda r: r["tokens_per_s"]) if ok else None


def _brief(r: dict) -> dict:
    if r["model"] == "attention":
        return {
            "attention": [
                {
                    k: (
                        v
                        if not isinstance(v, dict)
                        else {kk: v[kk] for kk in ("median_s", "tflop_per_s", "error") if kk in v}
                    )
                    for k, v in row.items()
                    if k in ("shape", "cudnn", "xla", "xla_over_cudnn")
                }
                for row in r.get("rows", [])
            ]
        }
    keys = (
        "model",
        "batch",
        "loss_block",
        "remat",
        "attention",
        "mode",
        "flags",
        "segments",
        "tokens_per_s",
        "mfu",
        "compile_s",
        "cudnn_attention",
    )
    return (
        {k: r.get(k) for k in keys}
        if "error" not in r
        else {**{k: r.get(k) for k in keys[:8]}, "error": r["error"][-400:]}
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="the plan at toy size (what the CPU smoke test runs)")
    ap.add_argument("--plan", choices=("main", "segments"), default="main", help="PLAN or SEGMENTS_PLAN")
    ap.add_argument("--models", nargs="+", default=None, help="only these models' runs (and the attention one)")
    ap.add_argument("--budget-s", type=float, default=540.0, help="stop starting new runs after this many seconds")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=None, help="directory for gpu_mfu.json (default bench/results)")
    ap.add_argument("--wheels", default=str(ROOT / ".whl"), help="carried wheels, used when named does not import")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return

    start = time.perf_counter()
    installed = ensure_importable(Path(args.wheels))
    os.environ.update(_DRIVER_ENV)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _common as C
    import report

    from named.internal import cheap_codegen_flags

    tuned, dropped, backend = usable_flags(TUNED_FLAGS)
    if backend != "gpu" and not args.tiny:
        raise SystemExit(
            f"jax's backend here is {backend!r}: the GPU plan would take hours (--tiny runs it at toy size)"
        )
    plan = TINY_PLAN if args.tiny else SEGMENTS_PLAN if args.plan == "segments" else PLAN
    if args.models:
        plan = [(m, s) for m, s in plan if m == "attention" or m in args.models]
    runs: list[dict] = []
    name = "gpu_mfu_tiny" if args.tiny else "gpu_mfu" if args.plan == "main" else f"gpu_mfu_{args.plan}"
    result = {
        "benchmark": "gpu_mfu",
        "command": C.command_line(),
        "models": {k: MODELS[k] for k in {m for m, _ in plan} if k in MODELS},
        "mfu_formula": "(6N + 12 L d T) * tokens/s / peak (trainer/loop/hardware.py's dense bf16 peak)",
        "tuned_xla_flags": tuned,
        "dropped_xla_flags": dropped,
        "install": installed,
        "runs": runs,
    }
    try:
        result["machine"] = C.machine()
    except Exception as e:  # noqa: BLE001 - a record, not a reason to stop
        result["machine"] = {"error": str(e)}
    try:
        result["machine"]["gpu"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        result["machine"]["gpu"] = None

    def left():
        return args.budget_s - (time.perf_counter() - start)

    default_attention = "auto"
    for model, settings in plan:
        if left() < 30:
            print(f"budget spent: {model} {settings} not run", flush=True)
            continue
        spec = {"model": model, "flags": settings.get("flags", "tuned"), "tuned_flags": tuned}
        if args.tiny and backend == "cpu":
            # the toy programs compile in XLA:CPU's cheapest code, as the test suite's do; a GPU run never
            spec["cpu_flags"] = list(cheap_codegen_flags())
        if model == "attention":
            spec.update(shapes=TINY_ATTENTION_SHAPES if args.tiny else ATTENTION_SHAPES, repeats=3 if args.tiny else 20)
        else:
            b = best(runs, model)
            inherit = {"batch": b["batch"], "loss_block": b["loss_block"]} if b else {"batch": MODELS[model]["batch"]}
            spec.update(
                batch=settings.get("batch") or inherit["batch"],
                loss_block=settings.get("loss_block") if "batch" in settings else inherit.get("loss_block"),
                remat=settings.get("remat", "none"),
                attention=settings.get("attention", default_attention),
                mode=settings.get("mode", "auto"),
                segments=settings.get("segments", "packed"),
                steps=args.steps,
            )
        r = run_one(spec, left())
        runs.append(r)
        print(json.dumps(_brief(r)), flush=True)
        if model != "attention" and "error" in r and spec["attention"] == "auto" and "cudnn" in r["error"].lower():
            default_attention = result["attention_fallback"] = "xla"  # cuDNN's kernel fails here: the rest without it
        C.write_result(name, {**result, "best": {m: best(runs, m) for m in MODELS}}, args.out)
    for m in MODELS:
        b = best(runs, m)
        if b:
            mfu = f", MFU {b['mfu']:.1%}" if b["mfu"] is not None else ""
            print(
                f"best {m}: batch {b['batch']} remat {b['remat']} attention {b['attention']} mode {b['mode']} "
                f"flags {b['flags']}: {b['tokens_per_s']:,.0f} tokens/s{mfu}"
            )
    print(report.gpu_block(Path(args.out) if args.out else C.RESULTS, name))


if __name__ == "__main__":
    main()
