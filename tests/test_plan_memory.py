"""The planner's memory rule (``plan.Plan.total_bytes``, from shapes) against XLA's compiled peak of
the same step, for each loss path on a tiny FSDP GPT-2 whose output head is most of its memory:
the full logits, the fused loss gathering the head once, and the fused loss gathering it block by
block. The estimate counts the state, the activations, the logits and the head as the loss holds
it (gathered, with its gradient made whole, or a block of each), not the one layer's gathered
weights nor how XLA schedules the rest: within a quarter of the peak either way here. (Before it
counted the gathered head, it was under half the peak for the first two paths.) Then the
tensor-parallel layouts the search tries, with the vocabulary split over ``model``: with
microbatches the estimate counts the gradient accumulator and the loop's copies of the gathered
head (before, FSDP x TP 2 with 4 microbatches was estimated at 0.54 of its peak)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _procs import as_users_compile

from named.nn import _fused_loss
from named.trainer.commands import plan
from named.trainer.config import load_config

CONFIG = Path(__file__).parent.parent / "config" / "gpt2_nano_fsdp.yaml"
# one layer of width 256, a vocab of 8192 (an 8 MiB float32 head), 8 sequences of 32 on 8 devices
TINY = [
    *("--model.n_layer", "1", "--model.n_embd", "256", "--model.n_head", "4", "--model.vocab_size", "8192"),
    *("--data.seq_len", "32", "--trainer.train_batch_size", "8"),
]
PATHS = {  # name: (flags, the whole-head budget of the fused loss)
    "full logits": ([], None),
    "fused, head gathered once": (["--trainer.loss_block_size", "1024"], 2**40),
    "fused, head gathered by blocks": (["--trainer.loss_block_size", "1024"], 0),
    # 8 layers, every 4th layer's input kept (nested remat): 2 + 4 layer inputs instead of 8
    "fused by blocks, nested remat": (
        ["--trainer.loss_block_size", "1024", "--model.n_layer", "8", "--model.remat", "full every=4"],
        0,
    ),
}


@pytest.mark.parametrize("path", list(PATHS))
def test_estimate_is_within_a_quarter_of_the_compiled_peak(path, monkeypatch):
    flags, budget = PATHS[path]
    if budget is not None:  # the loss and the plan read the same budget
        monkeypatch.setattr(_fused_loss, "WHOLE_HEAD_BYTES", budget)
    cfg = load_config(CONFIG, [*TINY, *flags])
    estimate = plan.make_plan(cfg).total_bytes
    peak = plan.train_step_report(cfg).peak_bytes
    assert 0.75 * peak <= estimate <= 1.25 * peak, (estimate / 2**20, peak / 2**20)


# eight heads (pure TP splits them 8 ways), 16 sequences (4 microbatches of one sequence per
# data-parallel group of FSDP x TP 2)
TP_TINY = [*TINY, "--model.n_head", "8", "--trainer.train_batch_size", "16"]
TP_LAYOUTS = {  # name: (the search's layout family, microbatches); none of them recomputes
    "FSDP+TP2, vocab split, 1 microbatch": ("FSDP+TP2", 1),
    # the case the estimate missed (0.54 of the peak): the microbatch loop holds the gradient
    # accumulator beside a microbatch's gradient, and the gathered head's copies twice over
    "FSDP+TP2, vocab split, 4 microbatches": ("FSDP+TP2", 4),
    "TP8, vocab split, 4 microbatches": ("TP", 4),
}


@pytest.mark.parametrize("layout", list(TP_LAYOUTS))
def test_tensor_parallel_estimates_are_within_a_quarter_of_the_compiled_peak(layout):
    from named.trainer.commands import plan_search

    name, micro = TP_LAYOUTS[layout]
    cfg = load_config(CONFIG, TP_TINY)
    [c] = [
        c
        for c in plan_search.candidates(8, plan_search.param_axes(cfg), 16)
        if (c.name, c.layout.microbatches, c.layout.remat) == (name, micro, "none")
    ]
    assert ("vocab", "model") in c.layout.param_mapping  # the vocabulary is split over the TP axis
    trial = c.layout.apply(cfg)
    estimate = plan.make_plan(trial).total_bytes
    peak = plan.train_step_report(trial).peak_bytes
    assert 0.75 * peak <= estimate <= 1.25 * peak, (estimate / 2**20, peak / 2**20)


def test_the_block_by_block_head_is_counted_smaller():
    # the same rule decides what the loss does and what the plan counts: gathering by blocks holds
    # two blocks and the device's slice of the gradient instead of the head and its whole gradient
    rows, embed, block = 8192, 256, 1024
    whole = _fused_loss.head_bytes_held(
        rows, embed, 4, block_size=block, embed_shards=8, blocks_possible=True, gather="once"
    )
    blocks = _fused_loss.head_bytes_held(
        rows, embed, 4, block_size=block, embed_shards=8, blocks_possible=True, gather="blocks"
    )
    assert whole == 2 * rows * embed * 4
    assert blocks == 2 * block * embed * 4 + rows * embed * 4 // 8
    # a vocab-parallel head cannot be gathered by blocks: counted whole whatever is asked
    assert (
        _fused_loss.head_bytes_held(
            rows, embed, 4, block_size=block, embed_shards=8, blocks_possible=False, gather="blocks"
        )
        == whole
    )


def test_the_compiled_step_copies_no_parameter():
    """The train step updates each parameter in place: XLA keeps no full-size copy of one beside
    its update. (Until issue 41 the finite check read the update ``u``, which weight decay makes
    from the parameter ``p``, so ``p`` had to outlive ``p + u`` and every float parameter of this
    model was copied at the start of the step: 196 MiB per device for the 613M model of
    docs/benchmarks.md section 4.)"""
    import re

    import named as nm
    from named.trainer.loop.checks import checked_setup

    flags = ["--model.n_layer", "2", "--model.remat", "full", "--data.seq_len", "32", "--trainer.train_batch_size", "8"]
    cfg = load_config(CONFIG, flags)
    s = checked_setup(cfg)
    step, args = plan.abstract_train_step(cfg, s)
    with nm.set_mesh(s.mesh):
        text = step.lower(*args).compile(as_users_compile()).as_text()  # laid out as in a user's process
    entry = text[text.index("\nENTRY") :]
    assert not re.findall(r"= f32\[[^\n]* copy\(%param[.\d]*\)", entry)
