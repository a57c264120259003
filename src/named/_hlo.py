"""Read an optimized HLO module's text: what one execution of the program costs per device.

``compiled.cost_analysis()`` counts a while loop's body once, so a model whose layers run in
``Stacked`` (a ``scan``: a while loop in HLO) reports the same FLOPs and collectives for 2 and
for 48 layers. Here every instruction is weighted by the product of the trip counts of the
loops around it, which XLA records on each ``while`` as ``known_trip_count`` in its
backend_config. A loop without one is counted once and named in ``unknown_loops``.

What is counted, per device:

- ``matmul_flops``: ``2 · (result elements) · (contracted elements)`` of each ``dot`` and
  ``convolution``, from the HLO shapes and contracting dimensions;
- ``flops``: those plus one FLOP per result element of elementwise arithmetic and comparison
  (XLA's convention), ``(input - output elements) · (reducer ops)`` per ``reduce`` and
  ``result elements · window`` per ``reduce-window``; gathers, scatters, copies and other data
  movement count none;
- ``transcendentals``: one per element of ``exp``, ``log``, ``tanh``, ``rsqrt``, ... (apart, as XLA does);
- ``bytes_accessed``: operands read and results written by each instruction outside fusions (a
  fusion counts its operands and results, not its insides); a (dynamic-)slice of an operand
  counts the slice and an in-place dynamic-update-slice its update. An estimate of memory traffic.

Of a ``conditional``, the costliest branch is counted (``conditionals`` says how many there were).
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "s4": 1,
    "u4": 1,
}
KINDS = (
    "all-gather",
    "reduce-scatter",
    "all-reduce",
    "all-to-all",
    "collective-permute",
    "ragged-all-to-all",
    "collective-broadcast",
)
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_LIST = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_COMMENT = re.compile(r"/\*.*?\*/")
_HEAD = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_LHS = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")

_ELEMENTWISE = frozenset(
    """add subtract multiply divide remainder maximum minimum negate abs sign compare select clamp
and or xor not shift-left shift-right-logical shift-right-arithmetic floor ceil round-nearest-afz round-nearest-even
convert is-finite real imag complex popcnt clz stochastic-convert""".split()
)
_TRANSCENDENTAL = frozenset(
    """exponential exponential-minus-one log log-plus-one tanh logistic rsqrt sqrt cbrt power
sine cosine tan atan2 erf""".split()
)
# Instructions that move no data of their own (aliases, bookkeeping, or costed in what they call).
_FREE = frozenset(
    """parameter constant tuple get-tuple-element bitcast while call conditional after-all partition-id
replica-id opt-barrier add-dependency domain""".split()
)
_SLICES = frozenset(("slice", "dynamic-slice", "gather"))


@dataclasses.dataclass
class Instr:
    name: str
    shape: str
    op: str
    operands: list[str]
    attrs: str
    line: str


@dataclasses.dataclass
class Computation:
    name: str
    instrs: list[Instr]
    shapes: dict[str, str]


_BRACKETS = re.compile(r"[()\[\]{}]")
_BRACKETS_AND_COMMAS = re.compile(r"[()\[\]{},]")


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket that closes the one at ``text[start]``."""
    depth = 0
    for m in _BRACKETS.finditer(text, start):  # the brackets alone: a line is mostly names and digits
        if m.group() in "({[":
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                return m.end()
    return len(text)


def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside every bracket, each part stripped, empty parts left out."""
    out, depth, last = [], 0, 0
    for m in _BRACKETS_AND_COMMAS.finditer(text):
        c = m.group()
        if c in "({[":
            depth += 1
        elif c != ",":
            depth -= 1
        elif depth == 0:
            out.append(text[last : m.start()])
            last = m.end()
    out.append(text[last:])
    return [s.strip() for s in out if s.strip()]


def _instr(line: str) -> Instr | None:
    m = _LHS.match(line)
    if not m:
        return None
    rest = line[m.end() :]
    if rest.startswith("("):
        end = _balanced(rest, 0)
    else:
        end = rest.find(" ")
        end = len(rest) if end < 0 else end
    shape, rest = rest[:end], rest[end:].lstrip()
    op_m = re.match(r"([a-z][\w\-]*)\(", rest)
    if not op_m:
        return None
    close = _balanced(rest, op_m.end() - 1)
    operands = [o.split()[-1].lstrip("%") for o in _split_top(rest[op_m.end() : close - 1])]
    return Instr(m.group(1), shape, op_m.group(1), operands, rest[close:], line)


def parse_module(hlo: str) -> tuple[dict[str, Computation], str | None]:
    """The computations of HLO text by name, and the entry computation's name."""
    comps: dict[str, Computation] = {}
    entry, current = None, None
    for raw in hlo.splitlines():
        line = _COMMENT.sub("", raw)
        if current is None:
            m = _HEAD.match(line)
            if m:
                current = Computation(m.group(2), [], {})
                comps[current.name] = current
                if m.group(1):
                    entry = current.name
            continue
        if line.startswith("}"):
            current = None
            continue
        ins = _instr(line)
        if ins is not None:
            current.instrs.append(ins)
            current.shapes[ins.name] = ins.shape
    return comps, entry


# ---- shapes ----------------------------------------------------------------------------------


def _arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(d, tuple(int(v) for v in s.split(",") if v)) for d, s in _ARRAY.findall(shape)]


def _dims(shape: str) -> tuple[int, ...]:
    arrays = _arrays(shape)
    return arrays[0][1] if arrays else ()


def _elements(shape: str) -> int:
    return sum(math.prod(dims) for _, dims in _arrays(shape))


def _itemsize(dtype: str) -> int:
    return _DTYPE_BYTES.get(dtype, 1 if dtype.startswith(("f8", "f4")) else 4)


def shape_bytes(shape: str) -> int:
    return sum(math.prod(dims) * _itemsize(d) for d, dims in _arrays(shape))


def _attr_ints(attrs: str, key: str) -> list[int]:
    m = re.search(rf"\b{key}=\{{([\d,]*)\}}", attrs)
    return [int(v) for v in m.group(1).split(",") if v] if m else []


def _called(attrs: str, key: str) -> list[str]:
    m = re.search(rf"\b{key}=\{{([^}}]*)\}}", attrs)
    if m:
        return [s.strip().lstrip("%") for s in m.group(1).split(",") if s.strip()]
    m = re.search(rf"\b{key}=%?([\w.\-]+)", attrs)
    return [m.group(1)] if m else []


def trip_count(attrs: str) -> int | None:
    """``known_trip_count`` from a while instruction's backend_config, or None."""
    m = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)"?', attrs)
    return int(m.group(1)) if m else None


# ---- collectives -----------------------------------------------------------------------------


@dataclasses.dataclass
class Collective:
    """One collective instruction of an optimized HLO module.

    ``bytes`` is the whole buffer on one device for one run: the result of an all-gather, the
    operand of a reduce-scatter, the operand (= result) of the others. ``sent_bytes`` estimates
    what one device sends in a ring: ``bytes·(n-1)/n`` (all-gather, reduce-scatter, all-to-all),
    twice that for an all-reduce, ``bytes`` for a permute. ``runs``: how many times it runs per
    execution of the program (the product of the trip counts of the loops around it);
    ``in_loop``: inside a while body; ``runs_known``: False when a loop around it has no known
    trip count (``runs`` then counts that loop once).
    """

    kind: str
    mesh_axes: tuple[str, ...]
    group_size: int
    shape: str
    bytes: int
    sent_bytes: int
    in_loop: bool
    name: str
    runs: int = 1
    runs_known: bool = True


def _groups(line: str, n_devices: int) -> list[list[int]]:
    m = _IOTA.search(line)
    if m:
        shape = [int(v) for v in m.group(1).split(",")]
        dims = [int(v) for v in m.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(v) for v in m.group(3).split(",")])
        return ids.reshape(shape).tolist()
    m = _LIST.search(line)
    if m and m.group(1):
        return [[int(v) for v in g.split(",") if v] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
    m = _PAIRS.search(line)
    if m:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1))]
    return [list(range(n_devices))]


def _mesh_axes_of(groups: list[list[int]], mesh) -> tuple[str, ...]:
    if mesh is None:
        return ()
    shape = tuple(mesh.devices.shape) if hasattr(mesh, "devices") else tuple(mesh.shape.values())
    names = tuple(mesh.axis_names)
    varying = set()
    for g in groups:
        coords = np.array([np.unravel_index(d, shape) for d in g if d < math.prod(shape)])
        if len(coords):
            varying |= {names[i] for i in range(len(names)) if len(set(coords[:, i])) > 1}
    return tuple(n for n in names if n in varying)


def _collective(ins: Instr, mesh, n_devices: int) -> Collective | None:
    kind = ins.op[: -len("-start")] if ins.op.endswith("-start") else ins.op
    if kind not in KINDS:
        return None
    arrays = _ARRAY.findall(ins.shape)
    if ins.op.endswith("-start") and len(arrays) > 1:  # async start: (operands, results, ...); the result comes second
        arrays = arrays[len(arrays) // 2 : len(arrays) // 2 + 1] if len(arrays) % 2 == 0 else arrays[-1:]
    nbytes = sum(math.prod(int(v) for v in s.split(",") if v) * _itemsize(d) for d, s in arrays)
    shape = ", ".join(f"{d}[{s}]" for d, s in arrays)
    groups = _groups(ins.line, n_devices)
    n = max(len(groups[0]), 1) if groups else 1
    if kind == "reduce-scatter":
        nbytes *= n
    if kind == "collective-permute":
        sent = nbytes
    elif kind == "all-reduce":
        sent = 2 * nbytes * (n - 1) // n
    else:
        sent = nbytes * (n - 1) // n
    return Collective(
        kind,
        _mesh_axes_of(groups, mesh),
        n if kind != "collective-permute" else 2,
        shape,
        nbytes,
        sent,
        False,
        ins.name,
    )


# ---- costs -----------------------------------------------------------------------------------


@dataclasses.dataclass
class HloCost:
    """Per-device cost of one execution of a program (see the module docstring for what counts)."""

    flops: float = 0.0
    matmul_flops: float = 0.0
    transcendentals: float = 0.0
    bytes_accessed: float = 0.0
    collectives: list[Collective] = dataclasses.field(default_factory=list)
    loops: list[tuple[str, int | None]] = dataclasses.field(default_factory=list)  # (while name, trip count)
    unknown_loops: list[str] = dataclasses.field(default_factory=list)
    conditionals: int = 0

    def scaled(self, n: int, *, loop: bool = False, known: bool = True) -> HloCost:
        colls = [
            dataclasses.replace(c, runs=c.runs * n, in_loop=c.in_loop or loop, runs_known=c.runs_known and known)
            for c in self.collectives
        ]
        return HloCost(
            self.flops * n,
            self.matmul_flops * n,
            self.transcendentals * n,
            self.bytes_accessed * n,
            colls,
            list(self.loops),
            list(self.unknown_loops),
            self.conditionals,
        )

    def add(self, other: HloCost) -> None:
        self.flops += other.flops
        self.matmul_flops += other.matmul_flops
        self.transcendentals += other.transcendentals
        self.bytes_accessed += other.bytes_accessed
        self.collectives += other.collectives
        self.loops += other.loops
        self.unknown_loops += other.unknown_loops
        self.conditionals += other.conditionals


def _dot_flops(ins: Instr, comp: Computation) -> float:
    lhs = _dims(comp.shapes.get(ins.operands[0], "")) if ins.operands else ()
    contracted = math.prod(lhs[i] for i in _attr_ints(ins.attrs, "lhs_contracting_dims") if i < len(lhs))
    return 2.0 * _elements(ins.shape) * contracted


def _conv_flops(ins: Instr, comp: Computation) -> float:
    kernel = _dims(comp.shapes.get(ins.operands[1], "")) if len(ins.operands) > 1 else ()
    m = re.search(r"dim_labels=\w+_(\w+)->", ins.attrs)
    out_features = kernel[m.group(1).index("o")] if m and "o" in m.group(1) and kernel else 1
    return 2.0 * _elements(ins.shape) * math.prod(kernel) / max(out_features, 1)


def _reducer_ops(comps: dict[str, Computation], attrs: str) -> int:
    names = _called(attrs, "to_apply")
    comp = comps.get(names[0]) if names else None
    if comp is None:
        return 1
    return max(1, sum(1 for i in comp.instrs if i.op in _ELEMENTWISE or i.op in _TRANSCENDENTAL))


class _Walker:
    def __init__(self, comps: dict[str, Computation], mesh, n_devices: int):
        self.comps, self.mesh, self.n_devices = comps, mesh, n_devices
        self.memo: dict[tuple[str, bool], HloCost] = {}

    def cost(self, name: str, fused: bool) -> HloCost:
        key = (name, fused)
        if key not in self.memo:
            self.memo[key] = HloCost()  # a (malformed) recursive call counts nothing rather than looping
            comp = self.comps.get(name)
            self.memo[key] = self._computation(comp, fused) if comp is not None else HloCost()
        return self.memo[key]

    def _computation(self, comp: Computation, fused: bool) -> HloCost:
        total = HloCost()
        for ins in comp.instrs:
            total.add(self._instruction(ins, comp, fused))
        return total

    def _instruction(self, ins: Instr, comp: Computation, fused: bool) -> HloCost:
        c = HloCost()
        op = ins.op
        if op == "while":
            n = trip_count(ins.attrs)
            body = _called(ins.attrs, "body")
            cond = _called(ins.attrs, "condition")
            c.loops.append((ins.name, n))
            if n is None:
                c.unknown_loops.append(ins.name)
            runs = n if n is not None else 1
            if body:
                c.add(self.cost(body[0], False).scaled(runs, loop=True, known=n is not None))
            if cond:
                c.add(
                    self.cost(cond[0], False).scaled(runs + 1 if n is not None else 1, loop=True, known=n is not None)
                )
            return c
        if op == "conditional":
            branches = _called(ins.attrs, "branch_computations") or (
                _called(ins.attrs, "true_computation") + _called(ins.attrs, "false_computation")
            )
            costs = [self.cost(b, False) for b in branches]
            if costs:
                c.add(max(costs, key=lambda k: (k.flops, k.bytes_accessed)).scaled(1))
            c.conditionals += 1
            return c
        if op == "fusion":
            for callee in _called(ins.attrs, "calls"):
                c.add(self.cost(callee, True).scaled(1))  # fused: its FLOPs; its bytes are the fusion's own
            if not fused:
                c.bytes_accessed += self._fusion_bytes(ins, comp)
            return c
        if op in ("call", "async-start", "custom-call"):
            for callee in (
                _called(ins.attrs, "to_apply") + _called(ins.attrs, "calls") + _called(ins.attrs, "called_computations")
            ):
                c.add(self.cost(callee, fused).scaled(1))
        coll = _collective(ins, self.mesh, self.n_devices)
        if coll is not None:
            c.collectives.append(coll)
        if op == "dot":
            c.matmul_flops = c.flops = _dot_flops(ins, comp)
        elif op == "convolution":
            c.matmul_flops = c.flops = _conv_flops(ins, comp)
        elif op in _ELEMENTWISE:
            c.flops = float(_elements(ins.shape))
        elif op in _TRANSCENDENTAL:
            c.transcendentals = float(_elements(ins.shape))
        elif op == "reduce" and ins.operands:
            n_in = len(ins.operands) // 2 or 1
            read = sum(_elements(comp.shapes.get(o, "")) for o in ins.operands[:n_in])
            c.flops = float(max(read - _elements(ins.shape), 0) * _reducer_ops(self.comps, ins.attrs))
        elif op == "reduce-window":
            m = re.search(r"size=([\dx]+)", ins.attrs)
            window = math.prod(int(v) for v in m.group(1).split("x")) if m else 1
            c.flops = float(_elements(ins.shape) * window)
        if not fused and op not in _FREE and not op.endswith("-done"):
            c.bytes_accessed += self._plain_bytes(ins, comp)
        return c

    def _plain_bytes(self, ins: Instr, comp: Computation) -> float:
        if ins.op in _SLICES:
            return 2.0 * shape_bytes(ins.shape)
        if ins.op == "dynamic-update-slice" and len(ins.operands) > 1:
            return 2.0 * shape_bytes(comp.shapes.get(ins.operands[1], ""))
        return float(shape_bytes(ins.shape) + sum(shape_bytes(comp.shapes.get(o, "")) for o in ins.operands))

    def _fusion_bytes(self, ins: Instr, comp: Computation) -> float:
        callee = self.comps.get(next(iter(_called(ins.attrs, "calls")), ""))
        if callee is None:
            return float(shape_bytes(ins.shape) + sum(shape_bytes(comp.shapes.get(o, "")) for o in ins.operands))
        users: dict[str, list[Instr]] = {}
        for i in callee.instrs:
            for o in i.operands:
                users.setdefault(o, []).append(i)
        by_name = {i.name: i for i in callee.instrs}

        def read(name: str) -> float:
            # what the fusion reads of one value: the slices taken of it when slices are all it feeds
            used = users.get(name, [])
            total = 0.0
            for u in used:
                if u.op == "bitcast":
                    total += read(u.name)
                elif u.op in _SLICES and u.operands[0] == name:
                    total += shape_bytes(u.shape)
                elif u.op == "dynamic-update-slice" and u.operands[0] == name:
                    continue  # updated in place: only the update is written
                else:
                    return float(shape_bytes(callee.shapes.get(name, "")))
            return total

        params = [i for i in callee.instrs if i.op == "parameter"]
        reads = sum(read(p.name) for p in params)
        root = next((i for i in callee.instrs if i.line.lstrip().startswith("ROOT")), None)
        outs = (
            [by_name[o] for o in root.operands if o in by_name] if root is not None and root.op == "tuple" else [root]
        )
        writes = 0.0
        for out in outs:
            if out is not None and out.op == "dynamic-update-slice" and len(out.operands) > 1:
                writes += shape_bytes(callee.shapes.get(out.operands[1], ""))
            elif out is not None:
                writes += shape_bytes(out.shape)
        return reads + writes


def analyze(hlo: str, mesh=None) -> HloCost:
    """The per-device cost of one execution of the program in ``hlo`` (optimized HLO text)."""
    n_devices = math.prod(mesh.shape.values()) if mesh is not None else 1
    comps, entry = parse_module(hlo)
    walker = _Walker(comps, mesh, n_devices)
    if entry is not None:
        return walker.cost(entry, False).scaled(1)
    # a fragment without ENTRY: every computation once, bodies of the loops it names marked in-loop
    total = HloCost()
    bodies = {b for c in comps.values() for i in c.instrs if i.op == "while" for b in _called(i.attrs, "body")}
    for name in comps:
        total.add(walker.cost(name, False).scaled(1, loop=name in bodies))
    return total
