"""The public surface of the library, walked by the tests that hold a rule for every public
name: tests/test_grads.py (a gradient case or a reason) and tests/test_contract.py (a row of the
edge-case contract). One walk, so that both see the same names."""

from __future__ import annotations

import inspect
import types

import named as nm
from named import nn

WALKED = {
    "nm": nm,
    "nn": nn,
    "nn.lora": nn.lora,
    "nn.mup": nn.mup,
    "nn.loss": nn.loss,
    "nn.precision": nn.precision,
    "nm.explicit": nm.explicit,
    "nm.random": nm.random,
    "nm.debug": nm.debug,
}


def public_surface() -> dict[str, object]:
    """Every public function and class of the walked namespaces, by its first name in WALKED
    (``nn.relu`` is ``nm.relu``: one entry). Modules and plain values (tables, constants) are not
    listed; a namespace module must be walked or listed itself. ``nm.random`` lists only what it defines."""
    out, seen = {}, set()
    for prefix, module in WALKED.items():
        names = getattr(module, "__all__", None) or [n for n in dir(module) if not n.startswith("_")]
        for n in names:
            obj = getattr(module, n)
            if module is nm.random and getattr(obj, "__module__", None) != nm.random.__name__:
                continue
            if inspect.ismodule(obj):
                # the models and the trainer install under named's name but are not the library;
                # named.internal is what they take from its internals, no promise to users
                if obj in WALKED.values() or obj.__name__.split(".")[:2] in (
                    ["named", "models"],
                    ["named", "trainer"],
                    ["named", "configs"],
                    ["named", "internal"],
                ):
                    continue
            # a type alias written `Axis | str` is a types.UnionType, which is not callable
            elif not (callable(obj) or isinstance(obj, types.UnionType)) or id(obj) in seen:
                continue
            seen.add(id(obj))
            out[f"{prefix}.{n}"] = obj
    return out
