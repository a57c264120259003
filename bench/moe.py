"""The MoE layer's train step (forward and backward) on 8 fake CPU devices, sides taking turns.

    .venv/bin/python bench/moe.py              # 4096 tokens of width 256, 8 experts of 512, top-2
    .venv/bin/python bench/moe.py --tiny       # seconds; what the smoke test runs

Two comparisons, each in its own alternating run (A B A B ..., medians):

- dispatch: dropless (tokens sorted by expert, ``jax.lax.ragged_dot``) against the dense
  reference (every expert on every token, weighted by the router), experts replicated and
  tokens split over the 8 devices (``{batch: data}``);
- placement: expert parallelism (``experts: expert``, tokens sent by all-to-all; auto and
  explicit mode) against replicated experts, both dropless, tokens split over the 8 devices.

Each side is one ``named_jit`` step: the MoE layer's output and router losses, their gradient
with respect to the layer and the tokens. Collective counts come from the optimized HLO.
"""

from __future__ import annotations

import _common as C  # sets XLA_FLAGS before jax is imported

import argparse
import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp

import named as nm
from named import nn

FULL = dict(embed=256, mlp=512, experts=8, top_k=2, batch=16, seq=256)
TINY = dict(embed=32, mlp=48, experts=8, top_k=2, batch=8, seq=16)


def _objective(moe, x):
    y, losses = moe(x)
    return jnp.mean(jnp.square(y.array)) + 0.01 * losses["load_balancing"] + 0.001 * losses["router_z"]


def _side(moe, x, mesh, compute, param):
    with nm.set_mesh(mesh), nm.axis_mapping(compute):
        moe, x = nm.shard(moe, param), nm.shard(x, compute)
        step = nm.named_jit(eqx.filter_value_and_grad(_objective), mapping=compute)
        compiled = step.lower(moe, x).compile()
        hlo = C.hlo_stats(compiled.as_text())["collectives"]

    def run():
        with nm.set_mesh(mesh):
            C.block(step(moe, x))

    run()  # compiled, warm
    return run, {k: v["count"] for k, v in hlo.items() if v["count"]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--per-round", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    s = TINY if args.tiny else FULL
    rounds, per_round = (2, 1) if args.tiny else (args.rounds, args.per_round)
    Embed, Mlp, Experts = nm.Axis("embed", s["embed"]), nm.Axis("mlp", s["mlp"]), nm.Axis("experts", s["experts"])
    moe = nn.MoE.init(Embed, Mlp, Experts, s["top_k"], key=jax.random.key(0))
    x = nm.random.normal(jax.random.key(1), (nm.Axis("batch", s["batch"]), nm.Axis("position", s["seq"]), Embed))

    dp = nm.make_mesh({"data": 8})
    ep = nm.make_mesh({"expert": 8})
    sides = {
        "dispatch": {
            "dropless": (moe, dp, {"batch": "data"}, {}),
            "dense": (dataclasses.replace(moe, dispatch="dense"), dp, {"batch": "data"}, {}),
        },
        "placement": {
            "replicated experts": (moe, ep, {"batch": "expert"}, {}),
            "EP auto": (moe, ep, {"batch": "expert", "experts": "expert"}, {"experts": "expert"}),
            "EP explicit": (dataclasses.replace(moe, parallel="explicit"), ep, {"batch": "expert", "experts": "expert"},
                            {"experts": "expert"}),
        },
    }
    result = {"machine": C.machine(), "command": C.command_line(), "settings": s, "comparisons": {}}
    for comparison, cases in sides.items():
        runs, collectives = {}, {}
        for name, (m, mesh, compute, param) in cases.items():
            runs[name], collectives[name] = _side(m, x, mesh, compute, param)
        print(f"{comparison}:", flush=True)
        wall, cpu = C.alternate(runs, rounds, per_round)
        result["comparisons"][comparison] = {
            name: {"wall": C.summary(wall[name]), "cpu": C.summary(cpu[name]), "collectives": collectives[name]}
            for name in cases}
    tokens = s["batch"] * s["seq"]
    print(f"\n{tokens} tokens, embed {s['embed']}, {s['experts']} experts of {s['mlp']}, top-{s['top_k']}; "
          "median step time (forward + backward), 8 CPU devices")
    print("| comparison | side | wall (ms) | CPU (ms) | collectives |\n|---|---|---|---|---|")
    for comparison, cases in result["comparisons"].items():
        for name, r in cases.items():
            coll = ", ".join(f"{k} {v}" for k, v in r["collectives"].items()) or "none"
            print(f"| {comparison} | {name} | {1e3 * r['wall']['median_s']:.1f} | {1e3 * r['cpu']['median_s']:.1f} | "
                  f"{coll} |")
    C.write_result("moe_tiny" if args.tiny else "moe", result, args.out)
    return result


if __name__ == "__main__":
    main()
