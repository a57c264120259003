"""Explicit mode (nm.shard_map and collectives by axis name) on 8 fake CPU devices.

The centre piece is the seed post's FSDP+TP transformer block — GQA attention and a SwiGLU MLP —
written per device with all_gather -> einsum -> psum / psum_scatter, checked against the same
block run by GSPMD (named_jit + named.nn modules): forward and gradients within 1e-5, and the
compiled gradient turns every weight all-gather into a reduce-scatter.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import named as nm
from named import Axis, nn

MESH = {"data": 4, "model": 2}
PARAM = {"embed": "data", "mlp": "model", "heads": "model", "kv_heads": "model"}
COMPUTE = {"batch": "data", "mlp": "model", "heads": "model", "kv_heads": "model"}
# seqax's residual layout: x[B/d, L, M/t], so each block all-gathers x and reduce-scatters its output
COMPUTE_SEQAX = {**COMPUTE, "embed": "model"}

Batch, Pos, Embed = Axis("batch", 8), Axis("position", 16), Axis("embed", 32)
Heads, KVHeads, HeadSize, Mlp = Axis("heads", 4), Axis("kv_heads", 2), Axis("head_size", 8), Axis("mlp", 64)


@pytest.fixture(scope="module")
def mesh():
    return nm.make_mesh(MESH)


def _put(tree, mapping, mesh):
    return jax.tree.map(lambda x: nm.shard(x, mapping, mesh), tree, is_leaf=nm.is_named_array)


def _max_diff(a, b) -> float:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    return max(float(jnp.max(jnp.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(la, lb))


def _rel_diff(a, b) -> float:
    """max |a - b| / max |b|: agreement relative to the array's scale (float32 sums in another
    order differ by ~1e-7 of it)."""
    scale = max(float(jnp.max(jnp.abs(np.asarray(y)))) for y in jax.tree.leaves(b))
    return _max_diff(a, b) / max(scale, 1e-30)


# ---- the block: parameters shared by both versions ------------------------------------------------


class Attention(eqx.Module):
    q_proj: nn.Linear  # embed -> heads head_size
    k_proj: nn.Linear  # embed -> kv_heads head_size
    v_proj: nn.Linear
    o_proj: nn.Linear  # heads head_size -> embed


class Block(eqx.Module):
    ln1: nn.RMSNorm
    attn: Attention
    ln2: nn.RMSNorm
    mlp: nn.MLP  # down(silu(gate(x)) * up(x))

    @staticmethod
    def init(key) -> Block:
        kq, kk, kv, ko, km, k1, k2 = jax.random.split(key, 7)
        attn = Attention(
            nn.Linear.init(Embed, (Heads, HeadSize), key=kq, use_bias=False),
            nn.Linear.init(Embed, (KVHeads, HeadSize), key=kk, use_bias=False),
            nn.Linear.init(Embed, (KVHeads, HeadSize), key=kv, use_bias=False),
            nn.Linear.init((Heads, HeadSize), Embed, key=ko, use_bias=False),
        )
        # non-trivial norm weights, so their gradients are tested against something
        ln1 = nn.RMSNorm(1.0 + 0.1 * nm.random.normal(k1, (Embed,)), Embed)
        ln2 = nn.RMSNorm(1.0 + 0.1 * nm.random.normal(k2, (Embed,)), Embed)
        return Block(ln1, attn, ln2, nn.MLP.init(Embed, Mlp, key=km, activation="silu", gated=True, use_bias=False))


def gspmd_block(p: Block, x, positions):
    """The reference: named.nn modules under named_jit; XLA's partitioner places the collectives."""

    def attention(x):
        q = nn.rotary_embedding(p.attn.q_proj(x), positions)
        k = nn.rotary_embedding(p.attn.k_proj(x), positions).rename({"position": "key_position"})
        v = p.attn.v_proj(x).rename({"position": "key_position"})
        return p.attn.o_proj(nn.dot_product_attention(q, k, v, causal=True))

    h = x + attention(p.ln1(x))
    return h + p.mlp(p.ln2(h))


# ---- the same block in explicit mode (the seed post, written with names) ---------------------------


def rms_norm(x, weight, eps=1e-6):
    """RMSNorm over a whole embed; the weight is stored embed/data (FSDP) and gathered here."""
    w = nm.all_gather(weight, "embed")
    x32 = x.astype(jnp.float32)
    return (x32 * nm.rsqrt(nm.square(x32).mean("embed") + eps) * w).astype(x.dtype)


def explicit_attention(p: Attention, nx, positions):
    # nx: batch/data position embed. Weights: embed/data {heads,kv_heads}/model head_size.
    wq = nm.all_gather(p.q_proj.weight, "embed")  # FSDP's gather before the local matmul
    wk = nm.all_gather(p.k_proj.weight, "embed")
    wv = nm.all_gather(p.v_proj.weight, "embed")
    q = nm.einsum("batch position embed, embed heads head_size -> batch position heads head_size", nx, wq)
    k = nm.einsum("batch position embed, embed kv_heads head_size -> batch position kv_heads head_size", nx, wk)
    v = nm.einsum("batch position embed, embed kv_heads head_size -> batch position kv_heads head_size", nx, wv)
    q, k = nn.rotary_embedding(q, positions), nn.rotary_embedding(k, positions)
    k, v = k.rename({"position": "key_position"}), v.rename({"position": "key_position"})
    # local GQA: this device's query heads use exactly this device's kv heads (both split over model)
    out = nn.dot_product_attention(q, k, v, causal=True)
    wo = nm.all_gather(p.o_proj.weight, "embed")  # heads/model head_size embed
    # contracting the model-split heads leaves partial sums: the type says so
    return nm.einsum_unreduced("batch position heads head_size, heads head_size embed -> batch position embed", out, wo)


def explicit_mlp(p: nn.MLP, nx):
    w_gate = nm.all_gather(p.gate.weight, "embed")  # embed mlp/model
    w_up = nm.all_gather(p.up.weight, "embed")
    gate = nm.einsum("batch position embed, embed mlp -> batch position mlp", nx, w_gate)
    up = nm.einsum("batch position embed, embed mlp -> batch position mlp", nx, w_up)
    y = nm.silu(gate) * up  # batch/data position mlp/model
    w_down = nm.all_gather(p.down.weight, "embed")  # mlp/model embed
    return nm.einsum_unreduced("batch position mlp, mlp embed -> batch position embed", y, w_down)


def explicit_block(p: Block, x, positions):
    """Megatron layout: the residual x is batch/data position embed (replicated over model),
    so each sub-block ends in an all-reduce (psum)."""
    h = x + nm.psum(explicit_attention(p.attn, rms_norm(x, p.ln1.weight), positions))
    return h + nm.psum(explicit_mlp(p.mlp, rms_norm(h, p.ln2.weight)))


def explicit_block_seqax(p: Block, x, positions):
    """seqax's layout: the residual is batch/data position embed/model; gather it before each
    norm, and reduce-scatter each sub-block's partial sums back onto embed/model."""
    gx = nm.all_gather(x, "embed")
    h = x + nm.psum_scatter(explicit_attention(p.attn, rms_norm(gx, p.ln1.weight), positions), "embed")
    gh = nm.all_gather(h, "embed")
    return h + nm.psum_scatter(explicit_mlp(p.mlp, rms_norm(gh, p.ln2.weight)), "embed")


def _inputs(mesh, compute):
    block = _put(Block.init(jax.random.key(0)), PARAM, mesh)
    x = nm.shard(nm.random.normal(jax.random.key(1), (Batch, Pos, Embed)), compute, mesh)
    probe = nm.shard(nm.random.normal(jax.random.key(2), (Batch, Pos, Embed)), compute, mesh)
    positions = nm.arange(Pos)
    return block, x, probe, positions


def _value_and_grad(fn, mesh, compute):
    """One program per version: the block's output and the gradients of <output, probe>, all
    returned in the parameter layout (gradients as FSDP stores them; y and dx reshard to it)."""

    def loss(p, x, probe, pos):
        y = fn(p, x, pos)
        return (y * probe).sum().scalar(), y

    vg = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    return nm.named_jit(vg, mapping=compute, out_mapping=PARAM, mesh=mesh)


@pytest.fixture(scope="module", params=["megatron", "seqax"])
def block_run(request, mesh):
    compute, body = (COMPUTE, explicit_block) if request.param == "megatron" else (COMPUTE_SEQAX, explicit_block_seqax)
    args = _inputs(mesh, compute)
    explicit = _value_and_grad(nm.shard_map(body, in_mapping=(PARAM, compute, compute)), mesh, compute)
    gspmd = _value_and_grad(gspmd_block, mesh, compute)
    (_, ye), (gp_e, gx_e) = explicit(*args)
    (_, yg), (gp_g, gx_g) = gspmd(*args)
    return dict(
        name=request.param,
        compute=compute,
        y=(ye, yg),
        gx=(gx_e, gx_g),
        gp=(gp_e, gp_g),
        report=nm.compiled_report(explicit, *args),
    )


def test_explicit_block_forward_equals_gspmd(block_run):
    ye, yg = block_run["y"]
    assert ye.axes == yg.axes == (Batch, Pos, Embed)
    assert float(jnp.max(jnp.abs(yg.array))) > 1.0  # not a trivially small output
    assert _max_diff(ye, yg) < 1e-5


def test_explicit_block_gradients_equal_gspmd(block_run):
    (gp_e, gp_g), (gx_e, gx_g) = block_run["gp"], block_run["gx"]
    assert _rel_diff(gx_e, gx_g) < 1e-5
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(gp_e)[0], jax.tree.leaves(gp_g)):
        assert _rel_diff(a, b) < 1e-5, (jax.tree_util.keystr(path), _max_diff(a, b), _rel_diff(a, b))
    assert float(jnp.max(jnp.abs(gp_g.mlp.down.weight.array))) > 1e-2  # gradients that say something
    # weight gradients come out FSDP-sharded, like the weights (reduce-scattered, never whole)
    assert nm.layout(gp_e.mlp.gate.weight) == "embed/data mlp/model"


def test_weight_all_gather_transposes_to_reduce_scatter(block_run):
    """The gradient of each FSDP all-gather is a reduce-scatter over data, in the optimized HLO."""
    rep = block_run["report"]
    n_weights = 9  # ln1, q, k, v, o, ln2, gate, up, down: each stored embed/data, gathered in the forward
    assert "reduce-scatter" in rep.hlo
    assert rep.count("reduce-scatter", "data") == n_weights, str(rep)
    assert rep.count("all-gather", "data") == n_weights, str(rep)
    assert rep.count("all-reduce", "data") == 0, str(rep)  # no FSDP gradient is all-reduced
    if block_run["name"] == "seqax":
        assert rep.count("reduce-scatter", "model") >= 2, str(rep)  # the two psum_scatters onto embed/model
    # each reduce-scatter moves one whole gathered gradient: e.g. gate's embed x mlp/model = 32 x 32 f32
    sizes = sorted(c.bytes for c in rep.collectives if c.kind == "reduce-scatter" and c.mesh_axes == ("data",))
    assert sizes.count(Embed.size * (Mlp.size // 2) * 4) == 3, sizes  # gate, up, down


# ---- local blocks and layouts ----------------------------------------------------------------------


def _fsdp_pair(mesh):
    w = nm.shard(nm.random.normal(jax.random.key(0), (Axis("embed", 64), Axis("mlp", 32))), PARAM, mesh)
    x = nm.shard(nm.random.normal(jax.random.key(1), (Axis("batch", 16), Axis("embed", 64))), COMPUTE, mesh)
    return w, x


def test_blocks_keep_names_local_sizes_and_layouts(mesh):
    w, x = _fsdp_pair(mesh)
    seen = {}

    def body(w, x):
        seen["w"] = (w.shape, nm.layout(w))
        seen["x"] = (x.shape, nm.layout(x))
        wg = nm.all_gather(w, "embed")
        seen["wg"] = (wg.shape, nm.layout(wg))
        return nm.einsum("batch embed, embed mlp -> batch mlp", x, wg)

    y = nm.shard_map(body, mesh=mesh, in_mapping=(PARAM, COMPUTE))(w, x)
    assert seen["w"] == ({"embed": 16, "mlp": 16}, "embed/data mlp/model")
    assert seen["x"] == ({"batch": 4, "embed": 64}, "batch/data embed")
    assert seen["wg"] == ({"embed": 64, "mlp": 16}, "embed mlp/model")
    assert y.shape == {"batch": 16, "mlp": 32}
    assert nm.layout(y) == "batch/data mlp/model"  # read off the block's layout, no out mapping needed
    np.testing.assert_allclose(y.array, np.asarray(x.array) @ np.asarray(w.array), rtol=1e-5, atol=1e-5)


def test_works_inside_named_jit_and_under_grad(mesh):
    w, x = _fsdp_pair(mesh)
    f = nm.shard_map(
        lambda w, x: nm.einsum("batch embed, embed mlp -> batch mlp", x, nm.all_gather(w, "embed")),
        in_mapping=(PARAM, COMPUTE),
    )
    g = nm.named_jit(jax.grad(lambda w, x: (f(w, x) ** 2).sum().scalar()), mesh=mesh)(w, x)
    ref = jax.grad(lambda w, x: jnp.sum((x @ w) ** 2))(np.asarray(w.array), np.asarray(x.array))
    np.testing.assert_allclose(g.array, ref, rtol=1e-5, atol=1e-4)


def test_psum_scatter_all_to_all_and_reductions_match_numpy(mesh):
    a = np.arange(16 * 8, dtype=np.float32).reshape(16, 8) / 7.0
    x = nm.shard(nm.named(a, "batch feat"), {"batch": "data"}, mesh)

    def body(x):
        out = {}
        out["sum_batch"] = nm.psum(x, "batch")  # the whole batch: local rows, then across data
        out["max_batch"] = nm.pmax(x, "batch")
        out["mean_batch"] = nm.pmean(x, "batch")
        out["sum_all"] = nm.psum(x, ("batch", "feat"))
        # a partial sum of my own making: every data shard contributes its rows' sum
        mine = nm.Unreduced(x.sum("batch"), ("data",))
        out["scattered"] = nm.psum_scatter(mine, "feat")  # feat/data
        # sequence -> feature parallel: batch becomes whole, feat split over data
        out["a2a"] = nm.all_to_all(x, split="feat", concat="batch")
        # a fresh axis has no layout; this one differs across data, so say it is split there
        out["index"] = nm.with_layout(
            nm.named(nm.axis_index("batch", of=x) * jnp.ones((1,), jnp.int32), "one"), "one/data"
        )
        return out

    out = nm.shard_map(body, mesh=mesh, in_mapping={"batch": "data"})(x)
    np.testing.assert_allclose(out["sum_batch"].array, a.sum(0), rtol=1e-6)
    np.testing.assert_allclose(out["max_batch"].array, a.max(0))
    np.testing.assert_allclose(out["mean_batch"].array, a.mean(0), rtol=1e-6)
    np.testing.assert_allclose(out["sum_all"].array, a.sum(), rtol=1e-6)
    np.testing.assert_allclose(out["scattered"].array, a.sum(0), rtol=1e-6)
    assert nm.layout(out["scattered"]) == "feat/data"
    np.testing.assert_allclose(out["a2a"].array, a)
    assert nm.layout(out["a2a"]) == "batch feat/data"
    np.testing.assert_array_equal(out["index"].array, [0, 1, 2, 3])


def test_pmax_has_jnp_max_gradient_under_jit(mesh):
    """nm.pmax differentiates like jnp.max over the whole axis: the gradient goes to the entries
    that hold the maximum, split equally among ties (lax.pmax alone has no differentiation rule)."""
    a = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
    a[13, 2] = a[2, 2] = a[:, 2].max() + 1.0  # a tie across two devices (rows 2 and 13 sit on data 0 and 3)
    r = np.random.default_rng(1).standard_normal(8).astype(np.float32)
    x = nm.shard(nm.named(a, "batch feat"), {"batch": "data"}, mesh)
    pmax = nm.shard_map(lambda v: nm.pmax(v, "batch"), mesh=mesh, in_mapping={"batch": "data"})
    got = jax.jit(jax.grad(lambda v: (pmax(v).array * r).sum()))(x)
    want = jax.grad(lambda v: (jnp.max(v, axis=0) * r).sum())(a)
    np.testing.assert_allclose(got.array, want, rtol=1e-6)
    assert got.array[2, 2] == got.array[13, 2] == r[2] / 2


def test_all_gather_over_two_mesh_axes_keeps_the_order(mesh):
    a = np.arange(32, dtype=np.float32)
    x = nm.shard(nm.named(a, "embed"), {"embed": ("data", "model")}, mesh)

    def body(x):
        assert nm.layout(x) == "embed/data+model" and x.axis_size("embed") == 4
        return nm.all_gather(x, "embed", invariant=True)

    y = nm.shard_map(body, mesh=mesh, in_mapping={"embed": ("data", "model")})(x)
    np.testing.assert_array_equal(y.array, a)
    assert nm.layout(y) == "embed"


def test_with_layout_restores_a_dropped_layout(mesh):
    x = nm.shard(nm.random.normal(jax.random.key(0), (Axis("heads", 4), Axis("d", 6))), {"heads": "model"}, mesh)

    def body(x):
        flat = x.flatten_axes(("heads", "d"), "hd")  # a fresh axis: its layout is gone
        assert nm.layout(flat) == "hd"
        back = nm.with_layout(flat.unflatten_axis("hd", (Axis("heads", 2), Axis("d", 6))), "heads/model d")
        return nm.all_gather(back, "heads", invariant=True)

    y = nm.shard_map(body, mesh=mesh, in_mapping={"heads": "model"})(x)
    np.testing.assert_allclose(y.array, x.array)


# ---- partial sums are visible and refused until reduced ------------------------------------------------


def test_unreduced_refuses_ops_and_says_how_to_fix(mesh):
    w, x = _fsdp_pair(mesh)
    errors = []

    def body(w, x):
        h = nm.einsum("batch embed, embed mlp -> batch mlp", x, nm.all_gather(w, "embed"))
        u = nm.einsum_unreduced("batch mlp, embed mlp -> batch embed", h, nm.all_gather(w, "embed"))
        assert isinstance(u, nm.Unreduced) and u.over == ("model",)
        assert nm.layout(u) == "batch/data embed {U: model}"
        for attempt in (
            lambda: nm.exp(u),
            lambda: u + x,
            lambda: u * x,
            lambda: u.sum("embed"),
            lambda: jnp.asarray(u),
        ):
            with pytest.raises(nm.UnreducedError) as e:
                attempt()
            errors.append(str(e.value))
        with pytest.raises(TypeError, match="Unreduced"):  # ops that check types first say so in their words
            nm.einsum("batch embed -> batch", u)
        # sums of partial sums are partial sums; numbers scale them
        v = 2.0 * (u + u) - u
        assert isinstance(v, nm.Unreduced)
        return nm.psum(v)

    y = nm.shard_map(body, mesh=mesh, in_mapping=(PARAM, COMPUTE))(w, x)
    wa, xa = np.asarray(w.array), np.asarray(x.array)
    np.testing.assert_allclose(y.array, 3 * (xa @ wa) @ wa.T, rtol=1e-4)
    for msg in errors:
        assert "batch/data embed {U: model}" in msg and "nm.psum" in msg and "'model'" in msg


def test_returning_an_unreduced_value_is_an_error(mesh):
    w, x = _fsdp_pair(mesh)

    def body(w, x):
        return nm.einsum_unreduced("batch embed, embed mlp -> batch mlp", x, w)  # embed/data contracted

    with pytest.raises(nm.UnreducedError, match=r"output .*'batch mlp/model \{U: data\}'"):
        nm.shard_map(body, mesh=mesh, in_mapping=(PARAM, {"embed": "data"}))(w, x)


def test_mismatched_blocks_name_the_axis_and_both_layouts(mesh):
    w, x = _fsdp_pair(mesh)
    with pytest.raises(nm.ShardingError) as e:
        nm.shard_map(
            lambda w, x: nm.psum(nm.einsum_unreduced("batch embed, embed mlp -> batch mlp", x, w)),
            mesh=mesh,
            in_mapping=(PARAM, COMPUTE),
        )(w, x)
    msg = str(e.value)
    assert "'embed'" in msg and "embed/data mlp/model" in msg and "batch/data embed" in msg and "all_gather" in msg


def test_gathering_a_whole_axis_is_an_error(mesh):
    w, x = _fsdp_pair(mesh)
    with pytest.raises(nm.ShardingError, match=r"axis 'embed' is whole in this block \(layout 'batch/data embed'\)"):
        nm.shard_map(lambda w, x: nm.all_gather(x, "embed"), mesh=mesh, in_mapping=(PARAM, COMPUTE))(w, x)


def test_returning_a_gathered_value_whole_explains_check_vma(mesh):
    w, _ = _fsdp_pair(mesh)
    with pytest.raises(nm.ShardingError, match=r"may differ across mesh axes \['data'\].*invariant=True"):
        nm.shard_map(lambda w: nm.all_gather(w, "embed"), mesh=mesh, in_mapping=PARAM)(w)
    y = nm.shard_map(lambda w: nm.all_gather(w, "embed", invariant=True), mesh=mesh, in_mapping=PARAM)(w)
    assert nm.layout(y) == "embed mlp/model"
    np.testing.assert_array_equal(y.array, w.array)


def test_out_axis_resources_are_a_checked_contract(mesh):
    w, _ = _fsdp_pair(mesh)
    y = nm.shard_map(lambda w: w * 2, mesh=mesh, in_mapping=PARAM, out_mapping=PARAM)(w)
    assert nm.layout(y) == "embed/data mlp/model"
    with pytest.raises(
        nm.ShardingError, match=r"says 'embed mlp/model': axis 'embed' is split over \('data',\), not whole"
    ):
        nm.shard_map(lambda w: w * 2, mesh=mesh, in_mapping=PARAM, out_mapping={"mlp": "model"})(w)
    with pytest.raises(nm.ShardingError, match=r"axis 'embed' is whole here.*with_layout"):
        nm.shard_map(
            lambda w: nm.all_gather(w, "embed", invariant=True), mesh=mesh, in_mapping=PARAM, out_mapping=PARAM
        )(w)
    with pytest.raises(nm.ShardingError, match=r"embed/data mlp/model.*'mlp' is split over \('model',\)"):
        nm.shard_map(lambda w: w * 2, mesh=mesh, in_mapping=PARAM, out_mapping={"embed": "data"})(w)


def test_collectives_outside_shard_map_say_where_they_belong():
    x = nm.zeros((Axis("embed", 4),))
    for fn in (lambda: nm.all_gather(x, "embed"), lambda: nm.psum(x, "embed"), lambda: nm.axis_index("embed")):
        with pytest.raises(nm.NamedError, match="inside a function run by nm.shard_map"):
            fn()


def test_axis_index_from_the_active_mapping(mesh):
    def body(x):
        start = nm.axis_index("batch") * x.axis_size("batch")
        return x + start.astype(jnp.float32)

    x = nm.shard(nm.zeros((Axis("batch", 8),)), {"batch": ("data", "model")}, mesh)
    y = nm.shard_map(body, mesh=mesh, in_mapping={"batch": ("data", "model")})(x)
    np.testing.assert_array_equal(y.array, np.arange(8))


def test_settling_part_of_a_sum_and_scattering_a_plain_partial_sum(mesh):
    a = np.arange(8 * 16, dtype=np.float32).reshape(8, 16) / 16
    b = np.arange(16 * 4, dtype=np.float32).reshape(16, 4) / 8
    split = {"embed": ("data", "model")}
    x = nm.shard(nm.named(a, "batch embed"), split, mesh)
    w = nm.shard(nm.named(b, "embed out"), split, mesh)

    def body(x, w):
        u = nm.einsum_unreduced("batch embed, embed out -> batch out", x, w)
        assert u.over == ("data", "model")
        half = nm.psum(u, mesh_axes="model")  # settle model; data is still owed
        assert isinstance(half, nm.Unreduced) and half.over == ("data",)
        whole = nm.psum(half)
        # a plain block of partial sums (each device: its slice of embed), scattered over batch
        mine = u.value
        scattered = nm.psum_scatter(mine, "batch", mesh_axes=("data", "model"))
        return whole, scattered

    whole, scattered = nm.named_jit(nm.shard_map(body, in_mapping=split), mesh=mesh)(x, w)
    np.testing.assert_allclose(whole.array, a @ b, rtol=1e-5)
    # nm.einsum on the same blocks owes nothing: it sums over the mesh axes that split embed itself
    settled = nm.named_jit(
        nm.shard_map(lambda x, w: nm.einsum("batch embed, embed out -> batch out", x, w), in_mapping=split), mesh=mesh
    )(x, w)
    np.testing.assert_allclose(settled.array, a @ b, rtol=1e-5)
    np.testing.assert_allclose(scattered.array, a @ b, rtol=1e-5)
    assert nm.layout(scattered) == "batch/data+model out"


def test_shard_map_takes_positional_arguments_and_needs_a_mesh():
    x = nm.zeros((Axis("batch", 8),))
    with pytest.raises(nm.ShardingError, match="needs a mesh"):
        nm.shard_map(lambda x: x)(x)
    with pytest.raises(nm.NamedError, match="positional arguments only"):
        nm.shard_map(lambda x: x, mesh=nm.make_mesh(MESH))(x=x)
