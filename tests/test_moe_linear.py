"""nn.MoELinear (Haliax's) against a numpy loop over the experts' row groups."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import named as nm
from named import Axis, nn

Tokens, In, Out, Experts = Axis("tokens", 6), Axis("in", 4), Axis("out", 3), Axis("experts", 3)


@pytest.mark.parametrize("out_first", [False, True])
def test_moe_linear_is_one_linear_per_group_of_rows(out_first):
    moe = nn.MoELinear.init(Experts, In, Out, key=jax.random.key(0), out_first=out_first)
    moe = eqx.tree_at(lambda m: m.bias, moe, nm.named(jnp.asarray([0.5, -1.0, 2.0]), Out))
    assert moe.out_first is out_first
    assert moe.weight.axes == ((Experts, Out, In) if out_first else (Experts, In, Out))
    x = nm.random.normal(jax.random.key(1), (In, Tokens))  # axes in any order
    sizes = np.array([2, 0, 3])  # the last token belongs to no expert
    y = jax.jit(lambda m, x, g: m(x, g))(moe, x, nm.named(jnp.asarray(sizes, jnp.int32), Experts))
    assert y.axes == (Out, Tokens)
    w = np.asarray(moe.weight.rearrange(("experts", "in", "out")).array)
    xs = np.asarray(x.array).T
    want, start = np.zeros((6, 3), np.float32), 0
    for e, n in enumerate(sizes):
        want[start : start + n] = xs[start : start + n] @ w[e]
        start += n
    want[:5] += [0.5, -1.0, 2.0]  # the bias, on the rows of the groups
    np.testing.assert_allclose(np.asarray(y.array).T[:5], want[:5], rtol=1e-5, atol=1e-6)
    with pytest.raises(nm.ArgumentTypeError, match="group_sizes must be 3 integers"):
        moe(x, jnp.array([1.0, 2.0, 3.0]))
    with pytest.raises(nm.AxisError, match="expects input axis 'in'"):
        moe(nm.zeros((Tokens, Out.alias("other"))), sizes)
