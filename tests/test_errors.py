"""Every error the library raises on purpose: its type, and that the message names the culprit
(the axis, the sizes, the spec) and, where it helps, the array's axes or the fix.

One row per ``raise`` in the core modules (src/named/_axis, _core, _einsum, _index, _ops, _shape,
_transforms, random); test_every_raise_is_covered keeps the table honest when one is added.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import named as nm
from named import Axis
from named import _axis as axis_mod
from named._core import NamedArray

B, E, M = Axis("batch", 2), Axis("embed", 3), Axis("mlp", 4)
x = nm.zeros((B, E))
xi = nm.zeros((B, E), dtype=jnp.int32)
w = nm.zeros((E, M))
AE = nm.AxisError

CASES = [
    # id, thunk, exception, regex the message must match
    # ---- _axis.py
    ("axis-empty-name", lambda: Axis("", 3), AE, r"non-empty string, got ''"),
    ("axis-name-not-str", lambda: Axis(3, 3), AE, r"non-empty string, got 3"),
    ("axis-name-space", lambda: Axis("a b", 3), AE, r"'a b' may not contain spaces"),
    ("axis-name-slash", lambda: Axis("embed/data", 3), AE, r"'embed/data' may not contain .*'/'"),
    ("axis-name-ellipsis", lambda: Axis("...", 3), AE, r"nor be '\.\.\.'"),
    ("axis-size-not-int", lambda: Axis("embed", "three"), AE, r"axis 'embed': size must be an int, got 'three'"),
    ("axis-size-negative", lambda: Axis("embed", -1), AE, r"axis 'embed': size must be >= 0, got -1"),
    ("axis-size-float", lambda: Axis("embed", 2.5), AE, r"axis 'embed': size must be an int, got 2.5"),
    ("axis-size-bool", lambda: Axis("embed", True), AE, r"axis 'embed': size must be an int, got True"),
    ("name_of-bad", lambda: x.axis_size(3), AE, r"expected an Axis or an axis name, got 3"),
    ("as_selectors-bad-item", lambda: x.sum(["batch", 3]), AE, r"expected an Axis or an axis name, got 3"),
    (
        "as_selectors-bad",
        lambda: axis_mod.as_selectors(3.5),
        AE,
        r"expected an axis, a name or a sequence of them, got 3.5",
    ),
    ("check_unique", lambda: nm.named(np.zeros((2, 2)), "a a"), AE, r"'a' appears twice .*\(a=2, a=2\).*rename"),
    (
        "index_of-size",
        lambda: x.sum(Axis("embed", 7)),
        AE,
        r"'embed' has size 3 in the array \(batch=2, embed=3\) but 7 was given",
    ),
    (
        "index_of-unknown",
        lambda: x.sum("mlp"),
        AE,
        r"'mlp' not found in array with axes \(batch=2, embed=3\); known names: batch, embed",
    ),
    ("index_of-unknown-scalar", lambda: x.sum().sum("mlp"), AE, r"'mlp' not found .*\(none: a scalar\)"),
    (
        "union-sizes",
        lambda: x + nm.zeros((Axis("embed", 4),)),
        AE,
        r"'embed' has size 3 in one operand and 4 in another .*\(batch=2, embed=3\) vs \(embed=4\)",
    ),
    # ---- _core.py
    (
        "NamedArray-axes-not-Axis",
        lambda: NamedArray(jnp.zeros(2), ("batch",)),
        AE,
        r"must be Axis objects, got 'batch'; use nm.named",
    ),
    (
        "NamedArray-shape",
        lambda: NamedArray(jnp.zeros((2, 4)), (B, E)),
        AE,
        r"shape \(2, 4\) does not match axes \(batch=2, embed=3\)",
    ),
    ("immutable", lambda: setattr(x, "axes", ()), AttributeError, r"immutable; use x.at"),
    (
        "scalar-with-axes",
        lambda: x.scalar(),
        AE,
        r"scalar\(\) needs an array with no axes, this one has \(batch=2, embed=3\)",
    ),
    ("len", lambda: len(x), TypeError, r"len\(\) is positional.*x.shape\[name\]"),
    ("iter", lambda: iter(x), TypeError, r"nm.unbind\(x, axis\)"),
    ("matmul", lambda: x @ w, TypeError, r"@ is positional; use nm.dot"),
    (
        "named-of-named",
        lambda: nm.named(x, "a b"),
        AE,
        r"got a NamedArray with axes \(batch=2, embed=3\); use rename or rearrange",
    ),
    (
        "named-count",
        lambda: nm.named(np.zeros((2, 3)), "batch"),
        AE,
        r"shape \(2, 3\) has 2 dimensions but 1 axes were given",
    ),
    (
        "named-size",
        lambda: nm.named(np.zeros((2, 3)), (B, Axis("embed", 4))),
        AE,
        r"'embed' has size 4 but the array's dimension is 3",
    ),
    ("named-ellipsis", lambda: nm.named(np.zeros((2, 3)), ("batch", ...)), AE, r"does not take '\.\.\.'"),
    (
        "positional-mixed",
        lambda: x + jnp.zeros((2, 3)),
        AE,
        r"positional array of shape \(2, 3\) was mixed with NamedArrays; wrap it with nm.named",
    ),
    ("axes_of-type", lambda: x + "text", TypeError, r"expected a NamedArray or a scalar, got str"),
    # ---- _einsum.py
    (
        "einsum-too-many-axes",
        lambda: nm.dot(*[nm.zeros((Axis(f"a{i}", 1),)) for i in range(53)], axis=()),
        AE,
        r"more than 52 distinct axes",
    ),
    (
        "dot-not-named",
        lambda: nm.dot(x, np.zeros(3), axis="embed"),
        TypeError,
        r"nm.dot takes a NamedArray, got a positional array of shape \(3,\); wrap it with nm.named",
    ),
    (
        "dot-unknown-axis",
        lambda: nm.dot(x, w, axis="heads"),
        AE,
        r"axis 'heads' is in none of the operands \(batch=2, embed=3\) , \(embed=3, mlp=4\)",
    ),
    ("einsum-no-arrow", lambda: nm.einsum("batch embed, embed mlp", x, w), AE, r"needs '->' and an output spec"),
    ("einsum-arity", lambda: nm.einsum("batch embed -> batch", x, w), AE, r"has 1 input specs but 2 arrays"),
    (
        "einsum-not-named",
        lambda: nm.einsum("batch embed, embed -> batch", x, np.zeros(3)),
        TypeError,
        r"operand 1 is a ndarray, not a NamedArray",
    ),
    (
        "einsum-repeat-in",
        lambda: nm.einsum("batch embed embed -> batch", x),
        AE,
        r"operand 0: spec 'batch embed embed' repeats a name",
    ),
    (
        "einsum-missing",
        lambda: nm.einsum("batch mlp -> batch", x),
        AE,
        r"operand 0: axes \['mlp'\] are not in its axes \(batch=2, embed=3\)",
    ),
    (
        "einsum-unlisted",
        lambda: nm.einsum("batch -> batch", x),
        AE,
        r"operand 0 has axes \['embed'\] that its spec does not list",
    ),
    (
        "einsum-repeat-out",
        lambda: nm.einsum("batch embed -> batch batch", x),
        AE,
        r"output 'batch batch' repeats a name",
    ),
    (
        "einsum-unknown-out",
        lambda: nm.einsum("batch embed -> heads", x),
        AE,
        r"output names \['heads'\] are in no operand \(operand axes: \(batch=2, embed=3\)\)",
    ),
    (
        "einsum-ellipsis-dropped",
        lambda: nm.einsum("... embed, embed mlp -> mlp", x, w),
        AE,
        r"axes \['batch'\] come in through '\.\.\.' but the output has no '\.\.\.'",
    ),
    # ---- _index.py
    ("index-name-only", lambda: x["batch"], AE, r"x\['batch'\] needs an index after the name"),
    ("index-positional", lambda: x[0], AE, r"index NamedArrays by name.*got 0; array axes \(batch=2, embed=3\)"),
    ("index-twice", lambda: x["batch", 0, "batch", 1], AE, r"'batch' is indexed twice"),
    (
        "index-bool-mask",
        lambda: x["batch", nm.named(jnp.array([True, False]), "batch")],
        AE,
        r"boolean NamedArray masks .* nm.where",
    ),
    ("index-unsupported", lambda: x["batch", 1.5], AE, r"unsupported index 1.5"),
    ("ds-too-long", lambda: x["embed", nm.ds(0, 4)], AE, r"nm.ds\(start, 4\) does not fit in axis 'embed' of size 3"),
    (
        "ds-too-long-gather",
        lambda: x["embed", nm.ds(0, 4), "batch", nm.named(jnp.array([0]), "k")],
        AE,
        r"does not fit in axis 'embed'",
    ),
    (
        "at-extra-axes",
        lambda: x.at["batch", 0].set(nm.zeros((M,))),
        AE,
        r"update values have axes \(mlp=4\) that the indexed region \(embed=3\) lacks",
    ),
    ("at-positional", lambda: x.at["batch", 0].set(jnp.zeros(3)), AE, r"positional array of shape \(3,\).*nm.named"),
    (
        "updated_slice-axes",
        lambda: nm.updated_slice(x, {"batch": 0}, nm.zeros((M,))),
        AE,
        r"update axes \['mlp'\] are not in the array \(batch=2, embed=3\)",
    ),
    (
        "updated_slice-size",
        lambda: nm.updated_slice(x, {"batch": 0}, nm.zeros((Axis("embed", 5),))),
        AE,
        r"update axis 'embed' has size 5 > 3",
    ),
    # ---- _ops.py
    (
        "reduce-where-extra",
        lambda: x.sum("embed", where=nm.ones((M,), dtype=bool)),
        AE,
        r"where= has axes \(mlp=4\) that the reduced array \(batch=2, embed=3\) lacks",
    ),
    # a plain array is reduced whole (Haliax's hax.all(a == b)); an axis cannot name its dimensions
    (
        "reduce-not-named",
        lambda: nm.sum(np.zeros(3), "batch"),
        TypeError,
        r"nm.sum\(x, axis='batch'\) on a plain array of shape \(3,\): axes are names",
    ),
    (
        "reduce-not-array",
        lambda: nm.sum("batch"),
        TypeError,
        r"nm.sum takes a NamedArray \(or a plain array, reduced whole\), got str",
    ),
    (
        "argmax-needs-one",
        lambda: x.argmax(("batch", "embed")),
        AE,
        r"argmax needs exactly one axis name, or None for a flat index; the array has axes \(batch=2, embed=3\)",
    ),
    ("argmin-two", lambda: nm.argmin(x, ("batch", "embed")), AE, r"argmin needs exactly one axis name"),
    (
        "along-one-axis",
        lambda: nm.softmax(x, ("batch", "embed")),
        AE,
        r"softmax needs exactly one axis name, got \('batch', 'embed'\); the array has axes \(batch=2, embed=3\)",
    ),
    ("cumsum-one-axis", lambda: nm.cumsum(x, "batch embed"), AE, r"cumsum needs exactly one axis name"),
    (
        "reduce-duplicate",
        lambda: x.sum(("embed", "embed")),
        AE,
        r"nm.sum: axis 'embed' is given twice in \('embed', 'embed'\); name each axis once \(the array has axes "
        r"\(batch=2, embed=3\)\)",
    ),
    (
        "reduce-duplicate-text",
        lambda: nm.logsumexp(x, "batch embed batch"),
        AE,
        r"nm.logsumexp: axis 'batch' is given twice",
    ),
    ("reduce-duplicate-axis", lambda: nm.var(x, (E, "embed")), AE, r"nm.var: axis 'embed' is given twice"),
    ("fft-duplicate", lambda: nm.fft(x, ("embed", "embed")), AE, r"nm.fft: axis 'embed' is given twice"),
    ("fftshift-duplicate", lambda: nm.fftshift(x, ("batch", "batch")), AE, r"nm.fftshift: axis 'batch' is given twice"),
    (
        "bincount-duplicate",
        lambda: nm.bincount(xi, Axis("n", 3), axis=("embed", "embed")),
        AE,
        r"nm.bincount: axis 'embed' is given twice",
    ),
    # ---- _shape.py
    ("create-bare-name", lambda: nm.zeros(("batch",)), AE, r"needs Axis objects with sizes, got the bare name 'batch'"),
    ("create-duplicate", lambda: nm.ones((B, B)), AE, r"'batch' appears twice in the requested axes"),
    ("arange-name", lambda: nm.arange("batch"), AE, r"arange needs an Axis with a size, got 'batch'"),
    ("rename-size", lambda: x.rename({"embed": Axis("e", 9)}), AE, r"axis 'embed' has size 3, the new Axis\('e', 9\)"),
    ("rename-collision", lambda: x.rename({"embed": "batch"}), AE, r"'batch' appears twice in the renamed axes"),
    ("rename-unknown", lambda: x.rename({"mlp": "m"}), AE, r"'mlp' not found in array with axes \(batch=2, embed=3\)"),
    # several '...' are Haliax's partial order; a name among them is still checked
    (
        "rearrange-two-ellipses",
        lambda: x.rearrange((..., "mlp", ...)),
        AE,
        r"'mlp' not found in array with axes \(batch=2, embed=3\)",
    ),
    ("rearrange-twice", lambda: x.rearrange(("batch", "batch")), AE, r"axis 'batch' is listed twice"),
    (
        "rearrange-missing",
        lambda: x.rearrange(("batch",)),
        AE,
        r"leaves out axes \['embed'\] of \(batch=2, embed=3\); list them or use '\.\.\.'",
    ),
    (
        "flatten-duplicate",
        lambda: nm.flatten_axes(x, ("embed", "embed"), "f"),
        AE,
        r"flatten_axes: axis 'embed' is given twice",
    ),
    ("flatten-empty", lambda: nm.flatten_axes(x, (), "f"), AE, r"flatten_axes needs at least one axis"),
    (
        "flatten-size",
        lambda: nm.flatten_axes(x, ("batch", "embed"), Axis("f", 5)),
        AE,
        r"Axis\('f', 5\) does not match the product 6",
    ),
    (
        "flatten-collision",
        lambda: nm.flatten_axes(nm.zeros((B, E, M)), ("batch", "embed"), "mlp"),
        AE,
        r"'mlp' appears twice in the flattened axes",
    ),
    (
        "unflatten-bare",
        lambda: nm.unflatten_axis(x, "embed", ("a", "b")),
        AE,
        r"unflatten_axis needs Axis objects with sizes, got 'a'",
    ),
    (
        "unflatten-product",
        lambda: nm.unflatten_axis(x, "embed", (Axis("a", 2), Axis("b", 2))),
        AE,
        r"\(a=2, b=2\) do not multiply to the size 3 of 'embed'",
    ),
    (
        "unflatten-collision",
        lambda: nm.unflatten_axis(x, "embed", (Axis("batch", 3),)),
        AE,
        r"'batch' appears twice in the unflattened axes",
    ),
    (
        "split-bare",
        lambda: nm.split(x, "embed", ["a", "b"]),
        AE,
        r"split needs Axis objects with sizes for the pieces, got 'a'",
    ),
    (
        "split-collision",
        lambda: nm.split(x, "embed", [Axis("batch", 1), Axis("embed", 2)]),
        AE,
        r"'batch' appears twice in a split piece's axes",
    ),
    (
        "split-sizes",
        lambda: nm.split(x, "embed", [Axis("embed", 1), Axis("embed", 1)]),
        AE,
        r"sizes \[1, 1\] do not sum to the size 3 of 'embed'",
    ),
    ("stack-empty", lambda: nm.stack("s", []), AE, r"stack needs at least one array"),
    (
        "stack-existing",
        lambda: nm.stack("batch", [x, x]),
        AE,
        r"new axis 'batch' already exists in \(batch=2, embed=3\)",
    ),
    (
        "stack-different",
        lambda: nm.stack("s", [x, w]),
        AE,
        r"different axes \(batch=2, embed=3\) and \(embed=3, mlp=4\)",
    ),
    ("stack-size", lambda: nm.stack(Axis("s", 3), [x, x]), AE, r"Axis\('s', 3\) but 2 arrays were given"),
    ("concat-empty", lambda: nm.concatenate("batch", []), AE, r"concatenate needs at least one array"),
    (
        "concat-different",
        lambda: nm.concatenate("embed", [x, nm.zeros((E, M))]),
        AE,
        r"along 'embed': arrays have different other axes \(batch=2\) and \(mlp=4\)",
    ),
    (
        "broadcast_axis-bare",
        lambda: nm.broadcast_axis(x, "mlp"),
        AE,
        r"broadcast_axis needs Axis objects with sizes, got 'mlp'",
    ),
    (
        "broadcast_to-missing",
        lambda: nm.broadcast_to(x, (E, M)),
        AE,
        r"the array's axes \(batch=2\) are not in the target \(embed=3, mlp=4\)",
    ),
    ("top_k-k", lambda: nm.top_k(x, "embed", 4), AE, r"k=4 is not within \[0, 3\], the size of 'embed'"),
    ("one_hot-bare", lambda: nm.one_hot(xi, "embed"), AE, r"one_hot needs an Axis with a size, got 'embed'"),
    (
        "one_hot-existing",
        lambda: nm.one_hot(xi, Axis("embed", 3)),
        AE,
        r"new axis 'embed' already exists in \(batch=2, embed=3\)",
    ),
    # ---- _transforms.py
    (
        "vmap-size",
        lambda: nm.vmap(lambda a, b: a, "batch")(x, nm.zeros((Axis("batch", 5),))),
        AE,
        r"vmap over 'batch': axis 'batch' has size 5 in one input \(batch=5\) but 2 elsewhere",
    ),
    (
        "vmap-absent",
        lambda: nm.vmap(lambda a: a, "mlp")(x),
        AE,
        r"vmap over 'mlp': no input has axis 'mlp'; pass an Axis with a size",
    ),
    (
        "vmap-output-has-axis",
        lambda: nm.vmap(lambda a: nm.zeros((B,)), "batch")(x),
        AE,
        r"an output already has axis 'batch' \(batch=2\)",
    ),
    ("vmap-no-axis", lambda: nm.vmap(lambda a: a, ()), AE, r"vmap needs at least one axis"),
    (
        "scan-absent",
        lambda: nm.scan(lambda c, a: (c, a), "mlp")(0.0, x),
        AE,
        r"scan over 'mlp': no input has axis 'mlp'",
    ),
    ("nmap-no-named", lambda: nm.nmap(jnp.sum)(np.zeros(3)), AE, r"nmap: no NamedArray argument"),
    (
        "nmap-produce",
        lambda: nm.nmap(jnp.sum, consume="embed")(x),
        AE,
        r"returned 0 positional dimensions but produce names 1 \(\['embed'\]\)",
    ),
    # ---- random.py
    (
        "random-param-axes",
        lambda: nm.random.normal(jax.random.key(0), (B,), mean=nm.zeros((M,))),
        AE,
        r"mean has axes \(mlp=4\) that are not among the requested \(batch=2\)",
    ),
    (
        "random-key-axes",
        lambda: nm.random.normal(nm.named(jax.random.split(jax.random.key(0), 2), (B,)), (E,)),
        AE,
        r"single key, got keys with axes \(batch=2\); nm.vmap",
    ),
]


@pytest.mark.parametrize("thunk, exc, pattern", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_error_names_the_culprit(thunk, exc, pattern):
    with pytest.raises(exc, match=pattern):
        thunk()


def test_axis_error_is_a_named_error_and_a_value_error():
    assert issubclass(nm.AxisError, nm.NamedError) and issubclass(nm.AxisError, ValueError)
    with pytest.raises(ValueError):
        x.sum("nope")


def _ours_by_name(name: str):
    todo, seen = [nm.NamedError], {}
    while todo:
        c = todo.pop()
        seen[c.__name__] = c
        todo += c.__subclasses__()
    return seen.get(name)


def _raises(path: pathlib.Path, module):
    """(line, what it raises, the class or None) of every ``raise X(...)``/``raise f(...)`` and
    every ``assert`` in a source file; a factory's class is its return annotation."""
    import ast
    import inspect as pyinspect

    text = path.read_text()
    lines = text.splitlines()
    tree = ast.parse(text)
    # factories defined inside functions (`def bad(what) -> CheckpointFormatError`): by annotation
    local = {f.name: ast.unparse(f.returns) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.returns}
    # error types passed in (`error: type[ConfigError] = ConfigError`): by the parameter's annotation
    for f in ast.walk(tree):
        if isinstance(f, ast.FunctionDef):
            for arg in (*f.args.args, *f.args.kwonlyargs):
                if isinstance(arg.annotation, ast.Subscript) and ast.unparse(arg.annotation.value) == "type":
                    local.setdefault(arg.arg, ast.unparse(arg.annotation.slice))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert):
            out.append((node.lineno, "assert", None))
        if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
            continue  # `raise` and `raise e`: re-raising something already raised
        if "# protocol" in lines[node.lineno - 1]:
            continue  # the Python protocol's own exception (AttributeError from __getattr__, ...)
        name = ast.unparse(node.exc.func)
        try:
            obj = eval(name, vars(module))  # noqa: S307 - names of this repository's own modules
        except Exception:  # noqa: BLE001 - imported inside a function, or a method of a local value
            attr = name.rsplit(".", 1)[-1]
            if attr in local:
                attr = local[attr].rsplit(".", 1)[-1]
            obj = _ours_by_name(attr) or next(
                (getattr(c, attr) for c in vars(module).values() if isinstance(c, type) and hasattr(c, attr)), None
            )
        if callable(obj) and not isinstance(obj, type):
            ret = pyinspect.signature(obj).return_annotation
            obj = eval(ret, vars(pyinspect.getmodule(obj))) if isinstance(ret, str) else ret  # noqa: S307
        out.append((node.lineno, name, obj if isinstance(obj, type) else None))
    return out


def test_every_purposeful_raise_is_one_of_ours():
    """Every exception src/ raises on purpose is a NamedError (which may also be a ValueError,
    TypeError, ...), and no assert checks anything: asserts vanish under ``python -O``. Protocol
    exceptions carry a ``# protocol`` comment on their line."""
    import importlib

    roots = {"named": pathlib.Path(nm.__file__).parent}
    roots["named.models"] = roots["named"].parent / "models"
    roots["named.trainer"] = roots["named"].parent / "trainer"
    bad, seen = [], 0
    for pkg, root in roots.items():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            module = importlib.import_module(".".join([pkg, *(parts[:-1] if parts[-1] == "__init__" else parts)]))
            for line, name, cls in _raises(path, module):
                seen += 1
                if cls is None or not issubclass(cls, nm.NamedError):
                    bad.append(f"{path.relative_to(root.parent)}:{line}: {name}")
    assert seen > 300  # the walk found the library's raises
    assert bad == [], "raises that are not NamedErrors (or asserts):\n" + "\n".join(bad)


def test_the_family_check_sees_what_it_should(tmp_path):
    (tmp_path / "m.py").write_text(
        "def f(x):\n    assert x\n    raise ValueError('no')\n"
        "def g():\n    raise AttributeError('x')  # protocol: getattr\n"
    )
    import types

    found = _raises(tmp_path / "m.py", types.SimpleNamespace(ValueError=ValueError, AttributeError=AttributeError))
    assert [(n, c) for _, n, c in found] == [("assert", None), ("ValueError", ValueError)]
