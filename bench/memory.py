"""Compiled per-device memory of the FSDP train step on 8 devices, against 16·N/8 bytes.

    .venv/bin/python bench/memory.py
    .venv/bin/python bench/memory.py --tiny

For each configuration the step ``named-train`` runs (``train.make_train_step``: forward,
backward, clipping, AdamW, the finite checks; model and optimizer state donated) is compiled on
abstract inputs laid out by the FSDP mappings (``plan.abstract_train_step``), and XLA's memory
analysis gives the per-device peak:

    peak = temp + argument + output − alias          (bytes, one device)

``16·N/8`` is the floor for f32 training state: parameters, gradients and two Adam moments
(4 × 4 bytes per parameter) split over 8 devices. Arguments (parameters + moments + the batch)
come in at 12·N/8 and, donated, alias the outputs; the gradients (4·N/8) and everything else
(activations kept for the backward pass, the all-gathered weights of the layer being computed,
logits) are in ``temp``. So ``peak / (16·N/8) − 1`` is what activations and gathered weights
cost on top of the state. ``state_ratio`` = (argument + output − alias) / (12·N/8) checks the
state alone is split without replication.
"""

from __future__ import annotations

import argparse
import math

import _common as C  # sets XLA_FLAGS before jax is imported

# name -> (model config, batch, seq, remat, loss[, mesh.gather[, compute dtype]]; "auto" and "f32" when left out)
CONFIGS = {
    "gpt2_4L_256_issue": (dict(C.SMALL_GPT2), C.BATCH, C.SEQ, "none", "full"),
    "gpt2_4L_256_issue_remat_blockwise": (dict(C.SMALL_GPT2), C.BATCH, C.SEQ, "full", "blockwise"),
    "gpt2_48L_512_b8": (
        dict(n_layer=48, n_head=8, n_embd=512, n_positions=256, vocab_size=8192),
        8,
        256,
        "full",
        "blockwise",
    ),
    "gpt2_48L_1024_b8": (
        dict(n_layer=48, n_head=16, n_embd=1024, n_positions=256, vocab_size=8192),
        8,
        256,
        "full",
        "blockwise",
    ),
    # the same with nested remat: every 6th layer's input kept (nn.Remat(every=6), docs/nn.md)
    "gpt2_48L_1024_b8_nested": (
        dict(n_layer=48, n_head=16, n_embd=1024, n_positions=256, vocab_size=8192),
        8,
        256,
        "full every=6",
        "blockwise",
    ),
    # the same with each linear layer's FSDP weight gathered where it is used and its gradient
    # reduce-scattered there (mesh.gather: per_use, nn.gather_per_use)
    "gpt2_48L_1024_b8_nested_per_use": (
        dict(n_layer=48, n_head=16, n_embd=1024, n_positions=256, vocab_size=8192),
        8,
        256,
        "full every=6",
        "blockwise",
        "per_use",
    ),
    # the same computing in bfloat16 (float32 state): each layer's weights cast as the scan reaches it
    "gpt2_48L_1024_b8_nested_per_use_bf16": (
        dict(n_layer=48, n_head=16, n_embd=1024, n_positions=256, vocab_size=8192),
        8,
        256,
        "full every=6",
        "blockwise",
        "per_use",
        "bf16",
    ),
    "gpt2_124M_seq1024_b8": (
        dict(n_layer=12, n_head=12, n_embd=768, n_positions=1024, vocab_size=50304),
        8,
        1024,
        "full",
        "blockwise",
    ),
}
TINY = {"tiny": (dict(n_layer=2, n_head=2, n_embd=64, n_positions=32, vocab_size=384), 8, 32, "none", "full")}


def measure(
    cfg: dict, batch: int, seq: int, remat: str, loss: str, weight_gather: str = "auto", dtype: str = "f32"
) -> dict:
    block = max(d for d in range(1, 1025) if cfg["vocab_size"] % d == 0)  # the largest divisor <= 1024
    over = {"trainer.loss_block_size": block if loss == "blockwise" else "null", "mesh.gather": weight_gather}
    step = C.compile_trainer_step(C.step_config({**cfg, "remat": remat}, batch=batch, seq=seq, dtype=dtype, over=over))
    mem = C.memory_stats(step["compiled"])
    # how the fused loss gathers the FSDP head (nn.blockwise_cross_entropy_loss, gather="auto")
    from named.nn import _fused_loss

    head = cfg["vocab_size"] * cfg["n_embd"] * (4 if dtype == "f32" else 2)  # in the compute dtype
    gather = ("once" if head <= _fused_loss.WHOLE_HEAD_BYTES else "by blocks") if loss == "blockwise" else None
    n = step["params"]
    n_dev = math.prod(C.MESH.values())
    floor = 16 * n / n_dev
    state = mem["argument_size_in_bytes"] + mem["output_size_in_bytes"] - mem["alias_size_in_bytes"]
    return {
        "config": {
            **cfg,
            "batch": batch,
            "seq": seq,
            "remat": remat,
            "loss": loss,
            "loss_block_size": block if loss == "blockwise" else None,
            "head_gather": gather,
            "weight_gather": weight_gather,
            "dtype": dtype,
        },
        "params": n,
        "memory": mem,
        "floor_16N_over_8_bytes": floor,
        "ratio_peak_over_floor": mem["peak_bytes"] / floor,
        "state_ratio": state / (12 * n / n_dev),
        "temp_beyond_grads_bytes": mem["temp_size_in_bytes"] - 4 * n / n_dev,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    configs = TINY if args.tiny else {k: CONFIGS[k] for k in args.configs}
    rows = {}
    for name, spec in configs.items():
        row = rows[name] = measure(*spec)
        m = row["memory"]
        print(
            f"{name}: N={row['params']:,} peak {m['peak_bytes'] / 2**20:.1f} MiB/device "
            f"(temp {m['temp_size_in_bytes'] / 2**20:.1f}, arg {m['argument_size_in_bytes'] / 2**20:.1f}, "
            f"out {m['output_size_in_bytes'] / 2**20:.1f}, alias {m['alias_size_in_bytes'] / 2**20:.1f}); "
            f"16N/8 = {row['floor_16N_over_8_bytes'] / 2**20:.1f} MiB; ratio {row['ratio_peak_over_floor']:.3f}; "
            f"state ratio {row['state_ratio']:.3f}",
            flush=True,
        )
    result = {
        "benchmark": "memory",
        "command": C.command_line(),
        "machine": C.machine(),
        "formula": "peak = temp + argument + output - alias (compiled.memory_analysis(), one device); "
        "floor = 16 * N / 8 (f32 params, grads, Adam mu and nu over 8 devices)",
        "mesh": C.MESH,
        "param_mapping": C.PARAM_MAPPING,
        "compute_mapping": C.COMPUTE_MAPPING,
        "dtype": "float32 state; compute as each row's config says",
        "step": "train.make_train_step (the trainer's loss, clipping, AdamW, finite checks), donated state",
        "rows": rows,
        "goal": "ratio_peak_over_floor <= 1.05",
    }
    C.write_result("memory" + ("_tiny" if args.tiny else ""), result, args.out)
    return result


if __name__ == "__main__":
    main()
