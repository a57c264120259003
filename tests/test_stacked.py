"""Stacked: init by vmap, fold/scan against a Python loop, per-layer arguments, remat policies
proven by the saved residuals and the remat eqn in the jaxpr, compile time independent of
depth, and FSDP/TP mappings."""

import contextlib
import io
import re
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _nn_util import MAPPINGS, assert_follows_mapping, close, jcall, run_sharded

import named as nm
from named import nn

# distinct sizes, so that a residual's shape says which activation it is
Batch, Embed, Mlp, Layers = nm.Axis("batch", 8), nm.Axis("embed", 16), nm.Axis("mlp", 24), nm.Axis("layers", 3)


class Block(eqx.Module):
    ln: nn.LayerNorm
    up: nn.Linear
    down: nn.Linear

    @staticmethod
    def init(Embed, Mlp, *, key):
        k1, k2 = jax.random.split(key)
        return Block(nn.LayerNorm.init(Embed), nn.Linear.init(Embed, Mlp, key=k1), nn.Linear.init(Mlp, Embed, key=k2))

    def __call__(self, x, scale=None, *, key=None, with_aux=False):
        h = nn.checkpoint_name(self.ln(x), "normed")  # [batch, embed]
        h = nn.checkpoint_name(nm.tanh(self.up(h)), "hidden")  # [batch, mlp]
        h = nn.Dropout(0.5)(h, key=key, inference=key is None)
        y = self.down(h)
        if scale is not None:
            y = y * scale
        out = x + y
        return (out, nm.sum(h, "mlp")) if with_aux else out


def make(remat="none", layers=Layers, seed=0):
    return nn.Stacked.init(layers, Block.init, Embed, Mlp, key=jax.random.PRNGKey(seed), remat=remat)


def x_input(seed=1):
    v = np.random.default_rng(seed).standard_normal((Batch.size, Embed.size)).astype(np.float32)
    return nm.named(jnp.asarray(v), (Batch, Embed))


def leaves(tree):
    return [
        np.asarray(x.array) for x in jax.tree.leaves(tree, is_leaf=nm.is_named_array) if isinstance(x, nm.NamedArray)
    ]


# ---- init, fold, scan ------------------------------------------------------------------------------


def test_init_by_vmap_equals_block_init_with_the_split_keys():
    s = make()
    assert s.stacked.up.weight.axes == (Layers, Embed, Mlp)
    assert s.stacked.ln.weight.axes == (Layers, Embed)
    blocks = s.unstacked()
    assert len(blocks) == Layers.size
    for blk, k in zip(blocks, jax.random.split(jax.random.PRNGKey(0), Layers.size)):
        want = Block.init(Embed, Mlp, key=k)
        assert blk.up.weight.axes == want.up.weight.axes
        for a, b in zip(leaves(blk), leaves(want)):
            np.testing.assert_array_equal(a, b)
    w = [np.asarray(b.up.weight.array) for b in blocks]
    assert not np.allclose(w[0], w[1]) and not np.allclose(w[1], w[2])


def test_fold_and_scan_equal_a_python_loop_over_unstacked():
    s, x = make(), x_input()
    want, aux = x, []
    for blk in s.unstacked():
        want, a = blk(want, with_aux=True)
        aux.append(np.asarray(a.array))
    out = jcall(lambda s, x: s.fold(x), s, x)
    assert out.axes == x.axes
    close(out.array, want.array)
    out, ys = jcall(lambda s, x: s.scan(x, with_aux=True), s, x)
    close(out.array, want.array)
    assert ys.axes == (Layers, Batch)  # outputs stacked along layers
    close(ys.array, np.stack(aux))


def test_per_layer_arguments_are_sliced_along_layers():
    s, x = make(), x_input()
    scale = nm.named(jnp.asarray([0.5, -1.0, 2.0]), (Layers,))
    keys = nm.named(jax.random.split(jax.random.key(3), Layers.size), (Layers,))  # per-layer dropout keys
    out = jcall(lambda s, x, sc, k: s.fold(x, sc, key=k), s, x, scale, keys)
    want = x
    for i, blk in enumerate(s.unstacked()):
        want = blk(want, scale["layers", i], key=keys.array[i])
    close(out.array, want.array)
    # a shared (not per-layer) argument goes whole to every layer
    shared = jcall(lambda s, x: s.fold(x, nm.named(jnp.asarray(2.0), ())), s, x)
    want = x
    for blk in s.unstacked():
        want = blk(want, 2.0)
    close(shared.array, want.array)


def test_stacked_errors():
    with pytest.raises(nm.NamedError, match="unknown remat policy 'sometimes'"):
        make(remat="sometimes")
    with pytest.raises(nm.NamedError, match="save_names needs at least one name"):
        make(remat="save_names:")
    with pytest.raises(nm.NamedError, match="offload.*CPU backend has none"):
        make(remat="offload")
    with pytest.raises(nm.AxisError, match="needs a Layers Axis"):
        nn.Stacked.init("layers", Block.init, Embed, Mlp, key=jax.random.PRNGKey(0))

    class Plain(eqx.Module):
        w: jax.Array

    with pytest.raises(nm.AxisError, match=r"\.w is a plain array"):
        nn.Stacked.init(Layers, lambda key: Plain(jax.random.normal(key, (2,))), key=jax.random.PRNGKey(0))

    class HasLayers(eqx.Module):
        w: nm.NamedArray

    with pytest.raises(nm.AxisError, match="already has the layers axis"):
        nn.Stacked.init(Layers, lambda key: HasLayers(nm.zeros(nm.Axis("layers", 2))), key=jax.random.PRNGKey(0))


# ---- remat policies, read from the jaxpr --------------------------------------------------------------


def saved_residuals(fn, *args) -> list[tuple[tuple[int, ...], str]]:
    """(shape, description) of what the backward pass keeps, parameters excluded
    (jax.ad_checkpoint.print_saved_residuals is the public view of this)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        jax.ad_checkpoint.print_saved_residuals(fn, *args)
    out = []
    for line in buf.getvalue().splitlines():
        m = re.match(r"\w+\[([\d,]*)\] (.*)", line.strip())
        if m and "from the argument" not in m.group(2):
            out.append((tuple(int(d) for d in m.group(1).split(",") if d), m.group(2)))
    return out


def stack_loss(s, x):
    return s.fold(x).sum().scalar()


def remat_eqns(jaxpr):
    """The remat (jax.checkpoint) equations anywhere in a jaxpr."""
    found = []
    for e in jaxpr.eqns:
        if e.primitive.name.startswith("remat") or e.primitive.name == "checkpoint":
            found.append(e)
        for v in e.params.values():
            sub = v.jaxpr if isinstance(v, jax.extend.core.ClosedJaxpr) else v
            if isinstance(sub, jax.extend.core.Jaxpr):
                found.extend(remat_eqns(sub))
    return found


L, B, E, M = Layers.size, Batch.size, Embed.size, Mlp.size


def test_remat_none_saves_the_most_and_full_saves_only_block_inputs():
    x = x_input()
    none = saved_residuals(stack_loss, make("none"), x)
    full = saved_residuals(stack_loss, make("full"), x)
    # full: the only activation kept is each layer's input, one [batch, embed] per layer
    assert [shape for shape, _ in full] == [(L, B, E)], full
    assert len(none) > 4 * len(full)
    bytes_none = sum(np.prod(s) for s, _ in none) * 4
    bytes_full = sum(np.prod(s) for s, _ in full) * 4
    assert bytes_full / L == B * E * 4 and bytes_none > 4 * bytes_full
    assert (L, B, M) in [s for s, _ in none]  # e.g. the hidden activation
    assert remat_eqns(jax.make_jaxpr(stack_loss)(make("none"), x).jaxpr) == []
    (eqn,) = remat_eqns(jax.make_jaxpr(stack_loss)(make("full"), x).jaxpr)
    assert eqn.params["policy"] is None and eqn.params["prevent_cse"] is False  # inside scan CSE is no risk


def test_remat_save_dots_saves_the_matmul_outputs():
    x = x_input()
    blk = make().unstacked()[0]
    # one block: exactly the weight matmul the backward needs (up's output), nothing else
    per_block = saved_residuals(
        jax.checkpoint(lambda b, x: b(x).sum().scalar(), policy=nn.remat_policy("save_dots")), blk, x
    )
    assert [(s, d.split(" from ")[0]) for s, d in per_block] == [((B, M), "output of dot_general")], per_block
    stacked = make("save_dots")
    assert sorted(s for s, _ in saved_residuals(stack_loss, stacked, x)) == [(L, B, E), (L, B, M)]
    (eqn,) = remat_eqns(jax.make_jaxpr(stack_loss)(stacked, x).jaxpr)
    assert eqn.params["policy"] is jax.checkpoint_policies.dots_with_no_batch_dims_saveable


@pytest.mark.parametrize("remat", ["save_names:hidden", ("save_names", "hidden")])
def test_remat_save_names_saves_exactly_the_tagged_values(remat):
    x = x_input()
    blk = make().unstacked()[0]
    per_block = saved_residuals(jax.checkpoint(lambda b, x: b(x).sum().scalar(), policy=nn.remat_policy(remat)), blk, x)
    assert [(s, d.split(" from ")[0]) for s, d in per_block] == [((B, M), "named 'hidden'")], per_block
    both = saved_residuals(
        jax.checkpoint(lambda b, x: b(x).sum().scalar(), policy=nn.remat_policy("save_names:hidden,normed")), blk, x
    )
    assert sorted(d.split(" from ")[0] for _, d in both) == ["named 'hidden'", "named 'normed'"]
    # in the stack: the tagged [batch, mlp] per layer, plus the layer inputs
    assert sorted(s for s, _ in saved_residuals(stack_loss, make(remat), x)) == [(L, B, E), (L, B, M)]


def test_gradients_are_identical_across_policies():
    x = x_input()
    grads = {}
    for remat in ["none", "full", "save_dots", "save_names:hidden"]:
        g = jcall(lambda s, x: jax.grad(stack_loss, argnums=(0, 1))(s, x), make(remat), x)
        grads[remat] = leaves(g)
    for remat, g in grads.items():
        for a, b in zip(g, grads["none"]):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6, err_msg=remat)


def test_compile_time_does_not_grow_with_depth():
    x = x_input()

    stacks = {n: make("full", nm.Axis("layers", n)) for n in (2, 16)}

    def compile_time(n):
        fn = jax.jit(lambda s, x: jax.grad(stack_loss)(s, x))  # a fresh function: no cached executable
        t = time.perf_counter()
        fn.lower(stacks[n], x).compile()
        return time.perf_counter() - t

    times = {2: [], 16: []}
    jax.config.update("jax_enable_compilation_cache", False)  # each compile is a compile (tests/conftest.py)
    try:
        for _ in range(3):  # interleaved, and the min of each, against load from other processes
            for n in times:
                times[n].append(compile_time(n))
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
    ratio = min(times[16]) / min(times[2])
    print(f"compile time 2 layers {min(times[2]):.3f}s, 16 layers {min(times[16]):.3f}s, ratio {ratio:.2f}")
    assert ratio < 2, times


# ---- sharding ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mapping", sorted(MAPPINGS))
def test_stacked_under_mappings(mapping):
    s, x = make("full"), x_input()
    want = jcall(lambda s, x: s.fold(x), s, x)
    out, mesh, compute = run_sharded(lambda s, x: s.fold(x), s, x, mapping=mapping)
    close(out.array, want.array)
    assert_follows_mapping(out, mesh, compute)
    _, param_map, _ = MAPPINGS[mapping]
    sharded = nm.shard(s, param_map, mesh)
    # the layers axis stays whole (scan slices it); embed (and mlp under TP) are split
    assert tuple(sharded.stacked.up.weight.array.sharding.spec)[:2] == (None, "data")
    g = nm.named_jit(jax.grad(stack_loss), mapping=compute, mesh=mesh)(sharded, x)
    close(g.stacked.up.weight.array, jcall(jax.grad(stack_loss), s, x).stacked.up.weight.array)


def nested_loss(s, x, scale, keys):
    """A scan with per-layer outputs, a shared argument and per-layer dropout keys."""

    def layer(block, h, scale, key):
        y = block(h, scale, key=key)
        return y, y * y

    h, ys = s.scan_via(layer)(x, scale, keys)
    return (h * h).sum().scalar() + ys.sum().scalar()


@pytest.mark.parametrize("mapping", [None, *sorted(MAPPINGS)])
def test_nested_remat_equals_no_remat_in_value_and_gradient(mapping):
    # every=2 over 4 layers: 2 kept layer inputs, each group of 2 re-run in the backward pass
    # (nested_scan's own VJP); the reference is the same stack without checkpointing
    Four = nm.Axis("layers", 4)
    x, keys = x_input(), jax.random.split(jax.random.PRNGKey(7), 4)
    scale = nm.named(jnp.linspace(0.5, 1.5, Embed.size), (Embed,))  # shared by every layer
    plain = make("none", layers=Four)
    nested = nn.Stacked(plain.stacked, Four, "full every=2")
    grad = jax.value_and_grad(nested_loss, argnums=(0, 1, 2))
    want_v, want_g = jcall(grad, plain, x, scale, keys)
    if mapping is None:
        got_v, got_g = jcall(grad, nested, x, scale, keys)
    else:
        (got_v, got_g), _, _ = run_sharded(grad, nested, x, scale, keys, mapping=mapping)
    np.testing.assert_allclose(float(got_v), float(want_v), rtol=1e-5)
    for a, b in zip(leaves(got_g), leaves(want_g), strict=True):  # atol: sums split over devices
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * max(1.0, np.abs(b).max()))


def test_nested_remat_needs_less_memory_than_full_under_fsdp():
    # 16 layers whose FSDP weight shards (3 KiB a layer per device) outweigh a layer's input (512
    # bytes), as at 613M parameters (docs/benchmarks.md section 4): every=4 keeps 4 + 4 inputs
    # instead of 16 (57.5 KB of temp against 60.9 KB under jax 0.10.2). Scanning groups of 4
    # layers instead (the first version) sliced a group's shards out and built its gradients:
    # 180 KB, 3x the temp of full.
    Sixteen, Wide, Rows = nm.Axis("layers", 16), nm.Axis("mlp", 192), nm.Axis("batch", 64)
    mesh = nm.make_mesh({"data": 8})
    x = nm.named(jnp.ones((Rows.size, Embed.size)), (Rows, Embed))

    def temp(remat):
        s = nn.Stacked.init(Sixteen, Block.init, Embed, Wide, key=jax.random.PRNGKey(0), remat=remat)
        grad = nm.named_jit(jax.grad(stack_loss), mapping={"batch": "data"}, mesh=mesh)
        with nm.set_mesh(mesh):
            compiled = grad.lower(nm.shard(s, {"embed": "data"}, mesh), x).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    full, nested = temp("full"), temp("full every=4")
    assert nested < full, (nested, full)


# ---- Haliax's spellings ---------------------------------------------------------------------------


class Noisy(eqx.Module):
    """A Haliax-style block: built by a static init from per-layer arguments, called with a key."""

    w: nm.NamedArray
    bias: float = eqx.field(static=True)

    @staticmethod
    def init(w, *, bias, key):
        return Noisy(w + nm.random.normal(key, w.axes), bias)

    def __call__(self, x, *, key):
        return nm.tanh(x * self.w + self.bias) + 0.1 * nm.random.normal(key, x.axes)


def test_haliax_curried_init_and_plain_per_layer_keys_match_a_loop():
    w = nm.random.normal(jax.random.key(0), (Layers, Embed))
    init_keys = jax.random.split(jax.random.key(1), Layers.size)
    s = nn.Stacked.init(Layers, Noisy, gradient_checkpointing=True)(w, bias=0.5, key=init_keys)
    assert s.Block == Layers and s.stacked.w.axes == (Layers, Embed) and nn.Remat.parse(s.remat) == nn.Remat()
    x = x_input()
    call_keys = jax.random.split(jax.random.key(2), Layers.size)
    want, ref_w = np.asarray(x.array), np.asarray(w.array)
    for i in range(Layers.size):  # the reference: numpy, with the layer's own draws from jax.random
        wi = ref_w[i] + np.asarray(jax.random.normal(init_keys[i], (Embed.size,)))
        np.testing.assert_allclose(np.asarray(s.get_layer(i).w.array), wi, rtol=1e-6)
        want = np.tanh(want * wi + 0.5) + 0.1 * np.asarray(jax.random.normal(call_keys[i], (Batch.size, Embed.size)))
    for unroll in (None, 2, True):
        close(jcall(lambda s, x, k: s.fold(x, key=k, unroll=unroll), s, x, call_keys).array, want)
    seq = nn.BlockSeq.init(Layers, Noisy)(w, bias=0.5, key=init_keys)
    close(jcall(lambda s, x, k: s.fold(x, key=k, unroll=2), seq, x, call_keys).array, want)
    with pytest.raises(nm.AxisError, match=r"has size 2 in the plain array at kwargs\['key'\]"):
        s.fold(x, key=call_keys[:2])
    with pytest.raises(nm.NamedError, match="Haliax's curried form"):
        nn.Stacked.init(Layers, Noisy, w)
    with pytest.raises(nm.NamedError, match="offloading a layer's carry"):
        nn.Stacked.init(Layers, Noisy, gradient_checkpointing="offload")


@pytest.mark.parametrize(
    "policy, remat",
    [
        (False, None),
        (True, nn.Remat()),
        ("recompute", nn.Remat()),
        ("save_all", None),
        ("nested", nn.Remat(every=Layers.size)),  # 3 layers: the largest divisor up to sqrt(3) is 1 group
        (
            nn.ScanCheckpointPolicy(save_block_internals=["hidden"], offload_block_internals=()),
            nn.Remat(save=("hidden",)),
        ),
    ],
)
def test_scan_checkpoint_policy_reads_as_a_remat(policy, remat):
    s = nn.Stacked.init(Layers, Block.init, Embed, Mlp, key=jax.random.key(0), gradient_checkpointing=policy)
    assert nn.Remat.parse(s.remat, Layers.size) == remat
    # and the saved residuals are those of the Remat it reads as
    x = x_input()
    assert saved_residuals(stack_loss, s, x) == saved_residuals(stack_loss, make("none" if remat is None else remat), x)
