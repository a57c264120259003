"""The trainer's step on a mixture-of-experts model, on 8 fake CPU devices, sides taking turns.

    .venv/bin/python bench/moe.py              # Mixtral-style, 2 layers, width 256, 8 experts of 512, top-2
    .venv/bin/python bench/moe.py --tiny       # seconds; what the smoke test runs

Every side is the step ``named-train`` runs (``train.make_train_step`` through
``_common.TrainerStep``: the next-token loss plus the router's load-balancing and z-losses,
clipping, AdamW, the finite checks) on a small Mixtral (``config/mixtral_tiny.yaml`` with the
sizes below: each layer's MLP is an ``nn.MoE``), 4096 tokens a step (batch 16 × seq 256). Two
comparisons, each in its own alternating run (A B A B ..., medians):

- dispatch: ``model.moe_dispatch`` dropless (tokens sorted by expert, ``jax.lax.ragged_dot``)
  against dense (every expert on every token, weighted by the router), parameters replicated and
  tokens split over the 8 devices (``{batch: data}``);
- placement: expert parallelism (``experts: expert`` in both mappings, tokens sent by all-to-all;
  ``model.expert_parallel`` auto and explicit) against replicated experts, both dropless, tokens
  split over the 8 devices.

Collective counts come from the optimized HLO of each step.
"""

from __future__ import annotations

import argparse

import _common as C  # sets XLA_FLAGS before jax is imported
import numpy as np

FULL = dict(embed=256, mlp=512, experts=8, top_k=2, layers=2, heads=4, kv_heads=2, vocab=512, batch=16, seq=256)
TINY = dict(embed=32, mlp=48, experts=8, top_k=2, layers=1, heads=2, kv_heads=1, vocab=384, batch=8, seq=16)
DATA, EXPERT = {"data": 8}, {"expert": 8}
# name -> (mesh, compute mapping, parameter mapping, model fields beside the sizes)
SIDES = {
    "dispatch": {
        "dropless": (DATA, {"batch": "data"}, {}, {}),
        "dense": (DATA, {"batch": "data"}, {}, {"moe_dispatch": "dense"}),
    },
    "placement": {
        "replicated experts": (EXPERT, {"batch": "expert"}, {}, {}),
        "EP auto": (EXPERT, {"batch": "expert", "experts": "expert"}, {"experts": "expert"}, {}),
        "EP explicit": (
            EXPERT,
            {"batch": "expert", "experts": "expert"},
            {"experts": "expert"},
            {"expert_parallel": "explicit"},
        ),
    },
}


def model_fields(s: dict) -> dict:
    return {
        "hidden_size": s["embed"],
        "intermediate_size": s["mlp"],
        "num_hidden_layers": s["layers"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"],
        "max_position_embeddings": s["seq"],
        "num_experts": s["experts"],
        "num_experts_per_tok": s["top_k"],
        "vocab_size": s["vocab"],
        "router_aux_loss_coef": 0.01,
        "router_z_loss_coef": 0.001,
    }


def _side(s: dict, ids: np.ndarray, mesh, compute_mapping, param_mapping, model) -> tuple[C.TrainerStep, dict]:
    cfg = C.step_config(
        {**model_fields(s), **model},
        batch=s["batch"],
        seq=s["seq"],
        base="mixtral_tiny.yaml",
        mesh=mesh,
        compute_mapping=compute_mapping,
        param_mapping=param_mapping,
    )
    step = C.TrainerStep(cfg, ids, segments=False)
    hlo = C.hlo_stats(step.compile().as_text())["collectives"]
    step.run()  # compiled, warm
    return step, {k: v["count"] for k, v in hlo.items() if v["count"]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--per-round", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    s = TINY if args.tiny else FULL
    rounds, per_round = (2, 1) if args.tiny else (args.rounds, args.per_round)
    ids = np.random.default_rng(0).integers(0, s["vocab"], size=(s["batch"], s["seq"]), dtype=np.int32)
    result = {
        "benchmark": "moe",
        "machine": C.machine(),
        "command": C.command_line(),
        "settings": s,
        "step": "train.make_train_step on config/mixtral_tiny.yaml with these sizes",
        "optimizer": C.OPTIMIZER,
        "comparisons": {},
    }
    for comparison, cases in SIDES.items():
        steps, collectives = {}, {}
        for name, case in cases.items():
            steps[name], collectives[name] = _side(s, ids, *case)
        print(f"{comparison}:", flush=True)
        wall, cpu = C.alternate({name: step.run for name, step in steps.items()}, rounds, per_round)
        result["comparisons"][comparison] = {
            name: {
                "wall": C.summary(wall[name]),
                "cpu": C.summary(cpu[name]),
                "collectives": collectives[name],
                "losses_first_and_last": [steps[name].losses[0], steps[name].losses[-1]],
            }
            for name in cases
        }
        del steps
    tokens = s["batch"] * s["seq"]
    print(
        f"\n{tokens} tokens, {s['layers']} layers of width {s['embed']}, {s['experts']} experts of {s['mlp']}, "
        f"top-{s['top_k']}; median train step, 8 CPU devices"
    )
    print("| comparison | side | wall (ms) | CPU (ms) | collectives |\n|---|---|---|---|---|")
    for comparison, cases in result["comparisons"].items():
        for name, r in cases.items():
            coll = ", ".join(f"{k} {v}" for k, v in r["collectives"].items()) or "none"
            print(
                f"| {comparison} | {name} | {1e3 * r['wall']['median_s']:.1f} "
                f"| {1e3 * r['cpu']['median_s']:.1f} | {coll} |"
            )
    C.write_result("moe_tiny" if args.tiny else "moe", result, args.out)
    return result


if __name__ == "__main__":
    main()
