"""Per-device peak memory, collectives and step time of the trainer's FSDP step, ``mesh.mode``
explicit against auto, on 8 CPU devices.

    nice -n 5 .venv/bin/python bench/explicit_memory.py
    .venv/bin/python bench/explicit_memory.py --tiny

Memory: the step ``named-train`` runs (``plan.train_step_report``: forward, backward, AdamW,
state donated), compiled on abstract inputs and never run, for GPT-2 124M and for a 48-layer,
512-wide GPT-2, with the full-vocabulary loss and with ``trainer.loss_block_size`` (no full
logits); the peak is XLA's buffer assignment (``arguments + outputs + temporaries -
aliased``). ``16·N/8`` is the f32 training state (parameters, gradients, two Adam moments)
split over the 8 devices: the FSDP ideal before activations and gathered weights. ``layer`` is
one layer's working set in explicit mode: two layers' gathered f32 weights (the prefetch) and
one layer's activations (``plan.activation_bytes`` without remat, per layer).

Step time: the same train step (``train.make_train_step``) run on a small GPT-2, explicit and
auto taking turns in one process (``_common.alternate``), with remat full (the same
recomputation in both modes) and none (explicit mode still recomputes each layer).
"""

from __future__ import annotations

import argparse

import _common as C  # sets XLA_FLAGS before jax is imported
import numpy as np

GPT2_124M = {
    "model.n_layer": 12,
    "model.n_head": 12,
    "model.n_embd": 768,
    "model.n_positions": 1024,
    "model.vocab_size": 50304,
    "data.seq_len": 1024,
}
# trainer.loss_block_size for the rows without full logits: 16 blocks of GPT-2's vocabulary
LOSS_BLOCK = {50304: 3144, 384: 96}
# 48 layers at GPT-2's vocabulary and sequence; width 512 keeps each compile to a couple of minutes
# on 2 cores (the scan compiles one layer whatever the depth; the width sets the buffer sizes).
DEEP_48 = {**GPT2_124M, "model.n_layer": 48, "model.n_head": 8, "model.n_embd": 512}
# A step of about a second on 2 CPU cores: long enough to time, short enough for many rounds.
STEP_GPT2 = {
    "model.n_layer": 6,
    "model.n_head": 4,
    "model.n_embd": 256,
    "model.n_positions": 256,
    "model.vocab_size": 8192,
    "data.seq_len": 256,
}
TINY = {
    "model.n_layer": 2,
    "model.n_head": 2,
    "model.n_embd": 64,
    "model.n_positions": 64,
    "model.vocab_size": 384,
    "data.seq_len": 32,
}
BATCH = 8
MODES = ("auto", "explicit")


def config(model: dict, remat: str, mode: str, loss_block: int | None = None):
    over = {
        **model,
        "model.remat": remat,
        "mesh.mode": mode,
        "mesh.shape": "{data: 8}",
        "trainer.loss_block_size": "null" if loss_block is None else loss_block,
        "mesh.param_mapping": "{embed: data}",
        "mesh.compute_mapping": "{batch: data}",
        "trainer.train_batch_size": BATCH,
        "trainer.microbatches": 1,
        "trainer.sample_interval": 0,
        "trainer.precision": "params=float32,compute=float32,output=float32",
    }
    return C.trainer_config("gpt2_small.yaml", over)


def measure(model: dict, remat: str, mode: str, loss_block: int | None) -> dict:
    from named.trainer.commands.plan import train_step_report

    rep = train_step_report(config(model, remat, mode, loss_block))
    return {
        "peak_bytes": rep.peak_bytes,
        "memory": rep.memory,
        "collectives": [
            dict(zip(("kind", "mesh_axes", "count", "bytes", "sent", "in_loop"), row)) for row in rep.summary()
        ],
    }


def memory_table(model: dict, settings: list[tuple[int | None, str]] | None = None) -> dict:
    """Rows for each (loss block, remat) of ``settings``; by default both loss heads by both remats."""
    from named.trainer.commands.plan import activation_bytes
    from named.trainer.loop.checks import checked_setup

    cfg = config(model, "none", "explicit")
    s = checked_setup(cfg)
    n = C.count_params(s.shapes)
    layers = model["model.n_layer"]
    ideal = 16 * n / 8
    layer = 2 * 4 * C.count_params(s.shapes.blocks) / layers + activation_bytes(cfg, s) / layers
    rows = {}
    if settings is None:
        settings = [(b, r) for b in (None, LOSS_BLOCK[model["model.vocab_size"]]) for r in ("none", "full")]
    for block, remat in settings:
        by_mode = {mode: measure(model, remat, mode, block) for mode in MODES}
        peak = {mode: by_mode[mode]["peak_bytes"] for mode in MODES}
        rows[f"remat_{remat}" + ("" if block is None else "_loss_blocks")] = {
            **by_mode,
            "loss_block_size": block,
            "explicit_over_auto": peak["explicit"] / peak["auto"],
            "explicit_over_ideal": peak["explicit"] / ideal,
            "auto_over_ideal": peak["auto"] / ideal,
            "explicit_over_ideal_plus_layer": peak["explicit"] / (ideal + layer),
        }
        print(
            f"{layers} layers, remat {remat}, loss_block_size {block}: peak "
            f"per device auto {peak['auto'] / 2**20:.1f} MiB, explicit "
            f"{peak['explicit'] / 2**20:.1f} MiB (explicit/auto {peak['explicit'] / peak['auto']:.3f}); "
            f"16N/8 = {ideal / 2**20:.1f} MiB, + one layer {(ideal + layer) / 2**20:.1f} MiB",
            flush=True,
        )
    return {"params": n, "ideal_bytes": ideal, "layer_bytes": layer, "seq": model["data.seq_len"], "rows": rows}


def step_times(model: dict, rounds: int, per_round: int, warmup: int, remats=("full", "none")) -> dict:
    import jax

    import named as nm

    ids = np.random.default_rng(0).integers(
        0, model["model.vocab_size"], (BATCH, model["data.seq_len"]), dtype=np.int32
    )
    out = {}
    for remat in remats:
        sides = {mode: C.TrainerStep(config(model, remat, mode), ids) for mode in ("explicit", "auto")}
        with nm.set_mesh(sides["auto"].mesh):
            for side in sides.values():
                for _ in range(warmup):  # the first call compiles
                    side.run()
            print(f"step time, remat {remat}:", flush=True)
            wall, cpu = C.alternate({m: s.run for m, s in sides.items()}, rounds, per_round)
        out[f"remat_{remat}"] = {
            "wall": {m: C.summary(v) for m, v in wall.items()},
            "cpu": {m: C.summary(v) for m, v in cpu.items()},
            "explicit_over_auto_wall": C.summary(wall["explicit"])["median_s"] / C.summary(wall["auto"])["median_s"],
            "explicit_over_auto_cpu": C.summary(cpu["explicit"])["median_s"] / C.summary(cpu["auto"])["median_s"],
            # the same init and tokens: the two modes' losses agree to rounding, step for step
            "losses": {m: s.losses for m, s in sides.items()},
        }
        r = out[f"remat_{remat}"]
        print(
            f"  explicit/auto wall {r['explicit_over_auto_wall']:.3f}, cpu {r['explicit_over_auto_cpu']:.3f}",
            flush=True,
        )
        del sides
        jax.clear_caches()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--tiny",
        action="store_true",
        help="a 2-layer model, two of the four memory rows, remat none timed once (the smoke test)",
    )
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--per-round", type=int, default=2)
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.rounds, args.per_round = 1, 1
    main_model, deep, step_model = (TINY, None, TINY) if args.tiny else (GPT2_124M, DEEP_48, STEP_GPT2)
    # the smoke test takes each loss head and each remat once (4 compiles, not 8) and times one remat
    settings = [(None, "none"), (LOSS_BLOCK[TINY["model.vocab_size"]], "full")] if args.tiny else None
    remats = ("none",) if args.tiny else ("full", "none")
    result = {"command": C.command_line(), "machine": C.machine(), "batch": BATCH}
    first = memory_table(main_model, settings)
    result.update({k: first[k] for k in ("params", "ideal_bytes", "layer_bytes", "seq", "rows")})
    if deep is not None:  # the same measurement as the first: the smoke test skips it
        result["deep"] = memory_table(deep)
    result["step_time"] = {
        "model": step_model,
        "batch": BATCH,
        "rounds": args.rounds,
        "per_round": args.per_round,
        **step_times(step_model, args.rounds, args.per_round, warmup=2, remats=remats),
    }
    C.write_result("explicit_memory_tiny" if args.tiny else "explicit_memory", result, args.out)


if __name__ == "__main__":
    main()
