"""docs/screenshots.py renders the notebooks' HTML views with headless Chromium. Runs where a
Chromium is installed (`apt-get install chromium-headless-shell`); skipped elsewhere."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("screenshots", ROOT / "docs" / "screenshots.py")
shots = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(shots)

pytestmark = pytest.mark.skipif(shots.browser() is None, reason="no headless Chromium installed")


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
