"""Data loader tokens/s from a pre-tokenised file, and checkpoint save / restore MB/s.

    .venv/bin/python bench/data_ckpt.py
    .venv/bin/python bench/data_ckpt.py --tiny
    .venv/bin/python bench/data_ckpt.py --s3      # checkpoints only: local disk beside a local S3 server

Loader: a ``.bin`` file of uint16 token ids (random, with an eos every ~1000 tokens) is
written to a temporary directory, then ``trainer.data.loader_throughput`` times making
shuffled, packed train batches (input_ids, segment_ids, loss_mask) from the memory-mapped
file, as training does, in this one process (one host). Goal: ≥ 5M tokens/s.

Checkpoints: a tree of f32 NamedArrays laid out FSDP-style over 8 fake CPU devices is saved
with ``trainer.checkpoint.save_checkpoint`` (synchronous: snapshot to host, write zarr v3
chunks with tensorstore, sha256 + fsync every file, atomic commit) and read back with
``restore`` onto the same layout (checks sizes and hashes). MB/s = tree bytes / wall time;
saves and restores take turns. The temporary directory is on the machine's local disk.

``--s3``: the same tree saved to and restored from the local disk and from ``s3://`` on moto's
standalone S3 server on 127.0.0.1 (started as a subprocess, as tests/test_s3_checkpoints.py
does), taking turns; written to ``bench/results/data_ckpt_s3.json``. On the store a save
encodes every chunk in memory, hashes and uploads it and writes the commit record last; a
restore fetches each needed object once, checks its sha256 and decodes it from memory.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import _common as C  # sets XLA_FLAGS before jax is imported
import jax
import jax.numpy as jnp
import numpy as np

import named as nm
from named.trainer.checkpoint import restore, save_checkpoint
from named.trainer.data import loader_throughput


def write_tokens(path: Path, n_tokens: int, vocab: int = 50257, eos: int = 0) -> None:
    rng = np.random.default_rng(0)
    ids = rng.integers(1, vocab, size=n_tokens, dtype=np.uint16)
    ids[rng.random(n_tokens) < 1e-3] = eos
    ids.tofile(path)


def bench_loader(tmp: Path, n_tokens: int, cases, steps: int, repeats: int) -> list[dict]:
    path = tmp / "tokens.bin"
    write_tokens(path, n_tokens)
    rows = []
    for seq_len, batch in cases:
        rates = [
            loader_throughput(path, seq_len=seq_len, batch_size=batch, steps=steps, bin_dtype="uint16", eos_id=0)
            for _ in range(repeats)
        ]
        rows.append(
            {
                "seq_len": seq_len,
                "batch_size": batch,
                "steps": steps,
                "file_tokens": n_tokens,
                "tokens_per_s": C.summary(rates),
            }
        )
        print(f"loader seq {seq_len} batch {batch}: median {np.median(rates) / 1e6:.2f}M tokens/s", flush=True)
    return rows


def make_tree(total_mb: int, mesh) -> tuple[dict, int]:
    """Four (vocab-like, embed) f32 arrays of about total_mb MiB together, embed over data."""
    Embed = nm.Axis("embed", 1024)
    rows = max(8, (total_mb * 2**20 // 4 // 4) // 1024)
    Rows = nm.Axis("rows", rows)
    mapping = {"embed": "data"}
    keys = jax.random.split(jax.random.key(0), 4)
    init = nm.named_jit(lambda k: nm.random.normal(k, (Rows, Embed)), mapping=mapping)
    tree = {f"w{i}": init(k) for i, k in enumerate(keys)}
    jax.block_until_ready(tree)
    return tree, 4 * rows * 1024 * 4


def bench_checkpoint(tmp, total_mb: int, repeats: int, mesh, tree=None) -> dict:
    """Save and restore ``tree`` (default: make_tree) ``repeats`` times under ``tmp``: a local
    directory or an ``s3://`` URL."""
    if tree is None:
        tree, nbytes = make_tree(total_mb, mesh)
    else:
        nbytes = sum(x.array.nbytes for x in jax.tree.leaves(tree, is_leaf=nm.is_named_array))
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    saves, restores = [], []
    for r in range(repeats):
        run = f"{tmp}/run{r}" if isinstance(tmp, str) else tmp / f"run{r}"
        t0 = time.perf_counter()
        path = save_checkpoint(run, r, tree)
        saves.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        out, _ = restore(path, target)
        jax.block_until_ready(out)
        restores.append(time.perf_counter() - t0)
        assert all(
            bool(jnp.array_equal(a.array, b.array))
            for a, b in zip(
                jax.tree.leaves(tree, is_leaf=nm.is_named_array), jax.tree.leaves(out, is_leaf=nm.is_named_array)
            )
        )
        if isinstance(run, str):
            from named.trainer.checkpoint import location, store

            store.delete_prefix(location(run))
        else:
            shutil.rmtree(run)
        print(
            f"checkpoint {run if isinstance(run, str) else 'local'} {nbytes / 2**20:.0f} MiB: save {saves[-1]:.2f}s "
            f"({nbytes / 1e6 / saves[-1]:.0f} MB/s), "
            f"restore {restores[-1]:.2f}s ({nbytes / 1e6 / restores[-1]:.0f} MB/s)",
            flush=True,
        )
    return {
        "bytes": nbytes,
        "leaves": len(tree),
        "layout": "(rows, embed/data) f32 on 8 devices",
        "save_s": C.summary(saves),
        "restore_s": C.summary(restores),
        "save_MB_per_s": nbytes / 1e6 / C.summary(saves)["median_s"],
        "restore_MB_per_s": nbytes / 1e6 / C.summary(restores)["median_s"],
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=100_000_000, help="tokens in the pre-tokenised file")
    ap.add_argument("--steps", type=int, default=200, help="batches timed per loader measurement")
    ap.add_argument("--ckpt-mb", type=int, default=512, help="size of the checkpointed tree (MiB)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tmp", default=None, help="directory for the temporary files (default: the system's)")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--s3", action="store_true", help="checkpoints only: local disk and a local S3 server, taking turns"
    )
    args = ap.parse_args(argv)
    if args.s3:
        return main_s3(args)
    cases = [(1024, 8), (1024, 64), (2048, 256)]
    if args.tiny:
        args.tokens, args.steps, args.ckpt_mb, args.repeats = 1_000_000, 5, 4, 1
        cases = [(128, 8)]
    mesh = nm.make_mesh(C.MESH)
    tmp = Path(tempfile.mkdtemp(prefix="named-bench-", dir=args.tmp))
    try:
        loader = bench_loader(tmp, args.tokens, cases, args.steps, args.repeats)
        with jax.set_mesh(mesh):
            ckpt = bench_checkpoint(tmp, args.ckpt_mb, args.repeats, mesh)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result = {
        "benchmark": "data_ckpt",
        "command": C.command_line(),
        "machine": C.machine(),
        "tmp_dir": str(tmp.parent),
        "loader": loader,
        "loader_goal": "tokens_per_s >= 5e6 per host",
        "checkpoint": ckpt,
    }
    C.write_result("data_ckpt" + ("_tiny" if args.tiny else ""), result, args.out)
    return result


def main_s3(args) -> dict:
    """Checkpoint save / restore to the local disk and to moto's S3 server, rounds taking turns."""
    import os
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_s3_checkpoints import MotoServer, s3_env  # the server the tests use

    if args.tiny:
        args.ckpt_mb, args.repeats = 4, 1
    server = MotoServer()
    server.create_bucket("bench")
    os.environ.update(s3_env(server.url))
    mesh = nm.make_mesh(C.MESH)
    tmp = Path(tempfile.mkdtemp(prefix="named-bench-", dir=args.tmp))
    local, s3 = [], []
    try:
        with jax.set_mesh(mesh):
            tree, _ = make_tree(args.ckpt_mb, mesh)
            for r in range(args.repeats):  # one save + restore on each side per round
                local.append(bench_checkpoint(tmp / f"round{r}", args.ckpt_mb, 1, mesh, tree))
                s3.append(bench_checkpoint(f"s3://bench/round{r}", args.ckpt_mb, 1, mesh, tree))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        server.stop()

    def merged(rows):
        saves = [t for row in rows for t in row["save_s"]["all_s"]]
        restores = [t for row in rows for t in row["restore_s"]["all_s"]]
        nbytes = rows[0]["bytes"]
        return {
            **{k: rows[0][k] for k in ("bytes", "leaves", "layout")},
            "save_s": C.summary(saves),
            "restore_s": C.summary(restores),
            "save_MB_per_s": nbytes / 1e6 / C.summary(saves)["median_s"],
            "restore_MB_per_s": nbytes / 1e6 / C.summary(restores)["median_s"],
        }

    import moto

    result = {
        "benchmark": "data_ckpt_s3",
        "command": C.command_line(),
        "machine": C.machine(),
        "s3_server": f"moto {moto.__version__} standalone server on 127.0.0.1 (in-memory)",
        "local": merged(local),
        "s3": merged(s3),
    }
    C.write_result("data_ckpt_s3" + ("_tiny" if args.tiny else ""), result, args.out)
    return result


if __name__ == "__main__":
    main()
