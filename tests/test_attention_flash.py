"""The blockwise ("flash") attention path against the plain XLA path, in value and in the
gradients of query, key, value and bias: shapes, masks, segment ids, windows, softcap, GQA and
cache offsets drawn by hypothesis, with blocks small enough that every case spans several (and
lengths that need padding); on one device, under the FSDP and TP mappings, and in explicit mode.
Also: "auto" takes it once the keys span more than one block, and its compiled backward pass
grows linearly in the sequence length where the XLA path's grows quadratically."""

import contextlib
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _nn_util import MAPPINGS, close, run_sharded
from hypothesis import given, settings
from hypothesis import strategies as st

import named as nm
from named import nn
from named.nn import _flash

TOL = 1e-5


@contextlib.contextmanager
def blocks_of(n: int):
    """Blocks of ``n`` positions (the default, 256, would make these small cases one block)."""
    old, _flash.BLOCK = _flash.BLOCK, n
    try:
        yield
    finally:
        _flash.BLOCK = old


def randn(axes, rng, dtype=jnp.float32):
    return nm.named(jnp.asarray(rng.standard_normal([a.size for a in axes]), dtype), tuple(axes))


def attention_and_grads(impl, q, k, v, bias=None, **kw):
    """The output and the gradients of <output, probe> for q, k, v (and bias), one program."""
    probe = nm.named(jnp.cos(jnp.arange(q.size, dtype=jnp.float32)).reshape(q.array.shape), q.axes)

    def loss(q, k, v, bias):
        out = nn.dot_product_attention(q, k, v, bias=bias, implementation=impl, **kw)
        return (out * probe.rearrange(out.names)).sum().scalar(), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, bias)
    return out, grads


def assert_same(impl_a, impl_b):
    out_a, grads_a = impl_a
    out_b, grads_b = impl_b
    assert out_a.axes == out_b.axes
    close(out_a.array, out_b.array, TOL)
    for ga, gb in zip(grads_a, grads_b, strict=True):
        if ga is None:
            assert gb is None
            continue
        assert ga.axes == gb.axes
        close(ga.array, gb.array, TOL)


@st.composite
def cases(draw):
    """Shapes and options of one attention call, and the block size to run it with."""
    kv = draw(st.sampled_from([1, 2, 4]))
    heads = kv * draw(st.sampled_from([1, 2]))
    T = draw(st.integers(1, 19))
    causal = draw(st.booleans())
    offset = draw(st.sampled_from([0, 0, 3])) if causal else 0
    S = T + offset
    opts = dict(
        causal=causal,
        segments=draw(st.booleans()) and offset == 0,
        window=draw(st.sampled_from([None, 1, 3, 8])) if causal else None,
        softcap=draw(st.sampled_from([None, 2.0])),
        bias=draw(st.sampled_from([None, "heads", "full"])),
        mask=draw(st.sampled_from([None, "keys", "full"])),
        offset=offset,
    )
    return dict(
        B=draw(st.integers(1, 2)),
        T=T,
        S=S,
        heads=heads,
        kv=kv,
        D=draw(st.sampled_from([4, 8])),
        block=draw(st.sampled_from([4, 8])),
        seed=draw(st.integers(0, 2**16)),
        **opts,
    )


def build(c):
    rng = np.random.default_rng(c["seed"])
    Batch, Pos, KPos = nm.Axis("batch", c["B"]), nm.Axis("position", c["T"]), nm.Axis("key_position", c["S"])
    Heads, HeadSize = nm.Axis("heads", c["heads"]), nm.Axis("head_size", c["D"])
    KV = Heads if c["kv"] == c["heads"] else nm.Axis("kv_heads", c["kv"])
    q = randn((Batch, Pos, Heads, HeadSize), rng)
    k, v = randn((Batch, KPos, KV, HeadSize), rng), randn((Batch, KPos, KV, HeadSize), rng)
    kw = dict(causal=c["causal"], window=c["window"], softcap=c["softcap"])
    if c["offset"]:
        kw["q_offset"] = c["offset"]
    if c["segments"]:
        cut = rng.integers(0, c["T"] + 1, size=(c["B"], 1))
        kw["segment_ids"] = nm.named(jnp.asarray((np.arange(c["T"]) >= cut).astype(np.int32)), (Batch, Pos))
    bias = {
        None: None,
        "heads": lambda: randn((Heads, KPos), rng),
        "full": lambda: randn((Batch, Heads, Pos, KPos), rng),
    }[c["bias"]]
    bias = bias() if bias else None
    if c["mask"] == "keys":  # padding: one row's keys all masked
        keep = rng.random((c["B"], c["S"])) > 0.3
        keep[0] = False
        kw["mask"] = nm.named(jnp.asarray(keep), (Batch, KPos))
    elif c["mask"] == "full":
        kw["mask"] = nm.named(jnp.asarray(rng.random((c["B"], c["T"], c["S"])) > 0.5), (Batch, Pos, KPos))
    return q, k, v, bias, kw


@settings(max_examples=15, deadline=None)
@given(cases())
def test_flash_equals_the_xla_path_in_value_and_gradient(c):
    q, k, v, bias, kw = build(c)
    want = attention_and_grads("xla", q, k, v, bias, **kw)
    with blocks_of(c["block"]):
        got = attention_and_grads("flash", q, k, v, bias, **kw)
    assert_same(got, want)


def test_fully_masked_rows_traced_windows_and_per_row_offsets():
    """Rows whose keys are all masked get the mean of the values (as on the XLA path, whose
    gradient then flows to the values only); a traced window and per-row cache offsets; a key
    length (13) that no block divides, so the keys are padded."""
    rng = np.random.default_rng(0)
    Batch, Pos, KPos = nm.Axis("batch", 2), nm.Axis("position", 5), nm.Axis("key_position", 13)
    Heads, KVHeads, HeadSize = nm.Axis("heads", 4), nm.Axis("kv_heads", 2), nm.Axis("head_size", 8)
    q = randn((Batch, Pos, Heads, HeadSize), rng)
    k, v = randn((Batch, KPos, KVHeads, HeadSize), rng), randn((Batch, KPos, KVHeads, HeadSize), rng)
    keep = rng.random((2, 5, 13)) > 0.5
    keep[1, 2] = False
    mask = nm.named(jnp.asarray(keep), (Batch, Pos, KPos))
    offsets = nm.named(jnp.asarray([8, 2]), (Batch,))
    with blocks_of(4):
        assert _flash.block_size(13) == (4, 16)
    for kw in (
        dict(mask=mask),
        dict(causal=True, mask=mask, q_offset=offsets),
        dict(causal=True, q_offset=offsets, window=3),
    ):
        want = attention_and_grads("xla", q, k, v, **kw)
        with blocks_of(4):
            got = attention_and_grads("flash", q, k, v, **kw)
        assert_same(got, want)

    def traced(impl):
        def f(q, k, v, w):
            with blocks_of(4):
                out = nn.dot_product_attention(q, k, v, causal=True, q_offset=w + 5, window=w, implementation=impl)
            return out.sum().scalar()

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(q, k, v, jnp.int32(3))

    (va, ga), (vb, gb) = traced("flash"), traced("xla")
    close(va, vb)
    for a, b in zip(ga, gb, strict=True):
        close(a.array, b.array)


def test_bf16_inputs_stay_close_to_the_xla_path():
    rng = np.random.default_rng(1)
    Batch, Pos, KPos = nm.Axis("batch", 2), nm.Axis("position", 24), nm.Axis("key_position", 24)
    Heads, HeadSize = nm.Axis("heads", 2), nm.Axis("head_size", 16)
    q, k, v = (randn((Batch, P, Heads, HeadSize), rng, jnp.bfloat16) for P in (Pos, KPos, KPos))
    want = nn.dot_product_attention(q, k, v, causal=True, implementation="xla")
    with blocks_of(8):
        got = nn.dot_product_attention(q, k, v, causal=True, implementation="flash")
    assert got.dtype == jnp.bfloat16
    close(np.asarray(got.array, np.float32), np.asarray(want.array, np.float32), 2e-2)


# ---- what "auto" takes, and what the flash path keeps ---------------------------------------------


def _inputs(T, B=1, H=2, D=16, seed=0):
    rng = np.random.default_rng(seed)
    Batch, Pos, KPos = nm.Axis("batch", B), nm.Axis("position", T), nm.Axis("key_position", T)
    Heads, HeadSize = nm.Axis("heads", H), nm.Axis("head_size", D)
    return randn((Batch, Pos, Heads, HeadSize), rng), *(randn((Batch, KPos, Heads, HeadSize), rng) for _ in "kv")


def test_auto_takes_flash_once_the_keys_span_more_than_one_block(caplog):
    q, k, v = _inputs(16)
    with blocks_of(8), caplog.at_level(logging.DEBUG, logger="named.nn"):
        jax.jit(lambda q, k, v: nn.dot_product_attention(q, k, v, causal=True))(q, k, v)
        jax.jit(lambda q, k, v: nn.dot_product_attention(q["position", :8], k, v))(q, k, v)  # 16 keys
        jax.jit(lambda q, k, v: nn.dot_product_attention(q, k, v, causal=True, implementation="xla"))(q, k, v)
        with nn.attention_implementation("flash"):
            jax.jit(lambda q, k, v: nn.dot_product_attention(q, k["key_position", :8], v["key_position", :8]))(q, k, v)
    paths = [r.getMessage().split(":")[1].split("(")[0].strip() for r in caplog.records if "path" in r.getMessage()]
    assert paths == ["flash path", "flash path", "xla path", "flash path"], paths
    assert nn.attention_keeps_scores("xla") and not nn.attention_keeps_scores("flash")
    assert not nn.attention_keeps_scores("cudnn", "gpu")
    assert not nn.attention_keeps_scores("auto", "gpu", key_length=128, dtype=jnp.bfloat16)
    assert nn.attention_keeps_scores("auto", "gpu", key_length=128, dtype=jnp.float32)
    assert nn.attention_keeps_scores("auto", "cpu", key_length=256)
    assert not nn.attention_keeps_scores("auto", "cpu", key_length=512)
    with nn.attention_implementation("xla"):
        assert nn.attention_keeps_scores("auto", "cpu", key_length=4096)
    with pytest.raises(nm.ArgumentError, match="unknown attention implementation 'pallas'"):
        nn.attention_keeps_scores("pallas")


def test_flash_refuses_key_axes_the_query_lacks():
    q, k, v = _inputs(8)
    k2 = k.broadcast_axis(nm.Axis("other", 2))
    with pytest.raises(nm.NamedError, match=r"implementation='flash'.*\['other'\] are not in the query"):
        nn.dot_product_attention(q, k2, k2, implementation="flash")


def test_the_flash_backward_keeps_no_scores():
    """No value in the traced forward or backward pass is as large as the [heads, T, S] scores:
    at most one block of them lives at a time."""
    q, k, v = _inputs(64, H=2)

    def loss(q, k, v):
        with blocks_of(16):
            return nn.dot_product_attention(q, k, v, causal=True, implementation="flash").sum().scalar()

    def sizes(jaxpr):
        for e in jaxpr.eqns:
            for o in e.outvars:
                yield o.aval.size
            for p in e.params.values():
                for sub in p if isinstance(p, (tuple, list)) else (p,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        yield from sizes(inner)

    largest = max(sizes(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr))
    assert largest <= 2 * 16 * 64, largest  # heads x block x T (the block's own scores are 2 x 16 x 16)


def _temp_bytes(impl, T):
    q, k, v = _inputs(T, B=1, H=2, D=16)

    def loss(q, k, v):
        with blocks_of(128):
            return nn.dot_product_attention(q, k, v, causal=True, implementation=impl).sum().scalar()

    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_compiled_backward_memory_grows_linearly_in_t():
    """Doubling T from 1024 to 2048 doubles the flash program's temporary memory (its largest
    arrays are [T, head_size]) and quadruples the XLA path's (its [T, T] scores)."""
    flash = [_temp_bytes("flash", T) for T in (512, 1024, 2048)]
    xla = [_temp_bytes("xla", T) for T in (1024, 2048)]
    assert flash[2] / flash[1] < 2.5 and flash[1] / flash[0] < 2.5, flash
    assert xla[1] / xla[0] > 3.5, xla
    assert flash[2] < xla[1] / 8, (flash, xla)


# ---- sharded: GSPMD mappings and explicit mode --------------------------------------------------------


@pytest.mark.parametrize("mapping", sorted(MAPPINGS))
def test_flash_under_mappings(mapping):
    rng = np.random.default_rng(3)
    Batch, Pos, KPos = nm.Axis("batch", 8), nm.Axis("position", 12), nm.Axis("key_position", 12)
    Heads, KVHeads, HeadSize = nm.Axis("heads", 4), nm.Axis("kv_heads", 2), nm.Axis("head_size", 8)
    q = randn((Batch, Pos, Heads, HeadSize), rng)
    k, v = randn((Batch, KPos, KVHeads, HeadSize), rng), randn((Batch, KPos, KVHeads, HeadSize), rng)
    seg = nm.named(jnp.asarray(np.repeat([[0] * 5 + [1] * 7], 8, 0)), (Batch, Pos))

    def value_and_grads(impl):
        def loss(q, k, v):
            with blocks_of(4):
                out = nn.dot_product_attention(q, k, v, causal=True, segment_ids=seg, implementation=impl)
            return (out * out).sum().scalar()

        return jax.value_and_grad(loss, argnums=(0, 1, 2))

    want_l, want_g = jax.jit(value_and_grads("xla"))(q, k, v)
    (got_l, got_g), _, _ = run_sharded(lambda _, *a: value_and_grads("flash")(*a), None, q, k, v, mapping=mapping)
    close(got_l, want_l)
    for a, b in zip(got_g, want_g, strict=True):
        close(a.array, b.array)


def test_flash_in_explicit_mode():
    """Inside nm.shard_map each device runs the blockwise path on its local heads (batch/data,
    heads and kv_heads/model): the output and gradients equal the global XLA path."""
    mesh = nm.make_mesh({"data": 4, "model": 2})
    compute = {"batch": "data", "heads": "model", "kv_heads": "model"}
    rng = np.random.default_rng(4)
    Batch, Pos, KPos = nm.Axis("batch", 4), nm.Axis("position", 12), nm.Axis("key_position", 12)
    Heads, KVHeads, HeadSize = nm.Axis("heads", 4), nm.Axis("kv_heads", 2), nm.Axis("head_size", 8)
    q = randn((Batch, Pos, Heads, HeadSize), rng)
    k, v = randn((Batch, KPos, KVHeads, HeadSize), rng), randn((Batch, KPos, KVHeads, HeadSize), rng)

    def attend(impl):
        def body(q, k, v):
            with blocks_of(4):
                return nn.dot_product_attention(q, k, v, causal=True, implementation=impl)

        return body

    explicit = nm.shard_map(attend("flash"), in_mapping=(compute, compute, compute))

    def loss(fn):
        return lambda q, k, v: (fn(q, k, v) ** 2).sum().scalar()

    vg = nm.named_jit(jax.value_and_grad(loss(explicit), argnums=(0, 1, 2)), mapping=compute, mesh=mesh)
    args = [nm.shard(x, compute, mesh) for x in (q, k, v)]
    got_l, got_g = vg(*args)
    want_l, want_g = jax.jit(jax.value_and_grad(loss(attend("xla")), argnums=(0, 1, 2)))(q, k, v)
    close(got_l, want_l)
    for a, b in zip(got_g, want_g, strict=True):
        close(a.rearrange(b.names).array, b.array)


def test_auto_attention_names_the_path_auto_takes_and_what_it_keeps():
    # what the planner counts: cuDNN on a GPU in 16 bits, the blockwise path past one block of keys,
    # else XLA (which keeps its scores); nn.attention_implementation overrides all of it
    assert nn.auto_attention("gpu", 4096, jnp.bfloat16) == "cudnn"
    assert nn.auto_attention("gpu", 4096, jnp.float32) == nn.auto_attention("tpu", 4096) == "flash"
    assert (nn.auto_attention("cpu", 256), nn.auto_attention("cpu", 257)) == ("xla", "flash")
    assert nn.attention_keeps_scores("auto", "cpu", 256) and not nn.attention_keeps_scores("auto", "cpu", 257)
    with nn.attention_implementation("xla"):
        assert nn.auto_attention("gpu", 4096, jnp.bfloat16) == "xla" and nn.attention_keeps_scores("auto", "gpu", 4096)
