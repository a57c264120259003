"""RoPE, packed-sequence positions, and dot_product_attention against independent references:
numpy (Hugging Face's rotate_half RoPE and repeat_kv GQA), equinox's MultiheadAttention and
jax.nn.dot_product_attention; bf16 numerics; the cuDNN rule; FSDP and TP mappings."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _nn_util import assert_follows_mapping, close, jcall, run_sharded, traced_constraints

import named as nm
from named import nn
from named.nn._attention import fused_attention

Batch, Pos, KPos = nm.Axis("batch", 2), nm.Axis("position", 8), nm.Axis("key_position", 8)
Heads, KVHeads, HeadSize, Embed = (
    nm.Axis("heads", 4),
    nm.Axis("kv_heads", 2),
    nm.Axis("head_size", 8),
    nm.Axis("embed", 16),
)


def randn(axes, seed, dtype=jnp.float32):
    v = np.random.default_rng(seed).standard_normal([a.size for a in axes]).astype(np.float32)
    return nm.named(jnp.asarray(v, dtype), tuple(axes))


def np64(x: nm.NamedArray, names) -> np.ndarray:
    return np.asarray(x.rearrange(names).array, np.float64)


# ---- numpy references ---------------------------------------------------------------------------


def hf_rope(x: np.ndarray, positions: np.ndarray, theta: float = 10000.0) -> np.ndarray:
    """transformers' LlamaRotaryEmbedding + apply_rotary_pos_emb, for x [b, t, h, d], positions [b, t]."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    freqs = positions[..., None].astype(np.float64) * inv_freq  # [b, t, d/2]
    emb = np.concatenate([freqs, freqs], -1)
    cos, sin = np.cos(emb)[:, :, None, :], np.sin(emb)[:, :, None, :]

    def rotate_half(v):
        v1, v2 = v[..., : d // 2], v[..., d // 2 :]
        return np.concatenate([-v2, v1], -1)

    return x * cos + rotate_half(x) * sin


def ref_attention(q, k, v, *, mask=None, bias=None, scale=None):
    """q [b, t, h, d], k/v [b, s, kv, d] (kv divides h: HF repeat_kv), mask [b|1, h|1, t, s]."""
    h, kv = q.shape[2], k.shape[2]
    k, v = np.repeat(k, h // kv, axis=2), np.repeat(v, h // kv, axis=2)
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = np.einsum("bthd,bshd->bhts", q, k) * scale
    if bias is not None:
        s = s + bias
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    s = s - s.max(-1, keepdims=True)
    w = np.exp(s)
    w = w / w.sum(-1, keepdims=True)
    return np.einsum("bhts,bshd->bthd", w, v)


def qkv(kv_heads=KVHeads, dtype=jnp.float32, seed=0):
    q = randn((Batch, Pos, Heads, HeadSize), seed, dtype)
    k = randn((Batch, KPos, kv_heads, HeadSize), seed + 1, dtype)
    v = randn((Batch, KPos, kv_heads, HeadSize), seed + 2, dtype)
    return q, k, v


QN, KN = ("batch", "position", "heads", "head_size"), ("batch", "key_position", "kv_heads", "head_size")


# ---- RoPE ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_rope_matches_hf_rotate_half(theta):
    x = randn((Batch, Pos, Heads, HeadSize), 1)
    positions = nm.named(
        jnp.asarray([[0, 1, 2, 3, 4, 5, 6, 7], [5, 9, 13, 100, 2, 0, 1, 4000]], jnp.int32), (Batch, Pos)
    )
    y = jcall(nn.rotary_embedding, x, positions, theta=theta)
    assert y.axes == x.axes
    close(y.array, hf_rope(np64(x, QN), np.asarray(positions.array), theta))
    # positions shared by the batch (a plain arange) broadcast by name
    y1 = jcall(nn.rotary_embedding, x, nm.arange(Pos), theta=theta)
    close(y1.array, hf_rope(np64(x, QN), np.tile(np.arange(8), (2, 1)), theta))
    # an axis order other than [.., position, heads, head_size] is fine: layout is by name
    xt = x.rearrange(("head_size", "heads", "batch", "position"))
    close(jcall(nn.rotary_embedding, xt, positions, theta=theta).rearrange(QN).array, y.array)


def test_rope_bf16_is_computed_in_float32_and_returned_in_bf16():
    x = randn((Batch, Pos, Heads, HeadSize), 1, jnp.bfloat16)
    y = jcall(nn.rotary_embedding, x, nm.arange(Pos) * 300)
    assert y.dtype == jnp.bfloat16
    want = hf_rope(np64(x, QN), np.tile(np.arange(8) * 300, (2, 1)))
    err = np.abs(np.asarray(y.array, np.float64) - want).max()
    assert err <= 2**-8 * np.abs(want).max()  # one bf16 rounding of the output


def test_rope_rejects_odd_head_size():
    x = randn((Pos, nm.Axis("head_size", 5)), 1)
    with pytest.raises(nm.AxisError, match="even 'head_size'"):
        jcall(nn.rotary_embedding, x, nm.arange(Pos))


def test_positions_restart_per_segment_and_keep_the_axis_order():
    seg = np.array([[0, 0, 0, 1, 1, 1, 1, 1], [3, 3, 4, 5, 5, 5, 7, 7]], np.int32)
    want = np.zeros_like(seg)
    for b in range(2):
        for t in range(1, 8):
            want[b, t] = 0 if seg[b, t] != seg[b, t - 1] else want[b, t - 1] + 1
    p = nn.positions_from_segments(nm.named(jnp.asarray(seg), (Batch, Pos)))
    assert p.axes == (Batch, Pos) and p.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(p.array), want)
    pt = nn.positions_from_segments(nm.named(jnp.asarray(seg.T), (Pos, Batch)))
    assert pt.axes == (Pos, Batch)
    np.testing.assert_array_equal(np.asarray(pt.array), want.T)


def test_packed_sequence_equals_the_separate_sequences():
    """Two sequences (3 and 5 tokens) packed in one row: RoPE with positions from segments, then
    causal attention with segment ids, give each token what its own sequence gives alone."""
    lens = (3, 5)
    q, k, v = (randn((Pos, Heads, HeadSize), s) for s in (1, 2, 3))
    seg = nm.named(jnp.asarray(np.repeat([0, 1], lens), jnp.int32), (Pos,))
    pos = nn.positions_from_segments(seg)
    np.testing.assert_array_equal(np.asarray(pos.array), [0, 1, 2, 0, 1, 2, 3, 4])

    @jax.jit  # one program per length instead of one per eager op
    def attend(q, k, v, positions, segment_ids=None):
        q, k = nn.rotary_embedding(q, positions), nn.rotary_embedding(k, positions)
        k, v = k.rename({"position": "key_position"}), v.rename({"position": "key_position"})
        return nn.dot_product_attention(q, k, v, causal=True, segment_ids=segment_ids)

    packed = attend(q, k, v, pos, segment_ids=seg)
    start = 0
    for n in lens:
        piece = {"position": slice(start, start + n)}
        P = nm.Axis("position", n)
        alone = attend(q[piece], k[piece], v[piece], nm.arange(P))
        close(packed[piece].array, alone.array)
        start += n


# ---- attention vs references -------------------------------------------------------------------------


def test_attention_block_matches_eqx_multihead_attention():
    """Projections as nn.Linear with eqx's weights copied in, then our attention, equal
    eqx.nn.MultiheadAttention with a causal mask."""
    mha = eqx.nn.MultiheadAttention(
        Heads.size, Embed.size, qk_size=HeadSize.size, vo_size=HeadSize.size, key=jax.random.PRNGKey(0)
    )
    E = Embed.size
    rng = np.random.default_rng(0)

    def proj(In, Out, w_eqx):  # eqx weight [out, in] -> ours [In..., Out...], built without init
        In, Out = (In if isinstance(In, tuple) else (In,)), (Out if isinstance(Out, tuple) else (Out,))
        w = jnp.asarray(w_eqx).T.reshape([a.size for a in In + Out])
        return nn.Linear(nm.named(w, In + Out), None, In, Out)

    wq, wk, wv = (proj(Embed, (Heads, HeadSize), p.weight) for p in (mha.query_proj, mha.key_proj, mha.value_proj))
    wo = proj((Heads, HeadSize), Embed, mha.output_proj.weight)
    x = nm.named(jnp.asarray(rng.standard_normal((2, 8, E)), jnp.float32), (Batch, Pos, Embed))
    xk = x.rename({"position": "key_position"})
    out = jcall(lambda x, xk: wo(nn.dot_product_attention(wq(x), wk(xk), wv(xk), causal=True)), x, xk)
    mask = jnp.tril(jnp.ones((8, 8), bool))
    want = jcall(lambda m, a: jax.vmap(lambda r: m(r, r, r, mask=mask))(a), mha, x.array)
    assert out.axes == (Batch, Pos, Embed)
    close(out.array, want)


@pytest.mark.parametrize("kv", [4, 2, 1], ids=["mha", "gqa4/2", "mqa4/1"])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_matches_repeat_kv_reference(kv, causal):
    q, k, v = qkv(nm.Axis("kv_heads", kv)) if kv != 4 else (None, None, None)
    if kv == 4:  # plain multi-head: key and value have `heads` too
        q = randn((Batch, Pos, Heads, HeadSize), 0)
        k, v = randn((Batch, KPos, Heads, HeadSize), 1), randn((Batch, KPos, Heads, HeadSize), 2)
    kn = ("batch", "key_position", "heads" if kv == 4 else "kv_heads", "head_size")
    out = jcall(nn.dot_product_attention, q, k, v, causal=causal, implementation="xla")
    assert out.axes == q.axes
    mask = np.tril(np.ones((8, 8), bool))[None, None] if causal else None
    close(out.array, ref_attention(np64(q, QN), np64(k, kn), np64(v, kn), mask=mask))


def test_attention_mask_bias_and_scale():
    q, k, v = qkv()
    rng = np.random.default_rng(5)
    bias = nm.named(
        jnp.asarray(rng.standard_normal((4, 8, 8)), jnp.float32), (Heads, Pos, KPos)
    )  # per query head, under GQA
    keep = rng.random((2, 8, 8)) < 0.7
    keep[..., 0] = True  # every query sees at least one key
    mask = nm.named(jnp.asarray(keep), (Batch, Pos, KPos))
    out = jcall(nn.dot_product_attention, q, k, v, bias=bias, mask=mask, scale=0.3)
    want = ref_attention(
        np64(q, QN), np64(k, KN), np64(v, KN), mask=keep[:, None], bias=np.asarray(bias.array)[None], scale=0.3
    )
    close(out.array, want)
    # causal and a mask combine (logical and)
    out = jcall(nn.dot_product_attention, q, k, v, mask=mask, causal=True)
    want = ref_attention(np64(q, QN), np64(k, KN), np64(v, KN), mask=(keep & np.tril(np.ones((8, 8), bool)))[:, None])
    close(out.array, want)


def test_segment_ids_equal_a_block_diagonal_mask():
    q, k, v = qkv()
    seg = np.array([[0, 0, 0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 2, 2, 2]])
    out = jcall(nn.dot_product_attention, q, k, v, segment_ids=nm.named(jnp.asarray(seg), (Batch, Pos)), causal=True)
    block = (seg[:, :, None] == seg[:, None, :]) & np.tril(np.ones((8, 8), bool))
    close(out.array, ref_attention(np64(q, QN), np64(k, KN), np64(v, KN), mask=block[:, None]))


@pytest.mark.parametrize("causal", [False, True])
def test_xla_path_equals_jax_nn_dot_product_attention(causal):
    q, k, v = qkv()
    rng = np.random.default_rng(6)
    bias = rng.standard_normal((2, 4, 8, 8)).astype(np.float32)
    ours = jcall(
        nn.dot_product_attention,
        q,
        k,
        v,
        causal=causal,
        bias=nm.named(jnp.asarray(bias), (Batch, Heads, Pos, KPos)),
        implementation="xla",
    )
    theirs = jcall(
        jax.nn.dot_product_attention,
        q.rearrange(QN).array,
        k.rearrange(KN).array,
        v.rearrange(KN).array,
        bias=jnp.asarray(bias),
        is_causal=causal,
        implementation="xla",
    )
    close(ours.array, theirs)
    # "auto" on CPU is the same XLA path
    auto = jcall(
        nn.dot_product_attention, q, k, v, causal=causal, bias=nm.named(jnp.asarray(bias), (Batch, Heads, Pos, KPos))
    )
    np.testing.assert_array_equal(np.asarray(auto.array), np.asarray(ours.array))


def test_fused_layout_code_equals_the_reference_on_cpu():
    """The cuDNN path folds named axes into jax.nn's [B, T, N, D] and back; run that same code with
    jax's XLA implementation so the folding (GQA group as N, kv heads in B, mask/bias as
    [B|1, N|1, T, S]) is checked without a GPU."""
    q, k, v = qkv()
    G = nm.Axis("heads_per_kv_heads", 2)
    qg = q.unflatten_axis("heads", (KVHeads, G))
    rng = np.random.default_rng(7)
    bias = nm.named(jnp.asarray(rng.standard_normal((4, 8, 8)), jnp.float32), (Heads, Pos, KPos)).unflatten_axis(
        "heads", (KVHeads, G)
    )
    keep = rng.random((2, 8, 8)) < 0.7
    keep[..., 0] = True
    mask = nm.named(jnp.asarray(keep), (Batch, Pos, KPos))
    out = jcall(fused_attention, qg, k, v, "position", "key_position", "head_size", True, mask, bias, None, "xla")
    out = out.flatten_axes(("kv_heads", "heads_per_kv_heads"), "heads")
    want = ref_attention(
        np64(q, QN),
        np64(k, KN),
        np64(v, KN),
        mask=(keep & np.tril(np.ones((8, 8), bool)))[:, None],
        bias=np.asarray(bias.flatten_axes(("kv_heads", "heads_per_kv_heads"), "heads").array)[None],
    )
    close(out.rearrange(QN).array, want)


def test_cudnn_on_cpu_raises_a_named_error_and_auto_falls_back():
    q, k, v = qkv(dtype=jnp.bfloat16)
    with pytest.raises(nm.NamedError, match=r"implementation='cudnn'.*backend is 'cpu'"):
        jcall(nn.dot_product_attention, q, k, v, implementation="cudnn")
    q32, k32, v32 = qkv()
    with pytest.raises(nm.NamedError, match="bfloat16, float16"):
        jcall(nn.dot_product_attention, q32, k32, v32, implementation="cudnn")
    with pytest.raises(nm.NamedError, match="unknown attention implementation 'pallas'"):
        jcall(nn.dot_product_attention, q, k, v, implementation="pallas")
    assert jcall(nn.dot_product_attention, q, k, v, causal=True).dtype == jnp.bfloat16


def test_attention_implementation_scope_sets_what_auto_means():
    """nn.attention_implementation(...) changes the default calls traced inside and nothing
    else: on CPU, "cudnn" makes them raise cuDNN's error, a call naming "xla" keeps its path,
    and leaving the scope restores the automatic choice."""
    q, k, v = qkv(dtype=jnp.bfloat16)
    want = jcall(nn.dot_product_attention, q, k, v, causal=True)
    with nn.attention_implementation("cudnn"):
        with pytest.raises(nm.NamedError, match=r"implementation='cudnn'.*backend is 'cpu'"):
            jax.eval_shape(lambda q, k, v: nn.dot_product_attention(q, k, v, causal=True), q, k, v)
        named_xla = jax.jit(lambda q, k, v: nn.dot_product_attention(q, k, v, causal=True, implementation="xla"))(
            q, k, v
        )
    with nn.attention_implementation("xla"):
        scoped = jax.jit(lambda q, k, v: nn.dot_product_attention(q, k, v, causal=True))(q, k, v)
    np.testing.assert_array_equal(np.asarray(scoped.array, np.float32), np.asarray(want.array, np.float32))
    np.testing.assert_array_equal(np.asarray(named_xla.array, np.float32), np.asarray(want.array, np.float32))
    after = jax.jit(lambda q, k, v: nn.dot_product_attention(q, k, v, causal=True))(q, k, v)  # a fresh trace
    assert after.axes == want.axes
    with pytest.raises(nm.NamedError, match="unknown attention implementation 'pallas'"):
        with nn.attention_implementation("pallas"):
            pass


def _softmax_dtypes(fn, *args):
    jaxpr = jax.make_jaxpr(fn)(*args)
    return {str(e.outvars[0].aval.dtype) for e in jaxpr.jaxpr.eqns if e.primitive.name in ("exp", "reduce_max")}


def test_bf16_inputs_get_a_float32_softmax():
    q, k, v = qkv(dtype=jnp.bfloat16, seed=3)
    q = q * 4  # peaky scores, where a bf16 softmax visibly loses precision
    out = jcall(nn.dot_product_attention, q, k, v, causal=True)
    assert out.dtype == jnp.bfloat16
    assert _softmax_dtypes(lambda a, b, c: nn.dot_product_attention(a, b, c, causal=True), q, k, v) == {"float32"}
    mask = np.tril(np.ones((8, 8), bool))[None, None]
    want = ref_attention(np64(q, QN), np64(k, KN), np64(v, KN), mask=mask)
    err = np.abs(np.asarray(out.array, np.float64) - want).max()

    def naive_bf16(qa, ka, va):  # scores and softmax in bf16
        ka, va = jnp.repeat(ka, 2, axis=2), jnp.repeat(va, 2, axis=2)
        s = jnp.einsum("bthd,bshd->bhts", qa, ka) * jnp.bfloat16(1 / np.sqrt(8))
        s = jnp.where(jnp.asarray(mask), s, jnp.finfo(jnp.bfloat16).min)
        return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), va)

    naive = naive_bf16(q.rearrange(QN).array, k.rearrange(KN).array, v.rearrange(KN).array)
    naive_err = np.abs(np.asarray(naive, np.float64) - want).max()
    assert err < naive_err, (err, naive_err)
    assert err < 0.02 * np.abs(want).max()


def test_attention_errors_name_the_axes():
    q, k, v = qkv()
    with pytest.raises(nm.AxisError, match=r"key lacks axes \['key_position'\]"):
        jcall(nn.dot_product_attention, q, k.rename({"key_position": "position"}), v)
    with pytest.raises(nm.AxisError, match="not a multiple of 3 kv heads"):
        k3 = randn((Batch, KPos, nm.Axis("kv_heads", 3), HeadSize), 1)
        jcall(nn.dot_product_attention, q, k3, k3)
    with pytest.raises(nm.AxisError, match="in neither query nor key"):
        jcall(nn.dot_product_attention, q, k, v, bias=randn((nm.Axis("other", 3), Pos, KPos), 4))


# ---- sharding ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mapping", ["fsdp", "tp"])
def test_attention_under_mappings(mapping):
    B8 = nm.Axis("batch", 8)
    q = randn((B8, Pos, Heads, HeadSize), 1)
    k, v = randn((B8, KPos, KVHeads, HeadSize), 2), randn((B8, KPos, KVHeads, HeadSize), 3)
    seg = nm.named(jnp.asarray(np.repeat([[0, 0, 0, 1, 1, 1, 1, 1]], 8, 0)), (B8, Pos))

    def attend(_, q, k, v, seg):
        return nn.dot_product_attention(
            nn.rotary_embedding(q, nn.positions_from_segments(seg)), k, v, causal=True, segment_ids=seg
        )

    want = jcall(attend, None, q, k, v, seg)
    out, mesh, compute = run_sharded(attend, None, q, k, v, seg, mapping=mapping)
    close(out.array, want.array)
    assert_follows_mapping(
        out, mesh, compute, traced_constraints(attend, None, q, k, v, seg, mesh=mesh, compute=compute)
    )


@pytest.mark.parametrize("kv", [4, 2])
def test_xla_path_never_transposes_the_scores(kv):
    """The scores are the largest array here: they are made in dot_general's own output order,
    and the mask is brought to them (not them to the mask). The one float transpose left is the
    output's, back to the query's axis order (plain jnp attention has it too)."""
    q = randn((Batch, Pos, Heads, HeadSize), 0)
    KV = nm.Axis("heads" if kv == 4 else "kv_heads", kv)
    k, v = randn((Batch, KPos, KV, HeadSize), 1), randn((Batch, KPos, KV, HeadSize), 2)
    seg = nm.named(jnp.zeros((2, 8), jnp.int32), (Batch, Pos))
    jaxpr = jax.make_jaxpr(lambda q, k, v, s: nn.dot_product_attention(q, k, v, causal=True, segment_ids=s))(
        q, k, v, seg
    )
    float_transposes = [
        e.invars[0].aval.size
        for e in jaxpr.jaxpr.eqns
        if e.primitive.name == "transpose" and jnp.issubdtype(e.invars[0].aval.dtype, jnp.floating)
    ]
    assert float_transposes == [q.size], float_transposes


# ---- Haliax's forms: weights, a query without positions, the forgetful mask ----------------------


def ref_weights(q, k, *, mask=None, bias=None):
    """The softmax weights of ref_attention: [b, h, t, s]."""
    h, kv = q.shape[2], k.shape[2]
    s = np.einsum("bthd,bshd->bhts", q, np.repeat(k, h // kv, axis=2)) / np.sqrt(q.shape[-1])
    s = s + (0 if bias is None else bias)
    s = np.where(mask, s, -np.inf) if mask is not None else s
    w = np.exp(s - s.max(-1, keepdims=True))
    return w / w.sum(-1, keepdims=True)


def test_attention_weights_and_a_query_without_positions_match_numpy():
    q, k, v = qkv()
    bias = randn((Heads, KPos), 7)
    w = jcall(lambda q, k, b: nn.dot_product_attention_weights(q, k, causal=True, bias=b), q, k, bias)
    assert w.axes == (Batch, Pos, Heads, KPos) and w.dtype == q.dtype
    causal = np.tril(np.ones((8, 8), bool))[None, None]
    want = ref_weights(np64(q, QN), np64(k, KN), mask=causal, bias=np.asarray(bias.array)[None, :, None, :])
    close(w.rearrange(("batch", "heads", "position", "key_position")).array, want)
    # one query per row (no position axis), standing at key position 5 of a cache
    q5 = q["position", 5]
    out = jcall(lambda q, k, v: nn.dot_product_attention(q, k, v, causal=True, q_offset=5), q5, k, v)
    assert out.axes == (Batch, Heads, HeadSize)
    sees = (np.arange(8) <= 5)[None, None, None, :]
    close(
        out.array,
        ref_attention(np64(q5, ("batch", "heads", "head_size"))[:, None], np64(k, KN), np64(v, KN), mask=sees)[:, 0],
    )
    w5 = nn.dot_product_attention_weights(q5, k, causal=True, q_offset=5)
    assert w5.axes == (Batch, Heads, KPos)
    close(w5.array, ref_weights(np64(q5, ("batch", "heads", "head_size"))[:, None], np64(k, KN), mask=sees)[:, :, 0])
    with pytest.raises(nm.ArgumentTypeError, match=r"Haliax's order, dot_product_attention\(KPos, Key, query"):
        nn.dot_product_attention(KPos, HeadSize, q, k, v)
    for fn, args in ((nn.dot_product_attention, (q, k.array, v)), (nn.dot_product_attention_weights, (q.array, k))):
        with pytest.raises(nm.ArgumentTypeError, match=r"takes a NamedArray as (key|query), got a positional array"):
            fn(*args)  # a plain array in its place is not Haliax's order
    with pytest.raises(nm.AxisError, match="segment_ids are per query position"):
        nn.dot_product_attention(q5, k, v, segment_ids=nm.zeros((Batch, Pos), jnp.int32))


def test_forgetful_causal_mask_drops_keys_as_jax_random_draws_them():
    Long = nm.Axis("key_position", 4000)
    key = jax.random.key(11)
    m = nn.forgetful_causal_mask(Long, 0.3, sample_prob=False, key=key)
    assert m.axes == (Long,) and m.dtype == jnp.bool_
    want = np.array(jax.random.bernoulli(key, 0.7, (4000,)))
    want[0] = True  # the first position is always kept
    np.testing.assert_array_equal(np.asarray(m.array), want)
    assert abs(np.asarray(m.array).mean() - 0.7) < 0.03
    sub_key, draw_key = jax.random.split(key)[1], jax.random.split(key)[0]
    p = float(jax.random.uniform(sub_key, (), minval=0.0, maxval=0.3))
    sampled = nn.forgetful_causal_mask(Long, 0.3, key=key)
    want = np.array(jax.random.bernoulli(draw_key, 1.0 - p, (4000,)))
    want[0] = True
    np.testing.assert_array_equal(np.asarray(sampled.array), want)
    assert np.asarray(nn.forgetful_causal_mask(Long, 0.0, key=key).array).all()
    assert np.asarray(nn.forgetful_causal_mask(Long, 1.0, sample_prob=False, key=key).array).sum() == 1
    with pytest.raises(nm.ArgumentError, match=r"mask_prob must be in \[0, 1\]"):
        nn.forgetful_causal_mask(Long, 1.5, key=key)
