"""``named-launch --nproc N [--devices-per-process D] -- named-train ...``

Starts N processes of a command on this machine, wired for ``jax.distributed`` (a free
coordinator port on 127.0.0.1, NAMED_PROCESS_ID 0..N-1, gloo collectives on CPU, D fake CPU
devices each). Forwards SIGINT/SIGTERM to all of them; when one exits with an error, the
others are stopped (SIGTERM, then SIGKILL after a grace period) and the launcher exits with
that error's code, naming the process.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(base: dict, pid: int, nproc: int, port: int, devices: int | None, cpu: bool) -> dict:
    env = dict(base)
    env.update(NAMED_COORDINATOR=f"127.0.0.1:{port}", NAMED_NUM_PROCESSES=str(nproc), NAMED_PROCESS_ID=str(pid))
    if cpu:
        env["JAX_PLATFORMS"] = "cpu"
        env["NAMED_CPU_COLLECTIVES"] = "gloo"
        if devices:
            flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
            env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    return env


def launch(cmd: list[str], nproc: int, *, devices_per_process: int | None = None, cpu: bool = True,
           grace_s: float = 10.0, env: dict | None = None) -> int:
    if nproc < 1:
        raise SystemExit("named-launch: --nproc must be >= 1")
    if not cmd:
        raise SystemExit("named-launch: give the command after --, e.g. named-launch --nproc 2 -- named-train ...")
    port = free_port()
    base = dict(os.environ if env is None else env)
    procs = [subprocess.Popen(cmd, env=child_env(base, i, nproc, port, devices_per_process, cpu)) for i in range(nproc)]

    def forward(signum, _frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        failed = None
        while True:
            codes = [p.poll() for p in procs]
            bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                failed = bad[0]
                break
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.1)
        i, code = failed
        print(f"named-launch: process {i} exited with code {code}; stopping the others", file=sys.stderr)
        for p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + grace_s
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        return code if code > 0 else 128 - code
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" in argv:
        k = argv.index("--")
        own, cmd = argv[:k], argv[k + 1 :]
    else:
        own, cmd = argv, []
    p = argparse.ArgumentParser(prog="named-launch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, required=True)
    p.add_argument("--devices-per-process", type=int, default=None, help="fake CPU devices per process")
    p.add_argument("--gpu", action="store_true", help="do not force the CPU platform and gloo")
    p.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    a = p.parse_args(own)
    return launch(cmd, a.nproc, devices_per_process=a.devices_per_process, cpu=not a.gpu, grace_s=a.grace)


if __name__ == "__main__":
    sys.exit(main())
