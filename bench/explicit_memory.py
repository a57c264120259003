"""Per-device peak memory and collectives of the trainer's FSDP step, ``mesh.mode`` explicit
against auto, on 8 CPU devices.

    nice -n 19 .venv/bin/python bench/explicit_memory.py
    .venv/bin/python bench/explicit_memory.py --tiny

The step is the one ``named-train`` runs (``plan.train_step_report``: forward, backward,
AdamW, state donated), compiled on abstract inputs and never run; the peak is XLA's buffer
assignment (``arguments + outputs + temporaries - aliased``). ``16·N/8`` is the f32 training
state (parameters, gradients, two Adam moments) split over the 8 devices: the FSDP ideal
before activations and one layer's gathered weights.
"""

from __future__ import annotations

import _common as C  # sets XLA_FLAGS before jax is imported

import argparse

from named.trainer.config import load_config
from named.trainer.plan import train_step_report

GPT2_124M = {"model.n_layer": 12, "model.n_head": 12, "model.n_embd": 768, "model.n_positions": 1024,
             "model.vocab_size": 50304, "data.seq_len": 1024}
TINY = {"model.n_layer": 2, "model.n_head": 2, "model.n_embd": 64, "model.n_positions": 64,
        "model.vocab_size": 384, "data.seq_len": 32}


def measure(model: dict, remat: str, mode: str) -> dict:
    over = {**model, "model.remat": remat, "mesh.mode": mode, "mesh.shape": "{data: 8}",
            "mesh.param_mapping": "{embed: data}", "mesh.compute_mapping": "{batch: data}",
            "trainer.train_batch_size": 8, "trainer.microbatches": 1, "trainer.sample_interval": 0,
            "trainer.precision": "params=float32,compute=float32,output=float32"}
    cfg = load_config(C.ROOT / "config" / "gpt2_small.yaml", [x for k, v in over.items() for x in (f"--{k}", str(v))])
    rep = train_step_report(cfg)
    return {"peak_bytes": rep.peak_bytes, "memory": rep.memory,
            "collectives": [dict(zip(("kind", "mesh_axes", "count", "bytes", "sent", "in_loop"), row)) for row in rep.summary()]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model, for the smoke test")
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    args = ap.parse_args(argv)
    model = TINY if args.tiny else GPT2_124M
    from named.models import Gpt2Config, num_params

    n = num_params(Gpt2Config(n_layer=model["model.n_layer"], n_head=model["model.n_head"], n_embd=model["model.n_embd"],
                              n_positions=model["model.n_positions"], vocab_size=model["model.vocab_size"]))
    ideal = 16 * n / 8
    rows = {}
    for remat in ("none", "full"):
        by_mode = {mode: measure(model, remat, mode) for mode in ("auto", "explicit")}
        ratio = by_mode["explicit"]["peak_bytes"] / by_mode["auto"]["peak_bytes"]
        rows[f"remat_{remat}"] = {**by_mode, "explicit_over_auto": ratio,
                                  "explicit_over_ideal": by_mode["explicit"]["peak_bytes"] / ideal,
                                  "auto_over_ideal": by_mode["auto"]["peak_bytes"] / ideal}
        print(f"remat {remat}: peak per device auto {by_mode['auto']['peak_bytes'] / 2**20:.1f} MiB, explicit "
              f"{by_mode['explicit']['peak_bytes'] / 2**20:.1f} MiB (explicit/auto {ratio:.3f}); "
              f"16N/8 = {ideal / 2**20:.1f} MiB")
    name = "explicit_memory_tiny" if args.tiny else "explicit_memory"
    C.write_result(name, {"command": C.command_line(), "machine": C.machine(), "params": n, "ideal_bytes": ideal,
                          "batch": 8, "seq": model["data.seq_len"], "rows": rows}, args.out)


if __name__ == "__main__":
    main()
