"""The import graph of src/, read with ast: no two modules import each other (function-level
imports included), the one import circle is NamedArray's method delegates, imports point
trainer -> models -> named, the trainer's sub-packages import only the ones below them
(``TRAINER_LAYERS``), and ``import named`` loads no model or trainer code.

The allowed pairs are the method delegates: ``named._core`` defines the class and, at its end,
imports ``_ops``/``_shape``/``_index``/``_einsum`` whose functions the one-line methods call,
while those modules import NamedArray from ``_core``. The circle through them also holds what
they use that imports ``_core`` itself: ``_rearrange`` (einsum's check of positional specs,
``rearrange``), ``_transforms`` (``_index``'s per-row updates are a vmap) and ``_remat`` (the
transforms' scan remat). Explicit mode is not in it: it hooks into the core from its own side.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = {"named": ROOT / "src/named", "named.models": ROOT / "src/models", "named.trainer": ROOT / "src/trainer"}
DELEGATES = {"named._ops", "named._shape", "named._index", "named._einsum"}
CIRCLE = {"named._core", *DELEGATES, "named._rearrange", "named._transforms", "named._remat"}
# named.trainer's sub-packages, bottom first: each may import the ones on the lines before its own,
# never one on its own line or after it (and the package's __init__ imports none of them).
TRAINER_LAYERS = (("config",), ("data", "checkpoint"), ("loop",), ("commands",))


def _module_name(path: pathlib.Path) -> str:
    for pkg, folder in sorted(PACKAGES.items(), key=lambda kv: -len(str(kv[1]))):
        if path.is_relative_to(folder):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            return ".".join([pkg, *parts[:-1]] if parts[-1] == "__init__" else [pkg, *parts])
    raise AssertionError(path)


def _graph() -> dict[str, set[str]]:
    files = {_module_name(f): f for folder in PACKAGES.values() for f in folder.rglob("*.py")}
    graph = {}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in files}
            elif isinstance(node, ast.ImportFrom):
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                prefix = (
                    ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
                    if node.level
                    else node.module
                )
                for a in node.names:  # `from pkg import module` depends on the module, not the package
                    target = f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in files else prefix
                    if target in files:
                        deps.add(target)
        deps.discard(mod)
        graph[mod] = deps
    return graph


def test_the_graph_is_read():
    g = _graph()
    assert "named.inspect" in g["named"] and "named._core" in g["named.inspect"]
    assert "named.trainer.config" in g["named.trainer.loop.train"]


def test_no_two_modules_import_each_other():
    g = _graph()
    pairs = sorted({tuple(sorted((a, b))) for a in g for b in g[a] if a in g.get(b, ())})
    allowed = {("named._core", d) for d in DELEGATES}
    assert [p for p in pairs if p not in allowed] == []


def _circles(g: dict[str, set[str]]) -> list[set[str]]:
    """The import circles of ``g``: its strongly connected components of more than one module."""
    reach = {}
    for start in g:  # the modules each one reaches (the graph is small: a walk per module)
        seen, todo = set(), [start]
        while todo:
            for nxt in g.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        reach[start] = seen
    circles: list[set[str]] = []
    for m in g:
        circle = {m} | {n for n in reach[m] if m in reach[n]}
        if len(circle) > 1 and circle not in circles:
            circles.append(circle)
    return circles


def test_circles_are_found():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}) == [{"a", "b", "c"}]


def test_the_one_import_circle_is_the_method_delegates():
    library = lambda m: not m.startswith(("named.models", "named.trainer"))  # noqa: E731
    circles = _circles({m: {d for d in deps if library(d)} for m, deps in _graph().items() if library(m)})
    assert [sorted(c) for c in circles] == [sorted(CIRCLE)], (
        "src/named may hold one import circle, NamedArray's method delegates (CIRCLE); a module that joins "
        "it, or a new circle, ties more of the library to the core (a circle that shrank: shrink CIRCLE)"
    )


def test_imports_point_one_way():
    g = _graph()
    layer = {"named.trainer": 2, "named.models": 1}
    rank = lambda m: next((v for k, v in layer.items() if m == k or m.startswith(k + ".")), 0)  # noqa: E731
    upward = [(a, b) for a in g for b in g[a] if rank(b) > rank(a) and not (a == "named" and b in layer)]
    assert upward == []


def _sub_package(module: str) -> str | None:
    """``named.trainer.loop.train`` -> ``loop``; ``named.trainer`` itself -> ``""``; None outside it."""
    parts = module.split(".")
    return (parts[2] if len(parts) > 2 else "") if parts[:2] == ["named", "trainer"] else None


def _package_arrows(g: dict[str, set[str]]) -> dict[str, set[str]]:
    """Which of the trainer's sub-packages each one imports, from any of its modules, module-level
    and function-level imports alike (``""``: the trainer package's own ``__init__``)."""
    arrows: dict[str, set[str]] = {}
    for mod, deps in g.items():
        if (src := _sub_package(mod)) is not None:
            arrows.setdefault(src, set())
            arrows[src] |= {dst for d in deps if (dst := _sub_package(d)) is not None and dst != src}
    return arrows


def _against_the_order(arrows: dict[str, set[str]], layers) -> list[tuple[str, str]]:
    """The arrows that do not point to a lower layer: up, sideways within a layer, out of the
    trainer's ``__init__``, or from or to a sub-package no layer declares."""
    rank = {pkg: i for i, layer in enumerate(layers) for pkg in layer}
    rank[""] = -1  # the trainer's __init__: anything may import it; it imports nothing of its own
    return sorted(
        (a, b) for a, deps in arrows.items() for b in deps if a not in rank or b not in rank or rank[b] >= rank[a]
    )


def test_an_arrow_against_the_order_or_a_circle_is_found():
    layers = (("low",), ("mid", "side"), ("top",))
    arrows = {"": set(), "low": set(), "mid": {"low"}, "side": {"mid"}, "top": {"mid", "side", "low", ""}}
    assert _against_the_order(arrows, layers) == [("side", "mid")]  # sideways
    assert _against_the_order({**arrows, "low": {"top"}}, layers) == [("low", "top"), ("side", "mid")]  # up
    assert _against_the_order({"": {"low"}, "new": {"low"}}, layers) == [("", "low"), ("new", "low")]
    assert _circles({**arrows, "low": {"top"}}) == [{"low", "mid", "side", "top"}]


def test_the_trainer_sub_packages_are_read():
    arrows = _package_arrows(_graph())
    assert {"config", "data", "checkpoint", "loop", "commands"} <= set(arrows)
    assert {"config", "data", "checkpoint"} <= arrows["loop"] and "loop" in arrows["commands"]


def test_the_trainer_sub_packages_import_only_the_ones_below():
    # config at the bottom, then data and checkpoint, then the loop, then the commands: a
    # sub-package never imports one that imports it, and a new module or sub-package is placed
    # in TRAINER_LAYERS before it can import anything
    arrows = _package_arrows(_graph())
    assert _circles(arrows) == [], "the trainer's sub-packages import each other in a circle"
    assert _against_the_order(arrows, TRAINER_LAYERS) == [], (
        f"(importer, imported) against the order {TRAINER_LAYERS}: move what the lower one needs down"
    )
    assert set(arrows) - {""} == {pkg for layer in TRAINER_LAYERS for pkg in layer}, (
        "every module of named.trainer lies in a sub-package of TRAINER_LAYERS"
    )


def test_import_named_loads_no_model_or_trainer_code():
    code = (
        "import sys, named\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('named.models', 'named.trainer')))\n"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={"JAX_PLATFORMS": "cpu", "PATH": ""})
