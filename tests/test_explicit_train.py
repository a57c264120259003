"""``mesh.mode: explicit``: the same models train with their layer stack run per device
(``nm.shard_map``, FSDP weights gathered per layer, gradients reduce-scattered per layer) and
give the losses and parameters of the default GSPMD mode, with and without remat, with
microbatches, and across a resume from a checkpoint written in the other mode."""

from __future__ import annotations

import shutil
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest
from _nn_util import all_eqns

import named as nm
from named import nn
from named.models.gpt2 import Gpt2Config, Gpt2LMHeadModel
from named.trainer.config import ConfigError, load_config
from named.trainer.loop.train import train

ROOT = Path(__file__).resolve().parents[1]
FSDP = {"mesh.shape": "{data: 8}", "mesh.param_mapping": "{embed: data}", "mesh.compute_mapping": "{batch: data}"}
TP = {
    "mesh.shape": "{data: 4, model: 2}",
    "mesh.param_mapping": "{embed: data, mlp: model, heads: model}",
    "mesh.compute_mapping": "{batch: data, mlp: model, heads: model}",
}
CASES = {
    "plain": {},
    "remat+microbatches": {"model.remat": "full", "trainer.microbatches": 2},
    "2-D mesh": {
        "mesh.shape": "{data: 4, replica: 2}",
        "mesh.param_mapping": "{embed: [data, replica]}",
        "mesh.compute_mapping": "{batch: [data, replica]}",
        "model.remat": "save_dots",
    },
    # tensor parallelism: mlp and heads stay split over model; the blocks' contractions over them are psum'd
    "fsdp+tp+dropout": {**TP, "model.dropout": 0.1},
    # and the fused loss (its own shard_map) beside the explicit stack, against the auto run above
    # (full logits): one run checks both, the loss blocks changing no number
    "fsdp+tp+dropout, loss blocks": {**TP, "model.dropout": 0.1, "trainer.loss_block_size": 96},
    "fsdp+tp (gqa)": {
        "mesh.shape": "{data: 4, model: 2}",
        "mesh.param_mapping": "{embed: data, mlp: model, heads: model, kv_heads: model}",
        "mesh.compute_mapping": "{batch: data, mlp: model, heads: model, kv_heads: model}",
    },
    # expert parallelism: each device holds 2 of the 4 experts; tokens travel by all-to-all
    "experts over 2": {
        "mesh.shape": "{data: 4, expert: 2}",
        "mesh.param_mapping": "{embed: data, experts: expert}",
        "mesh.compute_mapping": "{batch: [data, expert], experts: expert}",
    },
}
GPT2_CASES = ["plain", "remat+microbatches", "2-D mesh", "fsdp+tp+dropout, loss blocks"]
# The auto run each case's explicit run is compared with. In auto mode remat, microbatches, another
# mesh of the same 8 devices, tensor and expert parallelism and the fused loss change no number
# (beyond rounding, far under the tolerances), so the model's plain FSDP auto run stands for them
# all: a run of its own per case would train the same losses again. Dropout draws masks, so its
# cases keep their own auto run (tensor parallel with dropout, full logits).
REFERENCE = {case: "plain" for case in CASES} | {
    "fsdp+tp+dropout": "fsdp+tp+dropout",
    "fsdp+tp+dropout, loss blocks": "fsdp+tp+dropout",
}
# Only GPT-2's plain runs write checkpoints (at steps CKPT_EVERY and STEPS): the resume test reads them.
STEPS, CKPT_EVERY = 10, 5


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    (d / "code.txt").write_text(
        "\n".join(f"def g_{i}(a, b):\n    return a * {i} - b // {i % 5 + 1}\n" for i in range(300))
    )
    return d


def _run(corpus: Path, run_dir: Path, config: str = "gpt2_nano.yaml", **over):
    args = {
        "trainer.num_train_steps": STEPS,
        "trainer.train_batch_size": 16,
        "trainer.log_interval": 1,
        "trainer.eval_interval": 0,
        "trainer.sample_interval": 0,
        "trainer.progress_bar": "false",
        "trainer.run_dir": str(run_dir),
        "trainer.load_checkpoint": "null",
        "optimizer.warmup_steps": 2,
        "optimizer.learning_rate": 0.003,
        # GPT-2's key bias has a gradient of zero in exact arithmetic (softmax ignores a shift of a
        # query's logits), so it is pure rounding, which differs with the order of the sums; Adam
        # with its default epsilon (1e-8) turns that rounding into steps of learning-rate size. A
        # larger epsilon keeps the comparison about the model, not about that rounding.
        "optimizer.epsilon": 1e-4,
        "data.train": f"[{corpus / 'code.txt'}]",
        "data.seq_len": 32,
        "data.val_fraction": 0.05,
        "data.cache_dir": str(corpus / "cache"),
        "checkpoint.interval": CKPT_EVERY,
        "checkpoint.save_at_end": "false",
        "tracker.console": "false",
        **FSDP,
    }
    if config == "gpt2_nano.yaml":
        args.update({"model.n_layer": 2, "model.n_head": 2, "model.n_embd": 32, "model.n_positions": 64})
    else:
        args.update(
            {
                "model.hidden_size": 32,
                "model.intermediate_size": 48,
                "model.num_hidden_layers": 2,
                "model.max_position_embeddings": 64,
            }
        )
    if config == "gemma3_tiny.yaml":  # a local and a global layer: windows and rope differ per layer
        args.update({"model.sliding_window": 8, "model.sliding_window_pattern": 2})
    args.update(over)
    return train(load_config(ROOT / "config" / config, [x for k, v in args.items() for x in (f"--{k}", str(v))]))


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    """Each case trained in both modes, lazily (a case's runs are made by the first test that asks)."""
    cache: dict = {}
    base = tmp_path_factory.mktemp("runs")

    def get(case: str, mode: str, config: str = "gpt2_nano.yaml", batch_split: int = 1):
        if mode == "auto":
            case = REFERENCE[case]
        if (case, mode, config, batch_split) not in cache:
            over = CASES.get(case, {})
            if (case, config, batch_split) != ("plain", "gpt2_nano.yaml", 1):  # no checkpoint to resume from
                over = {**over, "checkpoint.interval": 0}
            cache[case, mode, config, batch_split] = _run(
                corpus,
                base / f"{config}-{case}-{mode}-{batch_split}",
                config,
                **{**over, "mesh.mode": mode, "mesh.batch_split": batch_split},
            )
        return cache[case, mode, config, batch_split]

    return get


def _assert_same(a, b, what: str):
    assert len(a.losses) == len(b.losses) > 0
    np.testing.assert_allclose(a.losses, b.losses, rtol=1e-5, atol=0, err_msg=f"{what}: losses")
    wa = jax.tree.leaves(a.model, is_leaf=nm.is_named_array)
    wb = jax.tree.leaves(b.model, is_leaf=nm.is_named_array)
    assert len(wa) == len(wb)
    for x, y in zip(wa, wb):
        x, y = (v.array if isinstance(v, nm.NamedArray) else v for v in (x, y))
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=1e-5, err_msg=f"{what}: parameters")


@pytest.mark.parametrize("case", GPT2_CASES)
def test_gpt2_explicit_trains_like_auto(case, runs):
    auto, explicit = runs(case, "auto"), runs(case, "explicit")
    assert len(auto.losses) == STEPS
    assert auto.losses[-1] < auto.losses[0]  # it trains, so equal losses are not two flat lines
    _assert_same(explicit, auto, case)
    # The explicit run's parameters stay stored as FSDP blocks: 1/8 of every embed weight per device
    # (over data, or over data and replica on the 2-D mesh).
    split = 4 if "model" in CASES[case].get("mesh.shape", "") else 8  # over data (and replica) only
    for x in jax.tree.leaves(explicit.model, is_leaf=nm.is_named_array):
        if isinstance(x, nm.NamedArray) and "embed" in x.names and not {"mlp", "heads"} & set(x.names):
            assert x.array.addressable_shards[0].data.size * split == x.array.size


@pytest.mark.parametrize(
    "config, case",
    [
        # the decoder under FSDP alone, with per-layer windows and rope (Llama 3 runs the same decoder,
        # FSDP and tensor parallel below: a plain Llama 3 run of its own would check nothing more)
        ("gemma3_tiny.yaml", "plain"),
        ("llama3_tiny.yaml", "fsdp+tp (gqa)"),
        ("mixtral_tiny.yaml", "experts over 2"),  # the router losses are the whole batch's in both modes
    ],
)
def test_decoder_explicit_trains_like_auto(config, case, runs):
    _assert_same(runs(case, "explicit", config), runs(case, "auto", config), f"{config} {case}")


@pytest.mark.parametrize(
    "config, case",
    [
        # dropout: each half draws its part of the whole batch's mask; the fused loss sums the halves' blocks
        ("gpt2_nano.yaml", "fsdp+tp+dropout, loss blocks"),
        ("mixtral_tiny.yaml", "experts over 2"),  # router statistics averaged over the halves: the whole batch's losses
    ],
)
def test_batch_split_trains_like_auto(config, case, runs):
    _assert_same(runs(case, "explicit", config, batch_split=2), runs(case, "auto", config), f"{config} {case} split")


@pytest.mark.parametrize("written, resumed", [("auto", "explicit"), ("explicit", "auto")])
def test_resume_from_a_checkpoint_of_the_other_mode(written, resumed, runs, corpus, tmp_path):
    full = runs("plain", written)  # STEPS steps, a checkpoint at step CKPT_EVERY only
    run_dir = tmp_path / "run"
    shutil.copytree(full.run_dir, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / f"step_{STEPS}", ignore_errors=True)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"step_{CKPT_EVERY}"]
    more = _run(corpus, run_dir, **{"mesh.mode": resumed, "trainer.load_checkpoint": "auto"})
    assert len(more.losses) == STEPS - CKPT_EVERY
    np.testing.assert_allclose(more.losses, full.losses[CKPT_EVERY:], rtol=1e-5, atol=0)
    for x, y in zip(jax.tree.leaves(more.model), jax.tree.leaves(full.model)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=1e-5)


def test_bad_modes_and_layouts_are_refused(corpus, tmp_path):
    with pytest.raises(ConfigError, match="mesh.mode must be one of auto, explicit"):
        load_config(ROOT / "config" / "gpt2_nano.yaml", ["--mesh.mode", "manual"])
    # activations split over mlp while the weights keep it whole: the blocks would contract halves
    odd = {
        "mesh.shape": "{data: 4, model: 2}",
        "mesh.param_mapping": "{embed: data}",
        "mesh.compute_mapping": "{batch: data, mlp: model}",
    }
    with pytest.raises(
        ConfigError,
        match=r"mesh.mode: explicit: .*splits 'mlp' over \['model'\] but the parameter "
        r"mapping keeps it whole",
    ):
        _run(corpus, tmp_path / "run", **{**odd, "mesh.mode": "explicit"})
    assert not (tmp_path / "run").exists()  # refused before anything was written
    # positions split: attention mixes them
    seq = {"mesh.shape": "{data: 4, seq: 2}", "mesh.compute_mapping": "{batch: data, position: seq}"}
    with pytest.raises(ConfigError, match=r"mesh.mode: explicit: .*splits 'position', an axis the layers mix"):
        _run(corpus, tmp_path / "seq", **{**seq, "mesh.mode": "explicit"})
    assert not (tmp_path / "seq").exists()
    # the batch split is explicit mode's, and cuts each device's sequences (16 / 8 devices = 2) evenly
    with pytest.raises(ConfigError, match="mesh.batch_split=2 needs mesh.mode: explicit"):
        load_config(ROOT / "config" / "gpt2_nano.yaml", ["--mesh.batch_split", "2"])
    with pytest.raises(ConfigError, match=r"mesh.batch_split must be >= 1, got 0"):
        load_config(ROOT / "config" / "gpt2_nano.yaml", ["--mesh.batch_split", "0", "--mesh.mode", "explicit"])
    with pytest.raises(ConfigError, match=r"mesh.batch_split=4 does not divide each device's 2 sequences"):
        _run(corpus, tmp_path / "split", **{"mesh.mode": "explicit", "mesh.batch_split": 4})
    assert not (tmp_path / "split").exists()


# ---- the collectives of one explicit gradient ---------------------------------------------------


def test_prefetched_gathers_and_one_reduce_scatter_per_layer_weight():
    """In the compiled gradient: every FSDP-split weight of a layer is gathered once per layer in
    the forward loop and each split matrix once more in the backward loop (gathered copies are
    never kept for all layers); the first layer's block is gathered before the forward loop and
    the last layer's before the backward loop, because each iteration gathers the next layer's
    (the prefetch); each layer's gradient of each split weight is reduce-scattered in the loop;
    the weights that stay replicated are all-reduced. GSPMD on CPU forms no reduce-scatter."""
    mesh = nm.make_mesh({"data": 8})
    param, compute = {"embed": "data"}, {"batch": "data"}
    cfg = Gpt2Config(n_embd=32, n_layer=3, n_head=4, vocab_size=96, n_positions=32)
    model = nm.shard(Gpt2LMHeadModel.init(cfg, key=jax.random.key(0)), param, mesh)
    ids = nm.shard(
        nm.named(jax.random.randint(jax.random.key(1), (8, 16), 0, 96), ("batch", "position")), compute, mesh
    )
    layer = [
        w for w in jax.tree.leaves(model.blocks.stacked, is_leaf=nm.is_named_array) if isinstance(w, nm.NamedArray)
    ]
    split = [w for w in layer if "embed" in w.names]
    matrices = [w for w in split if w.ndim > 2]  # layers axis + at least two more
    replicated = [w for w in layer if "embed" not in w.names]
    assert len(split) == 10 and len(matrices) == 4 and len(replicated) == 2

    def report(driver):
        def loss(m, ids):
            with nn.explicit_layers(driver):
                return (m(ids).array ** 2).mean()

        return nm.compiled_report(
            nm.named_jit(eqx.filter_grad(loss), mapping=compute, out_mapping=param, mesh=mesh), model, ids
        )

    rep = report(nn.ExplicitStack(param, compute))
    in_loop = [c for c in rep.collectives if c.in_loop]
    gathers = [c for c in in_loop if c.kind == "all-gather"]
    scatters = [c for c in in_loop if c.kind == "reduce-scatter"]
    assert len(split) + len(matrices) <= len(gathers) <= 2 * len(split)
    assert len(scatters) == len(split)
    assert all(c.runs == cfg.n_layer and c.mesh_axes == ("data",) for c in gathers + scatters)
    for w in matrices:  # one layer's block, gathered whole, outside the loops: once before each
        shape = f"f32[{','.join(map(str, w.array.shape[1:]))}]"
        assert [c.in_loop for c in rep.collectives if c.kind == "all-gather" and c.shape == shape].count(False) == 2
    # each reduce-scatter sends one layer's gradient of one split weight: its bytes are one layer's weight
    assert sorted(c.bytes for c in scatters) == sorted(w.array.nbytes // cfg.n_layer for w in split)
    # no stacked (all layers) weight is gathered whole anywhere
    assert not [c for c in rep.collectives if c.kind == "all-gather" and c.shape.startswith(f"f32[{cfg.n_layer},")]
    reduced = sum(c.bytes for c in in_loop if c.kind == "all-reduce")
    assert reduced == sum(w.array.nbytes // cfg.n_layer for w in replicated)
    assert report(None).count("reduce-scatter") == 0


@pytest.mark.parametrize("remat", ["none", "full"])
def test_a_bf16_stack_is_cast_per_layer_shard_before_its_gather(remat):
    """Explicit mode with a bfloat16 compute cast (``nn.cast_for_compute``), with or without
    ``remat`` (the driver recomputes each layer in its backward pass either way): each layer's
    float32 shards are cast before they are gathered, so every gather and gradient
    reduce-scatter in the layer loop moves bfloat16, no bfloat16 copy of the whole stack is
    made, and the gradients are those of the stack cast whole, to the bit."""
    import jax.numpy as jnp

    mesh = nm.make_mesh({"data": 8})
    param, compute = {"embed": "data"}, {"batch": "data"}
    # 5 layers: no per-layer weight or shard has a leading dimension of 5, the check below can tell them apart
    cfg = Gpt2Config(n_embd=32, n_layer=5, n_head=4, vocab_size=96, n_positions=32, remat=remat)
    model = nm.shard(Gpt2LMHeadModel.init(cfg, key=jax.random.key(0)), param, mesh)
    ids = nm.shard(
        nm.named(jax.random.randint(jax.random.key(1), (8, 16), 0, 96), ("batch", "position")), compute, mesh
    )

    def per_layer(m):
        return nn.cast_for_compute(m, "bf16")

    def whole(m):
        stack = m.blocks
        cast = nn.Stacked(nn.cast_for_compute(stack.stacked, "bf16"), stack.Layers, stack.remat)
        return eqx.tree_at(lambda c: c.blocks, nn.cast_for_compute(m, "bf16"), cast)

    def grad_fn(cast):
        def loss(m, ids):
            with nn.explicit_layers(nn.ExplicitStack(param, compute)):
                return (cast(m)(ids).array.astype(jnp.float32) ** 2).mean()

        return nm.named_jit(eqx.filter_grad(loss), mapping=compute, out_mapping=param, mesh=mesh)

    late, early = grad_fn(per_layer)(model, ids), grad_fn(whole)(model, ids)
    leaves = jax.tree.leaves(late, is_leaf=nm.is_named_array)
    assert leaves and all(g.dtype == jnp.float32 for g in leaves)
    for a, b in zip(leaves, jax.tree.leaves(early, is_leaf=nm.is_named_array)):
        np.testing.assert_array_equal(np.asarray(a.array), np.asarray(b.array))

    # The program jax hands to XLA (XLA:CPU computes bf16 matmuls in float32 and moves those converts
    # ahead of the gathers, so its compiled program gathers float32 on this backend).
    eqns = list(all_eqns(grad_fn(per_layer).trace(model, ids).jaxpr))
    moved = [e for e in eqns if e.primitive.name in ("all_gather", "reduce_scatter") and e.invars[0].aval.ndim >= 2]
    assert moved and all(e.invars[0].aval.dtype == jnp.bfloat16 for e in moved), [
        (e.primitive.name, e.invars[0].aval.str_short()) for e in moved
    ]
    stacked_casts = [
        e
        for e in eqns
        if e.primitive.name == "convert_element_type"
        and e.outvars[0].aval.dtype == jnp.bfloat16
        and e.invars[0].aval.ndim >= 3
        and e.invars[0].aval.shape[0] == cfg.n_layer
    ]
    assert not stacked_casts, [e.invars[0].aval.str_short() for e in stacked_casts]  # no copy of the whole stack


def test_batch_split_runs_each_layer_on_two_halves():
    """With ``batch_split=2`` each layer runs on two halves of every device's sequences. The halves
    do not depend on each other, except that the program orders their collectives: the second
    half's k-th collective waits for the first half's k-th (an optimization barrier in the program
    jax lowers; XLA:CPU expands barriers before its combiner, so its compiled program may merge the
    halves' all-reduces again). The tensor-parallel all-reduces over ``model`` send the same bytes
    in all; the weights' gathers and gradient reduce-scatters, which both halves share, are not
    repeated."""
    mesh = nm.make_mesh({"data": 4, "model": 2})
    param = {"embed": "data", "mlp": "model", "heads": "model"}
    compute = {"batch": "data", "mlp": "model", "heads": "model"}
    cfg = Gpt2Config(n_embd=32, n_layer=3, n_head=4, vocab_size=96, n_positions=32)
    model = nm.shard(Gpt2LMHeadModel.init(cfg, key=jax.random.key(0)), param, mesh)
    ids = nm.shard(
        nm.named(jax.random.randint(jax.random.key(1), (8, 16), 0, 96), ("batch", "position")), compute, mesh
    )

    def grad_fn(split):
        def loss(m, ids):
            with nn.explicit_layers(nn.ExplicitStack(param, compute, batch_split=split)):
                return (m(ids).array ** 2).mean()

        return nm.named_jit(eqx.filter_grad(loss), mapping=compute, out_mapping=param, mesh=mesh)

    fns = {n: grad_fn(n) for n in (1, 2)}  # each traced and compiled once, for its report, its text and its run
    reports = {n: nm.compiled_report(fns[n], model, ids) for n in (1, 2)}
    tp = {
        n: [c for c in r.collectives if c.in_loop and c.kind == "all-reduce" and c.mesh_axes == ("model",)]
        for n, r in reports.items()
    }
    assert len(tp[1]) > 0 and sum(c.bytes * c.runs for c in tp[2]) == sum(c.bytes * c.runs for c in tp[1])
    # each half's all-reduce holds half a layer's activations (XLA:CPU may put two in one instruction)
    assert {s for c in tp[2] for s in c.shape.split(", ")} == {"f32[1,16,32]"}
    assert {c.shape for c in tp[1]} == {"f32[2,16,32]"}
    for kind in ("all-gather", "reduce-scatter"):
        assert reports[2].count(kind, "data") == reports[1].count(kind, "data") > 0, kind
    # the replicated weights' (biases', norms') gradients are summed over data once, not per half
    assert reports[2].total_bytes("all-reduce", "data") == reports[1].total_bytes("all-reduce", "data") > 0

    def barriers(split):
        return fns[split].lower(model, ids).as_text().count("stablehlo.optimization_barrier")

    # the second half's two all-reduces (attention's and the MLP's) wait for the first's, in the
    # forward loop and again in the backward loop's recomputation; the input gradients' sums too
    assert barriers(1) == 0 and barriers(2) >= 2 * 2 + 1
    g1, g2 = fns[1](model, ids), fns[2](model, ids)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    with pytest.raises(nm.NamedError, match="batch_split=0 must be a positive int"):
        nn.ExplicitStack(param, compute, batch_split=0)


# ---- reports ---------------------------------------------------------------------------------------


def test_plan_compile_puts_the_modes_side_by_side(capsys):
    from named.trainer.commands import cli

    small = ["--model.n_layer", "1", "--data.seq_len", "32", "--trainer.train_batch_size", "8"]
    config = str(ROOT / "config" / "gpt2_nano_fsdp.yaml")
    assert cli.main_plan(["--config_path", config, "--compile", *small, "--mesh.mode", "explicit"]) == 0
    table = capsys.readouterr().out.split("mesh.mode explicit beside auto")[1].splitlines()[1:]
    head, rows = table[0].split(), {tuple(r.split()[:2]): r.split()[2:] for r in table[1:]}
    assert head[:6] == ["collective", "mesh", "axes", "explicit", "count", "explicit"]
    # explicit mode reduce-scatters its FSDP gradients; GSPMD on CPU forms no reduce-scatter
    explicit_count, _, _, auto_count, _, _ = rows["reduce-scatter", "data"]
    assert int(explicit_count) > 0 and int(auto_count) == 0
    assert ("peak", "memory") in rows
    # auto mode (the default) prints no comparison
    assert cli.main_plan(["--config_path", config, "--compile", *small]) == 0
    assert "beside auto" not in capsys.readouterr().out


@pytest.mark.procs
@pytest.mark.slow
def test_explicit_memory_bench_tiny(tmp_path):
    import json
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    import explicit_memory

    explicit_memory.main(["--tiny", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "explicit_memory_tiny.json").read_text())["rows"]
    for row in rows.values():
        assert row["explicit_over_auto"] == row["explicit"]["peak_bytes"] / row["auto"]["peak_bytes"]
        kinds = {c["kind"] for c in row["explicit"]["collectives"]}
        assert "reduce-scatter" in kinds


def test_lora_adapters_alone_are_differentiated_and_reduce_scattered():
    """With LoRA the caller differentiates the adapters only: explicit mode's backward gives their
    gradients (those of auto mode) and reduce-scatters only theirs; the frozen base weights are
    gathered for the forward pass but get no weight gradient and no reduce-scatter."""
    mesh = nm.make_mesh({"data": 8})
    param, compute = {"embed": "data"}, {"batch": "data"}
    cfg = Gpt2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=96, n_positions=32)
    base = Gpt2LMHeadModel.init(cfg, key=jax.random.key(0))
    model = nn.lora.apply(base, lambda path, _: path.endswith(("c_attn", "up")), rank=4, key=jax.random.key(2))
    # non-zero B, so that A's gradient is not zero either
    model = jax.tree.map(
        lambda x: x + 0.1 if isinstance(x, nm.NamedArray) and "lora_rank" in x.names else x,
        model,
        is_leaf=nm.is_named_array,
    )
    model = nm.shard(model, param, mesh)
    ids = nm.shard(
        nm.named(jax.random.randint(jax.random.key(1), (8, 16), 0, 96), ("batch", "position")), compute, mesh
    )
    adapters, frozen = eqx.partition(model, nn.lora.trainable(model), is_leaf=nm.is_named_array)

    def grad_of(driver):
        def loss(adapters, frozen, ids):
            with nn.explicit_layers(driver):
                return (eqx.combine(adapters, frozen, is_leaf=nm.is_named_array)(ids).array ** 2).mean()

        return nm.named_jit(jax.grad(loss), mapping=compute, out_mapping=param, mesh=mesh)

    explicit = grad_of(nn.ExplicitStack(param, compute))
    got, want = explicit(adapters, frozen, ids), grad_of(None)(adapters, frozen, ids)
    leaves = [(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))]
    assert len(leaves) == 4 and all(  # A and B of c_attn and up, each stacked over the layers
        np.abs(np.asarray(b)).max() > 0 for _, b in leaves
    )
    for a, b in leaves:
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    rep = nm.compiled_report(explicit, adapters, frozen, ids)
    split_adapters = [
        x
        for x in jax.tree.leaves(adapters.blocks, is_leaf=nm.is_named_array)
        if isinstance(x, nm.NamedArray) and "embed" in x.names
    ]
    assert len(split_adapters) == 2  # c_attn's and up's A: (layers, embed, lora_rank); their Bs have no embed
    # per step: each split adapter's gradient, once per layer (the base's ten split weights would add 20)
    assert rep.count("reduce-scatter", "data") == len(split_adapters) * cfg.n_layer


def test_explicit_mode_refuses_plain_per_layer_arguments():
    # the local scan slices per-layer arguments by name; a plain one (Haliax's split keys) is refused
    # rather than handed to every layer whole
    mesh = nm.make_mesh({"data": 8})
    Embed, Mlp, Layers = nm.Axis("embed", 16), nm.Axis("mlp", 32), nm.Axis("layers", 2)
    stack = nm.shard(nn.Stacked.init(Layers, nn.MLP.init, Embed, Mlp, key=jax.random.key(0)), {"embed": "data"}, mesh)
    x = nm.zeros((nm.Axis("batch", 8), Embed))
    with jax.set_mesh(mesh), nn.explicit_layers(nn.ExplicitStack({"embed": "data"}, {"batch": "data"})):
        with pytest.raises(nm.ShardingError, match=r"layer argument args\[0\] is a plain array of shape \(2,\)"):
            stack.fold_via(lambda block, h, k: block(h))(x, jax.random.split(jax.random.key(1), 2))
