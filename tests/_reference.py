"""Shared hypothesis strategies and numpy references for the property tests.

The references work from axis *names* with plain numpy fancy indexing, so they never call
the code under test: an operand with names ``("b", "a")`` is laid out for an output with
names ``("a", "c", "b")`` by indexing it with the output's coordinate grids.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

import named as nm

POOL = ("a", "b", "c", "d")


@st.composite
def sizes(draw, names=POOL, min_size=1, max_size=3) -> dict[str, int]:
    """One size per name (a name has one size in all operands of a test)."""
    return {n: draw(st.integers(min_size, max_size)) for n in names}


@st.composite
def axis_subsets(draw, names=POOL, min_size=0, max_size=None) -> tuple[str, ...]:
    """A subset of ``names`` in a random order."""
    if not names:
        return ()
    chosen = draw(st.lists(st.sampled_from(names), unique=True, min_size=min_size, max_size=max_size or len(names)))
    return tuple(chosen)


def random_values(rng: np.random.Generator, shape, kind: str = "float"):
    if kind == "float":
        return rng.standard_normal(shape).astype(np.float32)
    if kind == "positive":
        return rng.uniform(0.5, 2.0, shape).astype(np.float32)
    if kind == "unit":
        return rng.uniform(-0.9, 0.9, shape).astype(np.float32)
    if kind == "int":
        return rng.integers(-5, 6, shape).astype(np.int32)
    if kind == "nonzero_int":
        v = rng.integers(1, 6, shape) * rng.choice([-1, 1], shape)
        return v.astype(np.int32)
    if kind == "bool":
        return rng.random(shape) < 0.5
    raise ValueError(kind)


def make(rng, names, size_of, kind="float"):
    """(NamedArray, numpy array) with the given names."""
    arr = random_values(rng, tuple(size_of[n] for n in names), kind)
    return nm.named(arr, names), arr


def first_seen_names(*name_lists) -> tuple[str, ...]:
    """Names in first-seen order, left to right (the order nm.dot keeps its other axes in)."""
    out: list[str] = []
    for names in name_lists:
        for n in names:
            if n not in out:
                out.append(n)
    return tuple(out)


def union_names(*name_lists) -> tuple[str, ...]:
    """The documented broadcasting rule, restated: the operand with the most axes (leftmost on
    a tie) sets the order, then the names it lacks in first-seen order, left to right."""
    name_lists = [tuple(n) for n in name_lists]
    if not name_lists:
        return ()
    longest = max(len(n) for n in name_lists)
    base = next(n for n in name_lists if len(n) == longest)
    out: list[str] = list(base)
    for names in name_lists:
        for n in names:
            if n not in out:
                out.append(n)
    return tuple(out)


def expand(arr: np.ndarray, names, out_names, size_of) -> np.ndarray:
    """``arr`` (dimensions ``names``) broadcast to the full output with dimensions ``out_names``."""
    out_shape = tuple(size_of[n] for n in out_names)
    if not names:
        return np.broadcast_to(arr, out_shape)
    grids = np.indices(out_shape, sparse=True)
    picked = arr[tuple(grids[out_names.index(n)] for n in names)]
    return np.broadcast_to(picked, out_shape)


def as_numpy(x: nm.NamedArray, names) -> np.ndarray:
    """The NamedArray's values with dimensions in the order ``names`` (checks the name set)."""
    assert set(x.names) == set(names), (x.names, names)
    perm = [x.names.index(n) for n in names]
    return np.transpose(np.asarray(x.array), perm)
