"""Library overhead: the trainer's FSDP GPT-2 train step against the same step in plain JAX + Equinox.

    .venv/bin/python bench/overhead.py                 # the issue-9 configuration, f32
    .venv/bin/python bench/overhead.py --dtype bf16    # f32 params, bf16 compute
    .venv/bin/python bench/overhead.py --tiny          # seconds; what the smoke test runs

Side A ("named") is the step ``named-train`` runs: ``train.make_train_step`` through
``_common.TrainerStep``, on ``models.Gpt2LMHeadModel`` initialised by the trainer (parameter
mapping ``{"embed": "data"}``, compute mapping ``{"batch": "data"}``), with the trainer's loss
(``trainer.loss.token_losses``), optimizer (global-norm clipping at 1.0, AdamW with weight decay
0.1 off biases and norms, at a constant rate) and finite checks, one microbatch, the batch's
``input_ids`` and ``loss_mask`` (no ``segment_ids``: one document per row). Side B ("plain") is
``bench/reference_gpt2.py``: the same model and the same step written in plain JAX + Equinox +
optax, with hand-written PartitionSpecs and ``with_sharding_constraint`` on every activation it
creates. Both donate the model and optimizer state, return the same metrics and run on 8 fake
CPU devices.

Compile time is ``lower`` (tracing, ours included) plus ``compile`` (XLA), measured after
``jax.clear_caches()`` and taking turns. Step time is taken A B A B ... in rounds; each step
waits for its result and reads its loss, as a logging loop would. Medians and their ratio
(named / plain) are reported, together with opcode and collective counts of both optimized HLO
modules, which is where a real difference in the program would show.
"""

from __future__ import annotations

import argparse
import statistics
import time

import _common as C  # sets XLA_FLAGS before jax is imported
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import reference_gpt2 as ref
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

TINY = dict(n_layer=2, n_head=2, n_embd=64, n_positions=32, vocab_size=384)


class Plain:
    """Side B: ``reference_gpt2`` with the settings of the trainer config ``cfg``, on ``mesh``."""

    def __init__(self, cfg, mesh, ids_np: np.ndarray, model: ref.Gpt2 | None = None):
        """``model``: weights to start from (default: ``reference_gpt2``'s sharded init)."""
        o, t, m = cfg.optimizer, cfg.trainer, cfg.model
        if o.schedule != "constant" or o.warmup(t.num_train_steps):
            raise SystemExit("the plain side runs a constant learning rate: set optimizer.schedule constant, no warmup")
        optimizer = ref.make_optimizer(
            o.learning_rate,
            b1=o.beta1,
            b2=o.beta2,
            eps=o.epsilon,
            weight_decay=o.weight_decay,
            max_grad_norm=o.max_grad_norm,
        )
        self.model = (
            model
            if model is not None
            else ref.sharded_init(
                mesh,
                jax.random.key(0),
                n_layer=m.n_layer,
                n_head=m.n_head,
                n_embd=m.n_embd,
                n_positions=m.n_positions,
                vocab_size=m.vocab_size,
            )
        )
        self.opt_state = ref.init_optimizer(optimizer, self.model, mesh)
        rows = NamedSharding(mesh, P(ref.DATA, None))
        self.batch = {
            "input_ids": jax.device_put(jnp.asarray(ids_np), rows),
            "loss_mask": jax.device_put(jnp.ones(ids_np.shape, bool), rows),
        }
        self.flags = ref.flags(mesh)
        compute_dtype = jnp.bfloat16 if "compute=bfloat16" in t.precision else jnp.float32
        self.step = ref.make_train_step(
            optimizer, mesh, self.model, self.opt_state, microbatches=t.microbatches, compute_dtype=compute_dtype
        )
        self.losses: list[float] = []

    def lower(self):
        return self.step.lower(self.model, self.opt_state, self.batch, self.flags)

    def run(self):
        self.model, self.opt_state, metrics = self.step(self.model, self.opt_state, self.batch, self.flags)
        C.block((self.model, self.opt_state, metrics))
        self.losses.append(float(metrics["loss"]))


def lower_compile(side) -> tuple[float, float, object]:
    jax.clear_caches()
    t0 = time.perf_counter()
    lowered = side.lower()
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, compiled


def token_ids(cfg: dict, batch: int, seq: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, cfg["vocab_size"], size=(batch, seq), dtype=np.int32)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=("f32", "bf16"), default="f32")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--per-round", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--compile-repeats", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide model with 1 round (smoke test)")
    ap.add_argument("--out", default=None, help="directory for the JSON (default bench/results)")
    ap.add_argument("--profile", default=None, help="write a jax.profiler trace of 3 steps of each side here")
    args = ap.parse_args(argv)

    model, batch, seq = (dict(TINY), 8, 32) if args.tiny else (dict(C.SMALL_GPT2), C.BATCH, C.SEQ)
    if args.tiny:
        args.rounds, args.per_round, args.warmup, args.compile_repeats = 1, 1, 1, 1
    cfg = C.step_config(model, batch=batch, seq=seq, dtype=args.dtype)
    ids_np = token_ids(model, batch, seq)
    o = cfg.optimizer
    result = {
        "benchmark": "overhead",
        "command": C.command_line(),
        "machine": C.machine(),
        "config": {
            **model,
            "seq": seq,
            "batch": batch,
            "dtype": args.dtype,
            "mesh": C.MESH,
            "param_mapping": C.PARAM_MAPPING,
            "compute_mapping": C.COMPUTE_MAPPING,
            "microbatches": cfg.trainer.microbatches,
            "optimizer": f"clip_by_global_norm({o.max_grad_norm}) + adamw({o.learning_rate}, constant, "
            f"b1={o.beta1}, b2={o.beta2}, eps={o.epsilon}, weight_decay={o.weight_decay} "
            "off biases and norms)",
            "layers_run_with": "scan (Stacked / lax.scan)",
            "sides": {
                "named": "train.make_train_step (the trainer's step, loss and optimizer)",
                "plain": "bench/reference_gpt2.py make_train_step (the same step in plain JAX)",
            },
        },
    }
    named = C.TrainerStep(cfg, ids_np, segments=False)
    mesh = named.mesh
    with jax.set_mesh(mesh):
        sides = {"named": named, "plain": Plain(cfg, mesh, ids_np)}
        result["params"] = {k: C.count_params(eqx.filter(s.model, eqx.is_array)) for k, s in sides.items()}

        print("compile (lower + compile), alternating:", flush=True)
        lower_t = {k: [] for k in sides}
        compile_t = {k: [] for k in sides}
        compiled = {}
        for _ in range(args.compile_repeats):
            for k, s in sides.items():
                lo, co, compiled[k] = lower_compile(s)
                lower_t[k].append(lo)
                compile_t[k].append(co)
                print(f"  {k}: lower {lo:.2f}s compile {co:.2f}s", flush=True)
        hlo = {k: C.hlo_stats(c.as_text()) for k, c in compiled.items()}
        memory = {k: C.memory_stats(c) for k, c in compiled.items()}

        for s in sides.values():  # the call path compiles again (untimed), then warms up
            for _ in range(args.warmup):
                s.run()
        print("steps, alternating:", flush=True)
        times, cpu = C.alternate({k: s.run for k, s in sides.items()}, args.rounds, args.per_round)
        if args.profile:
            jax.profiler.start_trace(args.profile)
            for _ in range(3):
                for s in sides.values():
                    s.run()
            jax.profiler.stop_trace()

    total = {k: [a + b for a, b in zip(lower_t[k], compile_t[k])] for k in sides}
    step = {k: C.summary(v) for k, v in times.items()}
    per_round = [
        statistics.median(times["named"][i : i + args.per_round])
        / statistics.median(times["plain"][i : i + args.per_round])
        for i in range(0, len(times["named"]), args.per_round)
    ]
    result.update(
        {
            "step": step,
            "step_ratio_named_over_plain": step["named"]["median_s"] / step["plain"]["median_s"],
            "step_ratio_min_named_over_plain": step["named"]["min_s"] / step["plain"]["min_s"],
            "step_cpu": {k: C.summary(v) for k, v in cpu.items()},
            "step_cpu_ratio_named_over_plain": statistics.median(cpu["named"]) / statistics.median(cpu["plain"]),
            "step_ratio_per_round": [round(r, 4) for r in per_round],
            "step_ratio_median_of_rounds": statistics.median(per_round),
            "lower_s": {k: C.summary(v) for k, v in lower_t.items()},
            "compile_s": {k: C.summary(v) for k, v in compile_t.items()},
            "lower_plus_compile_s": {k: C.summary(v) for k, v in total.items()},
            "compile_ratio_named_over_plain": statistics.median(total["named"]) / statistics.median(total["plain"]),
            "losses_first_and_last": {k: [s.losses[0], s.losses[-1]] for k, s in sides.items()},
            "hlo": {k: {kk: v for kk, v in h.items() if kk != "opcodes"} for k, h in hlo.items()},
            "hlo_opcode_difference_named_minus_plain": {
                op: hlo["named"]["opcodes"].get(op, 0) - hlo["plain"]["opcodes"].get(op, 0)
                for op in sorted(set(hlo["named"]["opcodes"]) | set(hlo["plain"]["opcodes"]))
                if hlo["named"]["opcodes"].get(op, 0) != hlo["plain"]["opcodes"].get(op, 0)
            },
            "memory": memory,
            "goal": "step_ratio_named_over_plain <= 1.00",
        }
    )
    print(
        f"step median: named {step['named']['median_s']:.4f}s plain {step['plain']['median_s']:.4f}s "
        f"ratio {result['step_ratio_named_over_plain']:.3f} (CPU time ratio "
        f"{result['step_cpu_ratio_named_over_plain']:.3f}); "
        f"compile ratio {result['compile_ratio_named_over_plain']:.3f}"
    )
    print(
        "collectives:", {k: {c: v["count"] for c, v in h["collectives"].items() if v["count"]} for k, h in hlo.items()}
    )
    print("opcode difference (named - plain):", result["hlo_opcode_difference_named_minus_plain"])
    C.write_result(f"overhead_{args.dtype}" + ("_tiny" if args.tiny else ""), result, args.out)
    return result


if __name__ == "__main__":
    main()
