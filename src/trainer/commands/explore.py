"""The layout explorer: change the mesh, a mapping, remat, microbatches, the loss blocks or the
mode, and see at once what the run would hold per device against the device's memory, which
collectives it would run, its roofline step estimate, the device grid of one array and where the
layout ranks among those ``named-plan --search`` tries.

One computation serves the command line, the HTML page and Jupyter: every figure comes from
``plan.make_plan`` (shapes, nothing compiled), ``plan.train_step_report`` (the compiled step, on
request) and ``plan_search`` (the roofline and the ranking, on request). ``Explorer`` is the plain
API (``Explorer(cfg, device_kind="H100").view(param_mapping={"embed": "data"})``); ``Explorer.widget()``
puts ipywidgets controls on it (the ``notebook`` extra); ``report_page`` writes the self-contained
page of ``named-plan --html``.
"""

from __future__ import annotations

import dataclasses
import html
import json
import math

import equinox as eqx
import jax

import named as nm
from named.models import flops_per_token

from ..config import ConfigError, TrainConfig
from ..config.layout import Layout
from ..loop.checks import Setup, check_mappings, checked_setup
from .plan import Plan, Target, make_plan, train_step_report
from .plan_search import ROW_WORDS, Candidate, Roofline, candidates, fits, rank, row_words

_MiB = 2**20


def _mib(n: float) -> str:
    """Bytes as ``named-plan`` prints them."""
    return f"{n / _MiB:.2f} MiB"


@dataclasses.dataclass(repr=False)
class View:
    """One layout of a config, planned: ``plan`` from shapes (None with ``error``), ``compiled``
    when the step was compiled, ``roof`` when the device's speeds are known, ``rank`` (position,
    of how many) among ``--search``'s layouts when the ranking was asked for."""

    layout: Layout
    plan: Plan | None
    error: str | None = None
    compiled: nm.inspect.CompiledReport | None = None
    roof: Roofline | None = None
    rank: tuple[int, int] | None = None

    def memory(self) -> dict[str, float]:
        """Bytes per device: parameters, gradients, optimizer state, activations and logits (estimates,
        ``plan.Plan``: the figures ``named-plan`` and ``--search`` judge "fits" by). A compiled step's
        peak on this machine (``compiled.peak_bytes``) is shown beside them, never added: XLA:CPU's
        buffer assignment says nothing of another device kind's. A refused layout has none: its
        error, raised."""
        if self.plan is None:
            raise ConfigError(self.error)
        p = self.plan
        out = {
            "parameters": float(p.params.bytes_per_device),
            "gradients": float(p.gradient_bytes),
            "optimizer state": float(p.moments.bytes_per_device),
            "activations": p.activations,
            "logits": p.logits,
        }
        return out

    @property
    def total_bytes(self) -> float:
        return sum(self.memory().values())

    def collectives(self) -> dict[str, int]:
        """Bytes each device sends per step, by collective kind (compiled only; loop bodies once per run)."""
        out: dict[str, int] = {}
        for c in self.compiled.collectives if self.compiled is not None else ():
            out[c.kind] = out.get(c.kind, 0) + c.sent_bytes * c.runs
        return out

    def candidate(self) -> Candidate:
        """This layout as ``--search`` measures one (compiled figures where there are some)."""
        c = Candidate("this layout", self.layout, memory=self.total_bytes)
        if self.compiled is not None:
            c.flops, c.hbm_bytes = self.compiled.flops, self.compiled.bytes_accessed
            c.comm_bytes = sum(self.collectives().values())
        return c

    def step_seconds(self) -> dict[str, float]:
        """The roofline of one step: compute, HBM and communication seconds from the compiled
        program (``Candidate.seconds``); from shapes alone, the compute term of the model's FLOPs
        (6N + 12·L·d·T per token, a third more under ``remat: full``), a lower bound."""
        if self.roof is None:
            return {}
        if self.compiled is not None:
            return dict(zip(("compute", "HBM", "communication"), self.candidate().seconds(self.roof)))
        cfg = self.plan.cfg
        tokens = cfg.trainer.train_batch_size * cfg.data.seq_len / len(self.plan.setup.mesh.devices.flat)
        flops = flops_per_token(self.plan.setup.model_cfg, cfg.data.seq_len) * tokens
        if self.layout.remat == "full":
            flops *= 4 / 3
        return {"compute": flops / self.roof.peak_flops}

    def html(self, array: str | None = None) -> str:
        return view_html(self, array)

    def __repr__(self) -> str:
        what = f"cannot run: {self.error}" if self.error is not None else f"{_mib(self.total_bytes)} per device"
        return f"View({_layout_text(self.layout)}: {what})"

    def _repr_html_(self) -> str:
        return self.html()


class Explorer:
    """Plans layouts of one config for one device kind, cached by layout.

    ``cfg``: a TrainConfig, or a config file or shipped config's name (``"gpt2_nano"``; then
    ``overrides`` as on the command line).
    ``devices``: the device count planned for; it must be this process's (a notebook stands in
    N CPU devices with ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` before importing jax;
    ``named-plan --devices N`` does it for you). ``device_kind`` and ``device_memory`` as
    ``named-plan``'s flags, or ``target`` (what they make, ``plan.Target.of``). ``model``: a live
    module of the config's model type (built or changed in a notebook): its parameters' shapes are
    planned instead of those the config's model keys give; the batch, optimizer, the FLOPs of the
    shape-only step estimate and the ``search`` ranking stay the config's."""

    def __init__(
        self,
        cfg: TrainConfig | str,
        *,
        device_kind: str | None = None,
        devices: int | None = None,
        device_memory: str | None = None,
        overrides: tuple[str, ...] = (),
        target: Target | None = None,
        model=None,
    ):
        if not isinstance(cfg, TrainConfig):
            from ..config import load_config
            from ..config.read import resolve_config

            cfg = load_config(resolve_config(str(cfg)), list(overrides))
        here = len(jax.devices())
        if devices is not None and devices != here:
            raise ConfigError(
                f"devices={devices}, but this process has {here}: set XLA_FLAGS="
                f"--xla_force_host_platform_device_count={devices} before importing jax, or run "
                f"named-plan --devices {devices} --html PAGE"
            )
        self.cfg = cfg
        self.target = (
            target
            if target is not None
            else Target.of(device_kind, device_memory, stand_ins=jax.devices()[0].platform == "cpu")
        )
        dev = self.target.device
        known = dev is not None and dev.hbm_bandwidth is not None and dev.link_bandwidth is not None
        self.roof = Roofline.of(cfg, dev) if known else None
        self.model = model
        self._model_shapes = None if model is None else eqx.filter_eval_shape(lambda m: m, model)
        self.layout = Layout.of(cfg)
        self._views: dict[Layout, View] = {}
        self._compiled: dict[Layout, nm.inspect.CompiledReport] = {}
        self._ranked: list[Candidate] | None = None

    @property
    def budget(self) -> float:
        return self.target.memory if self.target.memory is not None else math.inf

    def view(self, layout: Layout | None = None, *, compile: bool = False, **changes) -> View:
        """The plan of ``layout`` (default: the config's) with ``changes`` (``Layout.replace``'s
        fields: ``param_mapping={"embed": "data"}``, ``remat="full"``, ...). A layout the checks refuse
        gives a View with ``error`` set (the ConfigError's or NamedError's message)."""
        lay = (layout if layout is not None else self.layout).replace(**changes)
        v = self._views.get(lay)
        if v is None:
            try:
                cfg = lay.apply(self.cfg)
                v = View(lay, make_plan(cfg, self.target, self._setup(cfg)), roof=self.roof)
            except (ConfigError, nm.NamedError) as e:
                v = View(lay, None, error=str(e))
            self._views[lay] = v
        if v.error is None:
            if compile and lay not in self._compiled:
                self._compiled[lay] = train_step_report(v.plan.cfg, v.plan.setup)
            v.compiled = self._compiled.get(lay)
            v.rank = self._rank_of(v)
        return v

    def _setup(self, cfg: TrainConfig) -> Setup:
        """The checks of ``cfg`` (``checked_setup``); with a live model, its shapes in place
        of the config's, checked against both mappings."""
        s = checked_setup(cfg)
        if self._model_shapes is None:
            return s
        if not isinstance(self.model, s.model_cls):
            raise ConfigError(
                f"model: the live module is a {type(self.model).__name__}; the config's model.type builds a "
                f"{s.model_cls.__name__}"
            )
        check_mappings(cfg, self._model_shapes, s.mesh, s.compute_mapping, s.param_mapping, s.model_cfg)
        return dataclasses.replace(s, shapes=self._model_shapes)

    def search(self, progress=None, *, measure: int = 0, measured=None) -> list[Candidate]:
        """``named-plan --search``'s ranking (compiles every candidate once; then cached), with
        ``progress`` (``plan_search.search``'s); ``measure``: the first that many that fit timed on
        this machine and ranked by it (``plan_search.timed``; ``measured`` is called with each)."""
        if self._ranked is None:
            from .plan_search import roofline, search, timed

            roof = self.roof if self.roof is not None else roofline(self.cfg, self.target)  # refuses, naming why
            ranked = search(self.cfg, self.target, roof=roof, progress=progress)
            self._ranked = timed(self.cfg, ranked, measure, self.budget, progress=measured) if measure else ranked
        return self._ranked

    def _rank_of(self, v: View) -> tuple[int, int] | None:
        """Where ``v`` stands in the ranking: its candidate's place, or, when it is none of them
        but was compiled, the place it takes when ranked among them."""
        if self._ranked is None:
            return None
        resolved = v.layout.replace(mesh_shape=dict(v.plan.setup.mesh.shape))  # {data: -1} is {data: 8}
        for i, c in enumerate(self._ranked, 1):
            if c.layout == resolved:
                return i, len(self._ranked)
        if v.compiled is None:
            return None
        mine = v.candidate()
        order = rank([*(dataclasses.replace(c) for c in self._ranked), mine], self.roof, self.budget)
        return order.index(mine) + 1, len(order)

    def widget(self):
        """ipywidgets controls over ``view`` (the ``notebook`` extra): see ``_widget.py``."""
        from ._widget import explorer_widget

        return explorer_widget(self)


# ---- HTML ------------------------------------------------------------------------------------

_STYLE = (
    ".nx table{border-collapse:collapse;margin:4px 0}"
    ".nx td,.nx th{padding:2px 8px;border-bottom:1px solid #ddd;text-align:left;background:#fff;color:#000}"
    ".nx td.n{text-align:right;font-variant-numeric:tabular-nums}"
    ".nx .bar{height:10px;background:#4c6ef5;display:inline-block}"
    ".nx .over{color:#c92a2a;font-weight:bold}.nx .err{color:#c92a2a}"
    ".nx h4{margin:10px 0 2px 0}"
)


def _layout_text(lay: Layout) -> str:
    return (
        f"mesh {dict(lay.mesh_shape)}; compute {dict(lay.compute_mapping)}; parameters {dict(lay.param_mapping)}; "
        f"remat {lay.remat}; microbatches {lay.microbatches}; loss blocks {lay.loss_block_size or 'none'}; "
        f"mode {lay.mode}; gather {lay.gather}"
    )


def _capacity_name(p: Plan) -> str:
    return f"{p.target.memory / 2**30:.1f} GiB per {p.target.device.name if p.target.device else 'device'}"


def view_html(v: View, array: str | None = None) -> str:
    """One view as an HTML fragment: memory against the capacity, collectives, step estimate,
    ranking and the device grid of ``array`` (default: the largest parameter). Figures carry
    ``data-figure`` attributes (``total``, ``parameters``, ...) that the browser test reads."""
    esc = html.escape
    parts = [f"<style>{_STYLE}</style><div class='nx'><div><small>{esc(_layout_text(v.layout))}</small></div>"]
    if v.error is not None:
        parts.append(f"<p class='err' data-figure='error'>cannot run: {esc(v.error)}</p></div>")
        return "".join(parts)
    p, mem = v.plan, v.memory()
    cap = p.target.memory
    scale = cap if cap else max(sum(mem.values()), 1.0)
    rows = []
    for name, n in [*mem.items(), ("total", sum(mem.values()))]:
        width = max(1, round(3 * min(100.0, 100.0 * n / scale))) if n > 0 else 0  # 300 px: the capacity
        share = f"<td class='n'>{n / cap:.2%}</td>" if cap else ""
        rows.append(
            f"<tr><td>{esc(name)}</td><td class='n' data-figure='{esc(name)}'>{_mib(n)}</td>{share}"
            f"<td><span class='bar' style='width:{width}px'></span></td></tr>"
        )
    over = cap is not None and sum(mem.values()) > cap
    cap_text = (
        f"of {esc(_capacity_name(p))}" + (" <span class='over'>OVER BUDGET</span>" if over else "")
        if cap
        else "(no device memory known: name a device kind)"
    )
    parts.append(
        "<h4>memory per device</h4><table>"
        + (f"<tr><th></th><th>bytes</th><th>of {esc(_capacity_name(p))}</th><th></th></tr>" if cap else "")
        + "".join(rows)
        + f"</table><div><small>{cap_text}; activations: "
        f"an estimate for one microbatch (Korthikanti et al. 2022) with {esc(p.attention)} attention"
        + (" (its T x T scores included)" if p.keeps_scores else " (no T x T scores)")
        + "; logits: float32, with their gradient"
        + (
            f"; the compiled step's peak on this machine (XLA:CPU, not the device's): "
            f"<span data-figure='compiled peak'>{_mib(v.compiled.peak_bytes)}</span>"
            if v.compiled is not None
            else ""
        )
        + "</small></div>"
    )
    if v.compiled is not None:
        coll = v.collectives()
        body = "".join(
            f"<tr><td>{esc(k)}</td><td class='n' data-figure='collective {esc(k)}'>{_mib(b)}</td></tr>"
            for k, b in sorted(coll.items())
        )
        parts.append(
            "<h4>collectives per device and step</h4>"
            + (f"<table><tr><th>kind</th><th>bytes sent</th></tr>{body}</table>" if coll else "<p>none</p>")
        )
    else:
        parts.append("<h4>collectives</h4><p>compile the step to see them</p>")
    secs = v.step_seconds()
    if secs:
        how = "compiled program" if v.compiled is not None else "shapes: compute term only, a lower bound"
        terms = ", ".join(f"{k} {s * 1e3:.3g} ms" for k, s in secs.items())
        parts.append(
            f"<h4>step estimate on {esc(v.roof.device.name)}</h4><p><span data-figure='step ms'>"
            f"{sum(secs.values()) * 1e3:.3g}</span> ms ({esc(terms)}; {esc(how)})</p>"
        )
    if v.rank is not None:
        parts.append(f"<p>ranks <b data-figure='rank'>{v.rank[0]}</b> of {v.rank[1]} layouts of --search</p>")
    path = array if array is not None else max(p.params.rows, key=lambda r: r.size).path
    try:
        grid = p.params.grid(path)._repr_html_()
    except nm.NamedError as e:
        grid = f"<p class='err'>{esc(str(e))}</p>"
    parts.append(f"<h4>device grid of <code>{esc(path)}</code></h4>{grid}</div>")
    return "".join(parts)


def ranking_html(ranked: list[Candidate], roof: Roofline, budget: float) -> str:
    """``named-plan --search``'s table as HTML."""
    head = "".join(f"<th>{h}</th>" for h in ("rank", *ROW_WORDS, "est. ms/step", "memory GiB"))
    rows = []
    for i, c in enumerate(ranked, 1):
        cells = [str(i), *row_words(c)]
        if c.error:
            cells += ["-", f"cannot run: {c.error}"]
        else:
            over = "" if fits(c, budget) else " (over budget)"
            cells += [f"{sum(c.seconds(roof)) * 1e3:.3g}", f"{c.memory / 2**30:.3g}{over}"]
        rows.append("<tr>" + "".join(f"<td>{html.escape(x)}</td>" for x in cells) + "</tr>")
    return f"<div class='nx'><table><tr>{head}</tr>{''.join(rows)}</table></div>"


_SCRIPT = """
const pick = () => {
  const key = ['layout', 'remat', 'microbatches'].map(id => document.getElementById(id).value).join('|');
  for (const s of document.querySelectorAll('section.variant')) s.hidden = s.dataset.key !== key;
};
for (const id of ['layout', 'remat', 'microbatches']) document.getElementById(id).addEventListener('change', pick);
pick();
"""


def report_page(ex: Explorer, *, compile: bool = False, search: bool = False) -> str:
    """The page ``named-plan --html`` writes: one self-contained file (no network, no scripts
    beyond a dozen lines that show the chosen section). Every layout of ``--search``'s first stage, and
    the config's own, each with remat none/full and 1, 2 or 4 microbatches, planned from shapes;
    three selects pick which one shows. ``compile``: the config's own layout compiled too;
    ``search``: the ranking table, and each section's rank."""
    cfg = ex.cfg
    if search:
        ex.search()
    own = ex.layout
    layouts = {"config": own}
    from .plan_search import param_axes

    t = cfg.trainer
    for c in candidates(len(jax.devices()), param_axes(cfg), t.train_batch_size):
        layouts.setdefault(c.name, c.layout)
    remats = sorted({"none", "full", own.remat}, key=lambda r: (r != "none", r != "full", r))
    micros = sorted({m for m in (1, 2, 4) if t.train_batch_size % m == 0} | {own.microbatches})
    sections = []
    for name, family in layouts.items():
        for remat in remats:
            for micro in micros:
                lay = own.replace(
                    mesh_shape=family.mesh_shape,
                    compute_mapping=family.compute_mapping,
                    param_mapping=family.param_mapping,
                    remat=remat,
                    microbatches=micro,
                )
                v = ex.view(lay, compile=compile and lay == own)
                key = f"{name}|{remat}|{micro}"
                sections.append(f"<section class='variant' data-key='{html.escape(key)}'>{v.html()}</section>")

    def select(id_: str, label: str, options, chosen) -> str:
        opts = "".join(
            f"<option value='{html.escape(str(o))}'{' selected' if o == chosen else ''}>{html.escape(str(o))}</option>"
            for o in options
        )
        return f"<label>{label} <select id='{id_}'>{opts}</select></label> "

    dev = ex.target.device.name if ex.target.device is not None else jax.devices()[0].device_kind
    model = ex.view().plan
    model = type(model.setup.model_cfg).__name__ if model is not None else "config"
    mappings = "".join(
        f"<tr><td>{html.escape(n)}</td>"
        + "".join(
            f"<td><code>{html.escape(json.dumps(lay.fields()[f]))}</code></td>"
            for f in ("mesh_shape", "compute_mapping", "param_mapping")
        )
        + "</tr>"
        for n, lay in layouts.items()
    )
    ranking = (
        "<h3>layouts ranked by --search (each compiled on abstract inputs)</h3>"
        + ranking_html(ex.search(), ex.roof, ex.budget)
        if search
        else ""
    )
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>named-plan</title>"
        "<style>body{font-family:system-ui,sans-serif;font-size:13px;margin:12px;background:#fff;color:#000}"
        "code{font-family:ui-monospace,monospace}</style></head><body>"
        f"<h2>named-plan: {html.escape(model)} "
        f"on {len(jax.devices())} x {html.escape(dev)}</h2>"
        f"<div>{select('layout', 'layout', list(layouts), 'config')}"
        f"{select('remat', 'remat', remats, own.remat)}"
        f"{select('microbatches', 'microbatches', micros, own.microbatches)}</div>"
        f"<details><summary>the layouts</summary><div class='nx'><table><tr><th>layout</th><th>mesh</th>"
        f"<th>compute mapping</th><th>parameter mapping</th></tr>{mappings}</table></div></details>"
        + "".join(sections)
        + ranking
        + f"<script>{_SCRIPT}</script></body></html>"
    )
