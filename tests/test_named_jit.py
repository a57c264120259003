"""named_jit as a jit: caching, static arguments, lowering, decorators, methods, donation."""

from __future__ import annotations

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import named as nm
from named import Axis

Batch, Embed = Axis("batch", 16), Axis("embed", 8)


def spec_of(x: nm.NamedArray) -> tuple:
    spec = tuple(x.array.sharding.spec)
    return spec + (None,) * (x.ndim - len(spec))


def _x(n: int = Batch.size, seed: int = 0) -> nm.NamedArray:
    return nm.random.normal(jax.random.key(seed), (Axis("batch", n), Embed))


# ---- caching and static arguments ------------------------------------------------------------


def test_second_call_with_same_shapes_does_not_retrace():
    traces = []

    @nm.named_jit
    def f(x, y):
        traces.append(1)
        return x * y

    x = _x()
    f(x, x)
    f(x, x + 1)  # new values, same shapes
    assert len(traces) == 1
    f(_x(8), _x(8))  # new shapes: a new trace
    assert len(traces) == 2
    f(x, x)
    assert len(traces) == 2
    f(x.astype(jnp.bfloat16), x.astype(jnp.bfloat16))  # new dtype
    assert len(traces) == 3


def test_static_python_arguments_recompile_when_changed():
    traces = []

    @nm.named_jit
    def f(x, n: int, mode: str, act: Callable):
        traces.append((n, mode))
        y = act(x) * n
        return y if mode == "plain" else -y

    x = _x()
    np.testing.assert_allclose(np.asarray(f(x, 2, "plain", nm.tanh).array), 2 * np.tanh(np.asarray(x.array)), rtol=1e-6)
    f(x, 2, "plain", nm.tanh)
    assert len(traces) == 1
    out = f(x, 3, "plain", nm.tanh)
    assert len(traces) == 2 and np.allclose(out.array, 3 * np.tanh(x.array))
    out = f(x, 3, "neg", nm.tanh)
    assert len(traces) == 3 and np.allclose(out.array, -3 * np.tanh(x.array))
    out = f(x, 3, "neg", nm.relu)
    assert len(traces) == 4 and np.allclose(out.array, -3 * np.maximum(x.array, 0))
    f(x, 3, "neg", nm.relu)
    assert len(traces) == 4


def test_keyword_arguments_static_and_dynamic():
    traces = []

    @nm.named_jit
    def f(x, *, bias, scale=1.0):
        traces.append(1)
        return x * scale + bias

    x = _x()
    out = f(x, bias=x, scale=2.0)
    np.testing.assert_allclose(np.asarray(out.array), 3 * np.asarray(x.array), rtol=1e-6)
    f(x, bias=x + 1, scale=2.0)
    assert len(traces) == 1
    f(x, bias=x, scale=3.0)
    assert len(traces) == 2


def test_the_current_mapping_is_part_of_the_cache_key():
    mesh = nm.make_mesh({"data": 4, "model": 2})
    traces = []

    @nm.named_jit
    def f(x):
        traces.append(nm.current_mapping())
        return nm.shard(x * 2)

    x = _x()
    with jax.set_mesh(mesh):
        with nm.axis_mapping({"batch": "data"}):
            a = f(x)
            f(x)
        with nm.axis_mapping({"batch": "model"}):
            b = f(x)
    assert traces == [{"batch": "data"}, {"batch": "model"}]
    assert spec_of(a) == ("data", None) and spec_of(b) == ("model", None)


# ---- lower, decorators, methods ----------------------------------------------------------------


def test_lower_gives_stablehlo_and_compiled_hlo():
    mesh = nm.make_mesh({"data": 8})

    def scale_rows(x):
        return x.sum("embed")

    f = nm.named_jit(scale_rows, mapping={"batch": "data"})
    x = nm.shard(_x(), {"batch": "data"}, mesh)
    with jax.set_mesh(mesh):
        lowered = f.lower(x)
        assert "stablehlo" in lowered.as_text()
        compiled = lowered.compile()
        assert "HloModule jit_scale_rows" in compiled.as_text()
        out = f(x)
    assert out.axes == (Batch,)
    assert spec_of(out) == ("data",)


def test_decorator_with_and_without_arguments():
    @nm.named_jit
    def plain(x):
        """Doubles."""
        return x * 2

    @nm.named_jit(mapping={"batch": "data"}, donate_args=(False,))
    def configured(x):
        return x * 3

    x = _x()
    assert plain.__name__ == "plain" and plain.__doc__ == "Doubles."
    np.testing.assert_allclose(np.asarray(plain(x).array), 2 * np.asarray(x.array))
    with jax.set_mesh(nm.make_mesh({"data": 8})):
        y = configured(x)
    np.testing.assert_allclose(np.asarray(y.array), 3 * np.asarray(x.array))
    assert spec_of(y) == ("data", None)


class Affine(eqx.Module):
    w: nm.NamedArray
    activation: Callable = eqx.field(static=True)
    label: str = "affine"

    @nm.named_jit
    def apply(self, x):
        return self.activation(nm.dot(x, self.w, axis="embed"))

    def __call__(self, x):
        return self.activation(nm.dot(x, self.w, axis="embed"))


def _affine(act=nm.tanh) -> Affine:
    return Affine(nm.random.normal(jax.random.key(3), (Embed, Axis("mlp", 4))), act)


def _affine_ref(m: Affine, x) -> np.ndarray:
    return np.asarray(m.activation(nm.dot(x, m.w, axis="embed")).array)


def test_named_jit_on_a_method():
    m, x = _affine(), _x()
    np.testing.assert_allclose(np.asarray(m.apply(x).array), _affine_ref(m, x), rtol=1e-5)
    assert "HloModule jit_apply" in m.apply.lower(x).compile().as_text()

    class Plain:
        def __init__(self, k):
            self.k = k

        @nm.named_jit
        def times(self, x):
            return x * self.k

    # a plain object is a static leaf: it must be hashable (it is, by identity)
    np.testing.assert_allclose(np.asarray(Plain(5).times(x).array), 5 * np.asarray(x.array))


def test_modules_and_bound_methods_as_arguments():
    traces = []

    @nm.named_jit
    def run(fn, x):
        traces.append(1)
        return fn(x)

    m, x = _affine(), _x()
    np.testing.assert_allclose(np.asarray(run(m, x).array), _affine_ref(m, x), rtol=1e-5)
    # equinox bound methods are pytrees too: the weights travel as arguments, not constants
    np.testing.assert_allclose(np.asarray(run(m.__call__, x).array), _affine_ref(m, x), rtol=1e-5)
    n = len(traces)
    m2 = eqx.tree_at(lambda m: m.w, m, m.w * 2)  # new weights: same program
    np.testing.assert_allclose(np.asarray(run(m2, x).array), _affine_ref(m2, x), rtol=1e-5)
    assert len(traces) == n
    m3 = _affine(nm.relu)  # a new static field: a new program
    np.testing.assert_allclose(np.asarray(run(m3, x).array), _affine_ref(m3, x), rtol=1e-5)
    assert len(traces) == n + 1


def test_outputs_with_static_leaves():
    @nm.named_jit
    def f(x):
        return {"y": x * 2, "n": 3, "name": "out", "none": None, "fn": nm.tanh, "axes": x.axes}

    x = _x()
    out = f(x)
    assert out["n"] == 3 and out["name"] == "out" and out["none"] is None and out["fn"] is nm.tanh
    assert out["axes"] == x.axes
    assert isinstance(out["y"], nm.NamedArray) and out["y"].axes == x.axes


def test_static_outputs_follow_the_input_shapes():
    # regression: static results were cached per function, not per trace, so a shape-dependent
    # static result from one call came back from a later call with other shapes
    f = nm.named_jit(lambda a: (a + 1, a.shape[0], str(a.dtype)))
    for n, dtype in [(4, jnp.float32), (8, jnp.float32), (4, jnp.float32), (4, jnp.int32), (8, jnp.float32)]:
        arr, size, dt = f(jnp.zeros(n, dtype))
        assert (size, dt) == (n, jnp.dtype(dtype).name)
        assert arr.shape == (n,)


def test_lower_of_a_function_with_named_static_outputs():
    # the static part of a result may hold NamedArray nodes, whose == is elementwise
    f = nm.named_jit(lambda x: (x * 2, x.axes, "tag"))
    x = _x()
    f(x)
    assert "HloModule" in f.lower(x).compile().as_text()
    assert f(x)[2] == "tag"


def test_lower_from_shapes_alone():
    # lowering needs no data: NamedArrays of ShapeDtypeStructs (with shardings) are enough
    mesh = nm.make_mesh({"data": 8})
    spec = jax.ShapeDtypeStruct(
        (Batch.size, Embed.size), jnp.float32, sharding=nm.sharding_for((Batch, Embed), {"batch": "data"}, mesh)
    )
    f = nm.named_jit(lambda x: x.sum("embed"), mapping={"batch": "data"})
    with jax.set_mesh(mesh):
        compiled = f.lower(nm.NamedArray(spec, (Batch, Embed))).compile()
    assert "f32[2,8]" in compiled.as_text()  # one device's block of batch=16 over data=8


def test_nested_named_jit():
    mesh = nm.make_mesh({"data": 8})
    inner = nm.named_jit(lambda x: nm.shard(x * 2), mapping={"batch": "data"})
    outer = nm.named_jit(lambda x: inner(x) + 1)
    with jax.set_mesh(mesh):
        y = outer(_x())
    np.testing.assert_allclose(np.asarray(y.array), 2 * np.asarray(_x().array) + 1, rtol=1e-6)


# ---- layouts of inputs and outputs --------------------------------------------------------------


def test_in_axis_resources_lays_out_inputs_and_out_defaults_to_axis_resources():
    mesh = nm.make_mesh({"data": 4, "model": 2})
    x = _x()  # on one device
    with jax.set_mesh(mesh):
        f = nm.named_jit(lambda x: x + 1, in_mapping={"batch": "data", "embed": "model"})
        g = nm.named_jit(lambda x: x + 1, mapping={"batch": "data"})
        h = nm.named_jit(lambda x: x + 1, mapping={"batch": "data"}, out_mapping={"embed": "data"})
        a, b, c = f(x), g(x), h(x)
    # no output mapping: the result follows the laid-out input
    assert spec_of(a) == ("data", "model")
    assert spec_of(b) == ("data", None)
    assert spec_of(c) == (None, "data")
    assert {s.data.shape for s in c.array.addressable_shards} == {(16, 2)}
    for y in (a, b, c):
        np.testing.assert_allclose(np.asarray(y.array), np.asarray(x.array) + 1)


def test_inputs_keep_their_layout_without_in_axis_resources():
    mesh = nm.make_mesh({"data": 8})
    w = nm.shard(nm.ones((Embed, Axis("mlp", 16))), {"mlp": "data"}, mesh)  # a parameter layout
    with jax.set_mesh(mesh):
        f = nm.named_jit(lambda w: w * 2, mapping={"batch": "data"})
        compiled = f.lower(w).compile()
        out = f(w)
    # the program reads the parameter in its own layout (no copy into the compute layout) ...
    (w_in,) = jax.tree.leaves(compiled.input_shardings)
    assert tuple(w_in.spec) == (None, "data")
    # ... and writes the result by the output mapping, which defaults to the compute mapping
    assert spec_of(out) == (None, None)


def test_explicit_mesh_argument():
    mesh = nm.make_mesh({"data": 8})
    f = nm.named_jit(lambda x: x * 2, mapping={"batch": "data"}, mesh=mesh)
    y = f(_x())  # no `with jax.set_mesh`
    assert y.array.sharding.mesh.shape == mesh.shape
    assert spec_of(y) == ("data", None)


# ---- donation -------------------------------------------------------------------------------


def _placed(mesh, *xs):
    return [nm.shard(x, {"batch": "data"}, mesh) for x in xs]


def test_donated_buffers_are_deleted_and_kept_ones_are_not():
    mesh = nm.make_mesh({"data": 8})
    a, b = _placed(mesh, _x(seed=1), _x(seed=2))
    want = np.asarray(a.array) + np.asarray(b.array)
    f = nm.named_jit(lambda a, b: (a + b, a * b), mapping={"batch": "data"}, donate_args=(True, False))
    with jax.set_mesh(mesh):
        s, _ = f(a, b)
    assert a.array.is_deleted()
    assert not b.array.is_deleted()
    np.testing.assert_allclose(np.asarray(s.array), want, rtol=1e-6)


def test_donate_a_pytree_prefix_and_kwargs():
    mesh = nm.make_mesh({"data": 8})
    p, q, r, k = _placed(mesh, *(_x(seed=i) for i in range(4)))

    def f(pair, r, *, k):
        # one result per donated array, of its shape, so XLA can reuse every donated buffer
        # (a donated buffer no output can alias is left alone, with a warning)
        return pair[0] + pair[1], r + k

    g = nm.named_jit(f, mapping={"batch": "data"}, donate_args=((True, False), None), donate_kwargs={"k": True})
    with jax.set_mesh(mesh):
        g((p, q), r, k=k)
    assert [x.array.is_deleted() for x in (p, q, r, k)] == [True, False, False, True]


def test_donate_everything_and_a_whole_train_state():
    mesh = nm.make_mesh({"data": 8})
    model = _affine()
    model = eqx.tree_at(lambda m: m.w, model, nm.shard(model.w, {"embed": "data"}, mesh))
    x = _placed(mesh, _x())[0]

    def step(model, x):
        return eqx.tree_at(lambda m: m.w, model, model.w * 0.5), x * 2

    with jax.set_mesh(mesh):
        new, _ = nm.named_jit(step, out_mapping={"embed": "data"}, donate_args=True)(model, x)
    assert model.w.array.is_deleted() and x.array.is_deleted()
    assert new.activation is model.activation and spec_of(new.w) == ("data", None)


def test_donate_args_must_be_a_prefix():
    f = nm.named_jit(lambda a, b: a + b, donate_args=((True, False), False))
    with pytest.raises(nm.NamedError, match="donate_args must be a bool, or a pytree prefix"):
        f(_x(), _x())
    g = nm.named_jit(lambda a: a, donate_args=(True, True))
    with pytest.raises(nm.NamedError, match="donate_args has 2 entries but the function got 1 positional"):
        g(_x())
    h = nm.named_jit(lambda a, *, k: a + k, donate_kwargs={"j": True})
    with pytest.raises(nm.NamedError, match="donate_kwargs must be"):
        h(_x(), k=_x())


def test_haliax_spellings_are_accepted_in_one_place():
    """Code moving over from Haliax may keep axis_resources=/in_axis_resources=/out_axis_resources=."""
    mesh = nm.make_mesh({"data": 8})
    x = nm.zeros((nm.Axis("batch", 8), nm.Axis("embed", 4)))
    ours = nm.named_jit(lambda v: v * 2, mapping={"batch": "data"}, out_mapping={"batch": "data"}, mesh=mesh)(x)
    theirs = nm.named_jit(
        lambda v: v * 2, axis_resources={"batch": "data"}, out_axis_resources={"batch": "data"}, mesh=mesh
    )(x)
    assert ours.array.sharding.is_equivalent_to(theirs.array.sharding, 2)
    assert nm.layout(theirs) == "batch/data embed"
    with pytest.raises(nm.NamedError, match="not both"):
        nm.named_jit(lambda v: v, mapping={}, axis_resources={})
    blocks = nm.shard_map(
        lambda v: v, mesh=mesh, in_axis_resources={"batch": "data"}, out_axis_resources={"batch": "data"}
    )
    assert nm.layout(blocks(x)) == "batch/data embed"
    with pytest.raises(TypeError, match="unexpected keyword"):
        nm.shard_map(lambda v: v, mesh=mesh, in_axis_resource={"batch": "data"})
    assert set(nm.partitioning.HALIAX_SPELLINGS.values()) == {"mapping", "in_mapping", "out_mapping"}
