"""``named-plan --search``: which layout to train a config with, on a mesh you may not have.

The search runs in two stages. First, every layout that fits the device count: data parallel,
FSDP, FSDP + Megatron tensor parallel (2, 4, 8 ways, where the heads and MLP divide), pure tensor
parallel, each with no gradient checkpointing and with full checkpointing of every block, and with
1, 2 or 4 microbatches, all in the config's ``mesh.mode`` and with its ``trainer.loss_block_size``.
The tensor-parallel layouts split the vocabulary (the embedding, the output head and the logits)
over ``model`` too. Then the best few of those (``REFINED``, distinct in layout and microbatches;
those that fit the memory budget first) are tried again in the other ``mesh.mode``, with the other
loss (the blockwise loss of ``loss_block_for`` where the config reads the full logits, the full
logits where it has blocks), and with both; those that store weights split (FSDP) also with the
other ``mesh.gather`` in auto mode, with either loss: at most ``VARIANTS * REFINED`` more
compiles (candidates whose lowered programs are equal share one, ``measured``). Each is checked
as ``named-train`` would check it, its memory per device planned from shapes (``plan.make_plan``:
the one rule of "fits" that ``named-plan``'s report, the explorer and the HTML page apply too; a
compiler's peak on this CPU never judges another device kind), and its train step compiled on
abstract inputs (nothing is allocated), then ranked by a roofline estimate of one step::

    time ≈ FLOPs / peak FLOP/s  +  HBM bytes / HBM bandwidth  +  collective bytes sent / link bandwidth

all per device, from the compiled program (loop bodies counted once per iteration) and the
device row of :mod:`named.trainer.loop.hardware` (on a CPU without ``--device-kind``: this
machine, measured and cached, ``hardware.this_cpu``); the peak is the one of the config's compute
dtype (``Device.matmul_peak``: a float32 run on an H100 runs its matmuls as TF32, at half the bf16
peak). The three terms are added, not overlapped: the estimate is an upper bound that ranks
layouts; it is no prediction of a measured step time. Recomputation moves at least the bytes of
computing once, but XLA:CPU counts the program that keeps its activations higher (three times
higher for GPT-2 medium), which ranked recomputation first for a GPU even when memory was
plentiful; so for a GPU or TPU a layout with ``remat: full`` and the same layout without it are
both charged the smaller of their two counts, and recomputation costs its extra FLOPs. For a CPU
the count is that of the program the run executes, and on this machine recomputing did run faster
(docs/benchmarks.md section 2): there each layout is charged its own. A layout over the memory budget is listed
below the others, marked; one the checks refuse (explicit mode a layout cannot run, a vocab with
no block) is listed last with the reason. ``timed`` (``--search --measure K``) runs the first K
that fit for a few steps on this machine's devices, taking turns step by step, and ranks them by
the median measured step time.

A candidate is a ``config.layout.Layout`` (the keys it sets: ``mesh.shape``, both mappings,
``mesh.mode``, ``mesh.gather``, ``model.remat``, ``trainer.microbatches``, ``trainer.loss_block_size``) and what was
measured of it: ``ranked[0].layout.apply(cfg)`` is the config that trains with the layout ranked
first. ``resolve_layout`` is what ``mesh.layout: auto`` does in ``named-train``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import math
import shlex
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator

from ..config import ConfigError, TrainConfig
from ..config.layout import Layout
from ..loop.hardware import Device
from .plan import Target, abstract_train_step, compiled_step_report, lowered_train_step, make_plan

_TP_AXES = ("mlp", "heads", "kv_heads")
REFINED = 3  # how many of the first stage's best layouts the second stage tries again (``refinements``)
VARIANTS = 5  # at most this many second-stage variants of each (``refinements``)
_OTHER_MODE = {"auto": "explicit", "explicit": "auto"}
_OTHER_GATHER = {"auto": "per_use", "per_use": "auto"}


@dataclasses.dataclass
class Candidate:
    """A layout the search tries (``name``: its family, DP, FSDP, ...) and what was measured of it."""

    name: str
    layout: Layout
    flops: float = 0.0
    hbm_bytes: float = 0.0
    comm_bytes: float = 0.0
    memory: float = 0.0  # bytes per device: ``plan.Plan.total_bytes`` (from shapes)
    error: str | None = None
    hbm_charged: float | None = None  # the HBM bytes the estimate uses, when not hbm_bytes (rank sets it)
    measured: float | None = None  # seconds per step, timed on this machine (``timed``)

    def seconds(self, roof: Roofline) -> tuple[float, float, float]:
        """Compute, HBM and communication time of one step, in seconds."""
        hbm = self.hbm_bytes if self.hbm_charged is None else self.hbm_charged
        return (
            self.flops / roof.peak_flops,
            hbm / roof.device.hbm_bandwidth,
            self.comm_bytes / roof.device.link_bandwidth if self.comm_bytes else 0.0,
        )


@dataclasses.dataclass(frozen=True)
class Roofline:
    """The speeds a step is estimated with: the device's row, and the matmul peak of the compute dtype."""

    device: Device
    peak_flops: float
    peak_kind: str  # bf16, TF32, ...

    @classmethod
    def of(cls, cfg: TrainConfig, dev: Device) -> Roofline:
        from named.nn.precision import get_policy

        if dev.hbm_bandwidth is None or dev.link_bandwidth is None:
            raise ConfigError(f"--search needs the HBM and link bandwidth of {dev.name}, which the device table lacks")
        return cls(dev, *dev.matmul_peak(get_policy(cfg.trainer.precision).compute_dtype))


def candidates(
    n_devices: int,
    param_axes: set[str],
    batch_size: int,
    *,
    mode: str = "auto",
    loss_block_size: int | None = None,
    gather: str = "auto",
) -> Iterator[Candidate]:
    """The first stage's layouts, each in ``mode``, with ``loss_block_size`` and ``gather``
    (``mesh.gather``)."""
    tp_axes = [a for a in _TP_AXES if a in param_axes]
    layouts = [
        ("DP", {"data": n_devices}, {"batch": "data"}, {}),
        ("FSDP", {"data": n_devices}, {"batch": "data"}, {"embed": "data"}),
    ]
    for tp in (2, 4, 8):
        if n_devices % tp == 0 and tp_axes and tp < n_devices:
            tp_map = dict.fromkeys([*tp_axes, *(["vocab"] if "vocab" in param_axes else [])], "model")
            layouts.append(
                (
                    f"FSDP+TP{tp}",
                    {"data": n_devices // tp, "model": tp},
                    {"batch": "data", **tp_map},
                    {"embed": "data", **tp_map},
                )
            )
    if tp_axes:
        tp_map = dict.fromkeys([*tp_axes, *(["vocab"] if "vocab" in param_axes else [])], "model")
        layouts.append(("TP", {"model": n_devices}, dict(tp_map), dict(tp_map)))
    for name, shape, compute_mapping, param_mapping in layouts:
        for remat in ("none", "full"):
            for micro in (1, 2, 4):
                if batch_size % micro == 0:
                    lay = Layout(shape, compute_mapping, param_mapping, remat, micro, loss_block_size, mode, gather)
                    yield Candidate(name, lay)


Progress = Callable[[int, int, "Candidate", "Candidate | None"], None]


def search(
    cfg: TrainConfig,
    target: Target,
    *,
    roof: Roofline | None = None,
    progress: Progress | None = None,
    refine: int = REFINED,
) -> list[Candidate]:
    """Check, plan, compile and measure every candidate of both stages (the module docstring;
    ``refine`` of the first stage's best are tried again); ranked (``rank``) for ``target`` (its
    device's speeds, ``roof`` where the caller has them, and its memory). ``progress`` is called
    after each candidate with how many are done, of how many, that candidate and the best so far."""
    import jax

    from ..loop.checks import model_config_for

    roof = roof if roof is not None else roofline(cfg, target)
    budget = target.memory if target.memory is not None else math.inf
    t = cfg.trainer
    first = list(
        candidates(
            len(jax.devices()),
            param_axes(cfg),
            t.train_batch_size,
            mode=cfg.mesh.mode,
            loss_block_size=t.loss_block_size,
            gather=cfg.mesh.gather,
        )
    )
    found: list[Candidate] = []
    total = len(first) + VARIANTS * refine  # the second stage's size is known once the first is ranked

    forward_passed: set[Layout] = set()  # shared by both stages

    def stage(cands: list[Candidate]) -> None:
        for c in measured(cfg, cands, target, forward_passed=forward_passed):
            found.append(c)
            if progress is not None:
                progress(len(found), total, c, rank(list(found), roof, budget)[0])

    stage(first)
    second = refinements(rank(found, roof, budget), model_config_for(cfg)[0].vocab_size, refine)
    total = len(first) + len(second)
    stage(second)
    return rank(found, roof, budget)


def planned(cfg: TrainConfig, c: Candidate, target: Target | None = None, forward_passed: set[Layout] | None = None):
    """``c`` with its memory per device (``plan.make_plan`` for ``target``, from shapes: nothing
    compiled), or with ``error`` (the first line of the ConfigError or NamedError of the checks
    ``named-train`` runs); and the config and checked setup that train it (None with an error).
    ``forward_passed``: layouts whose forward passed ``checks.check_activations``, which
    ``planned`` adds to; a layout that differs from one of them only in ``model.remat`` or
    ``mesh.gather`` (neither changes an activation or its layout) is not traced for it again."""
    import named as nm

    from ..loop.checks import checked_setup

    if c.error is None:
        try:
            trial = c.layout.apply(cfg)
            key = c.layout.replace(remat="none", gather="auto")
            s = checked_setup(trial, check_forward=forward_passed is None or key not in forward_passed)
            if forward_passed is not None:
                forward_passed.add(key)
            c.memory = make_plan(trial, target, s).total_bytes
            return trial, s
        except (ConfigError, nm.NamedError) as e:
            c.error = str(e).splitlines()[0]
    return None, None


def compile_threads() -> int:
    """How many train steps the search compiles at once: XLA compiles in its own threads, free of
    Python's lock, while the search traces the next candidate; one core stays for that tracing,
    and at most 4 compiles run together (each holds the compiler's memory for one program)."""
    from named.internal import process_cpu_count

    return max(1, min(4, process_cpu_count() - 1))


def measured(
    cfg: TrainConfig,
    cands: Iterable[Candidate],
    target: Target | None = None,
    threads: int | None = None,
    forward_passed: set[Layout] | None = None,
) -> Iterator[Candidate]:
    """Each of ``cands`` planned (``planned``) and, where it can run, its train step compiled on
    abstract inputs: FLOPs, HBM bytes and collective bytes sent per device; in order. Each is
    traced and lowered here, one at a time (tracing runs Python), and compiled and reported on
    ``threads`` threads (``compile_threads()``), so that XLA compiles one while the next is traced.
    Candidates whose lowered programs are identical (``mesh.gather: per_use`` where no weight is
    split FSDP-style alone, as under tensor parallelism) share one compile and its figures.
    ``forward_passed``: as ``planned`` takes it."""
    import named as nm

    def finish(c: Candidate, job) -> Candidate:
        if job is not None:
            try:
                report = job.result()
            except (ConfigError, nm.NamedError) as e:
                c.error = str(e).splitlines()[0]
            else:
                c.flops, c.hbm_bytes = report.flops, report.bytes_accessed
                c.comm_bytes = sum(col.sent_bytes * col.runs for col in report.collectives)
        return c

    threads = threads or compile_threads()
    compiles: dict[str, concurrent.futures.Future] = {}  # the lowered program's digest -> its compile
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="named-plan-compile") as pool:
        waiting: deque = deque()
        for c in cands:
            job = None
            trial, s = planned(cfg, c, target, forward_passed)
            if trial is not None:
                try:
                    lowered = lowered_train_step(trial, s)
                except (ConfigError, nm.NamedError) as e:
                    c.error = str(e).splitlines()[0]
                else:  # the text holds the mesh and every sharding: equal text, equal program
                    digest = hashlib.sha256(lowered.as_text().encode()).hexdigest()
                    job = compiles.get(digest)
                    if job is None:
                        job = compiles[digest] = pool.submit(compiled_step_report, lowered, s)
            waiting.append((c, job))
            while len(waiting) > threads:  # compiles in flight, and one more traced: no more held
                yield finish(*waiting.popleft())
        while waiting:
            yield finish(*waiting.popleft())


def measure(cfg: TrainConfig, c: Candidate, target: Target | None = None) -> Candidate:
    """``c`` alone through ``measured``."""
    (done,) = measured(cfg, [c], target, threads=1)  # run to its end: the thread pool is shut down here
    return done


def timed(
    cfg: TrainConfig, ranked: list[Candidate], k: int, memory_budget: float, *, steps: int = 3, progress=None
) -> list[Candidate]:
    """``ranked`` with its first ``k`` candidates that can run and fit (``rank`` lists those first)
    timed on this machine's devices: each one's train step compiled and run once to warm up on
    zeros (the same program and layout as on real data), then ``steps`` rounds in which each
    candidate runs one step in turn, so that a change in the machine's load (a shared machine's
    other work) falls on all of them alike; its ``measured`` seconds are the median of its rounds.
    Candidates take turns in groups whose planned memory fits ``memory_budget`` together (every
    state of a group is held at once); a group of one is timed alone. The timed come first, by
    measured time; the rest keep their order. ``progress`` is called with each timed candidate."""
    fit = [c for c in ranked if fits(c, memory_budget)][:k]
    for group in _held_together(fit, memory_budget):
        runs = [warm_step(cfg, c) for c in group]
        rounds: list[list[float]] = [[] for _ in group]
        for _ in range(steps):
            for run, seconds in zip(runs, rounds):
                seconds.append(run())
        for c, seconds in zip(group, rounds):
            c.measured = statistics.median(seconds)
            if progress is not None:
                progress(c)
        del runs  # the group's states go before the next group's are made
    rest = [c for c in ranked if c not in fit]
    return sorted(fit, key=lambda c: c.measured) + rest


def _held_together(cands: list[Candidate], memory_budget: float) -> Iterator[list[Candidate]]:
    """``cands`` in order, in runs whose planned memory per device adds up within the budget."""
    group: list[Candidate] = []
    held = 0.0
    for c in cands:
        if group and held + c.memory > memory_budget:
            yield group
            group, held = [], 0.0
        group.append(c)
        held += c.memory
    if group:
        yield group


def warm_step(cfg: TrainConfig, c: Candidate) -> Callable[[], float]:
    """``c``'s train step compiled and run once on zeros; returns a function that runs one more
    step on the state it keeps and gives its wall seconds."""
    import jax
    import jax.numpy as jnp

    import named as nm

    from ..loop.checks import checked_setup

    trial = c.layout.apply(cfg)
    s = checked_setup(trial)
    step, args = abstract_train_step(trial, s)
    leaves, tree = jax.tree.flatten(args)
    empty = [i for i, x in enumerate(leaves) if isinstance(x, jax.ShapeDtypeStruct)]
    fill = jax.jit(  # every input at once, laid out as the step takes it; the loss mask all true
        lambda: [jnp.full(leaves[i].shape, leaves[i].dtype == jnp.bool_, leaves[i].dtype) for i in empty],
        out_shardings=[leaves[i].sharding for i in empty],
    )
    for i, x in zip(empty, fill()):
        leaves[i] = x
    state = list(jax.tree.unflatten(tree, leaves))  # model, opt_state, batch, key, flags

    def run() -> float:
        model, opt_state, batch, key, flags = state
        with nm.set_mesh(s.mesh):
            t0 = time.perf_counter()
            state[0], state[1], metrics = step(model, opt_state, batch, key, flags)
            jax.block_until_ready(metrics)
            return time.perf_counter() - t0

    run()  # compiles
    return run


def refinements(ranked: list[Candidate], vocab_size: int, best: int = REFINED) -> list[Candidate]:
    """The second stage: the first ``best`` candidates of ``ranked`` that compiled, one per layout
    and microbatch count (a layout with and without remat ranks side by side, and explicit mode
    recomputes every layer whatever ``remat`` says, so both would try one program twice), each
    in the other mode, with the other loss (``loss_block_for``'s block, or the full logits where
    the candidate has blocks), and with both; and, where the layout stores weights split (FSDP),
    with the other ``mesh.gather`` in auto mode (``per_use``: each weight gathered where a layer
    uses it, its gradient reduce-scattered there; explicit mode gathers its own), with either
    loss. Not measured yet; a variant that needs a block the vocab does not have carries its
    ``error``."""
    try:
        block, no_block = loss_block_for(vocab_size), None
    except ConfigError as e:
        block, no_block = None, str(e)
    picked: dict[tuple[str, int], Candidate] = {}
    for c in ranked:
        if len(picked) < best and not c.error:
            picked.setdefault((c.name, c.layout.microbatches), c)
    out = []
    for c in picked.values():
        lay = c.layout
        other_mode, other_loss = _OTHER_MODE[lay.mode], None if lay.loss_block_size is not None else block
        # (mesh.gather is auto mode's: explicit mode gathers each layer's weights itself)
        modes = [(other_mode, False), (lay.mode, True), (other_mode, True)]
        variants = [(m, changes, "auto" if m == "explicit" else lay.gather) for m, changes in modes]
        if stores_split(lay):
            variants += [("auto", False, _OTHER_GATHER[lay.gather]), ("auto", True, _OTHER_GATHER[lay.gather])]
        for mode, loss_changes, gather in variants:
            loss = other_loss if loss_changes else lay.loss_block_size
            v = Candidate(c.name, lay.replace(mode=mode, loss_block_size=loss, gather=gather))
            if loss_changes and lay.loss_block_size is None and block is None:
                v.error = no_block  # the blockwise variant of a vocab without a block
            out.append(v)
    return out


def stores_split(lay: Layout) -> bool:
    """Whether ``lay`` stores a weight split where its computation does not use it split (FSDP):
    those weights are gathered, and ``mesh.gather`` says where."""
    compute = dict(lay.compute_mapping)
    return any(compute.get(a) != m for a, m in lay.param_mapping)


def loss_block_for(vocab_size: int) -> int:
    """The ``trainer.loss_block_size`` the search tries: the divisor of the vocab size nearest an
    eighth of it (by ratio; of two as near, the larger), so the loss holds an eighth of the
    logits in eight steps. At least 2 and less than the vocab; a ConfigError where the vocab has
    no such divisor (a prime size)."""
    import math

    divisors = [d for d in range(2, vocab_size) if vocab_size % d == 0]
    if not divisors:
        raise ConfigError(
            f"trainer.loss_block_size: the vocab size {vocab_size} has no divisor between 2 and itself to make "
            "blocks of (pad the vocabulary, e.g. model.vocab_size, to a multiple of 128)"
        )
    return min(divisors, key=lambda d: (abs(math.log(d * 8 / vocab_size)), -d))


def rank(found: list[Candidate], roof: Roofline, memory_budget: float) -> list[Candidate]:
    """Those that fit ``memory_budget`` by estimated step time, then those over it, then those that
    cannot run. For a GPU or TPU, a layout with and without recomputation (same mesh, mappings,
    mode, microbatches and loss blocks) are both charged the smaller of their HBM counts (the module
    docstring says why), so the one that recomputes ranks after the other whenever that one fits.
    For a CPU each is charged its own count: the XLA:CPU program counted is the one that runs."""

    def twin_key(c: Candidate):
        return c.name, c.layout.microbatches, c.layout.mode, c.layout.loss_block_size, c.layout.gather

    plain = {twin_key(c): c for c in found if c.layout.remat == "none" and not c.error}
    for c in found:
        c.hbm_charged = None
    for c in found:
        twin = plain.get(twin_key(c))
        if c.layout.remat != "none" and not c.error and twin is not None and roof.device.platform != "cpu":
            c.hbm_charged = twin.hbm_charged = min(c.hbm_bytes, twin.hbm_bytes)

    def key(c: Candidate):
        if c.error:
            return (2, 0.0)
        return (int(c.memory > memory_budget), sum(c.seconds(roof)))

    return sorted(found, key=key)


def param_axes(cfg: TrainConfig) -> set[str]:
    import jax

    import named as nm

    from ..loop.checks import model_config_for

    model_cfg, cls = model_config_for(cfg)
    shapes = jax.eval_shape(lambda k: cls.init(model_cfg, key=k), jax.random.key(0))
    return {a.name for x in jax.tree.leaves(shapes, is_leaf=nm.is_named_array) for a in getattr(x, "axes", ())}


def fits(c: Candidate, memory_budget: float) -> bool:
    """``c`` can run and its memory per device (``plan.Plan.total_bytes``) is within the budget."""
    return not c.error and c.memory <= memory_budget


def format_table(ranked: list[Candidate], roof: Roofline, memory_budget: float) -> str:
    timed_any = any(c.measured is not None for c in ranked)
    head = (
        "rank",
        *ROW_WORDS,
        "est. ms/step",
        "compute ms",
        "HBM ms",
        "comm ms",
        "memory GiB/device",
        *(("measured ms/step",) if timed_any else ()),
        "",
    )
    rows = []
    for i, c in enumerate(ranked, 1):
        layout = (str(i), *row_words(c))
        if c.error:
            rows.append((*layout, *["-"] * (len(head) - len(layout) - 1), f"cannot run: {c.error}"))
            continue
        t = c.seconds(roof)
        rows.append(
            (
                *layout,
                f"{sum(t) * 1e3:.3g}",
                *(f"{x * 1e3:.3g}" for x in t),
                f"{c.memory / 2**30:.3g}",
                *((f"{c.measured * 1e3:.3g}" if c.measured is not None else "-",) if timed_any else ()),
                "" if fits(c, memory_budget) else f"over budget ({memory_budget / 2**30:.1f} GiB)",
            )
        )
    left = {0, 1, 2, 3, 4, 5, len(head) - 1}  # the rank and the words; numbers align right
    widths = [max(len(r[j]) for r in (head, *rows)) for j in range(len(head))]
    lines = [
        "  ".join(x.ljust(w) if j in left else x.rjust(w) for j, (x, w) in enumerate(zip(r, widths))).rstrip()
        for r in (head, *rows)
    ]
    dev = roof.device
    note = (
        f"estimate per step on {dev.name}: FLOPs / {roof.peak_flops / 1e12:.3g} TFLOP/s ({roof.peak_kind} matmuls) "
        f"+ HBM bytes / {dev.hbm_bandwidth / 1e12:.3g} TB/s"
        + ("" if dev.platform == "cpu" else " (a layout with and without remat: the smaller count)")
        + " "
        f"+ collective bytes sent / {dev.link_bandwidth / 1e9:.3g} GB/s, added without overlap "
        "(an upper bound for ranking); memory: named-plan's estimate from shapes (parameters, gradients, "
        f"optimizer state, one microbatch's activations with the attention path the run takes on it, and its logits)"
        + (
            "; measured: the median of a few steps on this machine, taken in turns, which ranks those timed first"
            if timed_any
            else ""
        )
        + "."
    )
    return "\n".join([*lines, "", note])


def search_report(cfg: TrainConfig, target: Target, ranked: list[Candidate] | None = None) -> str:
    """The ranked table ``named-plan --search`` prints (of ``ranked``, when the caller searched already)."""
    import jax

    roof = roofline(cfg, target)
    budget = target.memory if target.memory is not None else math.inf
    ranked = ranked if ranked is not None else search(cfg, target, roof=roof)
    lines = [
        f"layouts for {len(jax.devices())} x {target.device.name} (each compiled on abstract inputs):",
        searched(cfg, ranked),
        format_table(ranked, roof, budget),
    ]
    if ranked and not ranked[0].error:
        flags = shlex.join(ranked[0].layout.flags())
        lines.append(f"the layout ranked first, as flags after the config's: {flags}")
    return "\n".join(lines)


# the headings of ``row_words``' columns in the ranking's tables (the text one and the HTML one)
ROW_WORDS = ("layout", "mesh", "mode", "gather", "remat", "microbatches", "loss block")


def row_words(c: Candidate) -> tuple[str, ...]:
    """The words of ``c``'s row in the ranking's tables (``ROW_WORDS``)."""
    lay = c.layout
    mesh = "x".join(f"{k}{v}" for k, v in lay.mesh_shape)
    return c.name, mesh, lay.mode, lay.gather, lay.remat, str(lay.microbatches), str(lay.loss_block_size or "none")


def describe(c: Candidate) -> str:
    """One candidate in a few words (the progress lines, ``mesh.layout: auto``'s choice)."""
    name, mesh, mode, gather, remat, micro, block = row_words(c)
    return f"{name} ({mesh}, mode {mode}, gather {gather}, remat {remat}, {micro} microbatch(es), loss blocks {block})"


def searched(cfg: TrainConfig, ranked: list[Candidate]) -> str:
    """What ``search`` tried for ``cfg`` (``ranked``, its result), in a sentence: the module
    docstring's two stages."""
    from ..loop.checks import model_config_for

    mode, block, gather = cfg.mesh.mode, cfg.trainer.loss_block_size, cfg.mesh.gather
    refined = {
        (c.name, c.layout.microbatches)
        for c in ranked
        if (c.layout.mode, c.layout.loss_block_size, c.layout.gather) != (mode, block, gather)
    }
    vocab = model_config_for(cfg)[0].vocab_size
    if block is not None:
        loss, other_loss = f"loss blocks of {block}", "the full logits"
    else:
        loss = "the full logits"
        try:
            other_loss = f"loss blocks of {loss_block_for(vocab)} (the divisor of the vocab {vocab} nearest an eighth)"
        except ConfigError:
            other_loss = f"no loss blocks (the vocab {vocab} has no divisor to make them of)"
    return (
        f"searched: DP, FSDP, FSDP+TP2/4/8 and TP (where the devices and heads divide), remat none and full, "
        f"1, 2 or 4 microbatches, in mesh.mode {mode} with {loss} and mesh.gather {gather}; then the best "
        f"{len(refined)} (one per layout and microbatch count) in mesh.mode {_OTHER_MODE[mode]}, with {other_loss}, "
        f"and with both, and those that store weights split with mesh.gather {_OTHER_GATHER[gather]} in mesh.mode "
        "auto, with either loss"
    )


def roofline(cfg: TrainConfig, target: Target) -> Roofline:
    """The speeds ``--search`` ranks by; refused (ConfigError) without a device that has them.
    Needs no devices, so ``named-plan`` asks for it before it stands any in."""
    if target.device is None:
        raise ConfigError("--search ranks layouts by a device's speeds: name it with --device-kind (e.g. H100)")
    return Roofline.of(cfg, target.device)


def resolve_layout(cfg: TrainConfig, *, progress: Progress | None = None) -> tuple[TrainConfig, str]:
    """What ``mesh.layout: auto`` does in ``named-train``: ``cfg`` with the layout of its run when
    the run exists (its ``config.yaml``: a resume keeps its layout), else with the layout ``search``
    ranks first for this machine (its device row; on a CPU, ``hardware.this_cpu``), and
    ``mesh.layout: config`` (the keys as now set, which the run's config.yaml records); with a
    sentence saying which. A ConfigError when no layout can run within the device's memory."""
    import dataclasses
    from pathlib import Path

    from ..config import load_config

    if cfg.mesh.layout != "auto":
        return cfg, "mesh.layout: config (the config's keys)"
    settled = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, layout="config"))
    recorded = Path(cfg.trainer.run_dir) / "config.yaml"
    if recorded.is_file():
        lay = Layout.of(load_config(recorded))
        return lay.apply(settled), f"mesh.layout auto: the layout recorded in {recorded} (a resume keeps its layout)"
    target = Target.of(None, None, calibrate=True)
    roof = roofline(settled, target)
    budget = target.memory if target.memory is not None else math.inf
    ranked = search(settled, target, roof=roof, progress=progress, refine=REFINED)
    best = ranked[0] if ranked else None
    if best is None or not fits(best, budget):
        why = (
            f"the best, {describe(best)}, needs {best.memory / 2**30:.3g} GiB per device of {budget / 2**30:.3g}"
            if best is not None and not best.error
            else "none of the layouts can run"
        )
        raise ConfigError(
            f"mesh.layout: auto found no layout for {roof.device.name} ({why}); "
            "see named-plan --search, or set mesh.shape and the mappings"
        )
    ms = sum(best.seconds(roof)) * 1e3
    return best.layout.apply(settled), (
        f"mesh.layout auto: {describe(best)}, ranked first of {len(ranked)} by named-plan --search's estimate "
        f"on {roof.device.name} ({ms:.3g} ms/step); flags: {shlex.join(best.layout.flags())}"
    )
