"""``named-plan --search``: which layout to train a config with, on a mesh you may not have.

Every layout that fits the device count is tried: data parallel, FSDP, FSDP + Megatron tensor
parallel (2, 4, 8 ways, where the heads and MLP divide), pure tensor parallel, each with no
gradient checkpointing and with full checkpointing of every block, and with 1, 2 or 4
microbatches. Each is checked as ``named-train`` would check it and its train step compiled on
abstract inputs (nothing is allocated), then ranked by a roofline estimate of one step::

    time ≈ FLOPs / peak FLOP/s  +  HBM bytes / HBM bandwidth  +  collective bytes sent / link bandwidth

all per device, from the compiled program (loop bodies counted once per iteration) and the
device row of :mod:`named.trainer.loop.hardware`; the peak is the one of the config's compute dtype
(``Device.matmul_peak``: a float32 run on an H100 runs its matmuls as TF32, at half the bf16
peak). The three terms are added, not overlapped: the estimate is an upper bound that ranks
layouts; it is no prediction of a measured step time. Recomputation moves at least the bytes of
computing once, but XLA:CPU counts the program that keeps its activations higher (three times
higher for GPT-2 medium), which ranked recomputation first even when memory was plentiful; so a
layout with ``remat: full`` and the same layout without it are both charged the smaller of their
two counts, and recomputation costs its extra FLOPs. A layout whose compiled peak memory exceeds
the budget is listed below the others, marked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from ..config import ConfigError, TrainConfig
from ..loop.hardware import Device
from .plan import Layout, Target, train_step_report

_TP_AXES = ("mlp", "heads", "kv_heads")


@dataclasses.dataclass
class Candidate:
    name: str
    mesh_shape: dict[str, int]
    compute_mapping: dict
    param_mapping: dict
    remat: str
    microbatches: int
    flops: float = 0.0
    hbm_bytes: float = 0.0
    comm_bytes: float = 0.0
    peak_bytes: int = 0
    error: str | None = None
    hbm_charged: float | None = None  # the HBM bytes the estimate uses, when not hbm_bytes (rank sets it)

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


def candidates(n_devices: int, param_axes: set[str], batch_size: int) -> Iterator[Candidate]:
    tp_axes = [a for a in _TP_AXES if a in param_axes]
    layouts = [
        ("DP", {"data": n_devices}, {"batch": "data"}, {}),
        ("FSDP", {"data": n_devices}, {"batch": "data"}, {"embed": "data"}),
    ]
    for tp in (2, 4, 8):
        if n_devices % tp == 0 and tp_axes and tp < n_devices:
            tp_map = dict.fromkeys(tp_axes, "model")
            layouts.append(
                (
                    f"FSDP+TP{tp}",
                    {"data": n_devices // tp, "model": tp},
                    {"batch": "data", **tp_map},
                    {"embed": "data", **tp_map},
                )
            )
    if tp_axes:
        tp_map = dict.fromkeys(tp_axes, "model")
        layouts.append(("TP", {"model": n_devices}, dict(tp_map), dict(tp_map)))
    for name, shape, compute_mapping, param_mapping in layouts:
        for remat in ("none", "full"):
            for micro in (1, 2, 4):
                if batch_size % micro == 0:
                    yield Candidate(name, shape, compute_mapping, param_mapping, remat, micro)


def layout_of(base: Layout, c: Candidate) -> Layout:
    """The layout tried as ``c``: ``base`` (the config's) with the candidate's mesh, mappings, remat
    and microbatches."""
    return base.replace(
        mesh_shape=c.mesh_shape,
        compute=c.compute_mapping,
        param=c.param_mapping,
        remat=c.remat,
        microbatches=c.microbatches,
    )


def _with(cfg: TrainConfig, c: Candidate) -> TrainConfig:
    return layout_of(Layout.of(cfg), c).apply(cfg)


def search(cfg: TrainConfig, roof: Roofline, *, memory_budget: float, progress=None) -> list[Candidate]:
    """Check, compile and measure every candidate; ranked (``rank``)."""
    import jax

    import named as nm

    from ..loop.checks import check_against_devices

    out = []
    for c in candidates(len(jax.devices()), param_axes(cfg), cfg.trainer.train_batch_size):
        trial = _with(cfg, c)
        try:
            report = train_step_report(trial, check_against_devices(trial))
        except (ConfigError, nm.NamedError) as e:
            c.error = str(e).splitlines()[0]
        else:
            c.flops, c.hbm_bytes, c.peak_bytes = report.flops, report.bytes_accessed, report.peak_bytes
            c.comm_bytes = sum(col.sent_bytes * col.runs for col in report.collectives)
        out.append(c)
        if progress is not None:
            progress(c)
    return rank(out, roof, memory_budget)


def rank(found: list[Candidate], roof: Roofline, memory_budget: float) -> list[Candidate]:
    """Those that fit ``memory_budget`` by estimated step time, then those over it, then those that
    cannot run. A layout with and without recomputation (same mesh, mappings and microbatches)
    are both charged the smaller of their HBM counts (the module docstring says why), so the one
    that recomputes ranks after the other whenever that one fits."""
    plain = {(c.name, c.microbatches): c for c in found if c.remat == "none" and not c.error}
    for c in found:
        twin = plain.get((c.name, c.microbatches))
        if c.remat != "none" and not c.error and twin is not None:
            c.hbm_charged = twin.hbm_charged = min(c.hbm_bytes, twin.hbm_bytes)

    def key(c: Candidate):
        if c.error:
            return (2, 0.0)
        return (int(c.peak_bytes > memory_budget), sum(c.seconds(roof)))

    return sorted(found, key=key)


def param_axes(cfg: TrainConfig) -> set[str]:
    import jax

    import named as nm

    from ..loop.checks import model_config_for

    model_cfg, cls = model_config_for(cfg)
    shapes = jax.eval_shape(lambda k: cls.init(model_cfg, key=k), jax.random.key(0))
    return {a.name for x in jax.tree.leaves(shapes, is_leaf=nm.is_named_array) for a in getattr(x, "axes", ())}


def format_table(ranked: list[Candidate], roof: Roofline, memory_budget: float) -> str:
    head = (
        "rank",
        "layout",
        "mesh",
        "remat",
        "microbatches",
        "est. ms/step",
        "compute ms",
        "HBM ms",
        "comm ms",
        "peak GiB/device",
        "",
    )
    rows = []
    for i, c in enumerate(ranked, 1):
        mesh = "x".join(f"{k}{v}" for k, v in c.mesh_shape.items())
        if c.error:
            rows.append(
                (str(i), c.name, mesh, c.remat, str(c.microbatches), "-", "-", "-", "-", "-", f"cannot run: {c.error}")
            )
            continue
        t = c.seconds(roof)
        over = c.peak_bytes > memory_budget
        rows.append(
            (
                str(i),
                c.name,
                mesh,
                c.remat,
                str(c.microbatches),
                f"{sum(t) * 1e3:.3g}",
                *(f"{x * 1e3:.3g}" for x in t),
                f"{c.peak_bytes / 2**30:.3g}",
                f"over budget ({memory_budget / 2**30:.1f} GiB)" if over else "",
            )
        )
    widths = [max(len(r[j]) for r in (head, *rows)) for j in range(len(head))]
    lines = [
        "  ".join(
            x.rjust(w) if j and j not in (1, 2, 3, 10) else x.ljust(w) for j, (x, w) in enumerate(zip(r, widths))
        ).rstrip()
        for r in (head, *rows)
    ]
    dev = roof.device
    note = (
        f"estimate per step on {dev.name}: FLOPs / {roof.peak_flops / 1e12:.3g} TFLOP/s ({roof.peak_kind} matmuls) "
        f"+ HBM bytes / {dev.hbm_bandwidth / 1e12:.3g} TB/s (a layout with and without remat: the smaller count) "
        f"+ collective bytes sent / {dev.link_bandwidth / 1e9:.3g} GB/s, added without overlap "
        "(an upper bound for ranking); "
        "peak memory from XLA's CPU buffer assignment, which can differ from a GPU's or TPU's."
    )
    return "\n".join([*lines, "", note])


def search_report(cfg: TrainConfig, target: Target, ranked: list[Candidate] | None = None) -> str:
    """The ranked table ``named-plan --search`` prints (of ``ranked``, when the caller searched already)."""
    import jax

    roof = roofline(cfg, target)
    budget = target.memory if target.memory is not None else float("inf")
    ranked = ranked if ranked is not None else search(cfg, roof, memory_budget=budget)
    return "\n".join(
        [
            f"layouts for {len(jax.devices())} x {target.device.name} (each compiled on abstract inputs):",
            format_table(ranked, roof, budget),
        ]
    )


def roofline(cfg: TrainConfig, target: Target) -> Roofline:
    """The speeds ``--search`` ranks by; refused (ConfigError) without a device that has them.
    Needs no devices, so ``named-plan`` asks for it before it stands any in."""
    if target.device is None:
        raise ConfigError("--search ranks layouts by a device's speeds: name it with --device-kind (e.g. H100)")
    return Roofline.of(cfg, target.device)
