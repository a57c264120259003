"""State dicts: any module as a flat ``{dotted key: array}`` dict and back, and as a safetensors file.

Keys join attribute names, sequence indices and dict keys with ".", as torch's ``state_dict``
does for the same nesting. A ``Stacked`` or a ``BlockSeq`` adds one level per layer
(``layers.0.mlp.up.weight``, not ``layers.stacked.…``): stacked arrays are split along their
layers axis on the way out and stacked again on the way in, so a file does not depend on which
of the two holds the blocks. Values are plain arrays, in the axis order of the module's
NamedArray with the layers axis removed; on load the template module gives the names back.

``flatten=True`` (Haliax's ``to_torch_compatible_state_dict``) first lays every module that can
out as torch holds it (``flatten_for_export``: a Linear's weight ``[out, in]``, several In or Out
axes merged into one), and on load puts the template's axes back (``unflatten_from_export``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._axis import ArgumentTypeError, Axis, NamedError
from ._core import NamedArray, is_named_array
from ._shape import unbind
from .nn import BlockSeq, Stacked
from .partitioning import sharding_for

__all__ = [
    "FileWriteError",
    "StateDictEntry",
    "StateDictError",
    "flatten_modules_for_export",
    "load_state_dict",
    "load_state_dict_file",
    "save_safetensors",
    "square_keys",
    "stack_state_dict",
    "unstack_state_dict",
    "save_state_dict",
    "state_dict",
    "state_dict_entries",
    "unflatten_modules_from_export",
]


class StateDictError(NamedError, ValueError):
    """A state dict (or its file) does not fit the module: a missing, unexpected or misshapen key."""


class FileWriteError(NamedError, OSError):
    """A file could not be written (a full disk, a file-size limit); ``filename`` names it. Also an
    OSError: the machine failed, not the input (the console scripts exit 1 for it, as for any OSError)."""

    def __str__(self) -> str:
        return f"cannot write {self.filename}: {self.strerror}"


def save_safetensors(
    arrays: Mapping[str, np.ndarray], path: str | os.PathLike, metadata: Mapping[str, str] | None = None
) -> None:
    """safetensors' ``save_file``, whose I/O failures (a ``SafetensorError``, which is no OSError,
    carrying the OS error's number in its text) become a FileWriteError naming ``path``."""
    from safetensors import SafetensorError
    from safetensors.numpy import save_file

    if not isinstance(arrays, Mapping):
        raise ArgumentTypeError(f"save_safetensors takes a mapping of names to arrays, got {type(arrays).__name__}")

    try:
        save_file(dict(arrays), str(path), metadata=dict(metadata) if metadata else None)
    except SafetensorError as e:
        m = re.search(r"\(os error (\d+)\)", str(e))
        code = int(m.group(1)) if m else 0
        raise FileWriteError(code, os.strerror(code) if code else str(e), str(path)) from None


# ---- the one flattening ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StateDictEntry:
    """One leaf of a pytree as state dicts see it.

    ``path`` is the pytree path (``jax.tree_util.keystr`` with "." separators, e.g.
    ``layers.stacked.mlp.up.weight``); ``parts`` are the parts of its state-dict key, with the
    layers Axis of each enclosing ``Stacked`` where that stack is split per layer.
    """

    path: str
    parts: tuple[str | Axis, ...]
    leaf: Any

    @property
    def stacks(self) -> tuple[Axis, ...]:
        """The layers axes the leaf is split along, outermost first."""
        return tuple(p for p in self.parts if isinstance(p, Axis))

    def key(self, *layers: int) -> str:
        """The state-dict key of this leaf's slice at ``layers`` (one index per stack)."""
        it = iter(layers)
        return ".".join(str(next(it)) if isinstance(p, Axis) else p for p in self.parts)

    def layer_indices(self) -> list[tuple[int, ...]]:
        """Every combination of layer indices, in key order (``[()]`` outside any stack)."""
        return list(itertools.product(*(range(a.size) for a in self.stacks)))


def _is_node(x) -> bool:
    return is_named_array(x) or isinstance(x, (Stacked, BlockSeq))


def _part(k) -> str:
    return jax.tree_util.keystr((k,), simple=True, separator=".")


def state_dict_entries(tree) -> list[StateDictEntry]:
    """Every leaf of ``tree`` (NamedArrays as leaves), in ``jax.tree.leaves(tree,
    is_leaf=nm.is_named_array)`` order, with its pytree path and its state-dict key parts."""
    out: list[StateDictEntry] = []
    _walk(tree, (), (), out)
    return out


def _walk(tree, keypath: tuple, parts: tuple, out: list) -> None:
    for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_node)[0]:
        full, here = keypath + path, parts + tuple(_part(k) for k in path)
        if isinstance(x, Stacked):
            _walk(x.stacked, full + (jax.tree_util.GetAttrKey("stacked"),), here + (x.Layers,), out)
        elif isinstance(x, BlockSeq):
            # the tuple's own indices become the layer part of the key
            _walk(x.blocks, full + (jax.tree_util.GetAttrKey("blocks"),), here, out)
        else:
            out.append(StateDictEntry(jax.tree_util.keystr(full, simple=True, separator="."), here, x))


def _is_array(x) -> bool:
    return isinstance(x, NamedArray) or eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _raw(x):
    return x.array if isinstance(x, NamedArray) else x


def _slices(e: StateDictEntry) -> list[tuple[str, Any]]:
    """``(key, array)`` for each layer slice of an array leaf."""
    if not e.stacks:
        return [(e.key(), _raw(e.leaf))]
    if not isinstance(e.leaf, NamedArray):
        raise StateDictError(f"{e.path}: a plain array inside a Stacked has no layers axis to split it by")
    slices = [e.leaf]
    for axis in e.stacks:
        slices = [s for x in slices for s in unbind(x, axis.name)]
    return [(e.key(*idx), x.array) for idx, x in zip(e.layer_indices(), slices)]


def _exports(x) -> bool:
    return isinstance(x, eqx.Module) and callable(getattr(type(x), "flatten_for_export", None))


def flatten_modules_for_export(tree):
    """``tree`` with every module that has a torch layout (a Linear) in it: ``flatten_for_export``.
    An abstract tree (``eqx.filter_eval_shape``) gives an abstract result."""

    def flatten(t):
        return jax.tree.map(lambda m: m.flatten_for_export() if _exports(m) else m, t, is_leaf=_exports)

    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree)):
        return eqx.filter_eval_shape(flatten, tree)
    return flatten(tree)


def unflatten_modules_from_export(flat, template):
    """The inverse of ``flatten_modules_for_export``: each flattened module back in the axes of
    the module at its place in ``template``."""
    try:
        return jax.tree.map(
            lambda f, t: f.unflatten_from_export(t) if _exports(t) else f, flat, template, is_leaf=_exports
        )
    except ValueError as e:  # jax's pytree mismatch
        raise StateDictError(
            f"unflatten_modules_from_export: the flattened tree is not shaped as the template: {e}"
        ) from e


def state_dict(tree, *, flatten: bool = False) -> dict[str, jax.Array]:
    """The arrays of ``tree`` (a module, or any pytree) under flat dotted keys.

    Non-array leaves are left out. Each value is the NamedArray's array, in its axis order;
    the arrays of a ``Stacked`` come one per layer (``layers.0.…``), without the layers axis.
    ``flatten=True``: torch's layouts (a Linear's weight ``[out, in]``, its bias ``[out]``).
    """
    if flatten:
        tree = flatten_modules_for_export(tree)
    out: dict[str, Any] = {}
    for e in state_dict_entries(tree):
        if not _is_array(e.leaf):
            continue
        for key, value in _slices(e):
            if key in out:
                raise StateDictError(f"two leaves of the tree have the state-dict key {key!r} (the second at {e.path})")
            out[key] = value
    return out


def _layer_key(prefix: str) -> re.Pattern:
    return re.compile(rf"^{re.escape(prefix)}\.(\d+)\.(.+)$" if prefix else r"^(\d+)\.(.+)$")


def stack_state_dict(state_dict: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """Haliax's ``_stack_state_dict``: the per-layer keys ``<prefix>.<i>.<rest>`` merged into one
    ``<prefix>.<rest>`` each, stacked along a new leading axis in layer order (a ``Stacked``'s
    arrays as one array); other keys are kept as they are. A layer missing from ``0..n-1`` for some
    ``<rest>`` is a StateDictError naming it."""
    if not isinstance(prefix, str):
        raise ArgumentTypeError(f"stack_state_dict: prefix is a key prefix (a str), got {prefix!r}")
    pattern, out, layers = _layer_key(prefix), {}, {}
    for key, value in state_dict.items():
        m = pattern.match(key)
        if m is None:
            out[key] = value
        else:
            layers.setdefault(m.group(2), {})[int(m.group(1))] = value
    for rest, by_layer in layers.items():
        missing = [i for i in range(max(by_layer) + 1) if i not in by_layer]
        if missing:
            raise StateDictError(
                f"stack_state_dict: {prefix + '.' if prefix else ''}{missing[0]}.{rest} is missing, but layer "
                f"{max(by_layer)} has {rest!r}"
            )
        values = [by_layer[i] for i in range(len(by_layer))]
        xp = jnp if any(isinstance(v, jax.Array) for v in values) else np
        out[f"{prefix}.{rest}" if prefix else rest] = xp.stack([xp.asarray(v) for v in values])
    return out


def unstack_state_dict(state_dict: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """The inverse of :func:`stack_state_dict`: each ``<prefix>.<rest>`` split along its leading
    axis into ``<prefix>.<i>.<rest>``; other keys are kept."""
    if not isinstance(prefix, str):
        raise ArgumentTypeError(f"unstack_state_dict: prefix is a key prefix (a str), got {prefix!r}")
    out = {}
    for key, value in state_dict.items():
        if prefix and not key.startswith(prefix + "."):
            out[key] = value
            continue
        rest = key[len(prefix) + 1 :] if prefix else key
        if not np.ndim(value):
            raise StateDictError(f"unstack_state_dict: {key!r} is 0-d: it has no layers axis to split")
        for i in range(np.shape(value)[0]):
            out[f"{prefix}.{i}.{rest}" if prefix else f"{i}.{rest}"] = value[i]
    return out


# ---- loading -----------------------------------------------------------------------------------------

_KINDS = (
    (jnp.floating, "floating-point"),
    (jnp.complexfloating, "complex"),
    (jnp.integer, "integer"),
    (jnp.bool_, "boolean"),
)


def _kind(dtype) -> str:
    # by issubdtype, not numpy's kind letter, which is "V" for bfloat16 and the float8s
    return next((name for kind, name in _KINDS if jnp.issubdtype(dtype, kind)), str(dtype))


@dataclasses.dataclass(frozen=True)
class _Found:
    """What a source says about one key before any of its data is read."""

    shape: tuple[int, ...]
    kind: str


def _expected_shape(e: StateDictEntry) -> tuple[int, ...]:
    if isinstance(e.leaf, NamedArray):
        stacked = {a.name for a in e.stacks}
        return tuple(a.size for a in e.leaf.axes if a.name not in stacked)
    return tuple(e.leaf.shape)


def _missing_text(keys: list[str]) -> str:
    more = f" (and {len(keys) - 1} more: {', '.join(keys[1:4])}{', ...' if len(keys) > 4 else ''})"
    return f"{keys[0]!r}{more if len(keys) > 1 else ''}"


def _check(entries: list[StateDictEntry], found: Mapping[str, _Found], strict: bool, where: str) -> None:
    """Every key, shape and dtype kind checked against the template before any value is used."""
    wanted = {}
    for e in entries:
        if _is_array(e.leaf):
            for idx in e.layer_indices():
                wanted[e.key(*idx)] = e
    unexpected = [k for k in found if k not in wanted]
    if strict and unexpected:
        raise StateDictError(
            f"{where}: unexpected key {_missing_text(unexpected)}: the module has no such parameter "
            "(pass strict=False to ignore it)"
        )
    missing = [k for k in wanted if k not in found]
    if missing and strict:
        raise StateDictError(
            f"{where}: missing key {_missing_text(missing)} (pass strict=False to keep the template's values)"
        )
    for key, e in wanted.items():
        if key not in found:
            if not eqx.is_array(_raw(e.leaf)):
                raise StateDictError(
                    f"{where}: missing key {key!r}, and the template is abstract: it has no value to keep"
                )
            continue
        f, shape = found[key], _expected_shape(e)
        if f.shape != shape:
            axes = ""
            if isinstance(e.leaf, NamedArray):
                axes = " (" + " ".join(a.name for a in e.leaf.axes if a not in e.stacks) + ")"
            raise StateDictError(f"{where}: key {key!r} has shape {list(f.shape)}, expected {list(shape)}{axes}")
        if f.kind != _kind(e.leaf.dtype):
            raise StateDictError(
                f"{where}: key {key!r} holds {f.kind} values, but parameter {e.path} is {e.leaf.dtype}"
            )


def _placement(leaf, mapping, mesh):
    axes = leaf.axes if isinstance(leaf, NamedArray) else None
    if (mapping is not None or mesh is not None) and axes is not None:
        return sharding_for(axes, mapping, mesh)
    sharding = getattr(_raw(leaf), "sharding", None)
    return sharding if isinstance(sharding, jax.sharding.Sharding) else None


def _join(e: StateDictEntry, get: Callable[[str], Any], mapping, mesh):
    """The leaf rebuilt from its per-layer values, cast to the template's dtype and placed."""
    dtype = e.leaf.dtype
    values = [get(e.key(*idx)) for idx in e.layer_indices()]
    xp = jnp if any(isinstance(v, jax.Array) for v in values) else np
    values = [xp.asarray(v).astype(dtype) for v in values]
    if e.stacks:
        full = xp.stack(values).reshape(tuple(a.size for a in e.stacks) + values[0].shape)
        order = [a.name for a in e.stacks] + [a.name for a in e.leaf.axes if a not in e.stacks]
        value = xp.transpose(full, [order.index(a.name) for a in e.leaf.axes])
    else:
        value = values[0]
    sharding = _placement(e.leaf, mapping, mesh)
    value = jax.device_put(value, sharding) if sharding is not None else jnp.asarray(value)
    return NamedArray(value, e.leaf.axes) if isinstance(e.leaf, NamedArray) else value


# The safetensors metadata entry that records the layout a file was written in: "torch" for
# flatten=True (a Linear's weight [out, in]), "named" for the modules' own axis order. A square
# weight has the same shape both ways, so without it a load in the other layout is a silent transpose.
LAYOUT_KEY = "named.layout"
_LAYOUTS = {"torch": True, "named": False}


def square_keys(template) -> list[str]:
    """The state-dict keys whose torch layout (``flatten=True``) has the same shape as the modules'
    own but another axis order (a square Linear's weight): a file in either layout fits them, so
    which one a file holds must be known, not guessed from shapes."""
    if not any(_exports(m) for m in jax.tree.leaves(template, is_leaf=_exports)):
        return []

    def layout(tree):
        out = {}
        for e in state_dict_entries(tree):
            if isinstance(e.leaf, NamedArray):
                names = tuple(a.name for a in e.leaf.axes if a not in e.stacks)
                for idx in e.layer_indices():
                    out[e.key(*idx)] = (_expected_shape(e), names)
        return out

    own = layout(template)
    flat = layout(eqx.filter_eval_shape(lambda t: flatten_modules_for_export(t), template))
    return [k for k, (shape, names) in flat.items() if k in own and own[k][0] == shape and own[k][1] != names]


def _layout(template, flatten, recorded: str | None, foreign: bool, where: str) -> bool:
    """Whether to load in torch's layout: ``flatten`` as given, else the layout the source records;
    a source that records none (another writer's file, torch tensors) is refused where a square
    weight makes its layout a guess."""
    if recorded is not None and recorded not in _LAYOUTS:
        raise StateDictError(f"{where}: its {LAYOUT_KEY!r} metadata is {recorded!r}; expected 'torch' or 'named'")
    if flatten is not None and not isinstance(flatten, bool):
        raise ArgumentTypeError(f"{where}: flatten must be True, False or None (the file's record), got {flatten!r}")
    if recorded is not None:
        if flatten is not None and flatten != _LAYOUTS[recorded]:
            raise StateDictError(
                f"{where}: the file was saved with flatten={_LAYOUTS[recorded]} ({recorded} layout, its "
                f"{LAYOUT_KEY!r} metadata) but is loaded with flatten={flatten}; leave flatten out to follow the file"
            )
        return _LAYOUTS[recorded]
    if flatten is not None:
        return flatten
    square = square_keys(template) if foreign else []
    if square:
        raise StateDictError(
            f"{where}: key {_missing_text(square)} is a square weight, and the source does not record its "
            "layout: pass flatten=True if it holds torch's [out, in] (a torch or Hugging Face file), "
            "flatten=False if it holds the modules' own axis order"
        )
    return False


def _rebuild(template, found, get, strict, mapping, mesh, where, flatten: bool):
    if not flatten:
        return _rebuild_flat(template, state_dict_entries(template), found, get, strict, mapping, mesh, where)
    flat = flatten_modules_for_export(template)
    loaded = unflatten_modules_from_export(
        _rebuild_flat(flat, state_dict_entries(flat), found, get, strict, None, None, where), template
    )

    def place(value, t):  # where the template (or mapping) puts it, now that its axes are back
        if not isinstance(value, NamedArray):
            return value
        sharding = _placement(t, mapping, mesh)
        return NamedArray(jax.device_put(value.array, sharding) if sharding is not None else value.array, t.axes)

    return jax.tree.map(place, loaded, template, is_leaf=is_named_array)


def _rebuild_flat(template, entries, found, get, strict, mapping, mesh, where):
    _check(entries, found, strict, where)
    template_values = {}  # non-strict: a key the source lacks keeps the template's slice

    def value(key: str, e: StateDictEntry):
        if key in found:
            return get(key)
        if e.path not in template_values:
            template_values[e.path] = dict(_slices(e))
        return template_values[e.path][key]

    leaves = [_join(e, lambda k, e=e: value(k, e), mapping, mesh) if _is_array(e.leaf) else e.leaf for e in entries]
    return jax.tree.unflatten(jax.tree.structure(template, is_leaf=is_named_array), leaves)


def _as_array(key, v):
    if isinstance(v, NamedArray):
        raise StateDictError(
            f"state dict key {key!r} holds a NamedArray; state dicts hold plain arrays (pass "
            "x.array, in the template's axis order)"
        )
    if isinstance(v, (np.ndarray, jax.Array)):
        return v
    try:  # a CPU torch tensor, a list, ...
        v = np.asarray(v)
    except Exception as e:
        raise StateDictError(f"state dict key {key!r} holds a {type(v).__name__} that is not an array ({e})") from None
    if v.dtype == object:
        raise StateDictError(f"state dict key {key!r} holds a {type(v).__name__}, not an array")
    return v


def load_state_dict(
    template,
    state_dict: Mapping[str, Any],
    *,
    strict: bool = True,
    mapping=None,
    mesh=None,
    flatten: bool | None = None,
):
    """A copy of ``template`` with its arrays taken from ``state_dict`` (as ``nm.state_dict`` makes).

    Args:
        template: a module (or any pytree) that supplies structure, axes and dtypes; it may be
            abstract (``eqx.filter_eval_shape(Model.init, ...)``).
        state_dict: flat dotted keys to arrays (numpy, jax, or anything with shape and dtype).
            Values are cast to the template's dtypes.
        strict: when False, keys the module lacks are ignored and keys the dict lacks keep the
            template's values.
        mapping, mesh: place every array by this parameter mapping on this mesh. Without them an
            array goes where the template's array is (its sharding), or to the default device.
        flatten: True: the dict holds torch's layouts (``nm.state_dict(m, flatten=True)``); the
            template's axes are put back. False: the modules' own axis order (``nm.state_dict(m)``).
            None (the default): False, except for a dict of torch tensors, whose layout is
            torch's or ours; it is then a StateDictError when a square weight (``nm.square_keys``)
            would load either way, and must be said.

    Raises:
        StateDictError: naming the missing, unexpected or misshapen key, before anything is placed.
    """
    if not isinstance(state_dict, Mapping):
        raise StateDictError(f"load_state_dict takes a mapping of keys to arrays, got {type(state_dict).__name__}")
    for k in state_dict:
        if not isinstance(k, str):
            raise StateDictError(f"state dict keys are strings, got {k!r}")
    foreign = any(type(v).__module__.split(".")[0] == "torch" for v in state_dict.values())
    flatten = _layout(template, flatten, None, foreign, "load_state_dict")
    arrays = {k: _as_array(k, v) for k, v in state_dict.items()}
    found = {k: _Found(tuple(v.shape), _kind(v.dtype)) for k, v in arrays.items()}
    return _rebuild(template, found, arrays.__getitem__, strict, mapping, mesh, "load_state_dict", flatten)


# ---- safetensors files ----------------------------------------------------------------------------


def _safetensors_kind(dtype: str) -> str:
    if dtype == "BOOL":
        return "boolean"
    kinds = {"F": "floating-point", "B": "floating-point", "I": "integer", "U": "integer", "C": "complex"}  # B: BF16
    return kinds.get(dtype[:1], dtype)


# The safetensors metadata entry that holds each tensor's sha256: safetensors itself has no checksum,
# so without it a flipped bit (a NaN, a wrong weight) in a copied file loads as a number.
DIGEST_KEY = "named.sha256"


def _sha256(array: np.ndarray) -> str:
    """The sha256 of an array's bytes as safetensors stores them (C order)."""
    return hashlib.sha256(np.ascontiguousarray(array).reshape(-1).view(np.uint8)).hexdigest()


def save_state_dict(
    tree,
    path: str | os.PathLike,
    *,
    metadata: Mapping[str, str] | None = None,
    flatten: bool = False,
    digest: bool = True,
) -> None:
    """Write ``nm.state_dict(tree, flatten=flatten)`` to ``path`` as safetensors.

    The file is written beside ``path`` and renamed into place, so a failed save leaves no
    partial file and any earlier file at ``path`` whole. With ``digest`` (the default) the
    metadata also holds the sha256 of every tensor (under ``"named.sha256"``), which
    ``load_state_dict_file`` checks; other readers ignore it. The metadata always records the
    layout (``"named.layout"``: ``"torch"`` for ``flatten=True``, else ``"named"``), which
    ``load_state_dict_file`` follows, so a file loads back equal whatever ``flatten`` it was saved with.
    """
    path = Path(path)
    if path.is_dir():
        raise StateDictError(f"{path}: is a directory; save_state_dict writes one file (e.g. model.safetensors)")
    metadata = dict(metadata) if metadata else {}
    if digest and DIGEST_KEY in metadata:
        raise StateDictError(
            f"{path}: metadata key {DIGEST_KEY!r} holds the tensors' digests; use another name (or digest=False)"
        )
    if LAYOUT_KEY in metadata:
        raise StateDictError(f"{path}: metadata key {LAYOUT_KEY!r} records the layout (flatten=); use another name")
    metadata[LAYOUT_KEY] = "torch" if flatten else "named"
    arrays = {k: np.ascontiguousarray(np.asarray(v)) for k, v in state_dict(tree, flatten=flatten).items()}
    if digest:
        metadata[DIGEST_KEY] = json.dumps({k: _sha256(v) for k, v in arrays.items()}, sort_keys=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        save_safetensors(arrays, tmp, metadata or None)
        os.replace(tmp, path)
    except FileWriteError as e:  # name the file asked for, not its temporary neighbour
        raise FileWriteError(e.errno, e.strerror, str(path)) from None
    finally:
        if tmp.exists():
            tmp.unlink()


def _digests(path: Path, metadata: Mapping[str, str] | None, keys) -> dict[str, str] | None:
    """The per-tensor sha256s a file was saved with, or None for a file saved without them."""
    text = (metadata or {}).get(DIGEST_KEY)
    if text is None:
        return None
    try:
        digests = json.loads(text)
    except ValueError:
        digests = None
    if not isinstance(digests, dict) or not all(isinstance(v, str) for v in digests.values()):
        raise StateDictError(
            f"{path}: its {DIGEST_KEY!r} metadata is not a JSON object of sha256 digests; the header "
            "was changed after the file was saved"
        )
    unlisted = [k for k in keys if k not in digests]
    if unlisted:
        raise StateDictError(
            f"{path}: tensor {_missing_text(unlisted)} has no digest in its {DIGEST_KEY!r} metadata; "
            "the file was changed after it was saved"
        )
    return digests


def load_state_dict_file(
    template,
    path: str | os.PathLike,
    *,
    strict: bool = True,
    mapping=None,
    mesh=None,
    flatten: bool | None = None,
):
    """``load_state_dict(template, <the safetensors file at path>)``: every key, shape and dtype
    in the file's header is checked against ``template`` before a tensor is read, and each
    tensor goes to its device(s) as it is read. Never unpickles anything.

    A file saved with digests (``save_state_dict``'s default) has each tensor's bytes checked
    against its sha256 as it is read: a tensor whose bytes changed since (a flipped bit, a bad
    copy) raises a StateDictError naming it and the file, and nothing is returned. A file
    without digests (other writers') loads unchecked.

    ``flatten``: None (the default) follows the layout the file records (``save_state_dict``
    writes it); a file that records none (torch's, Hugging Face's) is read in the modules' own
    layout, except that a square weight (``nm.square_keys``), which fits either, makes it a
    StateDictError asking for ``flatten=True`` (torch's ``[out, in]``) or ``False``. An explicit
    ``flatten`` that contradicts the file's record is a StateDictError."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise StateDictError(f"{path}: {'not a file' if path.exists() else 'not found'}")
    try:
        with safe_open(str(path), framework="numpy") as f:
            found = {}
            for k in f.keys():
                s = f.get_slice(k)
                found[k] = _Found(tuple(s.get_shape()), _safetensors_kind(s.get_dtype()))
            digests = _digests(path, f.metadata(), found)
            flatten = _layout(template, flatten, (f.metadata() or {}).get(LAYOUT_KEY), True, str(path))
            get = f.get_tensor
            if digests is not None:

                def get(key):
                    value = f.get_tensor(key)
                    if _sha256(value) != digests[key]:
                        raise StateDictError(
                            f"{path}: tensor {key!r} does not match the sha256 it was saved with: its "
                            "bytes changed since (a damaged or partly copied file); nothing was loaded"
                        )
                    return value

            return _rebuild(template, found, get, strict, mapping, mesh, str(path), flatten)
    except SafetensorError as e:
        raise StateDictError(f"{path}: safetensors cannot read it ({e})") from None
