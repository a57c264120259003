"""Every ambient value that changes what a trace produces is a jit-key context: the compute
mapping, the explicit-mode body, the layer-stack driver and the attention implementation."""

from __future__ import annotations

import pathlib
import re
import threading

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import named as nm
from named import Axis, nn

X = nm.random.normal(jax.random.key(0), (Axis("batch", 8), Axis("embed", 4)))
BY_BATCH, BY_EMBED = {"batch": "data"}, {"embed": "model"}


@pytest.fixture(scope="module")
def mesh():
    return nm.make_mesh({"data": 4, "model": 2})


def spec_of(x: nm.NamedArray) -> tuple:
    spec = tuple(x.array.sharding.spec)
    return spec + (None,) * (x.ndim - len(spec))


JITS = {"jax.jit": jax.jit, "eqx.filter_jit": eqx.filter_jit, "named_jit": nm.named_jit}


@pytest.mark.parametrize("jit", JITS.values(), ids=JITS.keys())
def test_a_jitted_function_follows_the_mapping_around_each_call(mesh, jit):
    traces = []

    def double(x):
        traces.append(dict(nm.current_mapping()))
        return nm.shard(x * 2)

    f = jit(double)
    with jax.set_mesh(mesh):
        with nm.axis_mapping(BY_BATCH):
            a = f(X)
        with nm.axis_mapping(BY_EMBED):
            b = f(X)
        with nm.axis_mapping(BY_BATCH):
            c = f(X)  # back to the first mapping: its program is still cached
    assert spec_of(a) == ("data", None) == spec_of(c)
    assert spec_of(b) == (None, "model")
    assert traces == [BY_BATCH, BY_EMBED]
    for y in (a, b, c):
        np.testing.assert_allclose(np.asarray(y.array), 2 * np.asarray(X.array))


def test_equal_mappings_share_a_program_whatever_their_order_or_container(mesh):
    traces = []
    f = jax.jit(lambda x: traces.append(1) or nm.shard(x + 1))
    with jax.set_mesh(mesh):
        for m in (
            {"batch": "data", "embed": "model"},
            {"embed": "model", "batch": "data"},
            {"embed": ["model"], "batch": "data"},
            {"embed": ("model",), "batch": "data"},
        ):
            with nm.axis_mapping(m):
                f(X)
    assert len(traces) == 2  # a one-element tuple is a different (if equivalent) mapping value
    assert nm.current_mapping() is None


def test_mappings_are_per_thread(mesh):
    f = jax.jit(lambda x: nm.shard(x * 3))
    both_inside = threading.Barrier(2, timeout=60)
    seen: dict[str, tuple] = {}

    def run(name, mapping):
        with jax.set_mesh(mesh), nm.axis_mapping(mapping):
            both_inside.wait()  # the other thread has entered its own mapping by now
            for _ in range(3):
                y = f(X)
            seen[name] = (dict(nm.current_mapping()), spec_of(y))
            both_inside.wait()

    threads = [threading.Thread(target=run, args=a) for a in (("batch", BY_BATCH), ("embed", BY_EMBED))]
    with nm.axis_mapping({"batch": "model"}):
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert nm.current_mapping() == {"batch": "model"}  # untouched by the threads
    assert seen == {"batch": (BY_BATCH, ("data", None)), "embed": (BY_EMBED, (None, "model"))}


def test_the_explicit_body_is_a_context_of_its_own(mesh):
    inside = {}

    def body(x):
        inside["mapping"] = nm.current_mapping()
        return nm.psum(x, "embed")

    with nm.axis_mapping(BY_EMBED):
        with pytest.raises(nm.NamedError, match="nm.psum is a collective"):
            nm.psum(X, "embed")
        y = nm.shard_map(body, mesh=mesh)(X)
        with pytest.raises(nm.NamedError, match="nm.psum is a collective"):
            nm.psum(X, "embed")  # the body context ended with the body
        assert nm.current_mapping() == BY_EMBED
    assert inside["mapping"] is None  # layers' nm.shard calls do nothing on a local block
    np.testing.assert_allclose(np.asarray(y.array), np.asarray(X.array).sum(1), rtol=1e-5)


def test_a_mapping_is_frozen_and_hashable():
    with nm.axis_mapping({"mlp": ["data", "model"]}) as m:
        assert nm.current_mapping() is m and m == {"mlp": ("data", "model")}
        assert hash(m) == hash(nm.partitioning.FrozenMapping({"mlp": ("data", "model")}))
        with pytest.raises(TypeError):
            m["mlp"] = None  # type: ignore[index]


def test_the_layer_driver_is_a_jit_key(mesh):
    """A jitted function traced under one nn.explicit_layers setting and called under another is
    traced again and runs as the second says; an equal driver built again reuses the program."""
    stack = nn.Stacked.init(Axis("layers", 2), nn.Linear.init, Axis("embed", 4), Axis("out", 4), key=jax.random.key(1))
    traces = []

    def run(stack, x):
        traces.append(nm.current_mapping())
        # the step sees the batch whole under GSPMD, this device's 2 rows of 8 per device
        return stack.fold_via(lambda block, h: h + h.axis_size("batch"))(x)

    f = jax.jit(run)
    per_device = lambda: nn.ExplicitStack({}, {"batch": "data"})  # noqa: E731  (equal drivers, new dicts)
    with jax.set_mesh(mesh):
        whole = f(stack, X)
        with nn.explicit_layers(per_device()):
            local = f(stack, X)
        with nn.explicit_layers(per_device()):
            f(stack, X)
        again = f(stack, X)
    assert len(traces) == 2
    np.testing.assert_allclose(np.asarray(whole.array), np.asarray(X.array) + 2 * 8, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(local.array), np.asarray(X.array) + 2 * 2, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(again.array), np.asarray(whole.array))


def test_the_attention_implementation_is_a_jit_key():
    """A jitted attention traced under nn.attention_implementation("xla") and called under
    "cudnn" is traced again and takes cuDNN's path, which the CPU refuses."""
    Pos, KPos, Hs = Axis("position", 4), Axis("key_position", 4), Axis("head_size", 8)
    q = nm.random.normal(jax.random.key(2), (Pos, Hs), jnp.bfloat16)
    kv = nm.random.normal(jax.random.key(3), (KPos, Hs), jnp.bfloat16)
    traces = []
    f = jax.jit(lambda q, k, v: traces.append(1) or nn.dot_product_attention(q, k, v, causal=True))
    with nn.attention_implementation("xla"):
        want = f(q, kv, kv)
    with nn.attention_implementation("cudnn"):
        with pytest.raises(nm.NamedError, match=r"implementation='cudnn'.*backend is 'cpu'"):
            f(q, kv, kv)
    with nn.attention_implementation("xla"):
        assert f(q, kv, kv).axes == want.axes
    assert len(traces) == 2


def test_ambient_state_lives_in_context_under_one_rule():
    """src/named keeps its ambient state in _context.py, as jax.make_user_context values; the one
    contextvars.ContextVar there is the trace-local collective order, which its docstring names."""
    src = pathlib.Path(nm.__file__).parent
    stateful = re.compile(r"ContextVar\(|threading\.local\(|make_user_context\(")
    elsewhere = sorted(
        str(f.relative_to(src)) for f in src.rglob("*.py") if f.name != "_context.py" and stateful.search(f.read_text())
    )
    assert elsewhere == []
    context = (src / "_context.py").read_text()
    assert len(re.findall(r"ContextVar\(", context)) == 1 and "collective order" in context.split('"""')[1]
    assert len(re.findall(r"make_user_context\(", context)) >= 5


def test_a_layer_driver_is_hashable_and_checks_what_it_is_given():
    a = nn.ExplicitStack({"embed": "data"}, {"batch": ["data"]}, independent=["batch"])
    b = nn.ExplicitStack({"embed": "data"}, {"batch": ("data",)})
    assert a == b and hash(a) == hash(b)  # a jit-key value: equal drivers share a program
    with pytest.raises(nm.ShardingError, match=r"ExplicitStack param_mapping: axis 'embed' is mapped to 3"):
        nn.ExplicitStack({"embed": 3}, {})
    with pytest.raises(nm.ShardingError, match=r"ExplicitStack: mesh= takes a jax mesh .* got dict"):
        nn.ExplicitStack({}, {}, mesh={"data": 4})
