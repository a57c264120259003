"""named.inspect: layout notation, the parameter report, the compiled-program report, and the
notebook views — numbers checked against bytes computed by hand."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import named as nm
from named import Axis
from named.inspect import parse_collectives

Embed, Mlp, Batch = Axis("embed", 64), Axis("mlp", 256), Axis("batch", 16)


# ---- layout notation ------------------------------------------------------------------------------


@pytest.mark.parametrize("text", [
    "batch/data position embed/model",
    "embed",
    "layers embed/data mlp/model",
    "batch/data+model position",
    "",
])
def test_layout_round_trips_through_parse_layout(text):
    names, mapping = nm.parse_layout(text)
    axes = tuple(Axis(n, 8) for n in names)
    assert nm.layout(axes, mapping) == text


def test_parse_layout_reads_mappings_and_seqax_nesting():
    assert nm.parse_layout("batch/data position embed/model") == (("batch", "position", "embed"),
                                                                   {"batch": "data", "embed": "model"})
    # seqax writes d_model/t/d for "split over t, then d"
    assert nm.parse_layout("d_model/t/d") == (("d_model",), {"d_model": ("t", "d")})
    assert nm.parse_layout("d_model/t+d") == nm.parse_layout("d_model/t/d")


@pytest.mark.parametrize("text, match", [
    ("batch/data batch", "axis 'batch' appears twice"),
    ("batch/data embed/data", "mesh axis 'data' splits both 'batch' and 'embed'"),
    ("batch//data", "cannot read 'batch//data'"),
    ("emb@d", "cannot read 'emb@d'"),
    ("batch/", "cannot read 'batch/'"),
])
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
    f = nm.named_jit(lambda w, x: nm.dot(x, w, axis="embed"), axis_resources={"batch": "data"}, mesh=mesh)
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
    mm = nm.shard_map(lambda w, x: nm.einsum("batch embed, embed out -> batch out", x, nm.all_gather(w, "embed")),
                      in_axis_resources=({"embed": "data"}, {"batch": "data"}))
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
  %ags = (f32[4,8]{1,0}, f32[16,8]{1,0}) all-gather-start(%p), channel_id=5, replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}
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


# ---- notebook views ---------------------------------------------------------------------------------


def test_named_array_html_shows_axes_dtype_and_layout():
    mesh = nm.make_mesh({"data": 4, "model": 2})
    x = nm.shard(nm.zeros((Batch, Embed), jnp.bfloat16), {"batch": "data"}, mesh)
    page = x._repr_html_()
    assert "bfloat16" in page and "batch/data embed" in page
    assert "<td><code>batch</code></td><td style='text-align:right'>16</td><td><code>batch/data</code></td>" in page
    assert "2.00 KiB" in page
