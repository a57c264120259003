"""Start Python worker processes side by side and wait for all of them (never leaving one behind)."""

from __future__ import annotations

import subprocess
import sys

# What conftest.py gives XLA in the pytest process (besides its 8 devices): the processes tests start
# compile the same way. The tests' models are tiny, so LLVM's optimisation of the generated code costs
# more than it saves (about 30 % of the suite's CPU time, measured on test_moe and test_families_sharded).
FAST_COMPILE = "--xla_backend_optimization_level=0"


def xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a process a test starts: ``devices`` fake CPU devices (None: jax's default, one)."""
    return (f"--xla_force_host_platform_device_count={devices} " if devices else "") + FAST_COMPILE


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
