"""named-plot: curves from metrics.jsonl, several runs overlaid, as PNG or HTML; bad input refused
before anything is written."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("matplotlib")

from named.trainer.commands import cli  # noqa: E402
from named.trainer.commands.plot import panels_of, read_metrics  # noqa: E402


def _run(folder, rows, tail: str = ""):
    folder.mkdir(parents=True)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (folder / "metrics.jsonl").write_text(text + tail, encoding="utf-8")
    return folder


def _rows(scale: float):
    out = []
    for step in range(10, 110, 10):
        out.append({"step": step, "train/loss": scale * 5 / step**0.3, "train/lr": 1e-3 * min(step / 30, 1),
                    "train/grad_norm": 2.0 / step**0.5, "train/tokens_per_s": 4000.0 + step})  # fmt: skip
        if step % 50 == 0:
            out.append(
                {"step": step, "eval/loss": scale * 5.5 / step**0.3, "eval/code/loss": 3.0, "eval/web/loss": 4.0}
            )
    out.append({"step": 100, "sample": "def f(): ..."})  # text rows are not curves
    return out


def test_metrics_are_read_as_series_and_a_torn_last_line_is_skipped(tmp_path):
    run = _run(tmp_path / "a", _rows(1.0), tail='{"step": 110, "train/lo')
    s = read_metrics(run)
    assert [step for step, _ in s["train/loss"]] == list(range(10, 110, 10))
    assert s["eval/loss"][0] == (50, pytest.approx(5.5 / 50**0.3))
    assert "sample" not in s
    titles = [t for t, _, _ in panels_of({"a": s})]
    assert titles == ["loss", "eval loss per source", "learning rate", "gradient norm", "tokens/s"]


@pytest.mark.parametrize("suffix", [".png", ".html"])
def test_named_plot_overlays_runs(tmp_path, suffix, capsys):
    a, b = _run(tmp_path / "a", _rows(1.0)), _run(tmp_path / "b", _rows(1.2))
    out = tmp_path / f"curves{suffix}"
    assert cli.main_plot([str(a), str(b / "metrics.jsonl"), "--out", str(out)]) == 0
    data = out.read_bytes()
    png = data if suffix == ".png" else __import__("base64").b64decode(data.split(b"base64,")[1].split(b"'")[0])
    assert png.startswith(b"\x89PNG")
    from io import BytesIO

    from PIL import Image

    with Image.open(BytesIO(png)) as img:
        assert img.width > 800 and img.height > 300
        colours = img.convert("RGB").getcolors(maxcolors=1 << 16)
    assert colours is None or len(colours) > 16  # curves drawn, not a blank canvas


def test_named_plot_refuses_bad_input_before_writing(tmp_path, capsys):
    out = tmp_path / "curves.png"
    assert cli.main_plot([str(tmp_path / "missing"), "--out", str(out)]) == 2
    assert "missing" in capsys.readouterr().err
    run = _run(tmp_path / "empty", [{"step": 1, "sample": "text only"}])
    assert cli.main_plot([str(run), "--out", str(out)]) == 2
    assert "no losses" in capsys.readouterr().err
    assert cli.main_plot([str(_run(tmp_path / "ok", _rows(1.0))), "--out", str(tmp_path / "c.pdf")]) == 2
    assert ".png or .html" in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "c.pdf").exists()


def test_without_matplotlib_one_line_says_what_to_install(monkeypatch, capsys, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert cli.main_plot([str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == "error: named-plot needs matplotlib: pip install 'named-jax[notebook]'"


def test_an_out_that_cannot_be_written_is_refused_before_drawing(tmp_path, monkeypatch, capsys):
    import os

    from named.trainer.commands import plot

    run = _run(tmp_path / "ok", _rows(1.0))
    monkeypatch.setattr(plot, "figure", lambda *a: pytest.fail("drew the runs before checking --out"))
    (tmp_path / "curves.png").mkdir()
    assert cli.main_plot([str(run), "--out", str(tmp_path / "curves.png")]) == 2
    assert f"--out {tmp_path / 'curves.png'} is a folder: name the file to write" in capsys.readouterr().err
    locked = tmp_path / "locked"
    locked.mkdir()
    access = os.access  # a folder this user may not write (the tests may run as root, who may)
    monkeypatch.setattr(os, "access", lambda p, mode: access(p, mode) and os.fspath(p) != str(locked))
    assert cli.main_plot([str(run), "--out", str(locked / "c.png")]) == 2
    assert f"the folder {locked} is not writable" in capsys.readouterr().err


def test_a_run_not_logged_yet_is_named_and_smoothing_and_legends(tmp_path, capsys):
    import numpy as np

    from named.trainer.commands.plot import figure, smoothed

    a = _run(tmp_path / "a", _rows(1.0))
    fresh = _run(tmp_path / "fresh", [])  # started, not at its first log step yet
    out = tmp_path / "c.png"
    assert cli.main_plot([str(a), str(fresh), "--out", str(out), "--smooth", "0.6"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"note: {fresh} has logged no curve yet (nothing in its metrics.jsonl): not drawn",
        f"wrote {out}",
    ]
    # TensorBoard's smoothing: each point the mean of the values so far weighted by 0.6 ** age
    x = np.random.default_rng(0).normal(size=12)
    want = [np.average(x[: i + 1], weights=0.6 ** np.arange(i, -1, -1)) for i in range(12)]
    np.testing.assert_allclose(smoothed(list(x), 0.6), want, rtol=1e-12)
    assert smoothed(list(x), 0.0) == list(x)
    assert cli.main_plot([str(a), "--out", str(out), "--smooth", "1"]) == 2
    assert "--smooth must be in [0, 1)" in capsys.readouterr().err
    labels = [ax.get_legend_handles_labels()[1] for ax in figure([a]).axes if ax.get_visible()]
    assert labels[0] == ["a train", "a eval"] and labels[1] == ["a eval code", "a eval web"]
