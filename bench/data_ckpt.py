"""Data loader tokens/s from a pre-tokenised file, and checkpoint save / restore MB/s.

    .venv/bin/python bench/data_ckpt.py
    .venv/bin/python bench/data_ckpt.py --tiny
    .venv/bin/python bench/data_ckpt.py --s3      # checkpoints only: local disk beside a local S3 server

Loader: a ``.bin`` file of uint16 token ids (random, with an eos every ~1000 tokens) is
written to a temporary directory, then ``loader_throughput`` (below) times making
shuffled, packed train batches (input_ids, segment_ids, loss_mask) from the memory-mapped
file, as training does, in this one process (one host). Goal: ≥ 5M tokens/s.

Checkpoints: a tree of f32 NamedArrays laid out FSDP-style over 8 fake CPU devices (1 GiB by
default) is saved and restored, each round taking turns with ``dd`` writing and reading as many
bytes with ``oflag=direct`` / ``iflag=direct`` in the same directory (what the disk itself does,
without the page cache): dd writes, ``save_checkpoint`` (synchronous: writes the arrays where
they are, zarr v3 chunks, a crc32c and an fsync of every file, atomic commit), dd reads,
``restore`` onto the same layout (checks sizes and checksums), then the trainer's way, one
``Checkpointer`` whose ``save`` snapshots to host memory (the time the train loop waits) and
commits in the background (``wait``). Restores read from the disk: the page cache is written
back and dropped before each restore where the process may (Linux, root; the result's
``restore_from`` says which). MB/s = tree bytes / wall time, also given as a fraction of dd's
(medians over the rounds); CPU time is this process's, all threads, per GiB; the load average is
printed each round. The temporary directory is on the machine's local disk.

``--s3``: the same tree saved to and restored from the local disk and from ``s3://`` on moto's
standalone S3 server on 127.0.0.1 (started as a subprocess, as tests/test_s3_checkpoints.py
does), taking turns; written to ``bench/results/data_ckpt_s3.json``. On the store a save
encodes every chunk in memory, hashes and uploads it and writes the commit record last; a
restore reads each whole chunk once through tensorstore's zarr driver and checks its crc32c.
CPU time (this process's; not the server's) is given beside each wall time, and the ratio to
boto3 round by round as well as of the medians. Each round also times, in two new processes
taking turns, the first restore of one checkpoint and boto3's first download of the same bytes:
what a run that starts and restores waits for, each landing in memory the process has not used
before. In the one process above, boto3's download reuses the memory that earlier rounds freed,
where a restore's values are always new memory (they outlive the call).
"""

from __future__ import annotations

import argparse
import concurrent.futures
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
from named.trainer.checkpoint.store import IO_THREADS
from named.trainer.data import Sequences, TokenStream, TrainBatches, open_pretokenized, resolve_sources


def write_tokens(path: Path, n_tokens: int, vocab: int = 50257, eos: int = 0) -> None:
    rng = np.random.default_rng(0)
    ids = rng.integers(1, vocab, size=n_tokens, dtype=np.uint16)
    ids[rng.random(n_tokens) < 1e-3] = eos
    ids.tofile(path)


def loader_throughput(
    path: Path, *, seq_len: int, batch_size: int, steps: int, bin_dtype: str = "uint16", eos_id: int = 0
) -> float:
    """Tokens per second of the trainer's shuffled train batches (``TrainBatches.batch_at``, what the
    loop calls) from a pre-tokenised file, memory-mapped as in training; one warm-up batch untimed."""
    (src,) = resolve_sources([str(path)])
    stream = TokenStream([open_pretokenized(src, bin_dtype=bin_dtype, vocab_size=None)], eos_id)
    batches = TrainBatches(Sequences(stream, seq_len), batch_size=batch_size, seed=0)
    batches.batch_at(0)
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        batches.batch_at(step)
    return steps * batch_size * seq_len / (time.perf_counter() - t0)


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


def _tree_axes(total_mb: int) -> tuple[tuple, dict]:
    rows = max(8, (total_mb * 2**20 // 4 // 4) // 1024)
    return (nm.Axis("rows", rows), nm.Axis("embed", 1024)), {"embed": "data"}


def abstract_tree(total_mb: int, mesh) -> dict:
    """``make_tree``'s shapes, dtypes and shardings, without making its values."""
    axes, mapping = _tree_axes(total_mb)
    sharding = nm.partitioning.sharding_for(axes, mapping, mesh)
    shape = jax.ShapeDtypeStruct(tuple(a.size for a in axes), jnp.float32, sharding=sharding)
    return {f"w{i}": nm.NamedArray(shape, axes) for i in range(4)}


def make_tree(total_mb: int, mesh) -> tuple[dict, int]:
    """Four (vocab-like, embed) f32 arrays of about total_mb MiB together, embed over data."""
    (Rows, Embed), mapping = _tree_axes(total_mb)
    rows = Rows.size
    keys = jax.random.split(jax.random.key(0), 4)
    init = nm.named_jit(lambda k: nm.random.normal(k, (Rows, Embed)), mapping=mapping)
    tree = {f"w{i}": init(k) for i, k in enumerate(keys)}
    jax.block_until_ready(tree)
    return tree, 4 * rows * 1024 * 4


def dd_rate(tmp: Path, way: str, mib: int = 1024) -> float | str:
    """MB/s of ``dd`` writing (``way="write_direct"``: a new file) or reading back (``"read_direct"``)
    ``mib`` MiB of ``tmp/dd.bin``, bypassing the page cache; the error's text where dd fails (no
    dd, or no O_DIRECT on this file system)."""
    import re
    import subprocess

    path = tmp / "dd.bin"
    cmd = {
        "write_direct": ["dd", "if=/dev/zero", f"of={path}", "bs=16M", f"count={mib // 16}", "oflag=direct"],
        "read_direct": ["dd", f"if={path}", "of=/dev/null", "bs=16M", "iflag=direct"],
    }[way]
    try:
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, check=True)
        wall = time.perf_counter() - t0
    except (OSError, subprocess.CalledProcessError) as e:
        return str(e)
    m = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", r.stderr)
    nbytes, secs = (int(m.group(1)), float(m.group(2))) if m else (mib * 2**20, wall)
    return nbytes / 1e6 / secs


def drop_page_cache() -> bool:
    """Write back and drop the page cache (Linux, as root), so that the next read comes from the
    disk as dd's ``iflag=direct`` does; False where that is not allowed (the read is then warm)."""
    import os

    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        return False
    return True


def fresh_memory(tree) -> tuple[float, float]:
    """(wall, CPU) seconds to map fresh page-aligned memory for every shard of ``tree``, as many at
    once as a restore reads (``aligned_empty``, what a restore reads into): the part of a restore's
    CPU that is this machine's cost of new memory, not the checkpoint's work."""
    from named.trainer.checkpoint.chunks import aligned_empty

    sizes = [
        sh.data.nbytes for x in jax.tree.leaves(tree, is_leaf=nm.is_named_array) for sh in x.array.addressable_shards
    ]
    t0, c0 = time.perf_counter(), time.process_time()
    with concurrent.futures.ThreadPoolExecutor(IO_THREADS) as pool:
        buffers = list(pool.map(aligned_empty, sizes))
    out = time.perf_counter() - t0, time.process_time() - c0
    del buffers
    return out


def _same(a, b) -> bool:
    return all(
        bool(jnp.array_equal(x.array, y.array))
        for x, y in zip(jax.tree.leaves(a, is_leaf=nm.is_named_array), jax.tree.leaves(b, is_leaf=nm.is_named_array))
    )


def bench_checkpoint(
    tmp, total_mb: int, repeats: int, mesh, tree=None, dd_mib: int | None = None, cold: bool = True
) -> dict:
    """Save and restore ``tree`` (default: make_tree) ``repeats`` times under ``tmp``: a local
    directory or an ``s3://`` URL. Each round: (``dd_mib``: dd writes that many MiB)
    ``save_checkpoint``, (dd reads them back) ``restore``, then a save through one
    ``Checkpointer`` kept across rounds (as the train loop keeps it). ``cold``: drop the page cache
    before each local restore where the process may."""
    import os

    from named.trainer.checkpoint import Checkpointer, location, store

    if tree is None:
        tree, nbytes = make_tree(total_mb, mesh)
    else:
        nbytes = sum(x.array.nbytes for x in jax.tree.leaves(tree, is_leaf=nm.is_named_array))
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    local = not isinstance(tmp, str)
    saves, restores, snapshots, commits, cpu = [], [], [], [], {"save": [], "restore": []}
    dd: dict[str, list] = {"write_direct": [], "read_direct": []}
    loads, fresh = [], []  # fresh: (wall, CPU) seconds to map fresh memory for the tree's shards
    from_disk: list[bool] = []  # whether each restore read from the disk (page cache dropped first)
    loop_dir = tmp / "loop" if local else f"{tmp}/loop"
    checkpointer = Checkpointer(loop_dir, keep_last=1)
    for r in range(repeats):
        loads.append(round(os.getloadavg()[0], 2))
        run = tmp / f"run{r}" if local else f"{tmp}/run{r}"
        if dd_mib:
            dd["write_direct"].append(dd_rate(tmp, "write_direct", dd_mib))
        t0, c0 = time.perf_counter(), time.process_time()
        path = save_checkpoint(run, r, tree)
        saves.append(time.perf_counter() - t0)
        cpu["save"].append(time.process_time() - c0)
        if dd_mib:
            dd["read_direct"].append(dd_rate(tmp, "read_direct", dd_mib))
            (tmp / "dd.bin").unlink(missing_ok=True)
        from_disk.append(local and cold and drop_page_cache())
        if local:
            fresh.append(fresh_memory(tree))
        t0, c0 = time.perf_counter(), time.process_time()
        out, _ = restore(path, target)
        jax.block_until_ready(out)
        restores.append(time.perf_counter() - t0)
        cpu["restore"].append(time.process_time() - c0)
        assert _same(tree, out)
        del out
        if local:
            shutil.rmtree(run)
        else:
            store.delete_prefix(location(run))
        t0 = time.perf_counter()
        checkpointer.save(r, tree)
        snapshots.append(time.perf_counter() - t0)
        checkpointer.wait()
        commits.append(time.perf_counter() - t0)
        gib = nbytes / 2**30
        dd_text = (
            f"; dd write {dd['write_direct'][-1]:.0f} MB/s, read {dd['read_direct'][-1]:.0f} MB/s"
            if dd_mib and not any(isinstance(x, str) for x in dd["write_direct"] + dd["read_direct"])
            else ""
        )
        mem_text = f"; fresh memory for it: {fresh[-1][0]:.2f}s, CPU {fresh[-1][1] / gib:.2f} s/GiB" if fresh else ""
        print(
            f"checkpoint {'local' if local else run} {nbytes / 2**20:.0f} MiB (load {loads[-1]}): "
            f"save {saves[-1]:.2f}s ({nbytes / 1e6 / saves[-1]:.0f} MB/s, CPU {cpu['save'][-1] / gib:.2f} s/GiB), "
            f"restore {restores[-1]:.2f}s ({nbytes / 1e6 / restores[-1]:.0f} MB/s, "
            f"CPU {cpu['restore'][-1] / gib:.2f} s/GiB), "
            f"Checkpointer.save {snapshots[-1]:.2f}s, committed after {commits[-1]:.2f}s{dd_text}{mem_text}",
            flush=True,
        )
    if local:
        shutil.rmtree(loop_dir)
    else:
        store.delete_prefix(location(loop_dir))

    def rate(times: list[float]) -> float:
        return nbytes / 1e6 / C.summary(times)["median_s"]

    result = {
        "bytes": nbytes,
        "leaves": len(tree),
        "layout": "(rows, embed/data) f32 on 8 devices",
        "save_s": C.summary(saves),
        "restore_s": C.summary(restores),
        "save_MB_per_s": rate(saves),
        "restore_MB_per_s": rate(restores),
        "restore_from": "disk (page cache dropped before each restore)"
        if from_disk and all(from_disk)
        else "page cache (not dropped)"
        if local
        else "the object store",
        # this process's CPU time (all threads): the work, which a loaded machine changes least
        "save_cpu_s": C.summary(cpu["save"]),
        "restore_cpu_s": C.summary(cpu["restore"]),
        "save_cpu_s_per_GiB": C.summary(cpu["save"])["median_s"] * 2**30 / nbytes,
        "restore_cpu_s_per_GiB": C.summary(cpu["restore"])["median_s"] * 2**30 / nbytes,
        "load_average_1min_per_round": loads,
        # the floor under a restore's CPU on this machine: memory for the values, mapped fresh
        **(
            {
                "fresh_memory_s": C.summary([w for w, _ in fresh]),
                "fresh_memory_cpu_s_per_GiB": C.summary([c for _, c in fresh])["median_s"] * 2**30 / nbytes,
            }
            if fresh
            else {}
        ),
        # the trainer's Checkpointer: rounds after the first copy into its previous save's buffers
        "checkpointer_save_s": C.summary(snapshots),
        "checkpointer_commit_s": C.summary(commits),
        "checkpointer_commit_MB_per_s": rate(commits),
    }
    if dd_mib:
        failed = [x for x in dd["write_direct"] + dd["read_direct"] if isinstance(x, str)]
        if failed:
            result["dd"] = {"skipped": failed[0]}
        else:
            import statistics

            result["dd"] = {
                "mib": dd_mib,
                **{f"{k}_MB_per_s": statistics.median(v) for k, v in dd.items()},
                **{f"{k}_MB_per_s_all": [round(x) for x in v] for k, v in dd.items()},
            }
            w, rd = result["dd"]["write_direct_MB_per_s"], result["dd"]["read_direct_MB_per_s"]
            result["save_over_dd_write"] = result["save_MB_per_s"] / w
            result["checkpointer_commit_over_dd_write"] = result["checkpointer_commit_MB_per_s"] / w
            result["restore_over_dd_read"] = result["restore_MB_per_s"] / rd
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=100_000_000, help="tokens in the pre-tokenised file")
    ap.add_argument("--steps", type=int, default=200, help="batches timed per loader measurement")
    ap.add_argument("--ckpt-mb", type=int, default=1024, help="size of the checkpointed tree (MiB)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tmp", default=None, help="directory for the temporary files (default: the system's)")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--no-loader", action="store_true", help="checkpoints only (the loader's rows are left out)")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--s3", action="store_true", help="checkpoints only: local disk and a local S3 server, taking turns"
    )
    ap.add_argument("--first", choices=("restore", "boto3"), help=argparse.SUPPRESS)  # first_in_new_process
    ap.add_argument("--url", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.first:
        return _first(args)
    if args.s3:
        return main_s3(args)
    cases = [(1024, 8), (1024, 64), (2048, 256)]
    if args.tiny:
        args.tokens, args.steps, args.ckpt_mb, args.repeats = 1_000_000, 5, 4, 1
        cases = [(128, 8)]
    machine = C.machine()  # the load average before the run
    mesh = nm.make_mesh(C.MESH)
    tmp = Path(tempfile.mkdtemp(prefix="named-bench-", dir=args.tmp))
    try:
        loader = bench_loader(tmp, args.tokens, cases, args.steps, args.repeats) if not args.no_loader else []
        with jax.set_mesh(mesh):
            ckpt = bench_checkpoint(
                tmp, args.ckpt_mb, args.repeats, mesh, dd_mib=16 if args.tiny else 1024, cold=not args.tiny
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result = {
        "benchmark": "data_ckpt",
        "command": C.command_line(),
        "machine": machine,
        "tmp_dir": str(tmp.parent),
        "loader": loader,
        "loader_goal": "tokens_per_s >= 5e6 per host",
        "dd": ckpt.pop("dd", {}),
        "checkpoint_goal": "save and restore MB/s >= 0.8 x dd's (oflag=direct / iflag=direct), "
        "restore CPU <= 0.5 s per GiB",
        "checkpoint": ckpt,
    }
    C.write_result("data_ckpt" + ("_tiny" if args.tiny else ""), result, args.out)
    return result


def _chunk_sized_blobs(tree) -> list[bytes]:
    """This process's shards as bytes: the objects a checkpoint uploads, without its encoding."""
    return [
        np.asarray(sh.data).tobytes()
        for x in jax.tree.leaves(tree, is_leaf=nm.is_named_array)
        for sh in x.array.addressable_shards
        if sh.replica_id == 0
    ]


def boto3_client(endpoint: str):
    """A boto3 S3 client with a connection for each of the checkpoint code's threads (its default
    pool has 10, which would leave 6 of the 16 threads waiting or reconnecting)."""
    import boto3
    import botocore.config

    config = botocore.config.Config(max_pool_connections=IO_THREADS)
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", config=config)


def boto3_download(client, bucket: str, keys: list[str], pool) -> list[bytes]:
    return list(pool.map(lambda k: client.get_object(Bucket=bucket, Key=k)["Body"].read(), keys))


def boto3_upload(client, bucket: str, keys: list[str], blobs: list[bytes], pool) -> None:
    list(pool.map(lambda kb: client.put_object(Bucket=bucket, Key=kb[0], Body=kb[1]), zip(keys, blobs)))


def first_in_new_process(what: str, url: str, ckpt_mb: int) -> dict:
    """Wall and CPU seconds (``wall_s``, ``cpu_s``) of the first ``restore`` of the checkpoint at
    ``url`` (``what="restore"``) or of boto3's first download of the objects under ``url``
    (``"boto3"``) in a new process, after its imports, devices and connection are ready."""
    import json
    import subprocess
    import sys

    cmd = [sys.executable, __file__, "--first", what, "--url", url, "--ckpt-mb", str(ckpt_mb)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-2000:]}")
    return json.loads(lines[-1])


def _first(args) -> None:
    """``--first``: the child process of ``first_in_new_process``; prints its JSON."""
    import json
    import os

    from named.trainer.checkpoint import read_commit

    jax.devices()
    if args.first == "restore":
        mesh = nm.make_mesh(C.MESH)
        with jax.set_mesh(mesh):
            read_commit(args.url)  # the store's context and a connection, as a run has them by now
            t0, c0 = time.perf_counter(), time.process_time()
            # the target without values: this process holds no more memory than boto3's
            out, _ = restore(args.url, abstract_tree(args.ckpt_mb, mesh))
            jax.block_until_ready(out)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            assert _same(make_tree(args.ckpt_mb, mesh)[0], out)
    else:
        bucket, prefix = args.url.removeprefix("s3://").split("/", 1)
        client = boto3_client(os.environ["AWS_ENDPOINT_URL"])
        keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/")["Contents"])
        with concurrent.futures.ThreadPoolExecutor(IO_THREADS) as pool:
            t0, c0 = time.perf_counter(), time.process_time()
            got = boto3_download(client, bucket, keys, pool)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        assert sum(map(len, got)) == args.ckpt_mb << 20
    print(json.dumps({"wall_s": wall, "cpu_s": cpu}), flush=True)


def boto3_copy(endpoint: str, bucket: str, prefix: str, blobs: list[bytes]) -> dict:
    """Seconds for boto3 to PUT ``blobs`` as objects under ``prefix``, then GET them back, each
    with as many threads as the checkpoint uses: the plain client's figure for the same bytes."""
    client = boto3_client(endpoint)
    keys = [f"{prefix}/{i:05d}" for i in range(len(blobs))]
    with concurrent.futures.ThreadPoolExecutor(IO_THREADS) as pool:
        t0, c0 = time.perf_counter(), time.process_time()
        boto3_upload(client, bucket, keys, blobs, pool)
        put, put_cpu = time.perf_counter() - t0, time.process_time() - c0
        t0, c0 = time.perf_counter(), time.process_time()
        got = boto3_download(client, bucket, keys, pool)
        get, get_cpu = time.perf_counter() - t0, time.process_time() - c0
    assert [len(g) for g in got] == [len(b) for b in blobs]
    client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys]})
    print(
        f"boto3 {sum(map(len, blobs)) / 2**20:.0f} MiB: put {put:.2f}s (CPU {put_cpu:.2f}s), "
        f"get {get:.2f}s (CPU {get_cpu:.2f}s)",
        flush=True,
    )
    return {"put_s": put, "get_s": get, "put_cpu_s": put_cpu, "get_cpu_s": get_cpu}


def main_s3(args) -> dict:
    """Checkpoint save / restore to the local disk and to moto's S3 server, rounds taking turns."""
    import os
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_s3_checkpoints import MotoServer, s3_env  # the server the tests use

    if args.tiny:
        args.ckpt_mb, args.repeats = 4, 1
    machine = C.machine()  # the load average before the run
    server = MotoServer()
    server.create_bucket("bench")
    os.environ.update(s3_env(server.url))
    mesh = nm.make_mesh(C.MESH)
    tmp = Path(tempfile.mkdtemp(prefix="named-bench-", dir=args.tmp))
    local, s3, boto, first = [], [], [], []
    try:
        with jax.set_mesh(mesh):
            tree, _ = make_tree(args.ckpt_mb, mesh)
            blobs = _chunk_sized_blobs(tree)
            # one checkpoint and the same bytes as boto3's objects, for the new processes' rounds
            first_ckpt = str(save_checkpoint("s3://bench/first", 0, tree))
            client = boto3_client(server.url)
            with concurrent.futures.ThreadPoolExecutor(IO_THREADS) as pool:
                boto3_upload(client, "bench", [f"boto_first/{i:05d}" for i in range(len(blobs))], blobs, pool)
            for r in range(args.repeats):  # one save + restore on each side per round
                local.append(bench_checkpoint(tmp / f"round{r}", args.ckpt_mb, 1, mesh, tree, cold=not args.tiny))
                s3.append(bench_checkpoint(f"s3://bench/round{r}", args.ckpt_mb, 1, mesh, tree))
                boto.append(boto3_copy(server.url, "bench", f"boto{r}", blobs))
                first.append(
                    {
                        "restore": first_in_new_process("restore", first_ckpt, args.ckpt_mb),
                        "boto3": first_in_new_process("boto3", "s3://bench/boto_first", args.ckpt_mb),
                    }
                )
                print(
                    f"first in a new process: restore {first[-1]['restore']['wall_s']:.2f}s "
                    f"(CPU {first[-1]['restore']['cpu_s']:.2f}s), boto3 {first[-1]['boto3']['wall_s']:.2f}s "
                    f"(CPU {first[-1]['boto3']['cpu_s']:.2f}s)",
                    flush=True,
                )
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
            # this process's CPU time, all threads (the S3 server is another process)
            "save_cpu_s": C.summary([t for row in rows for t in row["save_cpu_s"]["all_s"]]),
            "restore_cpu_s": C.summary([t for row in rows for t in row["restore_cpu_s"]["all_s"]]),
            "save_MB_per_s": nbytes / 1e6 / C.summary(saves)["median_s"],
            "restore_MB_per_s": nbytes / 1e6 / C.summary(restores)["median_s"],
        }

    import moto

    result = {
        "benchmark": "data_ckpt_s3",
        "command": C.command_line(),
        "machine": machine,
        "s3_server": f"moto {moto.__version__} standalone server on 127.0.0.1 (in-memory)",
        "local": merged(local),
        "s3": merged(s3),
        "boto3": {
            "objects": len(blobs),
            "bytes": sum(len(b) for b in blobs),
            "put_s": C.summary([b["put_s"] for b in boto]),
            "get_s": C.summary([b["get_s"] for b in boto]),
            "put_cpu_s": C.summary([b["put_cpu_s"] for b in boto]),
            "get_cpu_s": C.summary([b["get_cpu_s"] for b in boto]),
        },
        "load_average_1min_per_round": [row["load_average_1min_per_round"][0] for row in s3],
        # the first restore and boto3's first download, each in a new process (rounds taking turns)
        "first_in_new_process": {
            **{
                f"{side}_{k}": C.summary([row[side][f"{k}_s"] for row in first])
                for side in ("restore", "boto3")
                for k in ("wall", "cpu")
            },
            "restore_over_boto3_per_round": [
                round(row["boto3"]["wall_s"] / row["restore"]["wall_s"], 2) for row in first
            ],
        },
    }
    f = result["first_in_new_process"]
    f["restore_over_boto3"] = f["boto3_wall"]["median_s"] / f["restore_wall"]["median_s"]
    for side, key, base in (("save", "save_s", "put_s"), ("restore", "restore_s", "get_s")):
        result[f"s3_{side}_over_boto3"] = result["boto3"][base]["median_s"] / result["s3"][key]["median_s"]
        # the same ratio round by round (each round's two sides ran one after the other)
        result[f"s3_{side}_over_boto3_per_round"] = [
            round(b[base] / row[key]["all_s"][0], 2) for b, row in zip(boto, s3)
        ]
    C.write_result("data_ckpt_s3" + ("_tiny" if args.tiny else ""), result, args.out)
    return result


if __name__ == "__main__":
    main()
