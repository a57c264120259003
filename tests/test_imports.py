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

Also: no ``_private`` name is used outside the module that defines it (the rule is stated above
``test_nothing_private_crosses_a_module_boundary``).
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

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


def _imported_from(node: ast.ImportFrom, mod: str, is_pkg: bool) -> str:
    """The absolute name of the module of ``from <module> import ...``, written in module ``mod``."""
    if not node.level:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    return ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(f): f for folder in PACKAGES.values() for f in folder.rglob("*.py")}


def _graph() -> dict[str, set[str]]:
    files = _modules()
    graph = {}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in files}
            elif isinstance(node, ast.ImportFrom):
                prefix = _imported_from(node, mod, is_pkg)
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


@pytest.mark.procs
def test_import_named_loads_no_model_or_trainer_code():
    code = (
        "import sys, named\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('named.models', 'named.trainer')))\n"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={"JAX_PLATFORMS": "cpu", "PATH": ""})


# ---- the declared internal API: nothing _private crosses a module boundary -------------------
#
# A ``_name`` (function, class, constant, method or attribute) is used only in the module that
# defines it. What modules share has a name without the underscore: in a private module
# (``named._core.unchecked``), which only its own package imports (``named.nn._stacked`` from
# ``named.nn``; ``named._ops`` from ``named`` and ``named.nn``, never from the models or the
# trainer); what the models, the trainer and bench need from the library's internals is listed
# in ``named.internal``. Tests and bench stand outside every package: they may import a private
# module to test or time its shared names (tests/test_compat.py tests ``named._compat``), never
# a ``_name``: in an import, as an attribute of one of our modules or objects (``ck.write._x``,
# ``NamedArray._x``) or as a string handed to ``setattr`` (a monkeypatch). There is no list of
# exceptions: a test that needs to reach a name gives it a public name in its private module.

SCANNED = ("src", "tests", "bench", "examples")


def _is_private(name: str) -> bool:
    """``_name``; not a dunder nor a protocol hook named the same way (``_repr_html_``)."""
    return name.startswith("_") and not name.endswith("_")


def _owner(module: str) -> str:
    """The package a private module belongs to: its name up to the first ``_part``."""
    parts = module.split(".")
    return ".".join(parts[: next(i for i, p in enumerate(parts) if _is_private(p))])


def _within(importer: str | None, package: str) -> bool:
    """Whether module ``importer`` (None: a test or bench file) lies in ``package``; the library's
    package ``named`` holds neither the models nor the trainer, installed under its name."""
    if importer is None or not (importer == package or importer.startswith(package + ".")):
        return False
    return package != "named" or not importer.startswith(("named.models", "named.trainer"))


def _private_defs(tree: ast.AST) -> set[str]:
    """The private names a file defines: functions, classes, assignments, ``self._x = ...``."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            out.add(node.attr)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
    return {n for n in out if _is_private(n)}


def _private_uses(source: str, module: str | None, files: dict[str, object], ours: set[str]) -> list[str]:
    """``line: what`` for each private name of another module that ``source`` touches. ``module``
    is its dotted name (None: a test or bench file); ``files`` our modules; ``ours`` the private
    names our modules define (an attribute ``x._name`` of another library is not ours)."""
    tree = ast.parse(source)
    is_pkg = module is not None and module in files and str(files[module]).endswith("__init__.py")
    own = _private_defs(tree)
    bound: set[str] = set()  # local names of our modules and of what was imported from them
    found = []

    def module_use(line: int, target: str) -> None:
        if (
            module is not None
            and any(_is_private(p) for p in target.split("."))
            and not _within(module, _owner(target))
        ):
            found.append(f"{line}: imports {target}, private to {_owner(target)}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "named":
                    module_use(node.lineno, a.name)
                    bound.add((a.asname or a.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            prefix = _imported_from(node, module or "", is_pkg)
            if prefix.split(".")[0] != "named":
                continue
            module_use(node.lineno, prefix)
            for a in node.names:
                bound.add(a.asname or a.name)
                if f"{prefix}.{a.name}" in files:
                    module_use(node.lineno, f"{prefix}.{a.name}")
                elif _is_private(a.name):
                    found.append(f"{node.lineno}: from {prefix} import {a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr) and node.attr not in own:
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in ("self", "cls"):
                continue
            if f"{ast.unparse(node.value)}.{node.attr}" in files:  # named._compat, reached through `import named`
                module_use(node.lineno, f"{ast.unparse(node.value)}.{node.attr}")
            elif (isinstance(root, ast.Name) and root.id in bound) or node.attr in ours:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif (
            isinstance(node, ast.Call)
            and (getattr(node.func, "attr", None) or getattr(node.func, "id", None)) == "setattr"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _is_private(node.args[1].value)
            and node.args[1].value not in own
        ):
            found.append(f"{node.lineno}: setattr of {node.args[1].value!r}")
    return found


def _private_crossings() -> list[str]:
    files = _modules()
    sources = {
        f: f.read_text()
        for d in SCANNED
        for f in sorted((ROOT / d).rglob("*.py"))
        if not any(part.startswith(".venv") for part in f.parts)
    }
    ours = set().union(*(_private_defs(ast.parse(sources[f])) for f in files.values()))
    module_of = {f: m for m, f in files.items()}
    return [
        f"{path.relative_to(ROOT).as_posix()}:{use}"
        for path, source in sources.items()
        for use in _private_uses(source, module_of.get(path), files, ours)
    ]


def test_a_private_crossing_is_found():
    files = {m: f"{m.replace('.', '/')}.py" for m in ("named._core", "named._ops", "named.nn._stacked")}
    files["named.trainer.loop.x"] = "x.py"
    files["named.nn"] = "named/nn/__init__.py"
    ours = {"_unchecked", "_wrap", "_call", "_write_leaf"}
    lib, trainer = "named.nn._linear", "named.trainer.loop.x"

    def uses(src, module=lib):
        return [u.split(": ", 1)[1] for u in _private_uses(src, module, files, ours)]

    assert uses("from .._ops import _wrap\n") == ["from named._ops import _wrap"]
    assert uses("from .. import _ops\nf = _ops._wrap\n") == ["_ops._wrap"]
    assert uses("from .._core import NamedArray\nNamedArray._unchecked(1, ())\n") == ["NamedArray._unchecked"]
    assert uses("y = x._unchecked\n") == ["x._unchecked"]  # a private name of ours, on any object
    assert uses("from named._ops import where\n", trainer) == ["imports named._ops, private to named"]
    assert uses("import named.nn._stacked\n", None) == []  # a test may import a private module
    assert uses("import named.trainer.loop.x as w\nmonkeypatch.setattr(w, '_write_leaf', f)\n", None) == [
        "setattr of '_write_leaf'"
    ]
    # what may stay: a module's own privates, a private module inside its package, dunders, others' privates
    assert uses("from .._ops import where\nfrom ._stacked import call\n") == []
    assert uses("def _f(self):\n    return self._g, other._f, x.__class__, os._exit\n") == []


def test_nothing_private_crosses_a_module_boundary():
    assert _private_crossings() == [], (
        "a _private name used outside its module: give what modules share a public name in a private "
        "module (named.internal lists what the models, trainer and bench need from the library)"
    )
