"""Training throughput and MFU on one GPU: GPT-2 124M at seq 1024 and a Llama of about 1B.

Not run by ``make bench`` (it needs a GPU). On a GPU machine, from a clean checkout whose
``.whl/`` holds the wheels of ``bench/fetch_wheels.py`` (docs/benchmarks.md §6 has the device
call)::

    make bench-gpu GPU_OUT=$OUT                              # both models, then the table
    python3 bench/gpu_mfu.py --model gpt2 --budget-s 250 --out $OUT

If this Python cannot import ``named`` (nothing installed but the machine's jax, equinox and
optax), the script first installs the carried wheels and this tree into a private folder,
with no package index and no dependency resolution, and puts it on the workers' PYTHONPATH.
At the end it prints the table of every run in ``--out`` (both models when both are there).

What one measurement is: a worker subprocess (so XLA_FLAGS can differ per run and an
out-of-memory run only loses itself) builds the model (f32 parameters, bf16 compute through
the jmp policy ``params=float32,compute=bfloat16,output=float32``), the ``named_jit`` step
(value_and_grad + ``optax.adamw``, donated state), compiles it, runs 3 warm-up steps and times
``--steps`` more, each ended by ``block_until_ready``. Then

    tokens/s = batch · seq / median step time
    MFU      = flops_per_token · tokens/s / 989e12

with ``flops_per_token = 6 N + 12 L d T`` (``models.flops_per_token``: N the matmul weights
incl. the output head, L layers, d = heads · head_size, T = seq; the causal mask does *not*
halve the attention term) and 989 TFLOP/s the H100/H200 SXM dense bf16 peak from NVIDIA's
datasheet (the device notes here measured 769–798 TFLOP/s for an 8192³ bf16 matmul, so ~80 %
MFU is the practical ceiling).

Attention: ``nn.dot_product_attention`` takes cuDNN's fused kernel (``jax.nn.dot_product_attention
(implementation="cudnn")``) on GPU for bf16, head size ≤ 128 and a causal mask only; the
worker records whether the compiled program holds the cuDNN fMHA custom call.

XLA flags ("tuned", the default set here; "none" runs without them for comparison):

    --xla_gpu_enable_latency_hiding_scheduler=true    schedule collectives/async work to overlap compute
    --xla_gpu_enable_triton_gemm=false                cuBLAS(Lt) for matmuls instead of Triton GEMM fusions
    --xla_gpu_enable_highest_priority_async_stream=true
    --xla_gpu_enable_while_loop_double_buffering=true  overlap the next layer's work in scanned layers
    --xla_gpu_all_reduce_combine_threshold_bytes=134217728, --xla_gpu_all_gather_combine_threshold_bytes=134217728,
    --xla_gpu_reduce_scatter_combine_threshold_bytes=134217728   (several GPUs: fewer, larger collectives)

plus ``XLA_PYTHON_CLIENT_MEM_FRACTION=0.92``. A flag this jaxlib does not know makes XLA abort:
the worker then reports the error and the sweep goes on.

Sweep (staged, until ``--budget-s`` runs out; results are written after every run):
  1. batch sizes with scanned layers, no remat, tuned flags;
  2. at the best batch: remat policies (``save_dots``, ``full``) and, with ``full``, double batch;
  3. at the best so far: unrolled layers (a Python loop over ``Stacked.unstacked()``) vs scan;
  4. at the best so far: XLA flags "none".
The best run per model is recorded as ``best``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SITE = Path(tempfile.gettempdir()) / "named-gpu-site"  # where a machine without `named` gets it

PEAK_FLOPS = 989e12  # H100/H200 SXM dense bf16, NVIDIA datasheet
TUNED_FLAGS = [
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_enable_triton_gemm=false",
    "--xla_gpu_enable_highest_priority_async_stream=true",
    "--xla_gpu_enable_while_loop_double_buffering=true",
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728",
]
MODELS = {
    # GPT-2 small, 124M parameters with the padded 50304-token vocabulary.
    "gpt2": {"type": "gpt2", "config": dict(n_layer=12, n_head=12, n_embd=768, n_positions=1024, vocab_size=50304),
             "seq": 1024, "batches": [16, 32, 64]},
    # Llama-3.2-1B-shaped: 16 layers, hidden 2048, GQA 32/8, SwiGLU 8192, tied 128256 vocab (1.24B).
    "llama": {"type": "llama", "config": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                              num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                                              rms_norm_eps=1e-5, max_position_embeddings=4096,
                                              tie_word_embeddings=True, vocab_size=128256),
              "seq": 2048, "batches": [4, 8, 16]},
    # Seconds on a CPU: checks the script itself (what the smoke test runs).
    "tiny": {"type": "gpt2", "config": dict(n_layer=2, n_head=2, n_embd=64, n_positions=64, vocab_size=256),
             "seq": 64, "batches": [8]},
}


# ---- worker ------------------------------------------------------------------------------------


def _forward_unrolled(model, ids, remat):
    """The model's forward pass with its layers run by a Python loop (XLA sees every layer)."""
    import equinox as eqx

    import named as nm
    from named import nn

    policy = nn.remat_policy(remat)
    positions = nm.arange(ids.resolve_axis("position"))
    if hasattr(model, "wte"):  # GPT-2
        x = model.wte(ids) + model.wpe(positions)
        blocks, call = model.blocks.unstacked(), (lambda b, x: b(x)[0])
        final, head = model.ln_f, model.wte if model.lm_head is None else model.lm_head
    else:  # the decoder (Llama): the layers read their RoPE, window and scale from the config
        from named.models.decoder import layer_data

        x = model.embed_tokens(ids)
        data = layer_data(model.config)  # one value per setting for a model whose layers agree
        blocks, call = model.layers.unstacked(), (lambda b, x: b(x, positions=positions, **data)[0])
        final, head = model.norm, model.embed_tokens if model.lm_head is None else model.lm_head
    if policy is not False:
        call = eqx.filter_checkpoint(call, policy=policy, prevent_cse=False)
    for b in blocks:
        x = call(b, x)
    return head.unembed(final(x))


def worker(spec: dict) -> dict:
    os.environ["XLA_FLAGS"] = " ".join(TUNED_FLAGS if spec["flags"] == "tuned" else [])
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from named import models
    import named as nm
    from named._compat import cudnn_version
    from named.nn.loss import next_token_loss
    from named.nn.precision import cast_for_compute, get_policy

    m = MODELS[spec["model"]]
    cfg_cls, model_cls = ((models.Gpt2Config, models.Gpt2LMHeadModel) if m["type"] == "gpt2"
                          else (models.LlamaConfig, models.LlamaLMHeadModel))
    config = cfg_cls(**m["config"], remat=spec["remat"])
    seq, batch = m["seq"], spec["batch"]
    policy = get_policy("params=float32,compute=bfloat16,output=float32")
    optimizer = optax.adamw(3e-4, weight_decay=0.1)
    mesh = nm.make_mesh({"data": -1})
    param_map, compute_map = {"embed": "data"}, {"batch": "data"}

    def loss_fn(model, ids):
        mc = cast_for_compute(model, policy)
        logits = mc(ids) if spec["layers"] == "scan" else _forward_unrolled(mc, ids, spec["remat"])
        return next_token_loss(logits, ids).scalar()

    def step(model, opt_state, ids):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, ids)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return loss, eqx.apply_updates(model, updates), opt_state

    with jax.set_mesh(mesh):
        model = nm.named_jit(lambda k: model_cls.init(config, key=k), mapping=param_map)(jax.random.key(0))
        opt_state = nm.named_jit(optimizer.init, mapping=param_map)(model)
        ids_np = np.random.default_rng(0).integers(0, config.vocab_size, size=(batch, seq), dtype=np.int32)
        ids = nm.shard(nm.named(jnp.asarray(ids_np), (nm.Axis("batch", batch), nm.Axis("position", seq))), compute_map)
        jstep = nm.named_jit(step, mapping=compute_map, out_mapping=param_map, donate_args=(True, True, False))
        t0 = time.perf_counter()
        compiled = jstep.lower(model, opt_state, ids).compile()
        compile_s = time.perf_counter() - t0
        hlo = compiled.as_text()
        cudnn = "cudnn$fmha" in hlo or "__cudnn$fmha" in hlo
        del compiled, hlo
        state = [model, opt_state]

        def run():
            loss, state[0], state[1] = jstep(state[0], state[1], ids)
            return jax.block_until_ready(loss)

        losses = [float(run()) for _ in range(3)]
        times = []
        for _ in range(spec["steps"]):
            t0 = time.perf_counter()
            loss = run()
            times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    step_s = statistics.median(times)
    fpt = models.flops_per_token(config, seq)
    tokens_s = batch * seq / step_s
    mem = jax.devices()[0].memory_stats() or {}
    return {**spec, "seq": seq, "params": models.num_params(config), "flops_per_token": fpt, "compile_s": compile_s,
            "step_s": C_summary(times), "tokens_per_s": tokens_s, "mfu": fpt * tokens_s / PEAK_FLOPS,
            "cudnn_attention": cudnn, "losses": losses, "peak_bytes_in_use": mem.get("peak_bytes_in_use"),
            "device_kind": jax.devices()[0].device_kind, "jax": jax.__version__, "cudnn": cudnn_version(),
            "xla_flags": os.environ["XLA_FLAGS"]}


def C_summary(times):
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "n": len(times)}


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
    return subprocess.run([sys.executable, "-c", "import named.models, jmp, optax, equinox"], capture_output=True,
                          text=True, env=env)


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
            raise SystemExit(f"named does not import here and {wheels} holds no wheels: run bench/fetch_wheels.py "
                             f"where there is a package index, and bring {wheels.name}/ along")
        shutil.rmtree(SITE, ignore_errors=True)
        pip = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-index",
               "--no-deps", "--target", str(SITE)]
        subprocess.run(pip + [str(f) for f in files], check=True)
        # built with the carried setuptools (on PYTHONPATH), not in an isolated build environment
        # (that would need an index for the backend's own dependencies)
        subprocess.run(pip + ["--no-build-isolation", "--upgrade", str(ROOT)], check=True,
                       env={**os.environ, "PYTHONPATH": str(SITE)})
        stamp.write_text(_fingerprint())
        check = _imports(str(SITE))
        if check.returncode != 0:
            raise SystemExit(f"installed into {SITE}, but named still does not import:\n{check.stderr[-2000:]}")
    os.environ["PYTHONPATH"] = str(SITE)
    return f"installed from {wheels.name}/ into {SITE}"


def run_one(spec: dict, timeout_s: float) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    env = {k: v for k, v in os.environ.items() if k not in _DRIVER_ENV}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout_s, 1), env=env)
    except subprocess.TimeoutExpired:
        return {**spec, "error": f"timed out after {timeout_s:.0f}s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {**spec, "error": (proc.stderr or proc.stdout)[-1500:], "wall_s": time.perf_counter() - t0}
    out = json.loads(lines[-1])
    out["wall_s"] = time.perf_counter() - t0
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=list(MODELS), required=False)
    ap.add_argument("--budget-s", type=float, default=540.0, help="stop starting new runs after this many seconds")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="stage-1 batch sizes (default per model)")
    ap.add_argument("--out", default=None, help="directory for gpu_mfu_<model>.json (default bench/results)")
    ap.add_argument("--wheels", default=str(ROOT / ".whl"), help="carried wheels, used when named does not import")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.model == "tiny":
        args.steps = min(args.steps, 2)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    if not args.model:
        ap.error("--model is required")

    installed = ensure_importable(Path(args.wheels))
    os.environ.update(_DRIVER_ENV)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _common as C
    import report

    start = time.perf_counter()
    m = MODELS[args.model]
    runs: list[dict] = []
    result = {"benchmark": "gpu_mfu", "command": C.command_line(), "model": args.model, "model_config": m["config"],
              "seq": m["seq"], "peak_flops": PEAK_FLOPS, "mfu_formula": "(6N + 12 L d T) * tokens/s / 989e12",
              "precision": "params=float32,compute=bfloat16,output=float32", "tuned_xla_flags": TUNED_FLAGS,
              "install": installed, "runs": runs}
    try:
        result["machine"] = C.machine()
    except Exception as e:  # noqa: BLE001 - a record, not a reason to stop
        result["machine"] = {"error": str(e)}
    try:
        result["machine"]["gpu"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        result["machine"]["gpu"] = None

    def left():
        return args.budget_s - (time.perf_counter() - start)

    def go(**kw):
        spec = {"model": args.model, "batch": kw["batch"], "remat": kw.get("remat", "none"),
                "layers": kw.get("layers", "scan"), "flags": kw.get("flags", "tuned"), "steps": args.steps}
        if any(all(r.get(k) == v for k, v in spec.items()) for r in runs) or left() < 60:
            return None
        r = run_one(spec, left())
        runs.append(r)
        ok = "error" not in r
        print(json.dumps({k: r.get(k) for k in ("batch", "remat", "layers", "flags", "tokens_per_s", "mfu", "compile_s",
                                                 "cudnn_attention")} if ok else {**spec, "error": r["error"][-300:]}),
              flush=True)
        C.write_result(f"gpu_mfu_{args.model}", {**result, "best": best()}, args.out)
        return r if ok else None

    def best():
        ok = [r for r in runs if "error" not in r]
        return max(ok, key=lambda r: r["mfu"]) if ok else None

    for b in args.batches or m["batches"]:  # stage 1
        go(batch=b)
    b0 = best()
    if b0:  # stage 2
        for remat in ("save_dots", "full"):
            go(batch=b0["batch"], remat=remat)
        full = [r for r in runs if r.get("remat") == "full" and "error" not in r]
        if full:
            go(batch=2 * b0["batch"], remat="full")
        b1 = best()
        go(batch=b1["batch"], remat=b1["remat"], layers="unrolled")  # stage 3
        b2 = best()
        go(batch=b2["batch"], remat=b2["remat"], layers=b2["layers"], flags="none")  # stage 4
    C.write_result(f"gpu_mfu_{args.model}", {**result, "best": best()}, args.out)
    b = best()
    if b:
        print(f"best {args.model}: batch {b['batch']} remat {b['remat']} {b['layers']} flags {b['flags']}: "
              f"{b['tokens_per_s']:,.0f} tokens/s, MFU {b['mfu']:.1%}")
    print(report.gpu_block(Path(args.out) if args.out else C.RESULTS))


if __name__ == "__main__":
    main()
