"""The CPU benchmarks in bench/ still run (smallest settings, results to a temporary directory).

No timing is asserted: these only keep the scripts from rotting. The numbers live in
docs/benchmarks.md and come from `make bench`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

pytestmark = [pytest.mark.slow, pytest.mark.procs]  # the results record the git commit (a git process)


def _load(tmp_path: Path, name: str) -> dict:
    return json.loads((tmp_path / f"{name}.json").read_text())


def test_overhead_tiny(tmp_path):
    import overhead

    overhead.main(["--tiny", "--out", str(tmp_path)])
    r = _load(tmp_path, "overhead_f32_tiny")
    assert r["params"]["named"] == r["params"]["plain"]  # the same model on both sides
    assert r["step_ratio_named_over_plain"] > 0
    first = r["losses_first_and_last"]
    assert abs(first["named"][0] - first["plain"][0]) < 0.1  # both start near log(vocab)
    assert r["hlo"]["named"]["collectives"]["all-gather"]["count"] > 0  # FSDP gathers weights


def _plain_weights(model, mesh):
    """Our GPT-2's weights as ``reference_gpt2.Gpt2``: the Hugging Face tensors (Conv1D, ``[in, out]``)
    stacked over the layers, laid out by the reference's FSDP specs."""
    import reference_gpt2 as ref

    from named import models

    sd = models.hf_state_dict(model)
    layer = lambda name: np.stack([sd[f"transformer.h.{i}.{name}"] for i in range(model.config.n_layer)])  # noqa: E731
    blocks = {
        "ln1_w": "ln_1.weight",
        "ln1_b": "ln_1.bias",
        "attn_w": "attn.c_attn.weight",
        "attn_b": "attn.c_attn.bias",
        "proj_w": "attn.c_proj.weight",
        "proj_b": "attn.c_proj.bias",
        "ln2_w": "ln_2.weight",
        "ln2_b": "ln_2.bias",
        "up_w": "mlp.c_fc.weight",
        "up_b": "mlp.c_fc.bias",
        "down_w": "mlp.c_proj.weight",
        "down_b": "mlp.c_proj.bias",
    }
    g = ref.Gpt2(
        sd["transformer.wte.weight"],
        sd["transformer.wpe.weight"],
        {k: layer(v) for k, v in blocks.items()},
        (sd["transformer.ln_f.weight"], sd["transformer.ln_f.bias"]),
        model.config.n_head,
    )
    return jax.device_put(g, ref.shardings(g, mesh))


def _adam_moment(state):
    import optax

    adam = [
        x
        for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
        if isinstance(x, optax.ScaleByAdamState)
    ]
    return adam[0].mu


def test_the_plain_side_is_the_trainers_step_in_plain_jax():
    """overhead.py's baseline computes what ``train.make_train_step`` computes: from the same
    weights and tokens, one step gives the same loss, gradient norm, token count, clipped first
    Adam moment and new weights (weight decay and its mask included)."""
    import _common as C
    import overhead

    model = dict(n_layer=2, n_head=2, n_embd=32, n_positions=16, vocab_size=384)
    cfg = C.step_config(model, batch=8, seq=16, over={"optimizer.max_grad_norm": 0.5})
    ids = overhead.token_ids(model, 8, 16)
    named = C.TrainerStep(cfg, ids, segments=False)
    mesh = named.mesh
    with jax.set_mesh(mesh):
        plain = overhead.Plain(cfg, mesh, ids, model=_plain_weights(named.model, mesh))
        ours = named.run(wait=False)
        plain_model, plain_opt, theirs = plain.step(plain.model, plain.opt_state, plain.batch, plain.flags)
    assert float(ours["grad_norm"]) > cfg.optimizer.max_grad_norm  # so the clipping acts
    for k in ("loss", "grad_norm", "tokens"):
        np.testing.assert_allclose(float(ours[k]), float(theirs[k]), rtol=2e-5, err_msg=k)
    assert bool(ours["finite"]) and bool(theirs["finite"])
    new = _plain_weights(named.model, mesh)
    # the key bias: softmax ignores it, so its gradient is rounding, which Adam scales up to the rate
    D = model["n_embd"]
    for w in (new, plain_model):
        w.blocks["attn_b"] = w.blocks["attn_b"].at[:, D : 2 * D].set(0)
    pairs = [(new, plain_model), (_plain_weights(_adam_moment(named.opt_state), mesh), _adam_moment(plain_opt))]
    for ours_tree, theirs_tree in pairs:
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(ours_tree), jax.tree.leaves(theirs_tree)):
            np.testing.assert_allclose(
                np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path)
            )


def test_compile_depth_tiny(tmp_path):
    import compile_depth

    compile_depth.main(["--tiny", "--out", str(tmp_path)])
    r = _load(tmp_path, "compile_depth_tiny")
    assert [row["layers"] for row in r["rows"]] == [2, 4]


def test_memory_tiny(tmp_path):
    import memory

    memory.main(["--tiny", "--out", str(tmp_path)])
    row = _load(tmp_path, "memory_tiny")["rows"]["tiny"]
    m = row["memory"]
    assert (
        m["peak_bytes"]
        == m["temp_size_in_bytes"] + m["argument_size_in_bytes"] + m["output_size_in_bytes"] - m["alias_size_in_bytes"]
    )
    assert m["alias_size_in_bytes"] > 0  # the donated state aliases the outputs


def test_moe_tiny(tmp_path):
    import moe

    moe.main(["--tiny", "--out", str(tmp_path)])
    r = _load(tmp_path, "moe_tiny")["comparisons"]
    assert set(r["dispatch"]) == {"dropless", "dense"}
    assert "all-to-all" not in r["placement"]["replicated experts"]["collectives"]
    assert r["placement"]["EP auto"]["collectives"]["all-to-all"] > 0  # the tokens travel to their experts
    assert r["placement"]["EP explicit"]["collectives"]["all-to-all"] > 0


@pytest.mark.procs  # the result records the commit (git)
def test_attention_tiny(tmp_path):
    import attention

    attention.main(["--tiny", "--out", str(tmp_path)])
    row = _load(tmp_path, "attention_tiny")["rows"][0]
    assert set(row) == {"T", "xla", "flash512", "flash256"}
    assert all(row[side]["temp_bytes"] > 0 for side in ("xla", "flash512", "flash256"))


def test_decode_tiny(tmp_path):
    import decode

    decode.main(["--tiny", "--out", str(tmp_path)])
    for f in _load(tmp_path, "decode_tiny")["families"]:
        assert f["compiles_during_timing"] == 0  # every timed call reused its program
        assert set(f["greedy_tokens_agree"].values()) == {1.0}  # the same tokens as transformers
        assert {row["side"] for row in f["rows"]} == {"named", "transformers", "named-sample (continue_ids)"}


def test_first_step_tiny(tmp_path):
    """Every kind of launch reaches its first loss on our side (the warm cache included, which
    aborted before named-train compiled with CACHE_SAFE_CPU_FLAG), and on Levanter's where its
    venv is present (CI has none: then the result says why it was skipped)."""
    import first_step
    from peer import PEER_PY

    first_step.main(["--tiny", "--repeats", "1", "--no-build", "--out", str(tmp_path)])
    r = _load(tmp_path, "first_step_tiny")
    sides = [r["launches"]] + ([r["peer"]["launches"]] if PEER_PY.exists() else [])
    for launches in sides:
        for kind, x in launches.items():
            assert not x["failed"], (kind, x["failed"])
            assert 0 < x["compile_s"] < x["first_loss_s"]
    if PEER_PY.exists():
        assert set(r["peer"]["named_over_levanter"]) == set(r["launches"])
    else:
        assert "skipped" in r["peer"]


def test_data_ckpt_tiny(tmp_path):
    import data_ckpt

    data_ckpt.main(["--tiny", "--out", str(tmp_path), "--tmp", str(tmp_path)])
    r = _load(tmp_path, "data_ckpt_tiny")
    assert r["loader"][0]["tokens_per_s"]["median_s"] > 0
    assert r["checkpoint"]["save_MB_per_s"] > 0
    assert r["checkpoint"]["checkpointer_commit_s"]["n"] == 1  # the train loop's way was timed too


def test_data_ckpt_s3_tiny(tmp_path):
    import data_ckpt

    data_ckpt.main(["--s3", "--tiny", "--out", str(tmp_path), "--tmp", str(tmp_path)])
    r = _load(tmp_path, "data_ckpt_s3_tiny")
    assert r["boto3"]["bytes"] == r["s3"]["bytes"]  # the plain client moved the same bytes
    assert r["s3_save_over_boto3"] > 0 and r["s3_restore_over_boto3"] > 0
    # the first restore and boto3's first download, each in a new process (each checks its bytes)
    first = r["first_in_new_process"]
    assert first["restore_wall"]["n"] == first["boto3_wall"]["n"] == 1
    assert first["restore_over_boto3"] > 0 and len(first["restore_over_boto3_per_round"]) == 1


def test_gpu_mfu_driver_runs_the_plan_and_prints_the_table(tmp_path, capsys):
    """The GPU plan end to end at toy size on CPU: worker subprocesses running the trainer's
    step, the JSON (jax version, cuDNN version and XLA flags beside the numbers), the table,
    the runs that cannot run on a CPU recorded with the reason, and the same losses from the
    same tokens whichever attention path or layer mode ran them."""
    import gpu_mfu

    # a budget no toy run reaches: the driver stops starting runs when it is spent, and on a loaded
    # machine (the suite's two workers and the processes they start) 150 s left runs out and failed
    gpu_mfu.main(["--tiny", "--budget-s", "3600", "--steps", "2", "--out", str(tmp_path)])
    r = _load(tmp_path, "gpu_mfu_tiny")
    best = r["best"]["tiny"]
    assert r["install"] == "named was importable" and best["tokens_per_s"] > 0 and best["mfu"] is None  # no CPU peak
    assert (
        best["jax"] == jax.__version__
        and "cudnn" in best
        and "xla_gpu_enable_latency_hiding_scheduler" in best["xla_flags"]
    )
    runs = {(x["model"], x.get("loss_block"), x.get("remat"), x.get("attention"), x.get("mode")): x for x in r["runs"]}
    # runs after the first two take the loss block of the fastest run so far, which depends on timing
    one = {(x.get("remat"), x.get("attention"), x.get("mode")): x for x in r["runs"][3:]}
    assert "host memory" in one["offload", "auto", "auto"]["error"]
    xla, explicit = one["none", "xla", "auto"], one["none", "auto", "explicit"]
    assert explicit["loss_block"] == xla["loss_block"] in (None, 96)
    auto = runs["tiny", xla["loss_block"], "none", "auto", "auto"]
    assert xla["attention_paths"] == ["xla"] and not xla["cudnn_attention"]
    np.testing.assert_allclose(xla["losses"], auto["losses"], rtol=1e-5)
    np.testing.assert_allclose(explicit["losses"], auto["losses"], rtol=2e-3)
    assert runs["tiny", 96, "none", "auto", "auto"]["compiled_memory"]["peak_bytes"] > 0
    attention = runs["attention", None, None, None, None]["rows"][0]
    assert "backend is 'cpu'" in attention["cudnn"]["error"] and attention["xla"]["relative_error_vs_f32"]["out"] < 2e-2
    out = capsys.readouterr().out
    block = xla["loss_block"] or ""
    assert (
        f"| tiny | 8 | {block} | none | xla | auto | tuned | packed | {xla['step_s']['median_s'] * 1e3:,.1f} ms |"
        in out
    )


def test_fetch_wheels_asks_for_what_pyproject_pins():
    import fetch_wheels

    reqs = fetch_wheels.requirements(with_tests=False)  # what named and its train extra need, less the image's
    assert {fetch_wheels.distribution_name(r) for r in reqs} == {
        "jmp",
        "draccus",
        "google_crc32c",
        "zstandard",
        "jinja2",
        "setuptools",
        "wheel",
    }
    assert "pytest>=8" in fetch_wheels.requirements(with_tests=True)


def test_explicit_configs_one_config(tmp_path):
    import explicit_configs

    explicit_configs.main(["--configs", "gpt2_nano_fsdp_tp", "--out", str(tmp_path)])
    row = _load(tmp_path, "explicit_configs")["rows"]["gpt2_nano_fsdp_tp"]
    assert len(row["losses"]["explicit"]) == len(row["losses"]["auto"]) == 3
    assert row["max_relative_difference"] < 1e-5


def test_the_recommended_setup_configures_our_side_in_the_layout_the_search_chose():
    """peer.py --setup recommended hands our worker a search candidate's fields (as JSON); the
    config it then trains has that candidate's mesh, mappings, mode, remat, microbatches and
    loss block, not the FSDP defaults of the like-for-like comparison (what that config's step
    does is the trainer's, tested there)."""
    import peer

    from named.trainer.commands.plan_search import Candidate
    from named.trainer.config.layout import Layout

    compute = {"batch": "data", "mlp": "model", "heads": "model"}
    param = {"embed": "data", "mlp": "model", "heads": "model"}
    chosen = Candidate("FSDP+TP2", Layout({"data": 4, "model": 2}, compute, param, "full", 2, 192, "explicit"))
    fields = json.loads(json.dumps(peer.record(chosen)))
    assert fields["name"] == "FSDP+TP2" and fields["compute_mapping"] == compute
    cfg = peer.with_layout(peer.trainer_config("gpt2", peer.MODELS["gpt2"][1], 8, 32, "f32", "none"), fields)
    assert dict(cfg.mesh.shape) == {"data": 4, "model": 2}
    assert dict(cfg.mesh.compute_mapping) == compute
    assert dict(cfg.mesh.param_mapping) == param
    assert (cfg.mesh.mode, cfg.model.remat, cfg.trainer.microbatches) == ("explicit", "full", 2)
    assert cfg.trainer.loss_block_size == 192


def test_loss_tiny(tmp_path):
    import loss

    loss.main(["--tiny", "--rounds", "1", "--per-round", "1", "--warmup", "1", "--out", str(tmp_path)])
    r = _load(tmp_path, "loss_tiny")
    fused, full = r["sides"]["blockwise"], r["sides"]["full"]
    assert abs(fused["loss"] - full["loss"]) < 1e-4  # the same loss
    # the FSDP head: gathered once, its gradient reduce-scattered once, nothing in a loop
    assert fused["collectives"]["all-gather"] == {"instructions": 1, "in_loop": 0, "runs": 1, "bytes": 512 * 32 * 4}
    assert fused["collectives"]["reduce-scatter"]["runs"] == 1
