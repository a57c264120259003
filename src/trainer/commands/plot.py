"""``named-plot RUN [RUN ...]``: a run's training curves as a picture, several runs overlaid.

Reads ``metrics.jsonl`` in each run directory (the rows ``loop.trackers.Trackers`` writes:
``{"step": N, "train/loss": ..., "eval/<source>/loss": ...}``) and draws one panel per quantity
that some run logged: the loss (training, and evaluation dashed with round markers, each named in
the legend), the evaluation loss of each source, the learning rate, the gradient norm and
tokens/s; ``--smooth W`` smooths each curve as TensorBoard does. A run that has logged no curve
yet is not drawn, and a note says so. Matplotlib (the ``notebook`` extra)
draws it; ``.png`` writes the picture, ``.html`` one self-contained page with the picture inside.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from pathlib import Path

from ..checkpoint.run_places import METRICS_FILE
from ..config import ConfigError

# (panel title, the keys it draws, y on a log scale)
PANELS = (
    ("loss", ("train/loss", "eval/loss"), False),
    ("learning rate", ("train/lr",), False),
    ("gradient norm", ("train/grad_norm",), True),
    ("tokens/s", ("train/tokens_per_s",), False),
)
FORMATS = (".png", ".html")


def read_metrics(run: Path) -> dict[str, list[tuple[int, float]]]:
    """Each numeric key of ``run``'s metrics.jsonl as (step, value) pairs, in file order. A line
    that is not a JSON object (a run killed mid-write leaves half a line) is skipped."""
    path = run / METRICS_FILE if run.is_dir() else run
    if not path.is_file():
        raise ConfigError(f"{run}: no {METRICS_FILE} (name a run directory, or its {METRICS_FILE})")
    series: dict[str, list[tuple[int, float]]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            step = row.get("step") if isinstance(row, dict) else None
            if not isinstance(step, int) or isinstance(step, bool):
                continue
            for k, v in row.items():
                if k != "step" and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
                    series.setdefault(k, []).append((step, float(v)))
    return series


def panels_of(runs: dict[str, dict]) -> list[tuple[str, list[str], bool]]:
    """The panels some run has data for: the fixed ones, with the per-source evaluation losses
    (``eval/<source>/loss``) in a panel of their own after the loss."""
    logged = {k for s in runs.values() for k in s}
    sources = sorted(k for k in logged if k.startswith("eval/") and k.endswith("/loss") and k != "eval/loss")
    out = []
    for title, keys, log in PANELS:
        if any(k in logged for k in keys):
            out.append((title, list(keys), log))
        if title == "loss" and sources:
            out.append(("eval loss per source", sources, False))
    return out


def smoothed(values: list[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average (``weight`` of the past, 0: none),
    its start corrected for the missing history so the first point is the first value."""
    if not weight:
        return list(values)
    out, mean = [], 0.0
    for i, v in enumerate(values, start=1):
        mean = weight * mean + (1 - weight) * v
        out.append(mean / (1 - weight**i))
    return out


def unplotted(runs: list[Path]) -> list[str]:
    """One note per run with nothing to draw yet (its metrics.jsonl holds no curve: a run that has
    not reached its first log step), which ``figure`` leaves out of the picture."""
    drawn = {k for _, keys, _ in PANELS for k in keys}
    notes = []
    for run in map(Path, runs):
        if not any(k in drawn or (k.startswith("eval/") and k.endswith("/loss")) for k in read_metrics(run)):
            notes.append(f"note: {run} has logged no curve yet (nothing in its {METRICS_FILE}): not drawn")
    return notes


def figure(runs: list[Path], smooth: float = 0.0):
    """The curves of ``runs`` as a matplotlib Figure (a notebook shows it as it is); each run is
    labelled with its folder's name, each curve in the loss panels with what it is (``train``,
    ``eval``, ``eval <source>``). ``smooth`` in [0, 1) draws each curve smoothed (``smoothed``)
    over its raw values, faint."""
    if not runs:
        raise ConfigError("name at least one run directory")
    if not (isinstance(smooth, int | float) and 0 <= smooth < 1):
        raise ConfigError(f"--smooth must be in [0, 1) (the weight of the past; 0: none), got {smooth}")
    series = {}
    for run in map(Path, runs):
        label = (run if run.is_dir() else run.parent).resolve().name
        while label in series:  # two runs of one name (a/run, b/run): the later gets a suffix
            label += "'"
        series[label] = read_metrics(run)
    panels = panels_of(series)
    if not panels:
        raise ConfigError(f"{', '.join(map(str, runs))}: no losses, learning rates, norms or tokens/s logged yet")
    from matplotlib.figure import Figure

    cols = min(len(panels), 3)
    rows = math.ceil(len(panels) / cols)
    fig = Figure(figsize=(4.2 * cols, 3.2 * rows), layout="tight")
    axes = fig.subplots(rows, cols, squeeze=False)
    import matplotlib

    colours = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, keys, log) in zip(axes.flat, panels):
        for r, (label, s) in enumerate(series.items()):
            for j, k in enumerate(keys):
                if k not in s:
                    continue
                steps, values = zip(*s[k])
                name = f"{label} {_curve_name(k)}" if title in ("loss", "eval loss per source") else label
                style = "--" if k.startswith("eval/") and title == "loss" else ["-", "--", ":", "-."][j % 4]
                marker = ("o" if k.startswith("eval/") else ".") if len(steps) < 20 else None
                colour = colours[r % len(colours)]
                if smooth and len(steps) > 1:
                    ax.plot(steps, values, style, color=colour, alpha=0.25)
                    values = smoothed(list(values), smooth)
                ax.plot(steps, values, style, color=colour, label=name, marker=marker)
        ax.set_title(title)
        ax.set_xlabel("step")
        if log:
            from matplotlib.ticker import FuncFormatter

            ax.set_yscale("log")
            # 0.5, not 5x10^-1; between powers of ten only 2, 3 and 5 are labelled (the rest crowd)
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:e}"[0] in "235" else ""))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    return fig


def _curve_name(key: str) -> str:
    """``train/loss`` -> ``train``, ``eval/loss`` -> ``eval``, ``eval/code/loss`` -> ``eval code``."""
    return key.removesuffix("/loss").replace("/", " ")


def plot_runs(runs: list[Path], out: Path, smooth: float = 0.0) -> list[str]:
    """Draw ``runs`` into ``out`` (``.png`` or ``.html``); every input is checked before anything is
    written. Returns what to print: ``wrote OUT``, after a note for each run not drawn (``unplotted``)."""
    if out.suffix.lower() not in FORMATS:
        raise ConfigError(f"--out {out}: write a {' or '.join(FORMATS)} file")
    from ..data import atomic_write, check_target

    check_target(out, "--out", "curves.png")  # before the runs are read and drawn
    fig = figure(runs, smooth)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    data = buf.getvalue()
    if out.suffix.lower() == ".html":
        names = html.escape(", ".join(str(r) for r in runs))
        data = (
            "<!doctype html><html><head><meta charset='utf-8'><title>named-plot</title></head>"
            f"<body style='font-family:system-ui,sans-serif'><h3>{names}</h3>"
            f"<img alt='training curves of {names}' src='data:image/png;base64,{base64.b64encode(data).decode()}'>"
            "</body></html>"
        ).encode()
    with atomic_write(out) as f:
        f.write(data)
    return [*unplotted(runs), f"wrote {out}"]
