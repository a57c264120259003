"""named.inspect: layout notation, the parameter report, the compiled-program report, and the
notebook views — numbers checked against bytes computed by hand."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from _procs import as_users_compile

import named as nm
from named import Axis
from named.inspect import parse_collectives

Embed, Mlp, Batch = Axis("embed", 64), Axis("mlp", 256), Axis("batch", 16)


# ---- layout notation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "batch/data position embed/model",
        "embed",
        "layers embed/data mlp/model",
        "batch/data+model position",
        "",
    ],
)
def test_layout_round_trips_through_parse_layout(text):
    names, mapping = nm.parse_layout(text)
    axes = tuple(Axis(n, 8) for n in names)
    assert nm.layout(axes, mapping) == text


def test_parse_layout_reads_mappings_and_seqax_nesting():
    assert nm.parse_layout("batch/data position embed/model") == (
        ("batch", "position", "embed"),
        {"batch": "data", "embed": "model"},
    )
    # seqax writes d_model/t/d for "split over t, then d"
    assert nm.parse_layout("d_model/t/d") == (("d_model",), {"d_model": ("t", "d")})
    assert nm.parse_layout("d_model/t+d") == nm.parse_layout("d_model/t/d")


@pytest.mark.parametrize(
    "text, match",
    [
        ("batch/data batch", "axis 'batch' appears twice"),
        ("batch/data embed/data", "mesh axis 'data' splits both 'batch' and 'embed'"),
        ("batch//data", "cannot read 'batch//data'"),
        ("emb@d", "cannot read 'emb@d'"),
        ("batch/", "cannot read 'batch/'"),
    ],
)
def test_parse_layout_errors_name_the_token(text, match):
    with pytest.raises(nm.AxisError, match=match):
        nm.parse_layout(text)


def test_layout_of_a_placed_array_is_where_it_lives():
    mesh = nm.make_mesh({"data": 4, "model": 2})
    x = nm.shard(nm.zeros((Batch, Axis("position", 4), Embed)), {"batch": "data", "embed": "model"}, mesh)
    assert nm.layout(x) == "batch/data position embed/model"
    assert nm.layout(x, {"embed": ("data", "model")}) == "batch position embed/data+model"  # what a mapping asks for
    with nm.axis_mapping({"batch": "model"}):
        assert nm.layout(x) == "batch/model position embed"


def test_sharding_errors_carry_enough_to_fix_the_layout():
    mesh = nm.make_mesh({"data": 8})
    w = nm.zeros((Axis("embed", 12), Mlp))
    with pytest.raises(nm.ShardingError, match=r"axis 'embed' of size 12 .* not divisible by 8"):
        nm.param_report({"w": w}, {"embed": "data"}, mesh)


# ---- the parameter report ---------------------------------------------------------------------------


def _two_weight_model():
    return {
        "up": nm.zeros((Embed, Mlp)),  # 64 x 256 float32 = 65,536 bytes
        "down": nm.zeros((Mlp, Embed), jnp.bfloat16),  # 256 x 64 bfloat16 = 32,768 bytes
        "bias": nm.zeros((Mlp,)),  # 1,024 bytes, no axis mapped: replicated
    }


def test_param_report_bytes_under_fsdp_on_8_devices():
    mesh = nm.make_mesh({"data": 8})
    rep = nm.param_report(_two_weight_model(), {"embed": "data"}, mesh)
    rows = {r.path: r for r in rep.rows}
    assert rows["['up']"].layout == "embed/data mlp" and rows["['up']"].dtype == "float32"
    assert (rows["['up']"].global_bytes, rows["['up']"].bytes_per_device) == (65536, 8192)
    assert (rows["['down']"].global_bytes, rows["['down']"].bytes_per_device) == (32768, 4096)
    assert rows["['down']"].layout == "mlp embed/data" and rows["['down']"].dtype == "bfloat16"
    assert (rows["['bias']"].global_bytes, rows["['bias']"].bytes_per_device) == (1024, 1024)
    assert rows["['bias']"].replicated and not rows["['up']"].replicated
    assert rep.total_bytes == 65536 + 32768 + 1024
    assert rep.bytes_per_device == 8192 + 4096 + 1024
    assert rep.n_params == 2 * 64 * 256 + 256
    assert rep.replicated_fraction == pytest.approx(1024 / 99328)
    text = str(rep)
    assert "['up']" in text and "embed/data mlp" in text and "8.00 KiB" in text
    assert "1.0% of the bytes replicated" in text and "13.00 KiB per device" in text
    html = rep._repr_html_()
    assert html.count("<tr") == 4 and "embed/data mlp" in html and "background" in html  # the replicated row is marked


def test_param_report_under_2d_mapping_and_real_device_bytes_agree():
    mesh = nm.make_mesh({"data": 4, "model": 2})
    mapping = {"embed": "data", "mlp": "model"}
    tree = _two_weight_model()
    rep = nm.param_report(tree, mapping, mesh)
    assert [r.bytes_per_device for r in rep.rows] == [512, 4096, 8192]  # bias mlp/model, down, up (sorted keys)
    placed = nm.shard(tree, mapping, mesh)
    per_device = nm.inspect.device_bytes(placed)
    assert per_device == {d.id: rep.bytes_per_device for d in jax.devices()}


def test_param_report_on_an_abstract_model_allocates_nothing():
    shapes = jax.eval_shape(lambda: {"w": nm.zeros((Embed, Mlp))})
    rep = nm.param_report(shapes, {"mlp": "data"}, nm.make_mesh({"data": 8}))
    assert rep.rows[0].bytes_per_device == 64 * 256 * 4 // 8


# ---- the compiled-program report ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fsdp_matmul():
    mesh = nm.make_mesh({"data": 8})
    w = nm.shard(nm.random.normal(jax.random.key(0), (Embed, Axis("out", 32))), {"embed": "data"}, mesh)
    x = nm.shard(nm.random.normal(jax.random.key(1), (Batch, Embed)), {"batch": "data"}, mesh)
    f = nm.named_jit(lambda w, x: nm.dot(x, w, axis="embed"), mapping={"batch": "data"}, mesh=mesh)
    return mesh, f, w, x


def test_compiled_report_of_an_fsdp_matmul(fsdp_matmul):
    mesh, f, w, x = fsdp_matmul
    rep = nm.compiled_report(f, w, x)
    assert rep.mesh_shape == {"data": 8}
    assert [(c.kind, c.mesh_axes, c.group_size) for c in rep.collectives] == [("all-gather", ("data",), 8)]
    gather = rep.collectives[0]
    assert gather.bytes == 64 * 32 * 4  # the gathered weight, whole on every device
    assert gather.sent_bytes == 64 * 32 * 4 * 7 // 8
    assert rep.flops == 2 * (16 // 8) * 64 * 32  # this device's rows times the whole weight
    assert rep.memory["argument"] == (64 * 32 // 8 + 2 * 64) * 4  # one eighth of w and of x
    assert rep.memory["output"] == 2 * 32 * 4
    assert rep.peak_bytes >= rep.memory["argument"] + rep.memory["output"]
    text = str(rep)
    assert "all-gather" in text and "8.00 KiB" in text and "FLOPs per device: 8,192" in text
    assert "<table" in rep._repr_html_() and "all-gather" in rep._repr_html_()


def test_compiled_report_takes_lowered_and_compiled_stages(fsdp_matmul):
    mesh, f, w, x = fsdp_matmul
    lowered = f.lower(w, x)
    assert nm.compiled_report(lowered).count("all-gather", "data") == 1
    assert nm.compiled_report(lowered.compile()).total_bytes("all-gather") == 8192
    with pytest.raises(TypeError, match="compiled_report takes"):
        nm.compiled_report(42)


def test_explicit_fsdp_gradient_reports_a_reduce_scatter(fsdp_matmul):
    mesh, _, w, x = fsdp_matmul
    mm = nm.shard_map(
        lambda w, x: nm.einsum("batch embed, embed out -> batch out", x, nm.all_gather(w, "embed")),
        in_mapping=({"embed": "data"}, {"batch": "data"}),
    )
    g = nm.named_jit(jax.grad(lambda w, x: (mm(w, x) ** 2).sum().scalar()), mesh=mesh)
    rep = nm.compiled_report(g, w, x)
    assert rep.count("reduce-scatter", "data") == 1 and rep.count("all-gather", "data") == 1
    assert rep.total_bytes("reduce-scatter") == 64 * 32 * 4  # the whole weight gradient, summed and scattered


def test_parse_collectives_reads_replica_groups_in_every_form():
    mesh = nm.make_mesh({"data": 4, "model": 2})
    hlo = """
ENTRY %main (p: f32[4,8]) -> f32[16,8] {
  %ag = f32[16,8]{1,0} all-gather(f32[4,8]{1,0} %p), channel_id=1, replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}
  %ar = f32[4,8]{1,0} all-reduce(%p), channel_id=2, replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add
  %rs = bf16[2,8]{1,0} reduce-scatter(%x), channel_id=3, replica_groups=[1,8]<=[8], dimensions={0}
  %cp = f32[4,8]{1,0} collective-permute(%p), channel_id=4, source_target_pairs={{0,2},{2,4},{4,6},{6,0}}
  %ags = (f32[4,8]{1,0}, f32[16,8]{1,0}) all-gather-start(%p), channel_id=5, \
replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}
  %agd = f32[16,8]{1,0} all-gather-done(%ags)
  ROOT %a2a = f32[4,8]{1,0} all-to-all(%p), channel_id=6, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
}
"""
    got = [(c.kind, c.mesh_axes, c.group_size, c.bytes) for c in parse_collectives(hlo, mesh)]
    assert got == [
        ("all-gather", ("data",), 4, 16 * 8 * 4),
        ("all-reduce", ("model",), 2, 4 * 8 * 4),
        ("reduce-scatter", ("data", "model"), 8, 2 * 8 * 2 * 8),  # the operand: 8 devices' worth of the result
        ("collective-permute", ("data",), 2, 4 * 8 * 4),
        ("all-gather", ("data",), 4, 16 * 8 * 4),  # async start: the result, not the operand
        ("all-to-all", ("data", "model"), 8, 4 * 8 * 4),
    ]


def test_collectives_in_a_while_body_are_marked():
    hlo = """
%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ar = f32[8]{0} all-reduce(%x), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
}
ENTRY %main (p: f32[8]) -> f32[8] {
  %w = (s32[], f32[8]) while(%t), condition=%cond, body=%body
  ROOT %ar2 = f32[8]{0} all-reduce(%y), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
}
"""
    got = [(c.name, c.in_loop) for c in parse_collectives(hlo, nm.make_mesh({"data": 8}))]
    assert got == [("ar", True), ("ar2", False)]


# ---- loops: every iteration counted ------------------------------------------------------------------

_NESTED_HLO = """
HloModule m, entry_computation_layout={(f32[8,16]{1,0})->f32[8,4]{1,0}}

%inner_body (p: (s32[], f32[8,16], f32[16,4])) -> (s32[], f32[8,16], f32[16,4]) {
  %p = (s32[], f32[8,16]{1,0}, f32[16,4]{1,0}) parameter(0)
  %x = f32[8,16]{1,0} get-tuple-element(%p), index=1
  %w = f32[16,4]{1,0} get-tuple-element(%p), index=2
  %d = f32[8,4]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %ar = f32[8,4]{1,0} all-reduce(%d), channel_id=1, replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add
  ROOT %t = (s32[], f32[8,16]{1,0}, f32[16,4]{1,0}) tuple(%i, %x, %w)
}

%outer_body (q: (s32[], f32[8,16], /*index=2*/f32[16,4])) -> (s32[], f32[8,16], /*index=2*/f32[16,4]) {
  %q = (s32[], f32[8,16]{1,0}, f32[16,4]{1,0}) parameter(0)
  %inner = (s32[], f32[8,16]{1,0}, f32[16,4]{1,0}) while(%q), condition=%cond, body=%inner_body, \
backend_config={"known_trip_count":{"n":"4"},"known_init_step":{"init":"0","step":"1"}}
  %ag = f32[16,16]{1,0} all-gather(%y), channel_id=2, replica_groups=[4,2]<=[8], dimensions={0}
  ROOT %e = f32[8,16]{1,0} exponential(%z)
}

%mystery_body (r: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %r = (s32[], f32[8,16]{1,0}) parameter(0)
  %m = f32[8,16]{1,0} multiply(%a, %b)
  ROOT %ag2 = f32[8,16]{1,0} all-gather(%c), channel_id=3, replica_groups=[4,2]<=[8], dimensions={0}
}

ENTRY %main (arg: f32[8,16]) -> f32[8,4] {
  %arg = f32[8,16]{1,0} parameter(0)
  %outer = (s32[], f32[8,16]{1,0}, f32[16,4]{1,0}) while(%t0), condition=%cond, body=%outer_body, \
/*index=5*/backend_config={"known_trip_count":{"n":"3"}}
  %loop = (s32[], f32[8,16]{1,0}) while(%t1), condition=%cond2, body=%mystery_body
  ROOT %top = f32[8,4]{1,0} all-reduce(%v), channel_id=4, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
}
"""


def test_nested_loops_multiply_trip_counts_and_unknown_trips_are_named():
    from named import _hlo

    cost = _hlo.analyze(_NESTED_HLO, nm.make_mesh({"data": 4, "model": 2}))
    runs = {c.name: (c.runs, c.in_loop, c.runs_known, c.mesh_axes) for c in cost.collectives}
    assert runs == {
        "ar": (3 * 4, True, True, ("model",)),  # inner loop of 4 inside an outer loop of 3
        "ag": (3, True, True, ("model",)),
        "ag2": (1, True, False, ("model",)),  # a loop of unknown length: counted once, and flagged
        "top": (1, False, True, ("data", "model")),
    }
    assert cost.matmul_flops == 3 * 4 * 2 * 8 * 4 * 16  # 2 * result elements * contracted size, per run
    assert cost.transcendentals == 3 * 8 * 16
    assert cost.flops == cost.matmul_flops + 8 * 16  # + the multiply in the loop of unknown length, once
    assert [n for n, _ in cost.loops] == ["outer", "inner", "loop"]
    assert dict(cost.loops) == {"outer": 3, "inner": 4, "loop": None} and cost.unknown_loops == ["loop"]


def _gpt2_grad_step(n_layer: int, *, unrolled: bool = False):
    """The weight gradient of a tiny GPT-2 under FSDP, compiled on abstract inputs. ``unrolled``
    runs the same blocks in a Python loop (no while loop in the HLO): an independent program."""
    from named.models import Gpt2Config, Gpt2LMHeadModel
    from named.nn.loss import next_token_loss

    cfg = Gpt2Config(n_layer=n_layer, n_head=2, n_embd=32, n_positions=64, vocab_size=128)
    mesh = nm.make_mesh({"data": 8})

    def abstract(tree, mapping):
        return jax.tree.map(
            lambda x: (
                nm.NamedArray(
                    jax.ShapeDtypeStruct(x.array.shape, x.array.dtype, sharding=nm.sharding_for(x, mapping, mesh)),
                    x.axes,
                )
                if isinstance(x, nm.NamedArray)
                else x
            ),
            tree,
            is_leaf=nm.is_named_array,
        )

    model = abstract(jax.eval_shape(lambda k: Gpt2LMHeadModel.init(cfg, key=k), jax.random.key(0)), {"embed": "data"})
    ids = abstract(
        nm.NamedArray(jax.ShapeDtypeStruct((16, 32), jnp.int32), (Batch, Axis("position", 32))), {"batch": "data"}
    )

    def logits(m, ids):
        if not unrolled:
            return m(ids)
        x = m.wte(ids) + m.wpe(nm.arange(ids.resolve_axis("position")))
        for block in m.blocks.unstacked():
            x, _ = block(x)
        return m.wte.unembed(m.ln_f(x))

    grad = nm.named_jit(
        jax.grad(lambda m, ids: next_token_loss(logits(m, ids), ids).scalar()), mapping={"batch": "data"}, mesh=mesh
    )
    return cfg, nm.compiled_report(grad.lower(model, ids).compile(as_users_compile()))  # loops as users see them


@pytest.fixture(scope="module")
def gpt2_reports():
    return {key: _gpt2_grad_step(n, unrolled=u) for key, n, u in (("s2", 2, False), ("s8", 8, False), ("u2", 2, True))}


def test_flops_of_a_stacked_model_grow_with_depth(gpt2_reports):
    from named.models import flops_per_token

    tokens_per_device = 16 * 32 // 8
    for key in ("s2", "s8", "u2"):
        cfg, rep = gpt2_reports[key]
        want = flops_per_token(cfg, 32) * tokens_per_device  # 6N + 12·L·d·T, from the config alone
        assert rep.matmul_flops == pytest.approx(want, rel=0.01), (key, rep.matmul_flops, want)
        assert rep.flops == pytest.approx(want, rel=0.15)
    (_, s2), (_, s8), (_, u2) = gpt2_reports["s2"], gpt2_reports["s8"], gpt2_reports["u2"]
    assert [n for _, n in s2.loops] == [2, 2] and [n for _, n in s8.loops] == [8, 8]  # forward and backward scans
    assert "while" not in u2.hlo and not u2.loops
    # on a program without loops, our count agrees with XLA's own cost analysis
    assert u2.flops == pytest.approx(u2.xla_flops, rel=0.02)
    assert s2.matmul_flops == pytest.approx(u2.matmul_flops, rel=1e-6)  # the scan weighted by its trip count
    # XLA's cost analysis counts a loop body once: depth hardly moves its figure
    assert s8.xla_flops < 1.1 * s2.xla_flops and s8.flops > 3 * s2.flops


def test_collectives_in_a_scan_are_counted_per_layer_and_marked(gpt2_reports):
    (_, s2), (_, s8) = gpt2_reports["s2"], gpt2_reports["s8"]
    looped = [c for c in s8.collectives if c.in_loop]
    assert looped and all(c.runs == 8 and c.runs_known for c in looped)  # FSDP gathers each layer's weights in the scan
    assert all(c.runs == 1 for c in s8.collectives if not c.in_loop)
    for kind in ("all-gather", "all-reduce"):
        per_layer = sum(1 for c in s2.collectives if c.in_loop and c.kind == kind)
        assert s8.instructions(kind) == s2.instructions(kind)  # the same program text ...
        assert s8.count(kind) - s2.count(kind) == 6 * per_layer  # ... run 6 more layers
    assert s8.count("all-gather", "data") > 2 * 8  # at least a couple of gathers per layer
    assert any(row[0] == "all-gather" and row[5] == "yes" for row in s8.summary())
    text = str(s8)
    assert "while loops (trip count):" in text and "x8" in text and "yes" in text


def test_named_plan_compile_counts_microbatches_and_layers():
    """named-plan --compile: the train step's FLOPs (nested loops: microbatches x layers) against
    FLOPs/token x tokens / devices."""
    from pathlib import Path

    from named.models import Gpt2Config, flops_per_token
    from named.trainer.commands import plan
    from named.trainer.config import load_config

    config = Path(__file__).parent.parent / "config" / "gpt2_nano_fsdp.yaml"
    cfg = load_config(
        config,
        [
            "--model.n_layer",
            "2",
            "--model.n_embd",
            "128",
            "--model.n_head",
            "4",
            "--model.vocab_size",
            "384",
            "--data.seq_len",
            "32",
            "--trainer.train_batch_size",
            "16",
            "--trainer.microbatches",
            "2",
        ],
    )
    rep = plan.train_step_report(cfg, compiler_options=as_users_compile())  # the loops a user's compile has
    model_cfg = Gpt2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=384)  # what FLOPs/token depends on
    want = flops_per_token(model_cfg, 32) * 16 * 32 / 8
    assert sorted(n for _, n in rep.loops) == [2, 2, 2]  # the microbatch fold around two layer scans
    assert rep.matmul_flops == pytest.approx(want, rel=0.01)
    assert rep.flops == pytest.approx(want, rel=0.10)


# ---- notebook views ---------------------------------------------------------------------------------


def test_named_array_html_shows_axes_dtype_and_layout():
    mesh = nm.make_mesh({"data": 4, "model": 2})
    x = nm.shard(nm.zeros((Batch, Embed), jnp.bfloat16), {"batch": "data"}, mesh)
    page = x._repr_html_()
    assert "bfloat16" in page and "batch/data embed" in page
    assert "<td><code>batch</code></td><td style='text-align:right'>16</td><td><code>batch/data</code></td>" in page
    assert "2.00 KiB" in page
