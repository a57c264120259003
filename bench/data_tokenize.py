"""Token-cache build throughput and memory, and mixture loader throughput.

    .venv/bin/python bench/data_tokenize.py                      # 100 MB corpus, then 1 GB for memory
    .venv/bin/python bench/data_tokenize.py --mb 100 --big-mb 0  # skip the 1 GB build
    .venv/bin/python bench/data_tokenize.py --tiny

Tokenizer: a GPT-2-style byte-level BPE ``tokenizer.json`` (vocabulary ``--vocab``, with
``<|endoftext|>``) trained with the ``tokenizers`` trainer on the stdlib corpus. Corpus: the
stdlib's ``.py`` files as documents, repeated into JSON Lines shards of ``--shard-mb`` MB up
to ``--mb`` MB.

- **Reference**: ``HFTokenizer.encode_batch`` alone on the same documents, already in memory,
  in batches of the size the pipeline uses (the library's own thread pool on every core),
  before and again after the pipeline runs.
- **Pipeline**: ``cached_tokens`` from the files to a finished cache file (read, parse JSON,
  tokenise, range-check, write, fsync, rename), in a fresh process per run, in three modes:
  one pass in one process; shards with one worker; shards with one worker per core. Recorded:
  wall-clock tokens/s; CPU seconds per million tokens (the process and its workers; steadier
  than wall time on a shared machine); the builder's RSS after its imports and its peak during
  the build (``VmHWM``, reset after the imports); the largest worker's peak (``getrusage``,
  its own imports included).
- **Memory**: the sharded build again on ``--big-mb`` MB (10x), to show peak RSS does not grow
  with the corpus.
- **Loader**: ``TrainBatches.batch_at`` over a 3-source ``Mixture`` of memory-mapped caches
  (weights 5:3:2), seq 1024, batch 32, in one process: tokens of finished batches per second.

Runs take turns with nothing else of ours; the machine is shared, so the load average at start
and end is recorded with the numbers.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

from named.internal import process_cpu_count  # noqa: E402
from named.trainer.data import HFTokenizer, Mixture, Sequences, TokenStream, TrainBatches, _cache, _shards, stdlib_files  # noqa: E402  # noqa: E402
from named.trainer.data._encode import ENCODE_CHUNK_CHARS as _PIPELINE_CHARS  # noqa: E402
from named.trainer.data._sources import SourceFile  # noqa: E402


def train_tokenizer(folder: Path, vocab: int) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train([str(p) for p in stdlib_files(8_000_000)], trainer)
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return path


def write_corpus(folder: Path, total_mb: int, shard_mb: int) -> list[Path]:
    docs = [p.read_text("utf-8", errors="replace") for p in stdlib_files(8_000_000)]
    lines = [(json.dumps({"text": d}) + "\n").encode() for d in docs]
    folder.mkdir(parents=True, exist_ok=True)
    shards, written, i = [], 0, 0
    while written < total_mb * 10**6:
        path = folder / f"shard-{len(shards):04d}.jsonl"
        size = 0
        with path.open("wb") as f:
            while size < shard_mb * 10**6 and written + size < total_mb * 10**6:
                f.write(lines[i % len(lines)])
                size += len(lines[i % len(lines)])
                i += 1
        shards.append(path)
        written += size
    return shards


def reference(tokenizer_path: Path, shards: list[Path]) -> dict:
    tok = HFTokenizer(tokenizer_path)
    texts = [json.loads(line)["text"] for s in shards for line in s.open("rb")]
    batches, batch, size = [], [], 0
    for t in texts:
        batch.append(t)
        size += len(t)
        if size >= _PIPELINE_CHARS:
            batches.append(batch)
            batch, size = [], 0
    batches.append(batch)
    t0, c0 = time.perf_counter(), time.process_time()
    tokens = sum(len(ids) for b in batches for ids in tok.encode_batch(b))
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "cpu_s_per_M_tokens": cpu / tokens * 1e6,
        "bytes_per_s": sum(s.stat().st_size for s in shards) / seconds,
    }


def build_child(tokenizer_path: str, cache: str, mode: str, shards: list[str]) -> dict:
    """One cache build in this (fresh) process; prints its figures as JSON."""
    _shards.SHARDED_MIN_BYTES = 1 << 62 if mode == "single" else 0
    _shards.WORKERS = 1 if mode == "shards-1" else None
    tok = HFTokenizer(tokenizer_path)
    files = [SourceFile(Path(s).resolve(), "jsonl") for s in shards]
    before = _rss_mb("VmRSS")  # imports (jax, with named) and the tokenizer
    Path("/proc/self/clear_refs").write_text("5")  # restart the peak (VmHWM) from here
    t0, c0 = time.perf_counter(), _cpu_s()
    tokens = _cache.cached_tokens(files, tok, cache)
    seconds, cpu = time.perf_counter() - t0, _cpu_s() - c0
    return {
        "mode": mode,
        "tokens": int(len(tokens)),
        "seconds": seconds,
        "tokens_per_s": len(tokens) / seconds,
        "bytes_per_s": sum(Path(s).stat().st_size for s in shards) / seconds,
        "cpu_s_per_M_tokens": cpu / len(tokens) * 1e6,
        "rss_mb_before_build": before,
        "peak_rss_mb_builder": _rss_mb("VmHWM"),
        "peak_rss_mb_largest_worker": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
        "workers": 1 if mode != "shards-all" else min(process_cpu_count(), len(shards)),
    }


def _rss_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _cpu_s() -> float:
    """CPU seconds of this process and its finished children (the workers): on a shared machine
    the steadier measure of the work done."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def pipeline(tokenizer_path: Path, shards: list[Path], tmp: Path, mode: str) -> dict:
    cache = tmp / f"cache-{mode}"
    shutil.rmtree(cache, ignore_errors=True)
    cmd = [sys.executable, __file__, "--child", mode, str(tokenizer_path), str(cache), *map(str, shards)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    result["cache_file"] = str(next(cache.glob("tokens-*")))
    return result


def loader(caches: list[str], steps: int, seq_len: int = 1024, batch: int = 32) -> dict:
    sources = [Sequences(TokenStream([np.memmap(c, dtype=np.uint16, mode="r")], 0), seq_len) for c in caches]
    mix = Mixture(["a", "b", "c"], sources, [5, 3, 2])
    batches = TrainBatches(mix, batch_size=batch, seed=0)
    batches.batch_at(0)
    t0 = time.perf_counter()
    for s in range(1, steps + 1):
        batches.batch_at(s)
    seconds = time.perf_counter() - t0
    return {
        "seq_len": seq_len,
        "batch_size": batch,
        "steps": steps,
        "tokens_per_s": steps * batch * seq_len / seconds,
        "rows_per_source": [len(s) for s in sources],
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=100, help="corpus size for the throughput runs (MB)")
    ap.add_argument("--big-mb", type=int, default=1000, help="corpus size for the memory run (MB; 0 to skip)")
    ap.add_argument("--shard-mb", type=int, default=10, help="size of each JSONL file (MB)")
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=2000, help="loader batches timed")
    ap.add_argument("--tmp", default=None)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.tiny:
        args.mb, args.big_mb, args.shard_mb, args.vocab, args.steps = 4, 0, 1, 1024, 50
    tmp = Path(tempfile.mkdtemp(prefix="named-bench-data-", dir=args.tmp))
    try:
        result = {
            "benchmark": "data_tokenize",
            "command": C.command_line(),
            "machine": C.machine(),
            "corpus_mb": args.mb,
            "shard_mb": args.shard_mb,
            "vocab": args.vocab,
        }
        t0 = time.perf_counter()
        tokenizer_path = train_tokenizer(tmp, args.vocab)
        result["tokenizer_train_s"] = time.perf_counter() - t0
        shards = write_corpus(tmp / "corpus", args.mb, args.shard_mb)
        result["reference"] = ref = reference(tokenizer_path, shards)
        print(
            f"encode_batch alone: {ref['tokens_per_s'] / 1e6:.2f}M "
            f"tokens/s, CPU {ref['cpu_s_per_M_tokens']:.2f}s/M tokens",
            flush=True,
        )
        runs = {}
        for mode in ("single", "shards-1", "shards-all"):
            runs[mode] = r = pipeline(tokenizer_path, shards, tmp, mode)
            r["ratio_to_reference"] = r["tokens_per_s"] / ref["tokens_per_s"]
            r["cpu_ratio_reference_over_pipeline"] = ref["cpu_s_per_M_tokens"] / r["cpu_s_per_M_tokens"]
            print(
                f"pipeline {mode}: {r['tokens_per_s'] / 1e6:.2f}M tokens/s ({r['ratio_to_reference']:.2f}x; "
                f"CPU {r['cpu_s_per_M_tokens']:.2f}s/M tokens against {ref['cpu_s_per_M_tokens']:.2f}), "
                f"peak RSS {r['peak_rss_mb_builder']:.0f} MB, {r['rss_mb_before_build']:.0f} before (largest worker "
                f"{r['peak_rss_mb_largest_worker']:.0f} MB)",
                flush=True,
            )
        again = reference(tokenizer_path, shards)  # the machine is shared: the reference on both sides of the runs
        print(f"encode_batch alone, again: {again['tokens_per_s'] / 1e6:.2f}M tokens/s", flush=True)
        result["reference_after"] = again
        for r in runs.values():
            r["ratio_to_mean_reference"] = r["tokens_per_s"] / ((ref["tokens_per_s"] + again["tokens_per_s"]) / 2)
        same = len({Path(r["cache_file"]).read_bytes() for r in runs.values()}) == 1
        result["pipeline"], result["caches_identical"] = runs, same
        if args.big_mb:
            big = write_corpus(tmp / "big", args.big_mb, args.shard_mb)
            result["big"] = b = pipeline(tokenizer_path, big, tmp, "shards-all")
            b["corpus_mb"] = args.big_mb
            print(
                f"{args.big_mb} MB sharded build: {b['tokens_per_s'] / 1e6:.2f}M tokens/s, peak RSS "
                f"{b['peak_rss_mb_builder']:.0f} MB, {b['rss_mb_before_build']:.0f} before (largest worker "
                f"{b['peak_rss_mb_largest_worker']:.0f} MB)",
                flush=True,
            )
            shutil.rmtree(tmp / "big")
        cache = runs["single"]["cache_file"]
        result["loader"] = lo = loader([cache] * 3, args.steps)
        print(f"3-source mixture loader: {lo['tokens_per_s'] / 1e6:.1f}M tokens/s", flush=True)
        C.write_result("data_tokenize" + ("_tiny" if args.tiny else ""), result, args.out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(build_child(sys.argv[3], sys.argv[4], sys.argv[2], sys.argv[5:])))
    else:
        main()
