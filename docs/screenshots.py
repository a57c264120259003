"""Pictures of the notebooks' HTML views (device grids, parameter and compiled reports) for docs/.

    .venv/bin/python docs/screenshots.py                 # every notebook -> docs/images/
    .venv/bin/python docs/screenshots.py --out /tmp/img sharding_explorer
    .venv/bin/python docs/screenshots.py named_plan_html     # named-plan --html's page only

Reads the executed notebooks in docs/notebooks (their stored outputs; ``tests/test_notebooks.py``
re-executes them), puts each rich HTML output in a page of its own with a notebook output
area's plain white background, renders the page with headless Chromium from the OS
packages (``chromium-headless-shell`` or ``chromium``) and crops the PNG to what was drawn.
Images are named ``<notebook>-<cell>.png`` after the cell's number in the notebook
(``<notebook>-<cell>-<k>.png`` where a cell shows several). ``named_plan_html.png`` is
``named-plan --html``'s page with a layout chosen in its menus, driven over Chromium's DevTools
protocol (``Page``).
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import subprocess
import sys
import tempfile

DOCS = pathlib.Path(__file__).resolve().parent
BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")
WIDTH, HEIGHT = 1400, 2400


def browser() -> str | None:
    return next((path for b in BROWSERS if (path := shutil.which(b))), None)


def html_views(notebook: pathlib.Path) -> list[tuple[str, str]]:
    """(name, HTML) of every output that carries text/html: ``<cell>`` after the cell's number,
    ``<cell>-<k>`` for the k-th of several in one cell."""
    import nbformat

    nb = nbformat.read(notebook, as_version=4)
    views = []
    for i, cell in enumerate(nb.cells):
        html = [o["data"]["text/html"] for o in cell.get("outputs", []) if "text/html" in o.get("data", {})]
        views += [(f"{i}" if len(html) == 1 else f"{i}-{k}", h) for k, h in enumerate(html, 1)]
    return views


def _page(view: str) -> str:
    # The page's own background is plain white, as in a notebook's output area: the views must
    # carry their own colours (the report's replicated rows are hatched, not striped grey).
    return ("<!doctype html><html><head><meta charset='utf-8'><style>"
            "body{margin:8px;font-family:system-ui,sans-serif;font-size:13px;background:#fff;display:inline-block}"
            "code{font-family:ui-monospace,monospace}</style></head><body>" + view + "</body></html>")


def render(html_file: pathlib.Path, png: pathlib.Path, exe: str) -> subprocess.CompletedProcess:
    """Chromium's screenshot of ``html_file``, then cropped to its non-white part."""
    run = subprocess.run(
        [exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--enable-logging=stderr",
         f"--window-size={WIDTH},{HEIGHT}", f"--screenshot={png}", html_file.as_uri()],
        capture_output=True, text=True, timeout=120,
    )
    if run.returncode != 0 or not png.exists():
        raise RuntimeError(f"{exe} could not render {html_file}: {run.stderr[-2000:]}")
    from PIL import Image, ImageChops

    with Image.open(png) as img:
        rgb = img.convert("RGB")
    box = ImageChops.difference(rgb, Image.new("RGB", rgb.size, "white")).getbbox()
    if box is not None:
        rgb.crop((0, 0, min(box[2] + 8, rgb.width), min(box[3] + 8, rgb.height))).save(png)
    return run


class Page:
    """A page in headless Chromium driven over its DevTools protocol (``--remote-debugging-pipe``:
    JSON messages, each ended by a NUL byte, on the browser's file descriptors 3 and 4; nothing
    to install beyond the browser)::

        with Page(exe, url) as page:
            page.eval("document.title")
            page.screenshot(png)
    """

    def __init__(self, exe: str, url: str, *, width: int = WIDTH, height: int = 1200):
        import os

        to_browser, self._out = os.pipe()  # we write, the browser reads on its fd 3
        self._in, from_browser = os.pipe()  # the browser writes on its fd 4

        self._profile = tempfile.TemporaryDirectory()
        args = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--remote-debugging-pipe",
                f"--user-data-dir={self._profile.name}", f"--window-size={width},{height}", url]
        # The shell puts the browser's ends at 3 and 4 (a preexec_fn would fork a multithreaded JAX process).
        # Left to right, by way of two free numbers, since either end may already be 3 or 4 (bash:
        # dash takes one-digit descriptors only).
        a, b = to_browser, from_browser
        t, u = max(a, b, 4) + 1, max(a, b, 4) + 2
        remap = f'exec "$@" {t}<&{a} {u}>&{b} {a}<&- {b}>&- 3<&{t} 4>&{u} {t}<&- {u}>&-'
        self._proc = subprocess.Popen(
            ["bash", "-c", remap, "bash", *args], pass_fds=(to_browser, from_browser),
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        os.close(to_browser)
        os.close(from_browser)
        self._buffer, self._id, self.session = b"", 0, None
        pages = [t for t in self.send("Target.getTargets")["targetInfos"] if t["type"] == "page"]
        if not pages:
            raise RuntimeError(f"{exe} opened no page for {url}")
        self.session = self.send("Target.attachToTarget", targetId=pages[0]["targetId"], flatten=True)["sessionId"]
        import json
        import time

        # the page target is about:blank at first, then the url's document, loading, then complete
        loaded = f"location.href === {json.dumps(url)} && document.readyState === 'complete'"
        for _ in range(400):
            if self.eval(loaded):
                break
            time.sleep(0.05)
        else:
            raise RuntimeError(f"{exe} did not finish loading {url} in 20 s")

    def send(self, method: str, **params) -> dict:
        import json
        import os

        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if self.session is not None and not method.startswith("Target."):
            msg["sessionId"] = self.session
        os.write(self._out, json.dumps(msg).encode() + b"\0")
        while True:
            while b"\0" not in self._buffer:
                chunk = os.read(self._in, 1 << 16)
                if not chunk:
                    raise RuntimeError(f"the browser closed its pipe while answering {method}")
                self._buffer += chunk
            line, self._buffer = self._buffer.split(b"\0", 1)
            reply = json.loads(line)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def eval(self, expression: str):
        """The value of a JavaScript expression in the page; a thrown exception is a RuntimeError."""
        out = self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in out:
            raise RuntimeError(f"{expression}: {out['exceptionDetails']}")
        return out["result"].get("value")

    def screenshot(self, png: pathlib.Path) -> None:
        """The whole page (not only the window) as a PNG."""
        import base64

        size = self.send("Page.getLayoutMetrics")["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
        data = self.send("Page.captureScreenshot", format="png", clip=clip, captureBeyondViewport=True)["data"]
        png.write_bytes(base64.b64decode(data))

    def __enter__(self) -> Page:
        return self

    def __exit__(self, *exc) -> None:
        import os

        try:
            self.send("Browser.close")
        except (RuntimeError, OSError):
            pass
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        os.close(self._out)
        os.close(self._in)
        self._profile.cleanup()


# named-plan --html's page: the figure shown, and a choice made in one of its menus (as a user would: the
# menu's value set and its change event sent).
SHOWN_TOTAL = "document.querySelector('section.variant:not([hidden]) [data-figure=total]').textContent"
PLAN_PAGE = "named_plan_html"
PLAN_PAGE_CHOICES = (("layout", "FSDP+TP2"), ("remat", "full"), ("microbatches", "2"))


def choose(tab: Page, select: str, value: str) -> str:
    """Pick ``value`` in the page's menu ``select``; the menu's value after it."""
    return tab.eval(
        f"(() => {{ const s = document.getElementById({select!r}); s.value = {value!r}; "
        "s.dispatchEvent(new Event('change')); return s.value; })()"
    )


def plan_page_picture(exe: str, out: pathlib.Path) -> pathlib.Path:
    """``named-plan --html`` for gpt2_small (GPT-2 124M) on 8 H100s, FSDP + TP2 with remat and two
    microbatches chosen in its menus, as ``<out>/named_plan_html.png``."""
    with tempfile.TemporaryDirectory() as tmp:
        page = pathlib.Path(tmp) / "plan.html"
        args = ["--config", "gpt2_small", "--devices", "8", "--device-kind", "H100"]
        run = subprocess.run([sys.executable, "-m", "named.trainer.commands.cli", "plan", *args, "--html", str(page)],
                             capture_output=True, text=True, timeout=600)
        if run.returncode != 0:
            raise RuntimeError(f"named-plan --html failed: {run.stderr[-2000:]}")
        png = out / f"{PLAN_PAGE}.png"
        with Page(exe, page.as_uri(), width=1000) as tab:
            for select, value in PLAN_PAGE_CHOICES:
                choose(tab, select, value)
            tab.screenshot(png)
    return png


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("notebooks", nargs="*", help="notebook names (default: all in docs/notebooks)")
    p.add_argument("--out", type=pathlib.Path, default=DOCS / "images")
    a = p.parse_args(argv)
    exe = browser()
    if exe is None:
        print(f"error: no headless Chromium found (tried {', '.join(BROWSERS)}); "
              "apt-get install chromium-headless-shell", file=sys.stderr)
        return 2
    paths = sorted((DOCS / "notebooks").glob("*.ipynb"))
    want_page = not a.notebooks or PLAN_PAGE in a.notebooks
    if a.notebooks:
        paths = [q for q in paths if q.stem in a.notebooks]
        if len(paths) != len(set(a.notebooks) - {PLAN_PAGE}):
            known = [q.stem for q in (DOCS / "notebooks").glob("*.ipynb")] + [PLAN_PAGE]
            print(f"error: unknown notebook in {a.notebooks}; known: {known}", file=sys.stderr)
            return 2
    a.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for nb in paths:
            for cell, view in html_views(nb):
                page = pathlib.Path(tmp) / f"{nb.stem}-{cell}.html"
                page.write_text(_page(view), encoding="utf-8")
                png = a.out / f"{nb.stem}-{cell}.png"
                render(page, png, exe)
                print(png)
    if want_page:
        print(plan_page_picture(exe, a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
