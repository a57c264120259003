"""Start Python worker processes side by side and wait for all of them (never leaving one behind)."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import subprocess
import sys
from pathlib import Path

# What conftest.py gives XLA in the pytest process (besides its 8 devices): the processes tests start
# compile the same way. The tests' models are tiny, so compiling them costs more than running them:
# XLA:CPU makes its cheapest machine code (named.internal.cheap_codegen_flags: no LLVM optimisation,
# about 30 % of the suite's CPU time, measured on test_moe and test_families_sharded; no MLIR fusion
# emitters, where this jaxlib has the option: on 2 cores test_moe took 79 s instead of 138 s, XLA's
# backend compile 32 s instead of 77 s, and test_families_sharded 45 s instead of 69 s, 22 s instead
# of 43 s; and one LLVM module per program, measured where named._compat lists the options). XLA's HLO
# passes, which the collective and memory tests read, still run.
# The started processes keep the cheapest code too, although they run more steps: at LLVM's level 1
# (--xla_backend_optimization_level=1) a gpt2_nano train step on one device took 446 ms of CPU instead
# of 1,045 ms, but test_kill_resume, test_preemption, test_commands and test_multihost (one pytest
# process, their children counted) took 483 s of user CPU against 369 s when the processes that
# xla_flags() below sets up compiled at level 1, one run each, taking turns: the faster steps did not
# pay for the slower compiles (each process compiles its init, step, eval and sampling programs, and
# the multihost runs read no persistent cache).
_NO_FUSION_EMITTERS = "xla_cpu_use_fusion_emitters"


@functools.cache
def fast_compile() -> str:
    """The compile options above that this jaxlib knows, for XLA_FLAGS."""
    from named.internal import cheap_codegen_flags  # imports jax, which reads XLA_FLAGS only later

    return " ".join(cheap_codegen_flags())


def as_users_compile() -> dict:
    """Options for one ``Lowered.compile``: XLA's HLO passes as in a user's process, for a test that reads
    a program's structure (its loops, its copies). Without the fusion emitters XLA:CPU also rewrites every
    scatter (an embedding's gradient) into a while loop, and lays some parameters out differently."""
    return {_NO_FUSION_EMITTERS: True} if _NO_FUSION_EMITTERS in fast_compile() else {}


# XLA:CPU ends the whole process (SIGABRT) when a device has waited at a collective for 20 s (its
# warning) plus 40 s (its termination timeout). With two pytest workers of 8 fake devices each on 2
# cores, a device thread can be left that far behind the others: a CI run lost a worker inside a
# sharded train step that way, and pytest-xdist 3.8 then hung at the end of the run (a crashed
# worker's finished files go back on its queue as empty work). Ten minutes still ends a real deadlock.
PATIENT_COLLECTIVES = (
    "--xla_cpu_collective_call_warn_stuck_timeout_seconds=60 --xla_cpu_collective_call_terminate_timeout_seconds=540"
)


def xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a process a test starts: ``devices`` fake CPU devices (None: jax's default, one)."""
    count = f"--xla_force_host_platform_device_count={devices} " if devices else ""
    return f"{count}{fast_compile()} {PATIENT_COLLECTIVES}"


def run_workers(argvs: list[list[str]], env: dict, timeout: float) -> tuple[list[int], list[str]]:
    """``python -c ...`` per argument list, run at once; their exit codes and combined outputs."""
    procs = [
        subprocess.Popen([sys.executable, *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for argv in argvs
    ]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in procs], outs


def shared_dir(tmp_path_factory, name: str) -> Path:
    """A folder of the whole pytest session, the same for every xdist worker (the folder above each
    worker's own temporary folder): what a test file makes there once, another file's tests reuse."""
    base = tmp_path_factory.getbasetemp()
    d = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    d.mkdir(exist_ok=True)
    return d


@contextlib.contextmanager
def once(marker: Path):
    """Runs the block unless ``marker`` exists, then writes it (not when the block fails); one process
    at a time (a file lock beside it), so the pytest workers of a session share what the block made."""
    with open(marker.with_name(marker.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield not marker.exists()
            marker.touch()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
