"""Every shell command in README.md and docs/*.md runs, as written.

The commands of each page (its ```bash blocks, continuation lines joined, in page order) run
one after another with bash in a scratch folder laid out like a checkout (`.venv`, `config/`,
`examples/`, `Makefile` and `pyproject.toml` linked from the repository), so `runs/` and every file a
command writes stay out of the repository, and a later command of the page finds what an
earlier one wrote (`named-sample` reads the run `make train` made). They see one CPU device, as
on a reader's machine: the test's own fake-device flags are removed from their environment.

Two commands are not run, each for a reason that this file states (the table below); cluster
templates (SLURM, TPU pods) are fenced as ```text on their pages and are not commands here.
`make train` runs 10 of its 300 steps (``TRAIN_ARGS``, read by the Makefile): the whole run takes
about four minutes, and what follows it on the page needs only a finished run (a checkpoint for
`named-sample`, a metrics row, an eval and a sample for `named-plot`: the last step logs all three);
docs/trainer.md's first run trains those same 10 steps of the same config, so its programs come from
the session's persistent compilation cache (a run of another length bakes another learning-rate
schedule into its step: another program). A command that an earlier page of this session already
ran, word for word, is not run twice.
Each command must exit 0 with no traceback, and print what ``EXPECT`` asks of it.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from _procs import xla_flags

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = {
    "make test": "it is this test suite; CI runs it",
    "make bench": "over half an hour of timing runs; tests/test_bench_smoke.py runs each script at toy sizes",
}
_BLOCK = re.compile(r"^```(?:bash|sh|shell)\n(.*?)^```", re.S | re.M)


def commands(page: Path) -> list[str]:
    out = []
    for block in _BLOCK.findall(page.read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                out.append(shlex.join(words))
    return out


RUN = {p.name: [c for c in commands(p) if c not in NOT_RUN] for p in PAGES}
RUN = {name: cmds for name, cmds in RUN.items() if cmds}


# What a command prints, beyond exiting 0: README's first run logs its last step (the 10th of
# TRAIN_ARGS) with a train row, an eval and a sample, and the sample of its checkpoint begins with the prompt.
EXPECT = {
    "make train": lambda out: (
        all(f"[{kind} 10]" in out for kind in ("train", "eval", "sample")) and "done: 10 steps" in out
    ),
    ".venv/bin/named-sample --checkpoint runs/gpt2_nano --prompt 'def ' --tokens 100 --temperature 0.8": lambda out: (
        out.startswith("def ")
    ),
}


def test_the_commands_are_found():
    assert "make train" in RUN["README.md"] and any("named-plan" in c for c in RUN["trainer.md"])
    assert set(EXPECT) <= set(RUN["README.md"])  # each expectation still has its command
    assert set(NOT_RUN) <= set(commands(ROOT / "README.md"))  # every exception is still on the page
    for page in PAGES:  # nothing a reader cannot run slips into a bash block
        assert not [c for c in commands(page) if c.split()[0] in ("srun", "sbatch", "gcloud", "ssh")], page.name


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    # `make train` must find the environment installed: in the scratch folder its install rule
    # would install the scratch folder, not the project.
    stale = subprocess.run(["make", "-q", ".venv/.installed"], cwd=ROOT, capture_output=True).returncode
    assert stale == 0, "the .venv is older than pyproject.toml: run `make install` first"
    d = tmp_path_factory.mktemp("checkout")
    for name in (".venv", "config", "examples", "Makefile", "pyproject.toml"):
        (d / name).symlink_to(ROOT / name)
    return d


_ran: set[str] = set()  # the commands this session ran, in the shared scratch checkout


@pytest.mark.slow
@pytest.mark.parametrize("page", sorted(RUN))
@pytest.mark.procs
def test_page_commands_run_as_written(page, checkout):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = xla_flags()  # one device
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    env["TRAIN_ARGS"] = "--trainer.num_train_steps 10"  # make train: 10 of its 300 steps (warmup: 1)
    for command in RUN[page]:
        if command in _ran:
            continue
        _ran.add(command)
        done = subprocess.run(
            ["bash", "-c", command], cwd=checkout, env=env, capture_output=True, text=True, timeout=900
        )
        assert done.returncode == 0 and "Traceback" not in done.stderr, (
            f"{page}: `{command}` exited {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        )
        assert EXPECT.get(command, lambda out: True)(done.stdout), f"{page}: `{command}` printed\n{done.stdout[-3000:]}"
