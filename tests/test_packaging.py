"""What `pip install` of a built wheel puts on a machine: one top-level package (`named`), the
shipped YAML configs as package data, and nothing that collides with another distribution.

The install test builds the wheel, installs it with Coqui's `trainer==0.0.36` (the import name
`trainer` that our old layout collided with) into a fresh virtual environment, and runs
`named-train --config gpt2_nano` from outside the repository. The fresh environment borrows the
third-party dependencies (jax, draccus, torch, ...) from the test's own environment through a
`.pth` file placed after its own site-packages, so what is imported from `named` and `trainer`
is what the two wheels installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.procs, pytest.mark.network]


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    build = tmp_path_factory.mktemp("build")  # keep setuptools' build/ out of the checkout
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--quiet",
            "-w",
            str(out),
            str(ROOT),
        ],
        check=True,
        cwd=build,
        env={**os.environ, "PIP_NO_INPUT": "1"},
    )
    (whl,) = out.glob("named_jax-*.whl")
    return whl


def test_the_wheel_has_one_top_level_package_and_ships_the_configs(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    dist_info = {t for t in top if t.endswith(".dist-info")}
    assert top - dist_info == {"named"}, sorted(top)
    assert not any(n.startswith(("models/", "trainer/")) for n in names)
    shipped = {Path(n).name for n in names if n.startswith("named/configs/") and n.endswith(".yaml")}
    assert shipped == {p.name for p in (ROOT / "config").glob("*.yaml")}
    assert {"named/models/gpt2.py", "named/trainer/commands/cli.py", "named/py.typed"} <= set(names)
    # every module of the three source folders, sub-packages included (pyproject lists each package)
    sources = {
        f"named/{sub}{f.relative_to(folder).as_posix()}"
        for sub, folder in (
            ("", ROOT / "src/named"),
            ("models/", ROOT / "src/models"),
            ("trainer/", ROOT / "src/trainer"),
        )
        for f in folder.rglob("*.py")
    }
    assert sources - set(names) == set()


@pytest.mark.slow
def test_installs_beside_coqui_trainer_and_trains_from_the_wheel(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(py), "install", "--quiet", "--no-deps"]
    got = subprocess.run([*pip, "trainer==0.0.36", "coqpit"], capture_output=True, text=True)
    if got.returncode != 0:
        pytest.skip(f"the package index is not reachable for trainer==0.0.36: {got.stderr.strip()[-300:]}")
    subprocess.run([*pip, str(wheel)], check=True)
    site = Path(
        subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    # Sorted after our own site-packages' entries, so `named` and `trainer` come from the fresh installs.
    (site / "zz_borrowed_deps.pth").write_text(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")

    work = tmp_path / "elsewhere"  # not the repository: nothing from src/ or config/ is on the path
    work.mkdir()
    (work / "models.py").write_text("raise SystemExit('a user module named models must not shadow ours')\n")
    env = {
        **os.environ,
        "PYTHONPATH": "",
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
    }
    probe = subprocess.run(
        [
            str(py),
            "-c",
            "import named, named.models.gpt2, named.trainer.commands.cli, trainer\n"
            "print(named.__file__); print(trainer.__file__); print(trainer.__version__)",
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
    )
    assert probe.returncode == 0, probe.stderr
    named_file, trainer_file, trainer_version = probe.stdout.split()
    assert Path(named_file).is_relative_to(site) and Path(trainer_file).is_relative_to(site)
    assert Path(trainer_file).parent.name == "trainer" and trainer_version == "v0.0.36"

    run = subprocess.run(
        [
            str(venv / "bin" / "named-train"),
            "--config",
            "gpt2_nano",
            "--trainer.num_train_steps",
            "2",
            "--optimizer.warmup_steps",
            "0",
            "--trainer.train_batch_size",
            "8",
            "--model.n_layer",
            "1",
            "--data.seq_len",
            "32",
            "--data.stdlib_bytes",
            "200000",
            "--trainer.eval_interval",
            "0",
            "--trainer.sample_interval",
            "0",
            "--checkpoint.save_at_end",
            "false",
            "--trainer.run_dir",
            str(work / "run"),
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "done: 2 steps" in run.stdout
