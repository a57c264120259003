"""Compile time of the FSDP GPT-2 train step against depth (layers stacked with ``nn.Stacked``).

    .venv/bin/python bench/compile_depth.py                    # depths 2 4 8 32 48
    .venv/bin/python bench/compile_depth.py --depths 2 4 --repeats 1

Each measurement is ``lower`` (tracing and StableHLO) plus ``compile`` (XLA) of the step
``named-train`` runs (``train.make_train_step``: forward, backward, clipping, AdamW, the finite
checks) after ``jax.clear_caches()``, on abstract inputs laid out by the FSDP mappings
(``plan.abstract_train_step``), so nothing is initialised. Depths take turns
within each repeat; the median per depth is reported. ``Stacked`` runs the blocks with
``scan``, so the program holds one block whatever the depth: the goal is 48-layer / 4-layer
≤ 1.3.
"""

from __future__ import annotations

import argparse

import _common as C  # sets XLA_FLAGS before jax is imported


def measure(depth: int, cfg: dict, batch: int, seq: int, remat: str) -> tuple[float, float, int, dict]:
    step = C.compile_trainer_step(C.step_config({**cfg, "n_layer": depth, "remat": remat}, batch=batch, seq=seq))
    hlo = C.hlo_stats(step["compiled"].as_text())
    program = {"instructions": hlo["total_instructions"], "while_loops": hlo["opcodes"].get("while", 0)}
    return step["lower_s"], step["compile_s"], step["params"], program


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depths", type=int, nargs="+", default=[2, 4, 8, 32, 48])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--remat", default="none", help="Stacked remat policy (none, full, save_dots, ...)")
    ap.add_argument("--tiny", action="store_true", help="depths 2 and 4 of a 64-wide model, once (smoke test)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    cfg, batch, seq = dict(C.SMALL_GPT2), C.BATCH, C.SEQ
    if args.tiny:
        cfg, batch, seq = dict(n_layer=2, n_head=2, n_embd=64, n_positions=32, vocab_size=384), 8, 32
        args.depths, args.repeats = [2, 4], 1
    lower = {d: [] for d in args.depths}
    comp = {d: [] for d in args.depths}
    params, programs = {}, {}
    if not args.tiny:  # untimed: the first compile of a process pays one-off costs
        measure(args.depths[0], cfg, batch, seq, args.remat)
    for r in range(args.repeats):
        for d in args.depths:
            lo, co, params[d], programs[d] = measure(d, cfg, batch, seq, args.remat)
            lower[d].append(lo)
            comp[d].append(co)
            print(f"  repeat {r + 1}: {d:3d} layers  lower {lo:6.2f}s  compile {co:6.2f}s", flush=True)

    rows = []
    for d in args.depths:
        total = [a + b for a, b in zip(lower[d], comp[d])]
        rows.append(
            {
                "layers": d,
                "params": params[d],
                "lower_s": C.summary(lower[d]),
                "compile_s": C.summary(comp[d]),
                "lower_plus_compile_s": C.summary(total),
                "optimized_hlo": programs[d],
            }
        )
    med = {row["layers"]: row["lower_plus_compile_s"]["median_s"] for row in rows}
    result = {
        "benchmark": "compile_depth",
        "command": C.command_line(),
        "machine": C.machine(),
        "config": {
            **cfg,
            "seq": seq,
            "batch": batch,
            "mesh": C.MESH,
            "param_mapping": C.PARAM_MAPPING,
            "compute_mapping": C.COMPUTE_MAPPING,
            "remat": args.remat,
            "dtype": "f32",
            "step": "train.make_train_step (the trainer's loss, clipping, AdamW, finite checks), donated state",
            "optimizer": C.OPTIMIZER,
        },
        "rows": rows,
        "ratios_to_smallest_reference": {},
        "goal": "lower_plus_compile(48) / lower_plus_compile(4) <= 1.3",
    }
    base = 4 if 4 in med else min(med)
    result["ratios_to_smallest_reference"] = {str(d): med[d] / med[base] for d in med}
    result["reference_depth"] = base
    if 48 in med and 4 in med:
        result["ratio_48_over_4"] = med[48] / med[4]
    for row in rows:
        print(
            f"{row['layers']:3d} layers: lower+compile median {row['lower_plus_compile_s']['median_s']:.2f}s "
            f"(x{med[row['layers']] / med[base]:.2f} of {base} layers)"
        )
    C.write_result("compile_depth" + ("_tiny" if args.tiny else ""), result, args.out)
    return result


if __name__ == "__main__":
    main()
