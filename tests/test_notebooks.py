"""The notebooks in docs/notebooks execute top to bottom (so they never rot).

Each runs in a fresh kernel of this interpreter; the notebooks set XLA_FLAGS for 8 fake
devices in their first cell, before importing jax.
"""

from __future__ import annotations

import os
import pathlib
import sys

import pytest


def _read(path: pathlib.Path):
    """The notebook, as nbformat reads it. Imported here, not at collection: nbformat's import (jsonschema's
    format checkers) takes about 4 s of CPU, which each pytest worker would pay collecting this file."""
    return pytest.importorskip("nbformat").read(path, as_version=4)


NOTEBOOKS_DIR = pathlib.Path(__file__).resolve().parents[1] / "docs" / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))


def _kernel_name() -> str:
    """The ``python3`` kernel, checked to run this interpreter (ipykernel installs that kernelspec
    into the venv; jupyter_client runs a spec's ``python`` as ``sys.executable``)."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        spec = KernelSpecManager().get_kernel_spec("python3")
    except NoSuchKernel:
        pytest.fail("no python3 kernelspec: `pip install ipykernel` in this environment (make install does)")
    exe = spec.argv[0]
    assert exe in ("python", "python3", sys.executable) or os.path.realpath(exe) == os.path.realpath(sys.executable), (
        spec.argv
    )
    return "python3"


def test_every_notebook_is_linked_from_the_docs_and_every_link_is_a_notebook():
    # a notebook no page points to is never found by a reader; a link to a deleted one is dead
    import re

    docs = NOTEBOOKS_DIR.parent
    linked = {
        m
        for page in [docs.parent / "README.md", *docs.glob("*.md")]
        for m in re.findall(r"notebooks/(\w+)\.ipynb", page.read_text())
    }
    assert NOTEBOOKS and linked == {p.stem for p in NOTEBOOKS}, (sorted(linked), [p.stem for p in NOTEBOOKS])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
@pytest.mark.notebook
def test_notebook_executes(path):
    nbclient = pytest.importorskip("nbclient")
    nb = _read(path)
    assert "xla_force_host_platform_device_count=8" in nb.cells[1].source and "import jax" in nb.cells[1].source
    env_before = os.environ.get("XLA_FLAGS")
    client = nbclient.NotebookClient(
        nb, kernel_name=_kernel_name(), timeout=120, resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()
    assert os.environ.get("XLA_FLAGS") == env_before
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors


_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_collective_shown_is_explained(path):
    """A reader meets no collective in an output that the notebook's prose does not explain."""
    nb = _read(path)
    prose = " ".join(c.source for c in nb.cells if c.cell_type == "markdown")
    shown = " ".join(
        str(o.get("text", "")) + str(o.get("data", {}).get("text/plain", ""))
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
    )
    unexplained = [k for k in _KINDS if k in shown and k not in prose]
    assert not unexplained, f"{path.name} shows {unexplained} without a word about them"
