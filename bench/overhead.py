"""Library overhead: the same FSDP GPT-2 train step written with `named` and in plain JAX + Equinox.

    .venv/bin/python bench/overhead.py                 # the issue-9 configuration, f32
    .venv/bin/python bench/overhead.py --dtype bf16    # f32 params, bf16 compute
    .venv/bin/python bench/overhead.py --tiny          # seconds; what the smoke test runs

Side A is ``models.Gpt2LMHeadModel`` with a ``named_jit`` step (parameter mapping
``{"embed": "data"}``, compute mapping ``{"batch": "data"}``); side B is
``bench/reference_gpt2.py`` with hand-written PartitionSpecs and ``with_sharding_constraint``
on every activation it creates. Both use ``optax.adamw`` (no mask, no clipping), donate the
model and optimizer state, and run on 8 fake CPU devices.

Compile time is ``lower`` (tracing, ours included) plus ``compile`` (XLA), measured after
``jax.clear_caches()`` and taking turns. Step time is taken A B A B ... in rounds; medians
and their ratio (named / plain) are reported, together with opcode and collective counts of
both optimized HLO modules, which is where a real difference in the program would show.
"""

from __future__ import annotations

import _common as C  # sets XLA_FLAGS before jax is imported

import argparse
import statistics
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import named as nm
import reference_gpt2 as ref
from named.models import Gpt2Config, Gpt2LMHeadModel

TINY = dict(n_layer=2, n_head=2, n_embd=64, n_positions=32, vocab_size=256)


class Side:
    """One implementation: its jitted step, its state, and how to lower it."""

    def __init__(self, name, step, model, opt_state, ids):
        self.name, self.step, self.model, self.opt_state, self.ids = name, step, model, opt_state, ids
        self.losses: list[float] = []

    def run(self):
        loss, self.model, self.opt_state = self.step(self.model, self.opt_state, self.ids)
        C.block((loss, self.model, self.opt_state))
        return loss

    def lower_compile(self):
        jax.clear_caches()
        t0 = time.perf_counter()
        lowered = self.step.lower(self.model, self.opt_state, self.ids)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, compiled


def token_ids(cfg: dict, batch: int, seq: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, cfg["vocab_size"], size=(batch, seq), dtype=np.int32)


def build_named(cfg: dict, mesh, ids_np: np.ndarray, dtype: str, optimizer) -> Side:
    config = Gpt2Config(**cfg)
    model = nm.named_jit(lambda k: Gpt2LMHeadModel.init(config, key=k), mapping=C.PARAM_MAPPING)(jax.random.key(0))
    opt_state = nm.named_jit(optimizer.init, mapping=C.PARAM_MAPPING)(model)
    axes = (nm.Axis("batch", ids_np.shape[0]), nm.Axis("position", ids_np.shape[1]))
    ids = nm.shard(nm.named(jnp.asarray(ids_np), axes), C.COMPUTE_MAPPING, mesh)
    return Side("named", C.named_train_step(config, optimizer, dtype=dtype), model, opt_state, ids)


def build_plain(cfg: dict, mesh, ids_np: np.ndarray, dtype: str, optimizer) -> Side:
    model = ref.sharded_init(mesh, jax.random.key(0), **cfg)
    opt_state = ref.init_optimizer(optimizer, model, mesh)
    ids = jax.device_put(jnp.asarray(ids_np), NamedSharding(mesh, P(ref.DATA, None)))
    compute_dtype = jnp.bfloat16 if dtype == "bf16" else jnp.float32
    step = ref.make_train_step(optimizer, mesh, model, opt_state, compute_dtype=compute_dtype)
    return Side("plain", step, model, opt_state, ids)


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

    cfg, batch, seq = (dict(TINY), 8, 32) if args.tiny else (dict(C.SMALL_GPT2), C.BATCH, C.SEQ)
    if args.tiny:
        args.rounds, args.per_round, args.warmup, args.compile_repeats = 1, 1, 1, 1
    mesh = nm.make_mesh(C.MESH)
    optimizer = optax.adamw(C.LEARNING_RATE)
    ids_np = token_ids(cfg, batch, seq)
    result = {"benchmark": "overhead", "command": C.command_line(), "machine": C.machine(),
              "config": {**cfg, "seq": seq, "batch": batch, "dtype": args.dtype, "mesh": C.MESH,
                         "param_mapping": C.PARAM_MAPPING, "compute_mapping": C.COMPUTE_MAPPING,
                         "optimizer": f"optax.adamw({C.LEARNING_RATE})", "layers_run_with": "scan (Stacked / lax.scan)"}}
    with jax.set_mesh(mesh):
        sides = {"named": build_named(cfg, mesh, ids_np, args.dtype, optimizer),
                 "plain": build_plain(cfg, mesh, ids_np, args.dtype, optimizer)}
        result["params"] = {k: C.count_params(eqx.filter(s.model, eqx.is_array)) for k, s in sides.items()}

        print("compile (lower + compile), alternating:", flush=True)
        lower_t = {k: [] for k in sides}
        compile_t = {k: [] for k in sides}
        compiled = {}
        for _ in range(args.compile_repeats):
            for k, s in sides.items():
                lo, co, compiled[k] = s.lower_compile()
                lower_t[k].append(lo)
                compile_t[k].append(co)
                print(f"  {k}: lower {lo:.2f}s compile {co:.2f}s", flush=True)
        hlo = {k: C.hlo_stats(c.as_text()) for k, c in compiled.items()}
        memory = {k: C.memory_stats(c) for k, c in compiled.items()}

        for k, s in sides.items():  # the call path compiles again (untimed), then warms up
            for _ in range(args.warmup):
                s.losses.append(float(s.run()))
        print("steps, alternating:", flush=True)
        times, cpu = C.alternate({k: s.run for k, s in sides.items()}, args.rounds, args.per_round)
        if args.profile:
            jax.profiler.start_trace(args.profile)
            for _ in range(3):
                for s in sides.values():
                    s.run()
            jax.profiler.stop_trace()
        for s in sides.values():
            s.losses.append(float(s.run()))

    total = {k: [a + b for a, b in zip(lower_t[k], compile_t[k])] for k in sides}
    step = {k: C.summary(v) for k, v in times.items()}
    per_round = [statistics.median(times["named"][i:i + args.per_round]) / statistics.median(times["plain"][i:i + args.per_round])
                 for i in range(0, len(times["named"]), args.per_round)]
    result.update({
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
            if hlo["named"]["opcodes"].get(op, 0) != hlo["plain"]["opcodes"].get(op, 0)},
        "memory": memory,
        "goal": "step_ratio_named_over_plain <= 1.00",
    })
    print(f"step median: named {step['named']['median_s']:.4f}s plain {step['plain']['median_s']:.4f}s "
          f"ratio {result['step_ratio_named_over_plain']:.3f} (CPU time ratio {result['step_cpu_ratio_named_over_plain']:.3f}); "
          f"compile ratio {result['compile_ratio_named_over_plain']:.3f}")
    print("collectives:", {k: {c: v['count'] for c, v in h['collectives'].items() if v['count']} for k, h in hlo.items()})
    print("opcode difference (named - plain):", result["hlo_opcode_difference_named_minus_plain"])
    C.write_result(f"overhead_{args.dtype}" + ("_tiny" if args.tiny else ""), result, args.out)
    return result


if __name__ == "__main__":
    main()
