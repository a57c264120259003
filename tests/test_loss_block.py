"""``trainer.loss_block_size``: the trainer's loss made a vocab block at a time from the final
hidden states (``models.hidden_with_aux`` + ``nn.blockwise_next_token_loss``) trains as the
full-logits loss does, and the compiled train step no longer holds the ``[batch, position, vocab]``
logits. The config errors (a block that does not divide the vocabulary or split like it) are in
tests/test_bad_input_config.py, with the other checks that run before anything compiles."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_loss import _hlo_shapes

from named.trainer.commands.plan import train_step_report
from named.trainer.config import load_config
from named.trainer.loop.train import train

ROOT = Path(__file__).resolve().parents[1]
FSDP = {"mesh.shape": "{data: 8}", "mesh.param_mapping": "{embed: data}", "mesh.compute_mapping": "{batch: data}"}
# Megatron's vocab-parallel loss: the head's vocab split over `model`, each block spread over both devices
VOCAB_PARALLEL = {
    "mesh.shape": "{data: 4, model: 2}",
    "mesh.param_mapping": "{vocab: model}",
    "mesh.compute_mapping": "{batch: data, vocab: model}",
}
TINY = {
    "gpt2_nano.yaml": {"model.n_layer": 1, "model.n_head": 2, "model.n_embd": 32, "model.n_positions": 64},
    # a soft-cap well below the logits it meets, so that a loss without it would differ
    "gemma2_tiny.yaml": {
        "model.hidden_size": 32,
        "model.intermediate_size": 48,
        "model.num_hidden_layers": 2,
        "model.max_position_embeddings": 64,
        "model.final_logit_softcapping": 0.05,
    },
}
# config, overrides, block size (the byte tokenizer's vocabulary is 384 after rounding up)
CASES = {
    "gpt2 fsdp, microbatches": ("gpt2_nano.yaml", {**FSDP, "trainer.microbatches": 2}, 128),
    "gemma2 softcap, vocab-parallel": ("gemma2_tiny.yaml", VOCAB_PARALLEL, 64),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    (d / "code.txt").write_text(
        "\n".join(f"def g_{i}(a, b):\n    return a * {i} - b // {i % 5 + 1}\n" for i in range(300))
    )
    return d


def _run(corpus: Path, run_dir: Path, config: str, **over) -> tuple[list[float], float]:
    """Three steps, then one eval batch: the train losses and the eval loss."""
    args = {
        "trainer.num_train_steps": 3,
        "trainer.train_batch_size": 16,
        "trainer.log_interval": 1,
        "trainer.eval_interval": 3,
        "trainer.eval_batches": 1,
        "trainer.sample_interval": 0,
        "trainer.progress_bar": "false",
        "trainer.run_dir": str(run_dir),
        "trainer.load_checkpoint": "null",
        "optimizer.warmup_steps": 1,
        "optimizer.learning_rate": 0.003,
        "data.train": f"[{corpus / 'code.txt'}]",
        "data.seq_len": 32,
        "data.val_fraction": 0.05,
        "data.cache_dir": str(corpus / "cache"),
        "checkpoint.save_at_end": "false",
        "tracker.console": "false",
        **TINY[config],
        **over,
    }
    result = train(load_config(ROOT / "config" / config, [x for k, v in args.items() for x in (f"--{k}", str(v))]))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return result.losses, [r["eval/loss"] for r in rows if "eval/loss" in r][-1]


@pytest.mark.parametrize("case", list(CASES))
def test_blockwise_loss_trains_as_the_full_logits(corpus, tmp_path, case):
    config, over, block = CASES[case]
    full_losses, full_eval = _run(corpus, tmp_path / "full", config, **over)
    losses, eval_loss = _run(corpus, tmp_path / "block", config, **over, **{"trainer.loss_block_size": block})
    assert len(losses) == 3
    np.testing.assert_allclose(losses, full_losses, rtol=1e-5)  # the loss, and through it every update
    np.testing.assert_allclose(eval_loss, full_eval, rtol=1e-5)


def test_compiled_step_holds_no_full_logits():
    # A config whose logits dominate: one device's [1, 64, 8192] float32 logits are 2 MiB, the
    # whole FSDP-sharded model (with gradients and Adam's moments) well under 1 MiB per device.
    B, T, V = 8, 64, 8192
    args = [
        "--model.n_layer",
        "1",
        "--model.n_head",
        "2",
        "--model.n_embd",
        "32",
        "--model.n_positions",
        str(T),
        "--trainer.sample_interval",
        "0",
        "--model.vocab_size",
        str(V),
        "--data.seq_len",
        str(T),
        "--trainer.train_batch_size",
        str(B),
        *[a for k, v in FSDP.items() for a in (f"--{k}", v)],
    ]
    full, block = (
        train_step_report(load_config(ROOT / "config/gpt2_nano.yaml", args + extra))
        for extra in ([], ["--trainer.loss_block_size", "512"])
    )
    logits = B // 8 * T * V  # elements on one device
    print(
        f"peak per device: full logits {full.peak_bytes / 2**20:.2f} MiB, "
        f"blocks of 512 {block.peak_bytes / 2**20:.2f} MiB; the logits {4 * logits / 2**20:.2f} MiB"
    )
    assert full.peak_bytes - block.peak_bytes >= 4 * logits
    largest = {name: max(int(np.prod(s)) for s in _hlo_shapes(r.hlo)) for name, r in (("full", full), ("block", block))}
    assert largest["full"] >= logits > largest["block"], largest  # the detector finds them in the full step


def test_compiled_step_gathers_the_head_once():
    """The trainer's FSDP step with the fused loss: GPT-2's tied table (the head) is all-gathered
    once in the whole step (the embedding lookup gathers rows, not the table) and its gradient
    reduce-scattered once (the transpose of the loss's own gather; XLA:CPU forms no reduce-scatter
    under GSPMD, so the full-logits step shows an all-reduce instead), never inside a loop, and the
    step's collectives do not change with the number of vocab blocks. (The scan this loss replaced
    gathered each block of the head in the forward loop and again in the backward loop: 37
    all-gathers in this step with 8 blocks, 25 with 2.)"""
    B, T, V, E = 8, 64, 1024, 32
    args = [
        *("--model.n_layer", "1", "--model.n_head", "2", "--model.n_embd", str(E), "--model.n_positions", str(T)),
        *("--trainer.sample_interval", "0", "--model.vocab_size", str(V), "--data.seq_len", str(T)),
        *("--trainer.train_batch_size", str(B)),
        *[a for k, v in FSDP.items() for a in (f"--{k}", v)],
    ]
    steps = {
        block: train_step_report(
            load_config(ROOT / "config/gpt2_nano.yaml", [*args, "--trainer.loss_block_size", block])
        )
        for block in ("128", "512")
    }
    kinds = ("all-gather", "reduce-scatter", "all-reduce")
    counts = {b: {k: r.count(k) for k in kinds} for b, r in steps.items()}
    assert counts["128"] == counts["512"], counts
    for r in steps.values():
        head = [(c.kind, c.shape, c.in_loop) for c in r.collectives if str(V) in c.shape]
        # gathered as [embed, vocab]: the device's slice is turned before the gather, not the whole head after it
        assert head == [("all-gather", f"f32[{E},{V}]", False), ("reduce-scatter", f"f32[{E // 8},{V}]", False)]


# the nano GPT-2 with two layers (they run as a loop) and the fused loss, FSDP over 8 devices
_ORDER_STEP = """
import sys
from pathlib import Path
from named.trainer.commands.plan import train_step_report
from named.trainer.config import load_config
args = sys.argv[2:]
print(train_step_report(load_config(Path(sys.argv[1]), args)).hlo)
"""


@pytest.mark.procs
def test_the_head_and_its_gradient_are_made_after_the_layers_in_a_users_process():
    """The fused loss's whole head (the FSDP gather) and its gradient's sum (a zero fill) exist
    only while the loss runs: in the scheduled step they are made after the layers' forward loop,
    not at the start of the step and held through the model. Compiled in a process of its own
    with XLA:CPU's default scheduler (the suite's processes run the plain one,
    ``named._compat.CACHE_SAFE_CPU_FLAG``, which kept this order anyway), which moved both to the
    start while an optimisation barrier tied the head to the hidden states: docs/benchmarks.md
    section 2's GPT-2 step within the peer's memory went from 39.9 to 37.6 MB per device."""
    V, E = 1024, 32
    args = [
        *("--model.n_layer", "2", "--model.n_head", "2", "--model.n_embd", str(E), "--model.n_positions", "64"),
        *("--trainer.sample_interval", "0", "--model.vocab_size", str(V), "--data.seq_len", "64"),
        *("--trainer.train_batch_size", "8", "--trainer.loss_block_size", "128"),
        *[a for k, v in FSDP.items() for a in (f"--{k}", v)],
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    cmd = [sys.executable, "-c", _ORDER_STEP, str(ROOT / "config/gpt2_nano.yaml"), *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    made = _made_after_the_first_loop(done.stdout, f"f32[{E},{V}]")
    assert made[:2] == ["all-gather", "fusion"], made  # the gather, then the zero fill


def _made_after_the_first_loop(hlo: str, shape: str) -> list[str]:
    """The opcodes of the entry computation's instructions that make a ``shape`` value, in
    schedule order; an assertion error if one comes before the first ``while`` loop."""
    entry = hlo[hlo.index("\nENTRY ") :]
    made, loop_seen = [], False
    for line in entry.splitlines()[1:]:
        loop_seen = loop_seen or " while(" in line
        m = re.match(rf"\s*(?:ROOT )?%\S+ = {re.escape(shape)}\{{[^}}]*\}} ([\w-]+)\(", line)
        if m:
            assert loop_seen, f"made before the layers' loop: {line.strip()[:160]}"
            made.append(m.group(1))
    return made
