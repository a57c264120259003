"""Start Python worker processes side by side and wait for all of them (never leaving one behind)."""

from __future__ import annotations

import subprocess
import sys


def run_workers(argvs: list[list[str]], env: dict, timeout: float) -> tuple[list[int], list[str]]:
    """``python -c ...`` per argument list, run at once; their exit codes and combined outputs."""
    procs = [subprocess.Popen([sys.executable, *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for argv in argvs]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in procs], outs
