"""docs/screenshots.py renders the notebooks' HTML views with headless Chromium, and the layout
explorer's page (named-plan --html) is driven in it: a mapping changed there shows named-plan's
figure. Runs where a Chromium is installed (`make browser` installs Debian's as root); skipped
elsewhere, except in CI (CI=true), where a missing browser is a failure."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("screenshots", ROOT / "docs" / "screenshots.py")
shots = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(shots)

if shots.browser() is None and os.environ.get("CI"):
    pytest.fail("CI needs a headless Chromium for these tests: `make browser` (as root) installs it", pytrace=False)
pytestmark = [pytest.mark.browser, pytest.mark.skipif(shots.browser() is None, reason="no headless Chromium installed")]


def test_the_explorer_views_render_without_errors(tmp_path):
    views = shots.html_views(ROOT / "docs" / "notebooks" / "sharding_explorer.ipynb")
    grids = [(name, view) for name, view in views if "dev 0" in view]
    assert grids, "the sharding explorer shows no device grid"
    name, view = grids[0]
    page = tmp_path / "grid.html"
    page.write_text(shots._page(view), encoding="utf-8")
    dom = subprocess.run(
        [
            shots.browser(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--enable-logging=stderr",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert "<table" in dom.stdout and "dev 7" in dom.stdout
    assert "Uncaught" not in dom.stderr and ":CONSOLE" not in dom.stderr, dom.stderr[-2000:]

    png = tmp_path / "grid.png"
    shots.render(page, png, shots.browser())
    from PIL import Image

    with Image.open(png) as img:
        colours = img.convert("RGB").getcolors(maxcolors=1 << 16)
    assert img.width > 100 and img.height > 100
    assert colours is None or len(colours) > 8, "the picture is blank"


def test_the_script_writes_one_picture_per_view(tmp_path):
    assert shots.main(["--out", str(tmp_path), "named_arrays_tour"]) == 0
    names = {p.stem for p in tmp_path.glob("*.png")}
    expected = {f"named_arrays_tour-{n}" for n, _ in shots.html_views(ROOT / "docs/notebooks/named_arrays_tour.ipynb")}
    assert names == expected and names
    assert shots.main(["--out", str(tmp_path), "no_such_notebook"]) == 2


def test_the_explorer_page_shows_named_plans_figure_for_the_chosen_layout(tmp_path):
    """Drive named-plan --html's page in Chromium: pick another layout, remat and microbatch count
    in its selects, read the memory figure shown, and compare it with what named-plan prints for
    the config with those keys set on its command line."""
    from named.trainer.commands import cli, plan
    from named.trainer.config import load_config

    config = ROOT / "config" / "gpt2_nano.yaml"
    small = ["--model.n_layer", "2", "--data.seq_len", "32", "--trainer.train_batch_size", "16"]
    page = tmp_path / "plan.html"
    assert cli.main_plan(["--config_path", str(config), "--device-kind", "H100", "--html", str(page), *small]) == 0

    def named_plan_total(flags):
        # planned for the page's device kind (a CPU's plan counts what XLA:CPU keeps)
        text = plan.plan_report(load_config(config, [*small, *flags]), target=plan.Target.of("H100", None))
        return re.search(r"in all: ([\d.]+ MiB)", text).group(1)

    with shots.Page(shots.browser(), page.as_uri()) as tab:
        assert tab.eval(shots.SHOWN_TOTAL) == named_plan_total([])
        for select, value in shots.PLAN_PAGE_CHOICES:
            assert shots.choose(tab, select, value) == value
        assert tab.eval("document.querySelectorAll('section.variant:not([hidden])').length") == 1
        # tensor-parallel layouts split the vocabulary too
        fsdp_tp = [
            "--mesh.shape", "{data: 4, model: 2}",
            "--mesh.compute_mapping", "{batch: data, mlp: model, heads: model, vocab: model}",
            "--mesh.param_mapping", "{embed: data, mlp: model, heads: model, vocab: model}",
            "--model.remat", "full", "--trainer.microbatches", "2",
        ]  # fmt: skip
        assert tab.eval(shots.SHOWN_TOTAL) == named_plan_total(fsdp_tp)
        assert tab.eval(shots.SHOWN_TOTAL) != named_plan_total([])
        png = tmp_path / "explorer.png"
        tab.screenshot(png)
    from PIL import Image

    with Image.open(png) as img:
        assert img.width > 300 and img.height > 300
        colours = img.convert("RGB").getcolors(maxcolors=1 << 16)
    assert colours is None or len(colours) > 8, "the picture is blank"
