"""The peer: the same FSDP GPT-2 or Llama step on Haliax + Levanter (from PyPI), against `named`.

    .venv/bin/python bench/peer.py                       # GPT-2; builds bench/.venv-peer on first use
    .venv/bin/python bench/peer.py --model llama         # the Llama
    .venv/bin/python bench/peer.py --remat full          # both sides with per-block checkpointing
    .venv/bin/python bench/peer.py --peer-loss levanter  # the peer's own default loss (fused, blockwise)
    .venv/bin/python bench/peer.py --tiny --repeats 1    # smoke test

The peer runs in its own virtual environment (``bench/.venv-peer``, ignored by git), made
here with ``python3 -m venv`` and ``pip install --pre`` of the current Levanter release,
``marin-levanter`` / ``marin-haliax`` (with GitPython and chex, which it imports without
declaring them); if that fails (no registry, no wheel for this Python) the result says
``skipped`` and why.

Each side runs in its own persistent subprocess (its own venv's Python). A worker builds its
model with FSDP sharded init (parameters ``{"embed": "data"}``, activations
``{"batch": "data"}``, 8 fake CPU devices), compiles, and then runs steps when the driver asks:
the sides take turns of ``--per-round`` steps (named, peer, named, peer, ...), the idle one
asleep on its stdin, for ``--rounds`` turns; ``--repeats`` fresh pairs of workers.

Like for like (the default). Our side is the step ``named-train`` runs (``train.make_train_step``
through ``_common.TrainerStep``, the config of ``_common.step_config``): the trainer's loss (the
next-token cross-entropy summed over the tokens ``loss_mask`` keeps, over one microbatch, divided
by their count), the global gradient norm, global-norm clipping at 1.0, AdamW (betas 0.9 / 0.95,
weight decay 0.1 off biases and norms) at a constant rate, the finite checks of the loss, the
gradient norm, the update, the new parameters and optimizer state, and the stop flags agreed over
the devices; one document per row (no ``segment_ids``). The peer runs Levanter's
``Gpt2LMHeadModel`` or ``LlamaLMHeadModel`` through ``haliax.named_jit`` in a step that computes
the same: its logits, ``levanter.models.loss.next_token_loss`` summed by its ``loss_weight`` (the
predicted tokens) and divided by their count, the same norm, optax chain (the same weight-decay
mask: every array but biases and norm parameters) and checks, with donation, plain ("vanilla")
attention and no gradient checkpointing unless ``--remat full`` (Levanter's
``gradient_checkpointing=True``, the same policy as our ``remat="full"``). Each side reads its
loss back after every step, as a logging loop would. ``--peer-loss levanter`` gives the peer its
own default loss instead, ``model.compute_next_token_loss`` (a fused, vocabulary-blockwise loss).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common as C  # sets XLA_FLAGS before jax is imported

HERE = Path(__file__).resolve().parent
PEER_VENV = HERE / ".venv-peer"
PEER_PY = PEER_VENV / "bin" / "python"
# The versions measured in docs/benchmarks.md: the current Levanter, published as marin-levanter
# and marin-haliax (dev builds only). It imports git (GitPython) and chex without declaring them.
PEER_PACKAGES = ["marin-levanter==0.2.20.dev202606180959", "marin-haliax==0.2.20.dev202606180959", "GitPython", "chex"]
PEER_DISTS = ("marin-levanter", "marin-haliax", "jax", "jaxlib", "equinox", "optax")
PEER_IMPORTS = (
    "import levanter, haliax, levanter.models.gpt2, levanter.models.llama, levanter.models.loss, "
    "levanter.layers.attention"
)
# The Llama next to C.SMALL_GPT2: 4 layers, hidden 256, 4 query heads over 2 key/value heads
# (GQA), SwiGLU 1024, untied head, vocab 8192.
SMALL_LLAMA = dict(
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    vocab_size=8192,
)
MODELS = {  # (the config, its tiny version for the smoke test)
    "gpt2": (C.SMALL_GPT2, dict(n_layer=2, n_head=2, n_embd=64, n_positions=32, vocab_size=384)),
    "llama": (
        SMALL_LLAMA,
        dict(
            SMALL_LLAMA,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=32,
            vocab_size=384,
        ),
    ),
}


# ---- the peer venv ----------------------------------------------------------------------


def _peer_imports() -> subprocess.CompletedProcess:
    return subprocess.run([str(PEER_PY), "-c", PEER_IMPORTS], capture_output=True, text=True)


def ensure_peer_venv() -> tuple[bool, str]:
    """(ok, message). Builds the venv once (a later run reuses it) with pip from the registry."""
    if PEER_PY.exists() and _peer_imports().returncode == 0:
        return True, "reused"
    try:
        if not PEER_PY.exists():
            subprocess.run([sys.executable, "-m", "venv", str(PEER_VENV)], check=True, capture_output=True, text=True)
        pip = [str(PEER_PY), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        subprocess.run(pip + ["--upgrade", "pip"], check=True, capture_output=True, text=True, timeout=600)
        subprocess.run(pip + ["--pre", *PEER_PACKAGES], check=True, capture_output=True, text=True, timeout=1800)
    except subprocess.CalledProcessError as e:
        return (
            False,
            f"building {PEER_VENV.name} failed: {' '.join(e.cmd)}: {(e.stderr or e.stdout or '').strip()[-800:]}",
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"building {PEER_VENV.name} failed: {e}"
    check = _peer_imports()
    if check.returncode != 0:
        return False, f"{PEER_VENV.name} was built but the peer does not import: {check.stderr.strip()[-800:]}"
    return True, "built"


# ---- workers (run in a subprocess, one per side and repeat) ------------------------------------


def serve(run, info: dict) -> dict:
    """Answer the driver on stdin/stdout: after ``info`` (one JSON line), each ``run K`` line
    runs K steps and replies with their times; ``quit`` ends. Between requests this process
    sleeps on stdin, so the other side has the machine to itself."""
    print(json.dumps({"ready": True, **info}), flush=True)
    losses = []
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        times, cpu = [], []
        for _ in range(int(cmd[1])):
            t0, c0 = time.perf_counter(), time.process_time()
            loss = run()
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        losses.append(loss)
        print(json.dumps({"times": times, "cpu": cpu, "loss": losses[-1]}), flush=True)
    return {"losses": losses}


def trainer_config(model_type: str, cfg: dict, batch: int, seq: int, dtype: str, remat: str):
    """The trainer config both sides take their settings from (our worker runs it; the driver
    hands the peer its optimizer's)."""
    base = "gpt2_small.yaml" if model_type == "gpt2" else "llama_tiny.yaml"
    return C.step_config({**cfg, "remat": remat}, batch=batch, seq=seq, dtype=dtype, base=base)


def record(c) -> dict:
    """A ``named-plan --search`` candidate as the result's JSON holds it: its name, its layout's
    fields (as a config writes them: ``Layout.fields``) and its measurements, in one flat dict."""
    import dataclasses

    measured = dataclasses.asdict(c)
    del measured["layout"]
    return {**measured, **c.layout.fields()}


def with_layout(config, layout: dict | None):
    """``config`` trained in ``layout``: a candidate's ``record`` (mesh, mappings, remat,
    microbatches and whatever else the search varies), applied as the search applies them."""
    if layout is None:
        return config
    from named.trainer.config.layout import KEYS, Layout

    return Layout(**{f: layout[f] for f in KEYS if f in layout}).apply(config)  # (a record before a field: its default)


def worker_named(model_type, cfg, batch, seq, dtype, remat, peer_loss, optimizer, layout=None) -> dict:
    import numpy as np

    ids_np = np.random.default_rng(0).integers(0, cfg["vocab_size"], size=(batch, seq), dtype=np.int32)
    config = with_layout(trainer_config(model_type, cfg, batch, seq, dtype, remat or "none"), layout)
    step = C.TrainerStep(config, ids_np, segments=False)
    t0 = time.perf_counter()
    compiled = step.compile()
    compile_s = time.perf_counter() - t0
    program = {
        "hlo": C.hlo_stats(compiled.as_text()),
        "memory": C.memory_stats(compiled),
        "cost": C.cost_stats(compiled),
    }
    del compiled

    def run():
        step.run()
        return step.losses[-1]

    return serve(run, {"compile_s": compile_s, "params": C.count_params(step.model), **program})


def _levanter_config(model_type: str, cfg: dict, seq: int, remat: str | None):
    """Levanter's config for the model our ``cfg`` describes (its field names differ). ``remat``
    None: Levanter's own defaults for gradient checkpointing and attention (``--setup
    recommended``); otherwise ``remat`` and plain attention, as ours."""
    from levanter.layers.attention import AttentionBackend

    common = dict(max_seq_len=seq)
    if remat is not None:
        common.update(gradient_checkpointing=(remat == "full"), attn_backend=AttentionBackend.VANILLA)
    if model_type == "gpt2":
        from levanter.models.gpt2 import Gpt2Config

        if cfg["n_positions"] != seq:
            raise SystemExit("the peer ties max_seq_len to the position table: n_positions must equal seq")
        return Gpt2Config(
            hidden_dim=cfg["n_embd"],
            num_layers=cfg["n_layer"],
            num_heads=cfg["n_head"],
            **({} if remat is None else {"use_flash_attention": False}),
            **common,
        )
    from levanter.layers.rotary import DefaultRotaryEmbeddingsConfig
    from levanter.models.llama import LlamaConfig

    return LlamaConfig(
        hidden_dim=cfg["hidden_size"],
        intermediate_dim=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg["num_key_value_heads"],
        layer_norm_epsilon=cfg["rms_norm_eps"],
        tie_word_embeddings=cfg["tie_word_embeddings"],
        rope=DefaultRotaryEmbeddingsConfig(theta=cfg["rope_theta"]),
        **common,
    )


def worker_peer(model_type, cfg, batch, seq, dtype, remat, peer_loss, optimizer, layout=None) -> dict:
    from importlib import metadata

    import equinox as eqx
    import haliax as hax
    import jax
    import jax.numpy as jnp
    import jmp
    import numpy as np
    import optax
    from haliax.nn.normalization import LayerNormBase
    from jax.sharding import AxisType, NamedSharding, PartitionSpec
    from levanter.layers.attention import AttentionMask
    from levanter.models.lm_model import LmExample
    from levanter.models.loss import next_token_loss

    config = _levanter_config(model_type, cfg, seq, remat)
    Vocab = hax.Axis("vocab", cfg["vocab_size"])
    Batch = hax.Axis("batch", batch)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    param_mapping, compute_mapping = dict(C.PARAM_MAPPING), dict(C.COMPUTE_MAPPING)
    policy = jmp.get_policy("p=f32,c=bf16,o=f32" if dtype == "bf16" else "p=f32,c=f32,o=f32")
    ids_np = np.random.default_rng(0).integers(0, cfg["vocab_size"], size=(batch, seq), dtype=np.int32)

    def decay_mask(params):  # ours: every array but biases and the parameters of norm layers
        def leaf(path, x):
            if isinstance(x, LayerNormBase):
                return jax.tree.map(lambda _: False, x)
            return not any(getattr(k, "name", None) == "bias" for k in path)

        return jax.tree_util.tree_map_with_path(leaf, params, is_leaf=lambda x: isinstance(x, LayerNormBase))

    o = optimizer
    clip = [] if o["max_grad_norm"] is None else [optax.clip_by_global_norm(o["max_grad_norm"])]
    tx = optax.chain(
        *clip,
        optax.adamw(
            optax.constant_schedule(o["learning_rate"]),
            b1=o["b1"],
            b2=o["b2"],
            eps=o["eps"],
            weight_decay=o["weight_decay"],
            mask=decay_mask,
        ),
    )

    def loss_sum(model, example):
        model = policy.cast_to_compute(model)
        if peer_loss == "levanter":  # the peer's own default: fused, blockwise over the vocabulary
            return model.compute_next_token_loss(example, reduction=hax.sum).scalar()
        logits = model(example.tokens, example.attn_mask)
        return next_token_loss(
            model.Pos, model.Vocab, logits, example.tokens, loss_weight=example.loss_weight, reduction=hax.sum
        ).scalar()

    def all_finite(tree):
        leaves = jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array))
        return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in leaves]))

    def step(model, opt_state, example, flags):
        # Levanter modules hold non-array leaves (e.g. attention's `inference` flag); as its
        # Trainer does, the optimizer sees only the floating-point arrays.
        total, grads = eqx.filter_value_and_grad(loss_sum)(model, example)
        count = jnp.maximum(example.loss_weight.array.astype(jnp.float32).sum(), 1.0)
        loss = total / count
        grads = jax.tree.map(lambda g: g / count, grads)
        grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
        updates, new_opt = tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        new_model = eqx.apply_updates(model, updates)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & all_finite((updates, new_model, new_opt))
        agreed = jax.lax.with_sharding_constraint(flags.max(axis=0), PartitionSpec())
        return (
            new_model,
            new_opt,
            {"loss": loss, "grad_norm": grad_norm, "finite": finite, "tokens": count, "stop_flags": agreed},
        )

    with jax.set_mesh(mesh), hax.axis_mapping(compute_mapping):
        init = hax.named_jit(lambda k: config.build(Vocab, key=k), axis_resources=param_mapping)
        model = init(jax.random.PRNGKey(0))
        opt_state = hax.named_jit(lambda m: tx.init(eqx.filter(m, eqx.is_inexact_array)), axis_resources=param_mapping)(
            model
        )
        Pos = config.max_Pos
        tokens = hax.shard(hax.named(jnp.asarray(ids_np), (Batch, Pos)), compute_mapping)
        weight = hax.shard(
            hax.broadcast_to(LmExample.causal_loss_mask(Pos).astype(jnp.float32), (Batch, Pos)), compute_mapping
        )
        example = LmExample(tokens=tokens, loss_weight=weight, attn_mask=AttentionMask.causal())
        flags = jax.device_put(np.zeros((8, 2), np.int32), NamedSharding(mesh, PartitionSpec("data")))
        jstep = hax.named_jit(
            step,
            axis_resources=compute_mapping,
            out_axis_resources=param_mapping,
            donate_args=(True, True, False, False),
        )
        state = {"model": model, "opt": opt_state}
        t0 = time.perf_counter()
        compiled = jstep.lower(model, opt_state, example, flags).compile()
        compile_s = time.perf_counter() - t0
        program = {
            "hlo": C.hlo_stats(compiled.as_text()),
            "memory": C.memory_stats(compiled),
            "cost": C.cost_stats(compiled),
        }
        del compiled

        def run():
            state["model"], state["opt"], metrics = jstep(state["model"], state["opt"], example, flags)
            jax.block_until_ready((state["model"], state["opt"], metrics))
            return float(metrics["loss"])

        from levanter.layers.attention import default_attention_type

        params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
        versions = {d: metadata.version(d) for d in PEER_DISTS}
        setup = {
            "gradient_checkpointing": str(config.gradient_checkpointing),
            "attn_backend": str(config.attn_backend or f"default: {default_attention_type()}"),
            "loss": "model.compute_next_token_loss" if peer_loss == "levanter" else "next_token_loss on the logits",
        }
        return serve(run, {"compile_s": compile_s, "params": params, "versions": versions, "setup": setup, **program})


# ---- the driver ----------------------------------------------------------------------------------


class Worker:
    """One side's persistent subprocess (its own venv's Python), driven line by line."""

    def __init__(self, side: str, args, cfg, batch, seq, optimizer: dict, log_dir: Path, layout: dict | None = None):
        peer = side == "peer"
        recommended = args.setup == "recommended"
        cmd = [
            str(PEER_PY) if peer else sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            "peer" if peer else "named",
            "--worker-config",
            json.dumps(
                {
                    "model_type": args.model,
                    "cfg": cfg,
                    "batch": batch,
                    "seq": seq,
                    "dtype": args.dtype,
                    # recommended: the peer keeps Levanter's defaults, ours its layout's remat
                    "remat": None if recommended else args.remat,
                    "peer_loss": "levanter" if recommended else args.peer_loss,
                    "optimizer": optimizer,
                    "layout": layout,
                }
            ),
        ]
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        self.side, self.log = side, log_dir / f"{side}-{time.monotonic_ns()}.log"
        self._stderr = open(self.log, "w")
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=env
        )
        self.info = self._reply()

    def _reply(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        self.proc.wait()
        self._stderr.flush()
        raise RuntimeError(f"{self.side} worker failed (exit {self.proc.returncode}):\n{self.log.read_text()[-3000:]}")

    def run(self, steps: int) -> dict:
        self.proc.stdin.write(f"run {steps}\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self._stderr.close()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=tuple(MODELS), default="gpt2")
    ap.add_argument(
        "--peer-loss",
        choices=("full", "levanter"),
        default="full",
        help="the peer's loss: the same full-logits loss as ours, or its own default (fused, blockwise)",
    )
    ap.add_argument(
        "--setup",
        choices=("same", "recommended"),
        default="same",
        help="same: both sides compute the same step; recommended: each side's own recommended setup "
        "(Levanter's defaults against the layouts named-plan --search ranks first)",
    )
    ap.add_argument(
        "--device-kind",
        default="cpu",
        help="--setup recommended: the device whose roofline named-plan --search ranks by "
        "(cpu, the default: this machine, measured as named-plan --search measures it on a CPU, "
        "which is what the search ranks by when run here)",
    )
    ap.add_argument(
        "--measure",
        type=int,
        default=0,
        metavar="K",
        help="--setup recommended: as named-plan --search --measure K, time the first K layouts of each "
        "search here for a few steps and take the fastest",
    )
    ap.add_argument("--dtype", choices=("f32", "bf16"), default="f32")
    ap.add_argument("--remat", choices=("none", "full"), default="none")
    ap.add_argument("--repeats", type=int, default=2, help="pairs of fresh worker processes (one compile each)")
    ap.add_argument("--rounds", type=int, default=8, help="turns per pair: named runs --per-round steps, then peer")
    ap.add_argument("--per-round", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--no-build", action="store_true", help="skip (with a message) if the peer venv is missing")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", choices=("named", "peer"), help=argparse.SUPPRESS)
    ap.add_argument("--worker-config", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:
        w = json.loads(args.worker_config)
        fn = worker_named if args.worker == "named" else worker_peer
        return fn(
            w["model_type"],
            w["cfg"],
            w["batch"],
            w["seq"],
            w["dtype"],
            w["remat"],
            w["peer_loss"],
            w["optimizer"],
            w["layout"],
        )

    full, tiny = MODELS[args.model]
    cfg, batch, seq = (dict(tiny), 8, 32) if args.tiny else (dict(full), C.BATCH, C.SEQ)
    if args.tiny:
        args.repeats, args.rounds, args.per_round, args.warmup = 1, 1, 1, 1
    name = (
        "peer"
        + ("" if args.model == "gpt2" else f"_{args.model}")
        + f"_{args.dtype}"
        + ("" if args.remat == "none" or args.setup == "recommended" else f"_remat_{args.remat}")
        + ("" if args.peer_loss == "full" or args.setup == "recommended" else f"_peerloss_{args.peer_loss}")
        + ("" if args.setup == "same" else "_recommended")
        + ("_tiny" if args.tiny else "")
    )
    o = trainer_config(args.model, cfg, batch, seq, args.dtype, args.remat).optimizer
    optimizer = {
        "learning_rate": o.learning_rate,
        "b1": o.beta1,
        "b2": o.beta2,
        "eps": o.epsilon,
        "weight_decay": o.weight_decay,
        "max_grad_norm": o.max_grad_norm,
    }
    if o.schedule != "constant" or o.warmup(1):
        raise SystemExit("the peer runs a constant learning rate: the config must say optimizer.schedule constant")
    result = {
        "benchmark": "peer",
        "command": C.command_line(),
        "machine": C.machine(),
        "config": {
            "model": args.model,
            **cfg,
            "seq": seq,
            "batch": batch,
            "dtype": args.dtype,
            "remat": args.remat,
            "mesh": C.MESH,
            "param_mapping": C.PARAM_MAPPING,
            "compute_mapping": C.COMPUTE_MAPPING,
            "optimizer": f"clip_by_global_norm({o.max_grad_norm}) + adamw({o.learning_rate}, constant, "
            f"b1={o.beta1}, b2={o.beta2}, eps={o.epsilon}, weight_decay={o.weight_decay} "
            "off biases and norms), on both sides",
            "sides": {
                "named": "train.make_train_step (the trainer's step, loss and optimizer)",
                "peer": "Levanter's model in a haliax.named_jit step computing the same",
            },
            "peer_attention": "vanilla",
            "peer_loss": {
                "full": "levanter.models.loss.next_token_loss on the logits (like ours)",
                "levanter": "model.compute_next_token_loss (fused, blockwise)",
            }[args.peer_loss],
        },
        "protocol": f"{args.repeats} pairs of worker processes; per pair {args.warmup} warm-up steps each, then "
        f"{args.rounds} turns of {args.per_round} steps (named, peer, named, peer, ...)",
        "goal": "step_ratio_named_over_peer <= 0.9",
    }
    if args.setup == "recommended":
        result["config"].update(
            {
                "setup": "recommended",
                "remat": "ours: the layout's; the peer: Levanter's default (gradient_checkpointing=True)",
                "sides": {
                    "named": "the trainer's step in the layout named-plan --search ranks first (no memory limit)",
                    "named_at_peer_memory": "the trainer's step in the layout named-plan --search ranks first "
                    "within the peer's compiled peak memory per device",
                    "peer": "Levanter's model with its defaults (gradient checkpointing, its attention backend, "
                    "model.compute_next_token_loss) in a haliax.named_jit step, FSDP as Levanter's default mesh",
                },
                "peer_attention": "Levanter's default",
                "peer_loss": "model.compute_next_token_loss (fused)",
            }
        )
        result["goal"] = "step <= 0.85 x the peer's, or peak memory per device <= 0.7 x at step <= 1.0 x"
    if args.no_build and not PEER_PY.exists():
        ok, why = False, f"{PEER_VENV.name} does not exist and --no-build was given"
    else:
        ok, why = ensure_peer_venv()
    if not ok:
        result.update({"skipped": True, "reason": why})
        print(f"peer skipped: {why}")
        C.write_result(name, result, args.out)
        return result
    result["peer_venv"] = why

    sides = ["named", "peer"] if args.setup == "same" else ["peer", "named", "named_at_peer_memory"]
    times, cpu, compile_s, losses = ({} for _ in range(4))
    per_round: dict[str, list[float]] = {}
    info: dict[str, dict] = {}
    log_dir = Path(tempfile.mkdtemp(prefix="named-peer-"))
    for r in range(args.repeats):
        workers: dict[str, Worker] = {}
        try:
            for side in sides:
                layout = None
                if side != "peer" and args.setup == "recommended":
                    if "search" not in result:  # once: the peer's memory is the second budget
                        result["search"] = recommended_layouts(args, cfg, batch, seq, info["peer"]["memory"])
                    layout = result["search"]["chosen"].get(side)
                    if layout is None:  # the same layout as another side, or none fits
                        continue
                workers[side] = Worker(side, args, cfg, batch, seq, optimizer, log_dir, layout)
                info[side] = workers[side].info
                compile_s.setdefault(side, []).append(info[side]["compile_s"])
            for side, w in workers.items():
                losses.setdefault(side, []).append([w.run(args.warmup)["loss"]])
            for t in range(args.rounds):
                med = {}
                for side, w in workers.items():
                    out = w.run(args.per_round)
                    times.setdefault(side, []).extend(out["times"])
                    cpu.setdefault(side, []).extend(out["cpu"])
                    losses[side][-1].append(out["loss"])
                    med[side] = statistics.median(out["times"])
                for side in med:
                    if side != "peer":
                        per_round.setdefault(side, []).append(med[side] / med["peer"])
                shown = " ".join(f"{k} {v:.4f}s" for k, v in med.items())
                print(f"  pair {r + 1} turn {t + 1}: {shown}", flush=True)
        except RuntimeError as e:  # recorded, so `make bench` still finishes and says why
            result.update({"skipped": True, "reason": str(e)[-2000:]})
            print(f"peer benchmark failed: {e}")
            C.write_result(name, result, args.out)
            return result
        finally:
            for w in workers.values():
                w.close()
    shutil.rmtree(log_dir, ignore_errors=True)
    step = {k: C.summary(v) for k, v in times.items()}
    comp = {k: C.summary(v) for k, v in compile_s.items()}
    ours = [k for k in times if k != "peer"]
    peak = {k: v["memory"]["peak_bytes"] for k, v in info.items()}
    result.update(
        {
            "peer_versions": info["peer"].get("versions"),
            "peer_setup": info["peer"].get("setup"),
            "params": {k: v["params"] for k, v in info.items()},
            "step": step,
            "step_cpu": {k: C.summary(v) for k, v in cpu.items()},
            "compile_s": comp,
            "losses_first_and_last": {k: [v[0][0], v[0][-1]] for k, v in losses.items()},
            "hlo": {k: {kk: vv for kk, vv in v["hlo"].items() if kk != "opcodes"} for k, v in info.items()},
            "memory": {k: v["memory"] for k, v in info.items()},
            "cost": {k: v["cost"] for k, v in info.items()},
        }
    )
    for k in ours:
        suffix = "" if k == "named" else f"_{k.removeprefix('named_')}"
        result.update(
            {
                f"step_ratio_named_over_peer{suffix}": step[k]["median_s"] / step["peer"]["median_s"],
                f"step_ratio_min_named_over_peer{suffix}": step[k]["min_s"] / step["peer"]["min_s"],
                f"step_cpu_ratio_named_over_peer{suffix}": statistics.median(cpu[k]) / statistics.median(cpu["peer"]),
                f"step_ratio_per_round{suffix}": [round(x, 4) for x in per_round[k]],
                f"step_ratio_median_of_rounds{suffix}": statistics.median(per_round[k]),
                f"compile_ratio_named_over_peer{suffix}": comp[k]["median_s"] / comp["peer"]["median_s"],
                f"peak_memory_ratio_named_over_peer{suffix}": peak[k] / peak["peer"],
                f"tokens_per_s{suffix}": batch * seq / step[k]["median_s"],
            }
        )
        print(
            f"{k}: step median {step[k]['median_s']:.4f}s vs peer {step['peer']['median_s']:.4f}s, ratio "
            f"{result[f'step_ratio_named_over_peer{suffix}']:.3f} (median of turns "
            f"{result[f'step_ratio_median_of_rounds{suffix}']:.3f}, CPU time "
            f"{result[f'step_cpu_ratio_named_over_peer{suffix}']:.3f}); peak memory per device "
            f"{peak[k] / 2**20:.1f} MiB vs {peak['peer'] / 2**20:.1f} MiB ({peak[k] / peak['peer']:.3f})"
        )
    result["tokens_per_s_peer"] = batch * seq / step["peer"]["median_s"]
    if args.setup == "same":
        named, peer = info["named"]["hlo"]["opcodes"], info["peer"]["hlo"]["opcodes"]
        result["hlo_opcode_difference_named_minus_peer"] = {
            op: named.get(op, 0) - peer.get(op, 0)
            for op in sorted(set(named) | set(peer))
            if named.get(op, 0) != peer.get(op, 0)
        }
    C.write_result(name, result, args.out)
    return result


def recommended_layouts(args, cfg: dict, batch: int, seq: int, peer_memory: dict) -> dict:
    """``named-plan --search`` for our side of ``--setup recommended``, run here on the same 8 CPU
    devices, ranked by the roofline of ``--device-kind``: the layout it ranks first with no memory
    limit ("named"), and the one it ranks first within the peer's compiled peak memory per device
    ("named_at_peer_memory"; left out when it is the same layout, or when none fits)."""
    from named.trainer.commands.plan import Target
    from named.trainer.commands.plan_search import Roofline, fits, format_table, search, timed
    from named.trainer.loop import hardware

    config = trainer_config(args.model, cfg, batch, seq, args.dtype, "none")
    device = hardware.this_cpu() if args.device_kind == "cpu" else hardware.find(args.device_kind)
    roof = Roofline.of(config, device)
    budget = peer_memory["peak_bytes"]
    t0 = time.perf_counter()
    # named-plan --search, then named-plan --search --device-memory <the peer's peak>: each
    # refines its own best layouts (explicit mode, the blockwise loss)
    # (a layout's memory is named-plan's estimate from shapes, judged against the peer's compiled peak)
    fastest = search(config, Target(device, None), roof=roof)
    within = search(config, Target(device, budget), roof=roof)
    if args.measure:  # named-plan --search --measure K: the first K that fit timed here, and re-ranked
        fastest = timed(config, fastest, args.measure, math.inf)
        within = timed(config, within, args.measure, budget)
    fastest = fastest[0]
    seconds = time.perf_counter() - t0
    table = format_table(within, roof, budget)
    print(table, flush=True)

    chosen = {"named": record(fastest)}
    if (
        not within[0].error
        and fits(within[0], budget)
        and (within[0].name, within[0].layout)
        != (
            fastest.name,
            fastest.layout,
        )
    ):
        chosen["named_at_peer_memory"] = record(within[0])
    return {
        "device_kind": args.device_kind,
        "measure": args.measure,
        "search_s": seconds,
        "candidates": len(within),
        "budget_bytes_at_peer_memory": budget,
        "table_within_peer_memory": table,
        "chosen": chosen,
        "fastest_fits_peer_memory": fits(fastest, budget),
    }


if __name__ == "__main__":
    main()
