"""Every shipped config trains in ``mesh.mode: explicit`` as it does in ``auto`` (issue 19).

    .venv/bin/python bench/explicit_configs.py
    .venv/bin/python bench/explicit_configs.py --configs gpt2_nano llama_tiny

Each config of ``config/`` (the fine-tuning ones aside: they start from a Hugging Face folder,
and their LoRA runs are covered by tests/test_explicit_train.py) trains 3 steps on its own mesh
and mappings, once per mode, with the model shrunk to 2 layers of width 32 and a byte-level
vocabulary so that every config, 1B ones included, runs on a CPU. The result is each config's
losses in both modes and the largest relative difference between them. The test suite traces
every config's explicit gradient at its real size (``named-plan --mesh.mode explicit``,
tests/test_config_fuzz.py) and trains representative families in both modes for 20 steps
(tests/test_explicit_train.py); this script trains all of them, and takes a few minutes.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import _common as C  # sets XLA_FLAGS before jax is imported
import numpy as np
import yaml

from named.trainer.loop.train import train

STEPS = 3
SHRINK = {
    "gpt2": {"model.n_layer": 2, "model.n_head": 2, "model.n_embd": 32, "model.n_positions": 64},
    "decoder": {
        "model.hidden_size": 32,
        "model.intermediate_size": 48,
        "model.num_hidden_layers": 2,
        "model.max_position_embeddings": 64,
        "model.num_attention_heads": 4,
        "model.num_key_value_heads": 2,
        "model.head_dim": 8,
    },
}


def configs(names: list[str] | None) -> list[Path]:
    paths = sorted(p for p in (C.ROOT / "config").glob("*.yaml") if not p.name.startswith("finetune"))
    if names:
        paths = [p for p in paths if p.stem in names]
        missing = set(names) - {p.stem for p in paths}
        if missing:
            raise SystemExit(f"no such config: {sorted(missing)}")
    return paths


def run(path: Path, mode: str, work: Path) -> list[float]:
    model = yaml.safe_load(path.read_text())["model"]
    over = {
        "trainer.num_train_steps": STEPS,
        "trainer.train_batch_size": 16,
        "trainer.microbatches": 1,
        "trainer.log_interval": 1,
        "trainer.eval_interval": 0,
        "trainer.sample_interval": 0,
        "trainer.progress_bar": "false",
        "trainer.run_dir": str(work / f"{path.stem}-{mode}"),
        "trainer.load_checkpoint": "null",
        "optimizer.warmup_steps": 1,
        # see tests/test_explicit_train.py: GPT-2's key bias has a gradient that is pure rounding
        "optimizer.epsilon": 1e-4,
        "data.train": f"[{work / 'code.txt'}]",
        "data.seq_len": 32,
        "data.tokenizer": "byte",
        "data.val_fraction": 0.05,
        "data.cache_dir": str(work / "cache"),
        "checkpoint.interval": 0,
        "checkpoint.save_at_end": "false",
        "tracker.console": "false",
        "mesh.mode": mode,
        "model.vocab_size": 264,
        **SHRINK["gpt2" if model["type"] == "gpt2" else "decoder"],
    }
    if model.get("moe_intermediate_size"):
        over["model.moe_intermediate_size"] = 24
    return train(C.trainer_config(path.name, over)).losses


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="*", help="config names (default: all but the fine-tuning ones)")
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    args = ap.parse_args(argv)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "code.txt").write_text(
            "\n".join(f"def g_{i}(a, b):\n    return a * {i} - b // {i % 5 + 1}\n" for i in range(300))
        )
        for path in configs(args.configs):
            start = time.perf_counter()
            losses = {mode: run(path, mode, work) for mode in ("auto", "explicit")}
            a, e = np.asarray(losses["auto"]), np.asarray(losses["explicit"])
            rows[path.stem] = {
                "losses": losses,
                "max_relative_difference": float(np.max(np.abs(e - a) / np.abs(a))),
                "seconds": time.perf_counter() - start,
            }
            print(
                f"{path.stem:24s} explicit vs auto: max relative loss difference "
                f"{rows[path.stem]['max_relative_difference']:.1e}",
                flush=True,
            )
    C.write_result(
        "explicit_configs",
        {"command": C.command_line(), "machine": C.machine(), "steps": STEPS, "rows": rows},
        args.out,
    )


if __name__ == "__main__":
    main()
