"""Hugging Face checkpoints: read and write ``config.json`` + safetensors folders.

A folder holds ``config.json`` and either ``model.safetensors`` or shards listed by
``model.safetensors.index.json``. Tensors are read with safetensors' numpy API (no torch,
and never a pickle), one file at a time; each tensor goes to its device(s) as soon as it is
read, laid out by the parameter mapping, so a model that only fits when sharded loads.

Each family names its tensors in an ``HfLayout`` (``layout.keys``: our parameter path -> Hugging
Face name, ``{i}`` for the layer) that says how Hugging Face stores a Linear weight
(``layout.linear``: GPT-2's Conv1D keeps ``[in, out]``, torch's nn.Linear ``[out, in]``).
Our Linear weight has axes ``In + Out``; the Hugging Face tensor is that with each side
flattened (and transposed for ``[out, in]``); an embedding has the same shape in both; every
other parameter (biases, norm weights, OLMo 2's q/k norm over ``(heads, head_size)``) is flat.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

import named as nm
from named import NamedArray, nn

from ._hf_config import CheckpointFormatError, folder_file, read_json, reading, require_file
from ._parity import ParityReport, check_ids, our_logits, transformers_logits
from .registry import Family, family_for, family_for_hf

_LOG = logging.getLogger("named.models")

__all__ = [
    "CheckpointFormatError",
    "check_pretrained",
    "config_from_hf",
    "hf_state_dict",
    "load_pretrained",
    "save_pretrained",
]

# ---- our parameters <-> Hugging Face tensors ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Param:
    """One of our parameters and the Hugging Face tensors (one per layer, and per expert of an
    MoE layer, if stacked) it is made of."""

    path: str
    axes: tuple  # per tensor: without the stacked axes
    hf_names: tuple[str, ...]
    stacks: tuple[int, ...]  # the sizes of the stacked axes (layers, experts) the tensors are cut along
    linear: tuple[int, int] | None  # (in, out) flat sizes of a Linear weight
    flat: bool
    transposed: bool

    @property
    def stacked(self) -> bool:
        return bool(self.stacks)

    def index(self, k: int) -> tuple[int, ...]:
        """Where the ``k``-th of ``hf_names`` lies along the stacked axes."""
        return tuple(int(i) for i in np.unravel_index(k, self.stacks))

    @property
    def hf_shape(self) -> tuple[int, ...]:
        if self.linear is not None:
            return self.linear[::-1] if self.transposed else self.linear
        if self.flat:
            return (math.prod(a.size for a in self.axes),)
        return tuple(a.size for a in self.axes)

    def to_ours(self, t: np.ndarray) -> np.ndarray:
        if self.transposed:
            t = t.T
        return t.reshape(tuple(a.size for a in self.axes))

    def to_hf(self, x: np.ndarray) -> np.ndarray:
        x = x.reshape(self.hf_shape[::-1] if self.transposed else self.hf_shape)
        return np.ascontiguousarray(x.T if self.transposed else x)


def _params(model, arch: Family) -> tuple[list[_Param], list[NamedArray], Any]:
    params, leaves = [], []
    for entry in nm.state_dict_entries(model):  # nm.state_dict's flattening: paths and Stacked layers
        path, leaf = entry.path, entry.leaf
        if not isinstance(leaf, NamedArray) or path not in arch.layout.keys:
            raise CheckpointFormatError(f"{arch.model_type}: parameter {path!r} has no Hugging Face name (layout.keys)")
        template = arch.layout.keys[path]
        n = len(entry.stacks) if "{i}" in template else 0  # "{i}" the layer, "{j}" an MoE layer's expert
        axes = leaf.axes[n:]
        if n and entry.stacks != leaf.axes[:n]:
            raise CheckpointFormatError(f"{path}: a per-layer parameter without a leading layers axis")
        names = tuple(template.format(**dict(zip("ij", idx))) for idx in entry.layer_indices()) if n else (template,)
        owner = functools.reduce(getattr, path.split(".")[:-1], model)
        attr = path.rsplit(".", 1)[-1]
        linear = None
        if isinstance(owner, nn.Linear) and attr == "weight":
            linear = (
                math.prod(a.size for a in nm.axis_spec_to_tuple(owner.In)),
                math.prod(a.size for a in nm.axis_spec_to_tuple(owner.Out)),
            )
        flat = linear is None and not isinstance(owner, nn.Embedding)
        params.append(
            _Param(
                path,
                axes,
                names,
                tuple(a.size for a in leaf.axes[:n]),
                linear,
                flat,
                linear is not None and arch.layout.linear == "out_in",
            )
        )
        leaves.append(leaf)
    return params, leaves, jax.tree.structure(model, is_leaf=nm.is_named_array)


def hf_state_dict(model) -> dict[str, np.ndarray]:
    """The model's parameters as Hugging Face would name and shape them (numpy, on the host).

    Works on any pytree shaped like a model, e.g. its gradients.
    """
    params, leaves, _ = _params(model, family_for(model))
    out = {}
    for p, leaf in zip(params, leaves):
        for i, name in enumerate(p.hf_names):
            out[name] = p.to_hf(np.asarray(leaf.array[p.index(i)]))
    return out


# ---- safetensors files ---------------------------------------------------------------------------

_MAX_HEADER = 100_000_000  # safetensors' own limit
_NUMPY_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U64": np.uint64,
    "U32": np.uint32,
    "U16": np.uint16,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
_EXTRA_DTYPES = {"BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
_DTYPES = {**_NUMPY_DTYPES, **_EXTRA_DTYPES}


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """One entry of a safetensors header, checked: ``begin, end`` are offsets into the data."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _tensor_entry(path: Path, name: str, info, data_size: int) -> _Tensor:
    def bad(what: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{path}: corrupted safetensors header: tensor {name!r}: {what}")

    if not isinstance(info, dict):
        raise bad(f"expected an object with dtype, shape and data_offsets, got {info!r}")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str):
        raise bad(f"field 'dtype' should be a string, got {dtype!r}")
    if dtype not in _DTYPES:
        raise CheckpointFormatError(f"{path}: tensor {name!r} has unsupported dtype {dtype}")
    if not isinstance(shape, list) or not all(_is_count(n) for n in shape):
        raise bad(f"field 'shape' should be a list of non-negative integers, got {shape!r}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(n) for n in offsets):
        raise bad(f"field 'data_offsets' should be two non-negative integers, got {offsets!r}")
    begin, end = offsets
    if not begin <= end <= data_size:
        raise CheckpointFormatError(
            f"{path}: tensor {name!r} lies outside the file (bytes {begin}..{end} of {data_size})"
        )
    nbytes = math.prod(shape) * np.dtype(_DTYPES[dtype]).itemsize
    if end - begin != nbytes:
        raise CheckpointFormatError(
            f"{path}: tensor {name!r} of shape {shape} {dtype} needs {nbytes} bytes, "
            f"but its data_offsets give {end - begin}"
        )
    return _Tensor(dtype, tuple(shape), begin, end)


def _check_layout(path: Path, tensors: dict[str, _Tensor], data_size: int) -> None:
    """The safetensors rule: the tensors' bytes tile the data exactly, with no overlap, gap or tail."""
    at, previous = 0, None
    for name, t in sorted(tensors.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if t.begin != at:
            what = f"overlaps tensor {previous!r}" if t.begin < at else f"leaves bytes {at}..{t.begin} unused"
            raise CheckpointFormatError(f"{path}: corrupted safetensors file: tensor {name!r} {what}")
        at, previous = t.end, name
    if at != data_size:
        raise CheckpointFormatError(f"{path}: corrupted safetensors file: {data_size - at} bytes after the last tensor")


def _read_header(path: Path) -> tuple[int, dict[str, _Tensor]]:
    """The checked header of a safetensors file, read before anything of its size is allocated.

    Returns where the data starts and every tensor but ``__metadata__``. Every field is checked
    by us, to name the tensor and field; safetensors then opens the file (reading no tensor) as
    the format's own judge.
    """
    with reading(path):
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointFormatError(f"{path}: {size} bytes is too short for a safetensors file")
            n = int.from_bytes(head, "little")
            if n > min(size - 8, _MAX_HEADER):
                raise CheckpointFormatError(
                    f"{path}: corrupted safetensors header: it claims {n} bytes in a file of {size}"
                )
            raw = f.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise CheckpointFormatError(f"{path}: corrupted safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointFormatError(f"{path}: corrupted safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise CheckpointFormatError(
            f"{path}: corrupted safetensors header: '__metadata__' should map names to strings, got {metadata!r}"
        )
    data_size = size - 8 - n
    tensors = {name: _tensor_entry(path, name, info, data_size) for name, info in header.items()}
    _check_layout(path, tensors, data_size)
    try:
        with reading(path), safe_open(path, framework="numpy"):
            pass
    except SafetensorError as e:
        raise CheckpointFormatError(f"{path}: safetensors cannot read it ({e})") from None
    return 8 + n, tensors


def _read_tensor(handle, path: Path, data_start: int, name: str, t: _Tensor) -> np.ndarray:
    if t.dtype in _NUMPY_DTYPES:
        return handle.get_tensor(name)
    # numpy has no bfloat16 / float8, so safetensors' numpy API cannot return them: read the bytes
    dtype = _EXTRA_DTYPES[t.dtype]
    return np.fromfile(path, dtype=dtype, count=math.prod(t.shape), offset=data_start + t.begin).reshape(t.shape)


def _index_files(folder: Path, index: Path) -> list[Path]:
    """The shards ``index`` lists, each checked to lie inside ``folder`` before any is opened."""
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointFormatError(
            f"{index}: field 'weight_map' should map tensor names to file names, got {weight_map!r}"
        )
    files: dict[str, Path] = {}
    for tensor, name in weight_map.items():
        if not isinstance(name, str) or not name:
            raise CheckpointFormatError(f"{index}: weight_map[{tensor!r}] should be a file name, got {name!r}")
        if name not in files:
            files[name] = folder_file(folder, name, named_by=f"{index}: weight_map[{tensor!r}]")
    for path in files.values():
        require_file(path, f"listed in {index.name} but not found")
    return list(files.values())


def _checkpoint_files(folder: Path) -> list[Path]:
    index = folder_file(folder, "model.safetensors.index.json")
    if index.exists():
        return _index_files(folder, index)
    single = folder_file(folder, "model.safetensors")
    if single.exists():
        require_file(single)
        return [single]
    found = sorted(p.name for p in folder.glob("*.bin"))
    hint = f" (found {', '.join(found)}: pickles are never loaded; convert them to safetensors)" if found else ""
    raise CheckpointFormatError(f"{folder}: no model.safetensors or model.safetensors.index.json{hint}")


# ---- placement ---------------------------------------------------------------------------------------


@functools.cache
def _zeros(shape, dtype, sharding):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


@functools.cache
def _write_layer(sharding):
    # donating the stacked buffer: a stacked parameter is only ever held once (plus one layer)
    def write(buf, x, index):  # index: the tensor's place along the stacked axes (layer, expert)
        n = index.shape[0]
        return jax.lax.dynamic_update_slice(buf, x.reshape((1,) * n + x.shape), (*index, *(jnp.int32(0),) * x.ndim))

    return jax.jit(write, out_shardings=sharding, donate_argnums=0)


class _Placer:
    def __init__(self, mapping, mesh):
        if mapping is not None and mesh is None:
            mesh = nm.current_mesh()
            if mesh is None:
                raise nm.ArgumentError(
                    "load_pretrained got a mapping but no mesh: pass mesh= (e.g. nm.make_mesh({'data': -1}))"
                )
        self.mapping, self.mesh = mapping or {}, mesh

    def sharding(self, axes):
        if self.mesh is None:
            return jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return nm.sharding_for(tuple(axes), self.mapping, self.mesh)

    def put(self, buffer, p: _Param, k: int, stacks, value: np.ndarray):
        """``value``, the ``k``-th tensor of ``p``, placed (into ``buffer`` along ``stacks``, if stacked)."""
        if not p.stacked:
            return jax.device_put(value, self.sharding(p.axes))
        if buffer is None:
            full = tuple(stacks) + p.axes
            buffer = _zeros(tuple(a.size for a in full), value.dtype, self.sharding(full))()
        x = jax.device_put(value, self.sharding(p.axes))
        return _write_layer(buffer.sharding)(buffer, x, jnp.asarray(p.index(k), jnp.int32))


# ---- config.json -------------------------------------------------------------------------------------


def read_config(folder: Path) -> tuple[Family, Any, Path]:
    """The family and our config for the ``config.json`` in ``folder``, and that file's path."""
    if not folder.is_dir():
        raise CheckpointFormatError(
            f"{folder}: {'not a directory' if folder.exists() else 'not found'}; "
            "a Hugging Face model is a folder holding config.json and safetensors files"
        )
    where = folder_file(folder, "config.json")
    d = read_json(where)
    family = family_for_hf(d, where)
    return family, family.from_hf(d, where), where


def config_from_hf(folder: str | Path) -> Any:
    """Our config for the ``config.json`` in ``folder``."""
    return read_config(Path(folder))[1]


def _our_name(name: str, family: Family, wanted, config) -> str | None:
    """The model's name for a tensor name of a folder (some omit the base prefix), or None for a
    tensor that is no parameter: a tied copy of the embedding, or a buffer (``layout.ignored``)."""
    layout = family.layout
    if name not in wanted and layout.base_prefix + name in wanted:
        name = layout.base_prefix + name
    if (name == "lm_head.weight" and config.tie_word_embeddings) or any(re.search(r, name) for r in layout.ignored):
        return None
    return name


# ---- load and save -----------------------------------------------------------------------------------


def load_pretrained(
    folder: str | Path,
    *,
    mapping: Mapping | None = None,
    mesh=None,
    dtype=jnp.float32,
    check: bool = False,
    tolerance: float = 1e-3,
) -> tuple[Any, Any]:
    """``(config, model)`` from a Hugging Face folder of any family in ``models.FAMILIES``.

    Args:
        folder: holds ``config.json`` and ``model.safetensors`` or a sharded
            ``model.safetensors.index.json`` with its files.
        mapping: the parameter mapping (``{"embed": "data"}``); every tensor is placed by it
            on ``mesh`` as it is read. Without a mesh the model lands on the default device.
        mesh: the device mesh (default: the current one when a mapping is given).
        dtype: the parameters' dtype (default float32); None keeps the checkpoint's.
        check: run ``check_pretrained`` on the loaded model: log its report (logger
            ``named.models``) and raise a CheckpointFormatError when our float32 logits differ
            from ``transformers``' by more than ``tolerance``.

    Raises:
        CheckpointFormatError: naming the file, tensor or field that is missing, unexpected,
            of the wrong shape or dtype, corrupted, unreadable or unsupported. No tensor is read
            before the folder's config and every header (name, shape, dtype, byte range of each
            tensor) have been checked, and no file is opened that lies outside ``folder`` once
            symlinks are followed (an index naming one is refused before any shard is opened).
    """
    folder = Path(folder)
    placer = _Placer(mapping, mesh)
    arch, config, _ = read_config(folder)
    abstract = eqx.filter_eval_shape(arch.model_cls.init, config, key=jax.random.key(0))
    params, leaves, treedef = _params(abstract, arch)
    arrays: list[Any] = [None] * len(params)
    for path, data_start, todo in _plan(folder, arch, config, params, leaves, keep_dtype=dtype is None):
        try:
            with reading(path), safe_open(path, framework="numpy") as handle:
                for name, (k, layer, t) in todo.items():
                    p = params[k]
                    value = p.to_ours(_read_tensor(handle, path, data_start, name, t))
                    if dtype is not None:
                        value = value.astype(dtype)
                    layers = leaves[k].axes[: len(p.stacks)]
                    arrays[k] = placer.put(arrays[k], p, layer, layers, value)
        except SafetensorError as e:
            raise CheckpointFormatError(f"{path}: safetensors cannot read it ({e})") from None
    model = jax.tree_util.tree_unflatten(treedef, [NamedArray(a, leaf.axes) for a, leaf in zip(arrays, leaves)])
    if check:
        report = check_pretrained(folder, model)
        _LOG.info("load_pretrained check: %s", report)
        if report.max_logit_diff is not None and not report.max_logit_diff <= tolerance:
            raise CheckpointFormatError(
                f"{folder}: our logits differ from {report.reference}'s by "
                f"{report.max_logit_diff:.2e} (> tolerance {tolerance:g})"
            )
    return config, model


def check_pretrained(folder: str | Path, model) -> ParityReport:
    """Checks ``model`` (loaded from ``folder``) against the folder: every tensor of the folder
    is a parameter of the model and every parameter is in the folder; a few tokens give finite
    logits of the right shape; and, where ``transformers`` is installed, the max difference from
    its float32 logits on the same folder (eager attention), our model run in float32.
    """
    folder = Path(folder)
    family = family_for(model)
    params, _, _ = _params(model, family)
    wanted = {name for p in params for name in p.hf_names}
    in_folder = {name for path in _checkpoint_files(folder) for name in _read_header(path)[1]}
    saved = {_our_name(name, family, wanted, model.config) for name in in_folder} - {None}
    if saved != wanted:
        missing, extra = sorted(wanted - saved), sorted(saved - wanted)
        raise CheckpointFormatError(
            f"{folder}: the folder's tensors and the model's parameters differ: missing "
            f"{missing[:3]}, unexpected {extra[:3]}"
        )
    ids = check_ids(model.config.vocab_size, family.max_positions(model.config))
    ours = our_logits(model, ids)
    theirs, reference = transformers_logits(folder, ids)
    diff = None if theirs is None else float(np.abs(ours - theirs).max())
    return ParityReport(family.name, ids.shape, len(saved), diff, reference)


def check_folder(folder: str | Path) -> tuple[Family, Any]:
    """``(family, config)`` of a Hugging Face folder after every check ``load_pretrained`` makes
    short of reading tensors: config.json, and each safetensors header against the model it
    describes (every parameter present once, shapes, kinds of dtype). Nothing is allocated."""
    folder = Path(folder)
    arch, config, _ = read_config(folder)
    # the key too is made under eval_shape: a check compiles nothing
    abstract = eqx.filter_eval_shape(lambda: arch.model_cls.init(config, key=jax.random.key(0)))
    params, leaves, _ = _params(abstract, arch)
    _plan(folder, arch, config, params, leaves, keep_dtype=False)
    return arch, config


def _number_kind(dtype) -> str:
    for kind, name in ((jnp.floating, "floating-point"), (jnp.integer, "integer"), (jnp.bool_, "boolean")):
        if jnp.issubdtype(dtype, kind):
            return name
    return str(dtype)


def _plan(folder: Path, arch: Family, config, params: list[_Param], leaves: list, *, keep_dtype: bool):
    """Every file's header checked against the model before a single tensor is read.

    Returns, per file, where its data starts and ``{tensor name: (parameter index, layer, entry)}``.
    """
    wanted = {name: (k, i) for k, p in enumerate(params) for i, name in enumerate(p.hf_names)}

    def ours(name: str) -> str | None:
        return _our_name(name, arch, wanted, config)

    plan: list[tuple[Path, int, dict[str, tuple[int, int, _Tensor]]]] = []
    found: dict[str, Path] = {}
    dtypes: dict[int, tuple[str, str]] = {}
    for path in _checkpoint_files(folder):
        data_start, header = _read_header(path)
        todo = {}
        for name, t in header.items():
            key = ours(name)
            if key is None:
                continue
            if key not in wanted:
                raise CheckpointFormatError(
                    f"{path}: unexpected tensor {name!r}: {arch.architecture} with this "
                    "config.json has no such parameter"
                )
            if key in found:
                raise CheckpointFormatError(f"{path}: tensor {name!r} appears again (also in {found[key]})")
            k, layer = wanted[key]
            p = params[k]
            expected = _number_kind(leaves[k].dtype)
            if _number_kind(_DTYPES[t.dtype]) != expected:
                raise CheckpointFormatError(
                    f"{path}: tensor {name!r} has dtype {t.dtype}, expected a {expected} dtype for parameter {p.path}"
                )
            if t.shape != p.hf_shape:
                raise CheckpointFormatError(
                    f"{path}: tensor {name!r} has shape {list(t.shape)}, expected {list(p.hf_shape)} from config.json"
                )
            first_dtype, first = dtypes.setdefault(k, (t.dtype, name))
            if keep_dtype and first_dtype != t.dtype:
                # one stacked buffer holds every layer: with dtype=None there is no common dtype to convert to
                raise CheckpointFormatError(
                    f"{path}: tensor {name!r} has dtype {t.dtype}, but {first!r} of the same "
                    f"parameter has {first_dtype}; pass a dtype to convert them"
                )
            found[key] = path
            todo[name] = (k, layer, t)
        plan.append((path, data_start, todo))
    missing = [n for n in wanted if n not in found]
    if missing:
        more = f" (and {len(missing) - 1} more: {', '.join(missing[1:4])}{', ...' if len(missing) > 4 else ''})"
        raise CheckpointFormatError(f"{folder}: missing tensor {missing[0]!r}{more if len(missing) > 1 else ''}")
    return plan


def parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", str(size), re.IGNORECASE)
    if not m:
        raise CheckpointFormatError(f"max_shard_size={size!r}: use a number of bytes or e.g. '500MB', '2GiB'")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}[unit]
    return int(float(m.group(1)) * scale)


def save_pretrained(model, config, folder: str | Path, *, max_shard_size: int | str | None = None) -> None:
    """Write ``model`` as a Hugging Face folder that ``transformers`` loads with ``from_pretrained``.

    Writes ``config.json`` and ``model.safetensors``, or, when the tensors exceed
    ``max_shard_size`` (bytes, or a string like ``"2GB"``), ``model-0000k-of-0000n.safetensors``
    files and ``model.safetensors.index.json``. The files of an earlier save in ``folder``
    are removed first. Tensors are fetched to the host one file's worth at a time.
    """
    arch = family_for(config)
    hf_config = arch.to_hf(config)  # a config the family's format cannot hold fails before anything is written
    folder = Path(folder)
    expected = eqx.filter_eval_shape(arch.model_cls.init, config, key=jax.random.key(0))
    params, leaves, _ = _params(model, arch)
    exp_params, exp_leaves, _ = _params(expected, arch)
    if [p.path for p in params] != [p.path for p in exp_params]:
        raise CheckpointFormatError(f"the model's parameters {[p.path for p in params]} do not match {config}")
    for p, leaf, e in zip(params, leaves, exp_leaves):
        if leaf.axes != e.axes:
            raise CheckpointFormatError(f"parameter {p.path} has axes {leaf.axes}, but {config} gives {e.axes}")

    entries = [(name, k, i) for k, p in enumerate(params) for i, name in enumerate(p.hf_names)]
    nbytes = {name: math.prod(params[k].hf_shape) * leaves[k].dtype.itemsize for name, k, _ in entries}
    limit = parse_size(max_shard_size) if max_shard_size is not None else None
    shards: list[list[tuple[str, int, int]]] = [[]]
    size = 0
    for entry in entries:
        if limit is not None and shards[-1] and size + nbytes[entry[0]] > limit:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes[entry[0]]

    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.iterdir():  # a previous save's files, which the new index would not list
        if re.fullmatch(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json", old.name):
            old.unlink()
    n = len(shards)
    weight_map = {}
    for s, shard in enumerate(shards):
        filename = "model.safetensors" if n == 1 else f"model-{s + 1:05d}-of-{n:05d}.safetensors"
        tensors = {}
        for name, k, i in shard:
            leaf = leaves[k].array
            tensors[name] = params[k].to_hf(np.asarray(leaf[params[k].index(i)]))
            weight_map[name] = filename
        nm.save_safetensors(tensors, folder / filename, metadata={"format": "pt"})
    if n > 1:
        index = {"metadata": {"total_size": sum(nbytes.values())}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    hf_config["dtype"] = str(np.dtype(leaves[0].dtype))
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
