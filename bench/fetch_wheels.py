"""Download, here, the wheels a GPU machine needs to run this checkout (``make bench-gpu``) with
no package index: what ``named`` needs beyond what the borrowed GPU image already has.

    .venv/bin/python bench/fetch_wheels.py                 # -> .whl/ (ignored by git)
    .venv/bin/python bench/fetch_wheels.py --tests         # also pytest and hypothesis

The image carries jax (0.11.2 with its CUDA 13 plugin), jaxlib, numpy, equinox (so jaxtyping),
optax, tensorstore, tokenizers (so huggingface_hub and PyYAML), safetensors and pyarrow
(``IN_IMAGE``). This fetches the rest of what ``named`` and its train extra require (jmp,
draccus, google-crc32c, zstandard, jinja2), at the versions pyproject.toml asks for, with
their dependencies, and setuptools and wheel (the build backend, so that the tree itself can
be installed there without an index); then drops the wheels of packages the image has, so
that nothing shadows its numpy. Three are compiled (google-crc32c, zstandard and jinja2's
markupsafe): their wheels are for ``--python-version`` (the image's 3.12) on x86-64 Linux.
docs/benchmarks.md §6 has the device call that carries ``.whl/``.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Distributions the GPU image provides, itself or as dependencies of what it has (normalised
# names): never carried.
IN_IMAGE = {
    "jax",
    "jaxlib",
    "numpy",
    "ml_dtypes",
    "opt_einsum",
    "scipy",
    "equinox",
    "jaxtyping",
    "wadler_lindig",
    "typing_extensions",
    "optax",
    "absl_py",
    "tensorstore",
    "tokenizers",
    "huggingface_hub",
    "pyyaml",
    "safetensors",
    "packaging",
    "filelock",
    "fsspec",
    "tqdm",
    "requests",
    "pyarrow",
}
# Resolution needs the platform of binary wheels in the closure (PyYAML has no pure wheel);
# those are then dropped as IN_IMAGE.
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any"]


def requirements(with_tests: bool) -> list[str]:
    """The specifiers pyproject.toml gives (one place for the versions) for what ``named`` and its
    train extra need and the image lacks, plus pytest and hypothesis ``with_tests``."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = pyproject["project"]
    extras = project["optional-dependencies"]
    tests = [r for r in extras["test"] if distribution_name(r) in ("pytest", "hypothesis")] if with_tests else []
    needed = [r for r in project["dependencies"] + extras["train"] if distribution_name(r) not in IN_IMAGE]
    return needed + tests + pyproject["build-system"]["requires"]


def distribution_name(requirement: str) -> str:
    """A requirement's (or a wheel file's) distribution name, normalised: lower case, ``_`` for ``-`` and ``.``."""
    return re.sub(r"[-.]+", "_", re.split(r"[<>=!~\[ ;]", requirement, maxsplit=1)[0]).lower()


def _name(wheel: Path) -> str:
    return distribution_name(wheel.name.split("-")[0])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dest", default=str(ROOT / ".whl"))
    ap.add_argument("--python-version", default="3.12", help="the GPU image's Python (for resolving only)")
    ap.add_argument("--tests", action="store_true", help="also pytest and hypothesis, to run tests there")
    args = ap.parse_args(argv)
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    reqs = requirements(args.tests)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--disable-pip-version-check",
        "--only-binary=:all:",
        "--python-version",
        args.python_version,
        *[f"--platform={p}" for p in PLATFORMS],
        "-d",
        str(dest),
        *reqs,
    ]
    subprocess.run(cmd, check=True)
    for wheel in sorted(dest.glob("*.whl")):
        if _name(wheel) in IN_IMAGE:
            wheel.unlink()
    kept = sorted(dest.glob("*.whl"))
    binary = [w.name for w in kept if not w.name.endswith("-none-any.whl")]
    if binary:  # these tie the carried set to one Python and platform
        print(f"compiled for Python {args.python_version} on x86-64 Linux: {', '.join(binary)}")
    print(f"{len(kept)} wheels in {dest}: " + ", ".join(w.name for w in kept))
    return 0


if __name__ == "__main__":
    sys.exit(main())
