"""nm.random beyond normal/uniform: ``split`` that keeps names (per-layer keys inside Stacked),
the table of distributions, permutation, choice, categorical and dirichlet.

Where the named function wraps jax.random with the same key and shape, the values must be
equal to jax.random's, with parameters laid out by name; moments check that each parameter
reaches the distribution in the right place."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import named as nm
from named import Axis, nn
from named import random as nr

KEY = jax.random.key(42)
A, B = Axis("a", 3), Axis("b", 4)


def _data(k):
    return np.asarray(jax.random.key_data(k))


# ---- split ---------------------------------------------------------------------------------


def test_split_of_a_plain_key_is_jax_split():
    np.testing.assert_array_equal(_data(nr.split(KEY, 3)), _data(jax.random.split(KEY, 3)))
    named = nr.split(KEY, Axis("ensemble", 3))
    assert named.axes == (Axis("ensemble", 3),)
    np.testing.assert_array_equal(_data(named.array), _data(jax.random.split(KEY, 3)))


def test_split_of_named_keys_splits_each_and_keeps_names():
    Layers = Axis("layers", 4)
    plain = jax.random.split(KEY, 4)
    keys = nm.named(plain, (Layers,))
    with pytest.raises(ValueError):
        jax.random.split(keys.array)  # what the issue hit: jax splits one key only
    first, second = nr.split(keys)
    assert first.axes == second.axes == (Layers,)
    for i in range(4):
        want = jax.random.split(plain[i])
        np.testing.assert_array_equal(_data(first.array[i]), _data(want[0]))
        np.testing.assert_array_equal(_data(second.array[i]), _data(want[1]))
    grid = nr.split(keys, Axis("ensemble", 3))
    assert grid.axes == (Layers, Axis("ensemble", 3))
    np.testing.assert_array_equal(_data(grid.array[2]), _data(jax.random.split(plain[2], 3)))


class _NoisyBlock(eqx.Module):
    """A block that draws twice from its per-layer key, as a block with dropout in two places does."""

    scale: nm.NamedArray

    def __call__(self, x, *, key):
        k1, k2 = nr.split(key)
        return x * self.scale + nr.normal(k1, x.axes) + nr.gumbel(k2, x.axes)


def test_split_inside_stacked_per_layer_keys():
    Layers, Embed = Axis("layers", 3), Axis("embed", 5)
    stack = nn.Stacked.init(Layers, lambda key: _NoisyBlock(nm.ones((Embed,)) * 0.5), key=KEY)
    layer_keys = jax.random.split(jax.random.key(7), 3)
    x = nm.zeros((Embed,))
    out = stack.fold(x, key=nm.named(layer_keys, (Layers,)))
    # The same loop by hand with jax.random.
    want = np.zeros(5, np.float32)
    for i in range(3):
        k1, k2 = jax.random.split(layer_keys[i])
        want = want * 0.5 + np.asarray(jax.random.normal(k1, (5,))) + np.asarray(jax.random.gumbel(k2, (5,)))
    np.testing.assert_allclose(np.asarray(out.array), want, rtol=1e-5, atol=1e-6)


def test_split_errors():
    with pytest.raises(nm.ArgumentError, match=r"num must be an int >= 0 or an Axis, got 2.5"):
        nr.split(KEY, 2.5)
    keys = nm.named(jax.random.split(KEY, 2), "layers")
    with pytest.raises(nm.AxisError, match=r"new axis 'layers' is already an axis of the keys"):
        nr.split(keys, Axis("layers", 2))


# ---- the table of distributions ------------------------------------------------------------

# name -> (parameters as NamedArrays over some of the axes or numbers, analytic mean, variance)
PARAMS = {
    "gumbel": ({}, np.euler_gamma, np.pi**2 / 6),
    "laplace": ({}, 0.0, 2.0),
    "logistic": ({}, 0.0, np.pi**2 / 3),
    "exponential": ({}, 1.0, 1.0),
    "cauchy": ({}, None, None),
    "maxwell": ({}, 2 * np.sqrt(2 / np.pi), 3 - 8 / np.pi),
    "rademacher": ({}, 0.0, 1.0),
    "beta": ({"a": 2.0, "b": 5.0}, 2 / 7, 10 / (49 * 8)),
    "gamma": ({"a": 3.0}, 3.0, 3.0),
    "loggamma": ({"a": 3.0}, None, None),
    "poisson": ({"lam": 4.0}, 4.0, 4.0),
    "t": ({"df": 5.0}, 0.0, 5 / 3),
    "chisquare": ({"df": 3.0}, 3.0, 6.0),
    "pareto": ({"b": 5.0}, 5 / 4, 5 / (16 * 3)),
    "geometric": ({"p": 0.25}, 4.0, 0.75 / 0.0625),
    "weibull_min": ({"scale": 2.0, "concentration": 1.0}, 2.0, 4.0),
    "binomial": ({"n": 10.0, "p": 0.3}, 3.0, 2.1),
}


def test_every_row_is_tested_here():
    assert set(PARAMS) == set(nr.DRAWS)


@pytest.mark.parametrize("name", sorted(nr.DRAWS))
def test_draws_equal_jax_random_with_named_parameters(name):
    fn, params = nr.DRAWS[name]
    scalars, _, _ = PARAMS[name]
    # Each parameter varies along one of the axes (a, then b, ...), given in another layout than
    # the draw's; jax gets the same values broadcast by hand.
    named, raw = {}, {}
    for j, p in enumerate(params):
        base = scalars[p]
        ax = (A, B)[j % 2]
        vals = base * (1.0 + 0.1 * np.arange(ax.size, dtype=np.float32))
        if name in ("geometric", "binomial") and p == "p":
            vals = np.clip(vals, 0.05, 0.95)
        named[p] = nm.named(vals, (ax,))
        raw[p] = vals[:, None] if ax is A else vals[None, :]
    draw = getattr(nr, name)

    @jax.jit  # one compile for the three draws: eager rejection samplers compile op by op
    def both(key):
        # Positional parameters after the axes mean the same as keywords.
        return (
            draw(key, (A, B), **named),
            draw(key, (A, B), *(named[p] for p in params)),
            fn(key, *(jnp.broadcast_to(raw[p], (3, 4)) for p in params), (3, 4), None),
        )

    got, pos, want = both(KEY)
    assert got.axes == pos.axes == (A, B)
    np.testing.assert_array_equal(np.asarray(got.array), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(pos.array), np.asarray(want))


@pytest.mark.parametrize("name", sorted(n for n in PARAMS if PARAMS[n][1] is not None))
def test_moments_match_the_distribution(name):
    scalars, mean, var = PARAMS[name]
    draws = np.asarray(
        jax.jit(lambda k: getattr(nr, name)(k, (Axis("sample", 40_000),), **scalars))(KEY).array, np.float64
    )
    se = np.sqrt(var / draws.size)
    assert abs(draws.mean() - mean) < 6 * se + 1e-3, (draws.mean(), mean)
    assert abs(draws.var() - var) < 0.1 * var, (draws.var(), var)


def test_draw_argument_errors():
    with pytest.raises(nm.ArgumentTypeError, match=r"nm.random.beta needs the parameters \['b'\]"):
        nr.beta(KEY, (A,), a=1.0)
    with pytest.raises(nm.ArgumentTypeError, match=r"unexpected or repeated keyword 'alpha'"):
        nr.gamma(KEY, (A,), alpha=1.0)
    with pytest.raises(nm.ArgumentTypeError, match=r"takes 1 parameters \(lam\) after the axes, got 2"):
        nr.poisson(KEY, (A,), 1.0, 2.0)
    with pytest.raises(nm.AxisError, match=r"df has axes \(b=4\) that are not among the requested \(a=3\)"):
        nr.t(KEY, (A,), df=nm.ones((B,)))


# ---- permutation, choice, categorical, dirichlet -------------------------------------------


def test_permutation_of_an_axis_and_along_a_named_axis():
    p = nr.permutation(KEY, Axis("item", 10))
    np.testing.assert_array_equal(np.asarray(p.array), np.asarray(jax.random.permutation(KEY, 10)))
    assert sorted(np.asarray(p.array).tolist()) == list(range(10))
    x = nm.named(np.arange(12.0).reshape(3, 4), (A, B))
    shuffled = nr.permutation(KEY, x, "b")
    np.testing.assert_array_equal(np.asarray(shuffled.array), np.asarray(jax.random.permutation(KEY, x.array, axis=1)))
    # Every row is a reordering of the same columns.
    np.testing.assert_array_equal(np.sort(np.asarray(shuffled.array), axis=1), np.asarray(x.array))


def test_choice_with_and_without_replacement_and_weights():
    S = Axis("sample", 5)
    c = nr.choice(KEY, Axis("vocab", 8), (S,), replace=False)
    np.testing.assert_array_equal(np.asarray(c.array), np.asarray(jax.random.choice(KEY, 8, (5,), replace=False)))
    assert len(set(np.asarray(c.array).tolist())) == 5
    x = nm.named(np.arange(12.0).reshape(3, 4), (A, B))
    picked = nr.choice(KEY, x, (S,), axis="b")
    assert picked.axes == (A, S)
    np.testing.assert_array_equal(np.asarray(picked.array), np.asarray(jax.random.choice(KEY, x.array, (5,), axis=1)))
    p = nm.named(np.array([0.0, 0.0, 1.0, 0.0], np.float32), (B,))
    only = nr.choice(KEY, x, (S,), axis="b", p=p)
    assert (np.asarray(only.array) == np.asarray(x.array)[:, 2:3]).all()
    with pytest.raises(nm.ArgumentError, match=r"\(sample=5\) draws without replacement from 4 entries of 'b'"):
        nr.choice(KEY, x, (S,), axis="b", replace=False)


def test_categorical_over_named_logits():
    logits = nm.named(np.log(np.array([[0.1, 0.2, 0.7], [0.5, 0.25, 0.25]], np.float32)), "row vocab")
    N = Axis("draw", 20_000)
    got = nr.categorical(KEY, logits.rearrange("vocab row"), "vocab", axes=(N,))
    assert got.axes == (N, Axis("row", 2))
    want = jax.random.categorical(KEY, logits.array.T, axis=0, shape=(20_000, 2))
    np.testing.assert_array_equal(np.asarray(got.array), np.asarray(want))
    freq = np.stack([np.bincount(np.asarray(got.array)[:, r], minlength=3) / 20_000 for r in range(2)])
    np.testing.assert_allclose(freq, np.exp(np.asarray(logits.array)), atol=0.02)


def test_dirichlet_over_a_named_event_axis():
    alpha = nm.named(np.array([[1.0, 2.0, 3.0], [5.0, 1.0, 1.0]], np.float32), "group k")
    N = Axis("draw", 20_000)
    got = nr.dirichlet(KEY, alpha.rearrange("k group"), "k", (N,))
    assert got.axes == (N, Axis("group", 2), Axis("k", 3))
    want = jax.random.dirichlet(KEY, alpha.array, (20_000, 2))
    np.testing.assert_array_equal(np.asarray(got.array), np.asarray(want))
    np.testing.assert_allclose(np.asarray(got.array).sum(-1), 1.0, atol=1e-5)
    a = np.asarray(alpha.array)
    np.testing.assert_allclose(np.asarray(got.array).mean(0), a / a.sum(-1, keepdims=True), atol=0.01)
