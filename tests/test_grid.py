"""The device grid: each device's cell names the block it holds, checked against the shards jax
itself computes for the array's sharding (``devices_indices_map``), on (8,) and (4, 2) meshes."""

from __future__ import annotations

import html.parser
import re

import jax
import jax.numpy as jnp
import pytest

import named as nm
from named import Axis
from named.inspect import device_grid

Batch, Pos, Embed, Mlp = Axis("batch", 8), Axis("position", 4), Axis("embed", 64), Axis("mlp", 32)

CASES = [
    # (mesh shape, axes, mapping)
    ({"data": 8}, (Embed,), {"embed": "data"}),
    ({"data": 8}, (Embed, Mlp), {"embed": "data"}),  # FSDP weight
    ({"data": 8}, (Batch, Pos, Embed), {"batch": "data"}),
    ({"data": 4, "model": 2}, (Embed, Mlp), {"embed": "data", "mlp": "model"}),  # FSDP + TP weight
    ({"data": 4, "model": 2}, (Embed, Mlp), {"mlp": "model"}),  # TP only: replicated over data
    ({"data": 4, "model": 2}, (Batch, Pos, Embed), {"batch": "data", "embed": "model"}),
    ({"data": 4, "model": 2}, (Batch, Pos, Embed), {"batch": ("model", "data")}),  # one axis over both, model major
    ({"data": 4, "model": 2}, (Batch, Pos, Embed), {}),  # replicated everywhere
    ({"data": 8}, (Mlp,), {}),
]


def _expected(x: nm.NamedArray) -> dict[int, dict[str, tuple[int, int]]]:
    shape = x.array.shape
    out = {}
    for d, idx in x.array.sharding.devices_indices_map(shape).items():
        out[d.id] = {a.name: (s.start or 0, n if s.stop is None else s.stop) for a, s, n in zip(x.axes, idx, shape)}
    return out


def _text_cells(text: str, axes) -> dict[int, tuple[str, int, dict[str, tuple[int, int]]]]:
    """device id -> (block letter, copies, {axis: (start, stop)}) read back from the text grid."""
    names = [a.name for a in axes]
    sizes = {a.name: a.size for a in axes}
    cells: dict[int, tuple] = {}
    band: list[list[str]] = []

    def flush():
        for col in zip(*band):
            m = re.fullmatch(r"dev (\d+): ([A-Z]+)(?: x(\d+))?", col[0])
            assert m, col
            blocks = {}
            for line in col[1:]:
                b = re.fullmatch(r"(\w+)\[(?:(\d+):(\d+)|:)\]", line)
                assert b, line
                blocks[b.group(1)] = (int(b.group(2)), int(b.group(3))) if b.group(2) else (0, sizes[b.group(1)])
            assert list(blocks) == names
            cells[int(m.group(1))] = (m.group(2), int(m.group(3) or 1), blocks)

    for line in text.splitlines():
        if "|" not in line:
            if band:
                flush()
            band = []
            continue
        band.append([c.strip() for c in line.split("|")[1:-1]])
    return cells


class _Checker(html.parser.HTMLParser):
    """Every tag closed, in order; collects text."""

    def __init__(self):
        super().__init__()
        self.stack: list[str] = []
        self.text: list[str] = []
        self.styles: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.stack.append(tag)
        if tag == "td":
            self.styles.append(dict(attrs).get("style", ""))

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, (self.stack, tag)
        self.stack.pop()

    def handle_data(self, data):
        self.text.append(data)


def _check_html(page: str) -> _Checker:
    p = _Checker()
    p.feed(page)
    p.close()
    assert not p.stack, p.stack
    return p


@pytest.mark.parametrize("mesh_shape, axes, mapping", CASES)
def test_text_grid_names_each_devices_block(mesh_shape, axes, mapping):
    mesh = nm.make_mesh(mesh_shape)
    x = nm.shard(nm.zeros(axes), mapping, mesh)
    grid = device_grid(x)
    expected = _expected(x)
    got = _text_cells(str(grid), axes)
    assert {d: b for d, (_, _, b) in got.items()} == expected
    # same block <-> same letter, and the copy count is how many devices hold it
    for letter, copies, blocks in got.values():
        same = [e for e, b in expected.items() if b == blocks]
        assert copies == len(same)
        assert {got[e][0] for e in same} == {letter}
    assert len({letter for letter, _, _ in got.values()}) == len({tuple(b.values()) for b in expected.values()})
    # mesh axes and their sizes label the sides
    for name, size in mesh_shape.items():
        assert f"{name}={size}" in str(grid).splitlines()[0]
        assert f"{name} {size - 1}" in str(grid)
    assert grid.block(7) == expected[7]


@pytest.mark.parametrize("mesh_shape, axes, mapping", CASES)
def test_html_grid_is_well_formed_and_coloured_by_block(mesh_shape, axes, mapping):
    mesh = nm.make_mesh(mesh_shape)
    x = nm.shard(nm.zeros(axes), mapping, mesh)
    expected = _expected(x)
    page = device_grid(x)._repr_html_()
    p = _check_html(page)
    text = " ".join(p.text)
    for name in mesh_shape:
        assert name in text
    for a in axes:
        assert f"{a.name}[" in text
    # one td per device, in mesh order, coloured by the block it holds
    order = [d.id for d in mesh.devices.flat]
    colour = [re.search(r"background-color:([^;]+)", s).group(1) for s in p.styles]
    assert len(colour) == len(order)
    blocks = [tuple(expected[d].values()) for d in order]
    for i in range(len(order)):
        for j in range(len(order)):
            assert (colour[i] == colour[j]) == (blocks[i] == blocks[j])
    replicated = any(blocks.count(b) > 1 for b in blocks)
    assert bool(re.search(r"x\d+ replicated", text)) == replicated


def test_abstract_and_mapped_arrays_draw_the_placed_layout():
    mesh = nm.make_mesh({"data": 4, "model": 2})
    mapping = {"batch": "data", "embed": "model"}
    placed = nm.shard(nm.zeros((Batch, Pos, Embed)), mapping, mesh)
    abstract = nm.NamedArray(
        jax.ShapeDtypeStruct(placed.array.shape, jnp.float32, sharding=nm.sharding_for(placed, mapping, mesh)),
        placed.axes,
    )
    want = _expected(placed)
    assert {d: device_grid(abstract).block(d) for d in want} == want
    assert {d: device_grid((Batch, Pos, Embed), mapping, mesh).block(d) for d in want} == want
    with nm.axis_mapping(mapping), nm.set_mesh(mesh):  # no sharding of its own: the current mapping and mesh
        assert {d: device_grid((Batch, Pos, Embed)).block(d) for d in want} == want


def test_param_report_grid_and_tree_grids():
    mesh = nm.make_mesh({"data": 4, "model": 2})
    mapping = {"embed": "data", "mlp": "model"}
    tree = {"up": nm.zeros((Embed, Mlp)), "bias": nm.zeros((Mlp,))}
    rep = nm.param_report(tree, mapping, mesh)
    placed = nm.shard(tree, mapping, mesh)
    for name in ("up", "bias"):
        want = _expected(placed[name])
        g = rep.grid(name)
        assert {d: g.block(d) for d in want} == want and name in str(g).splitlines()[0]
    grids = rep.grid()
    assert len(grids) == 2 and "['bias']" in str(grids) and "['up']" in str(grids)
    _check_html(grids._repr_html_())
    tree_grids = device_grid(placed)
    assert [g.title for g in tree_grids] == ["['bias']", "['up']"]
    with pytest.raises(nm.AxisError, match=r"grid\('nope'\) matches no array"):
        rep.grid("nope")


def test_named_array_html_includes_the_grid_only_when_laid_out():
    mesh = nm.make_mesh({"data": 4, "model": 2})
    x = nm.shard(nm.zeros((Batch, Pos, Embed)), {"batch": "data", "embed": "model"}, mesh)
    page = x._repr_html_()
    _check_html(page)
    assert "dev 7" in page and "embed[32:64]" in page and "batch/data position embed/model" in page
    assert "dev 0" not in nm.zeros((Batch,))._repr_html_()  # one device, never laid out: no grid


def test_param_report_html_gives_every_cell_its_own_background():
    """Jupyter stripes alternate rows grey: a replicated row must not rely on a light shade alone."""
    mesh = nm.make_mesh({"data": 8})
    rep = nm.param_report({"w": nm.zeros((Embed, Mlp)), "b": nm.zeros((Mlp,))}, {"embed": "data"}, mesh)
    p = _check_html(rep._repr_html_())
    assert p.styles and all("background-color:#ffffff" in s for s in p.styles)
    marked = [s for s in p.styles if "repeating-linear-gradient" in s]
    assert len(marked) == 6  # the replicated bias row, every cell hatched
