"""One attention layer's forward and backward pass: the blockwise path against XLA's plain one.

    .venv/bin/python bench/attention.py
    .venv/bin/python bench/attention.py --tiny

``value_and_grad`` of ``sum(dot_product_attention(q, k, v, causal=True) * probe)`` over q, k, v
(batch 8, heads 8, head size 64, float32, one CPU device), compiled once per side and length. Per
side: the compiled program's temporary memory (``memory_analysis().temp_size_in_bytes``: what it
allocates besides its inputs and outputs) and the step's wall and CPU time, sides taking turns
(``_common.alternate``). The sides: ``implementation="xla"`` (keeps the [T, T] scores for the
backward pass) and ``"flash"`` with key/query blocks of 512 and of 256.
"""

from __future__ import annotations

import argparse

import _common as C  # sets XLA_FLAGS before jax is imported
import jax
import jax.numpy as jnp
import numpy as np

import named as nm
from named import nn
from named.nn import _flash

SIDES = {"xla": ("xla", None), "flash512": ("flash", 512), "flash256": ("flash", 256)}


def step_fn(impl: str, block: int | None, shapes):
    q, k, v = shapes

    def loss(q, k, v, probe):
        old = _flash.BLOCK
        _flash.BLOCK = block or old  # read while tracing: the block size of this program
        try:
            out = nn.dot_product_attention(q, k, v, causal=True, implementation=impl)
        finally:
            _flash.BLOCK = old
        return (out * probe).sum().scalar()

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def bench_length(T: int, B: int, H: int, D: int, rounds: int) -> dict:
    rng = np.random.default_rng(0)
    Batch, Pos, KPos = nm.Axis("batch", B), nm.Axis("position", T), nm.Axis("key_position", T)
    Heads, HeadSize = nm.Axis("heads", H), nm.Axis("head_size", D)

    def randn(*axes):
        return nm.named(jnp.asarray(rng.standard_normal([a.size for a in axes]), jnp.float32), axes)

    q, k, v = (
        randn(Batch, Pos, Heads, HeadSize),
        randn(Batch, KPos, Heads, HeadSize),
        randn(Batch, KPos, Heads, HeadSize),
    )
    probe = randn(Batch, Pos, Heads, HeadSize)
    row: dict = {"T": T}
    steps = {}
    for name, (impl, block) in SIDES.items():
        compiled = step_fn(impl, block, (q, k, v)).lower(q, k, v, probe).compile()
        row[name] = {"temp_bytes": compiled.memory_analysis().temp_size_in_bytes}
        C.block(compiled(q, k, v, probe))  # warm up
        steps[name] = lambda c=compiled: C.block(c(q, k, v, probe))
    wall, cpu = C.alternate(steps, rounds=rounds, per_round=1)
    for name in SIDES:
        row[name].update(wall=C.summary(wall[name]), cpu=C.summary(cpu[name]))
    base = row["xla"]
    for name in SIDES:
        if name != "xla":
            row[name]["wall_over_xla"] = row[name]["wall"]["median_s"] / base["wall"]["median_s"]
            row[name]["cpu_over_xla"] = row[name]["cpu"]["median_s"] / base["cpu"]["median_s"]
            row[name]["temp_over_xla"] = row[name]["temp_bytes"] / base["temp_bytes"]
    return row


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="batch 1, heads 2, head size 16, T 64 (a smoke test)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    B, H, D = (1, 2, 16) if a.tiny else (8, 8, 64)
    lengths = [64] if a.tiny else a.lengths
    rows = []
    for T in lengths:
        print(f"T={T}", flush=True)
        rows.append(bench_length(T, B, H, D, 1 if a.tiny else a.rounds))
        for name in SIDES:
            r = rows[-1][name]
            print(
                f"  {name}: temp {r['temp_bytes'] / 2**20:.1f} MiB, wall {r['wall']['median_s']:.3f}s, "
                f"cpu {r['cpu']['median_s']:.3f}s",
                flush=True,
            )
    result = {
        "command": C.command_line(),
        "machine": C.machine(),
        "shape": {"batch": B, "heads": H, "head_size": D, "dtype": "float32", "causal": True},
        "rows": rows,
    }
    C.write_result("attention_tiny" if a.tiny else "attention", result, a.out)
    return result


if __name__ == "__main__":
    main()
