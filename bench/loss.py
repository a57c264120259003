"""The loss without full logits (``nn.blockwise_cross_entropy_loss``, the trainer's
``trainer.loss_block_size``) against the full-logits loss, and against itself at an earlier commit.

    .venv/bin/python bench/loss.py --baseline 62ea26f      # the fused loss against the scan of that commit
    .venv/bin/python bench/loss.py --tiny --rounds 1       # smoke test (no baseline)

What is timed is the gradient step of the loss alone on the output head of the CPU GPT-2
(``_common.SMALL_GPT2``: embed 256, vocab 8192; batch 16 x seq 256): ``value_and_grad`` of the
mean next-token loss with respect to the final hidden states and the head (``(vocab, embed)``,
as GPT-2's tied table), under ``named_jit`` with FSDP on 8 devices (head ``{"embed": "data"}``,
activations ``{"batch": "data"}``), in float32, with vocabulary blocks of 1024 (as the layout
``named-plan --search`` ranks first within the peer's memory, docs/benchmarks.md section 2).

Sides: ``full`` (``cross_entropy_loss`` of the whole logits), ``blockwise`` (this tree's loss),
and with ``--baseline COMMIT`` ``baseline`` (the same call on the library as it was at COMMIT,
taken with ``git archive`` into a temporary folder). Each side is a persistent subprocess that
compiles once and then runs steps when the driver asks (``peer.serve``, ``peer.Worker``): the sides take turns of
``--per-round`` steps for ``--rounds`` rounds, the idle ones asleep on their stdin. Each worker
also reports its compiled program: the collectives (how many instructions, how many of them in a
loop, how many runs per call, bytes per call) and the peak memory per device.
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common as C  # sets XLA_FLAGS before jax is imported
import peer

BLOCK = 1024
SIDES = ("full", "blockwise")


def worker(side: str, tiny: bool) -> None:
    import jax
    import numpy as np

    import named as nm
    from named.inspect import parse_collectives
    from named.nn.loss import blockwise_next_token_loss, next_token_loss

    embed, vocab = (32, 512) if tiny else (C.SMALL_GPT2["n_embd"], C.SMALL_GPT2["vocab_size"])
    batch, seq = (8, 32) if tiny else (C.BATCH, C.SEQ)
    block = vocab // 8
    mesh = nm.make_mesh(C.MESH)
    rng = np.random.default_rng(0)
    hidden = nm.named(rng.standard_normal((batch, seq, embed)).astype(np.float32), "batch position embed")
    head = nm.named((rng.standard_normal((vocab, embed)) / np.sqrt(embed)).astype(np.float32), "vocab embed")
    ids = nm.named(rng.integers(0, vocab, (batch, seq)).astype(np.int32), "batch position")
    hidden, ids = nm.shard((hidden, ids), C.COMPUTE_MAPPING, mesh)
    head = nm.shard(head, C.PARAM_MAPPING, mesh)

    def loss(h, w, ids):
        if side == "full":
            return next_token_loss(nm.shard(nm.dot(h, w, axis="embed")), ids).scalar()
        extra = {}  # the parameter layout, where the loss takes it (it did not at every commit)
        if "weight_mapping" in inspect.signature(blockwise_next_token_loss).parameters:
            extra["weight_mapping"] = C.PARAM_MAPPING
        return blockwise_next_token_loss(h, w, ids, block_size=block, **extra).scalar()

    def grads(h, w, ids):
        value, (gh, gw) = jax.value_and_grad(loss, argnums=(0, 1))(h, w, ids)
        # each gradient laid out as its argument, as the trainer's step keeps them (the head's
        # split along embed, the hidden states' along batch: renamed so that one mapping says both)
        return value, gh.rename({"embed": "hidden_embed"}), gw

    step = nm.named_jit(
        grads, mapping=C.COMPUTE_MAPPING, out_mapping={**C.COMPUTE_MAPPING, **C.PARAM_MAPPING}, mesh=mesh
    )
    t0 = time.perf_counter()
    compiled = step.lower(hidden, head, ids).compile()
    compile_s = time.perf_counter() - t0
    collectives: dict = {}
    for c in parse_collectives(compiled.as_text(), mesh):
        k = collectives.setdefault(c.kind, {"instructions": 0, "in_loop": 0, "runs": 0, "bytes": 0})
        k["instructions"] += 1
        k["in_loop"] += int(c.in_loop)
        k["runs"] += c.runs
        k["bytes"] += c.bytes * c.runs
    info = {
        "library": str(Path(nm.__file__).resolve().parent),
        "compile_s": compile_s,
        "collectives": collectives,
        "memory": C.memory_stats(compiled),
        "shapes": {"batch": batch, "seq": seq, "embed": embed, "vocab": vocab, "block": block},
    }

    def run():
        value, *grads = step(hidden, head, ids)
        C.block(grads)
        return float(value)

    peer.serve(run, info)


def _baseline_path(commit: str, into: Path) -> Path:
    """A folder on which ``import named`` finds the library as it was at ``commit``."""
    archive = subprocess.run(
        ["git", "-C", str(C.ROOT), "archive", commit, "src/named"], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    (into / "pkg").mkdir()
    (into / "pkg" / "named").symlink_to(into / "src" / "named")
    return into / "pkg"


class Worker(peer.Worker):
    """One side's persistent subprocess; ``python_path`` first on its path (the baseline's library)."""

    def __init__(self, side: str, tiny: bool, log_dir: Path, python_path: Path | None = None):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        if python_path is not None:
            env["PYTHONPATH"] = str(python_path)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "full" if side == "full" else "blockwise"]
        self.side, self.log = side, log_dir / f"{side}.log"
        self._stderr = open(self.log, "w")
        self.proc = subprocess.Popen(
            cmd + (["--tiny"] if tiny else []),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env=env,
        )
        self.info = self._reply()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", help="a commit whose blockwise loss takes turns with this tree's")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--per-round", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", help="folder for the JSON result (default bench/results)")
    ap.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker, args.tiny)
        return {}

    machine = C.machine()
    with tempfile.TemporaryDirectory() as tmp:
        sides = {side: Worker(side, args.tiny, Path(tmp)) for side in SIDES}
        if args.baseline:
            sides["baseline"] = Worker("baseline", args.tiny, Path(tmp), _baseline_path(args.baseline, Path(tmp)))
            assert sides["baseline"].info["library"].startswith(str(Path(tmp).resolve())), sides["baseline"].info
        wall: dict = {s: [] for s in sides}
        cpu: dict = {s: [] for s in sides}
        losses: dict = {}
        try:
            for w in sides.values():
                w.run(args.warmup)
            for r in range(args.rounds):
                for name, w in sides.items():
                    out = w.run(args.per_round)
                    wall[name] += out["times"]
                    cpu[name] += out["cpu"]
                    losses[name] = out["loss"]
                print(
                    f"  round {r + 1}/{args.rounds}: "
                    + ", ".join(f"{n} {statistics.median(wall[n][-args.per_round :]):.4f}s" for n in sides),
                    flush=True,
                )
        finally:
            for w in sides.values():
                w.close()
    result = {
        "machine": machine,
        "command": C.command_line(),
        "baseline": args.baseline,
        "protocol": f"{args.warmup} warm-up steps per side, then {args.rounds} rounds of {args.per_round} steps "
        "per side, taking turns; medians",
        "sides": {
            name: {
                "wall": C.summary(wall[name]),
                "cpu": C.summary(cpu[name]),
                "loss": losses[name],
                **{k: v for k, v in w.info.items() if k not in ("ready", "library")},
            }
            for name, w in sides.items()
        },
    }
    med = {n: statistics.median(wall[n]) for n in wall}
    med_cpu = {n: statistics.median(cpu[n]) for n in cpu}
    for other in ("full", "baseline"):
        if other in med:
            result[f"blockwise_over_{other}"] = {
                "wall": med["blockwise"] / med[other],
                "cpu": med_cpu["blockwise"] / med_cpu[other],
            }
    C.write_result("loss_tiny" if args.tiny else "loss", result, args.out)
    return result


if __name__ == "__main__":
    main()
