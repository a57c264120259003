"""Time to the first step's loss of ``named-train --config gpt2_nano``, and of Levanter's
``train_lm`` on the same model and text, from process start, by phase.

    .venv/bin/python bench/first_step.py              # both sides (the peer: bench/.venv-peer, built if missing)
    .venv/bin/python bench/first_step.py --no-peer    # ours only
    .venv/bin/python bench/first_step.py --tiny       # a 1-layer model of width 16 (smoke test)

Each launch is a fresh process. Ours runs the ``named-train`` entry point (``main_train``) on the
embedded corpus for one step, with evaluation, samples and checkpoints off. The peer runs
Levanter's own entry point, ``levanter.main.train_lm`` through ``levanter.config.main`` with a YAML
config, as a Levanter user launches it, in its own virtual environment (``bench/.venv-peer``, built
as bench/peer.py builds it; skipped, with the reason, where that fails or with ``--no-build``). The
time runs from just before the process is started to the moment its first loss reaches this script:
our ``[train 1] loss=`` line; for the peer, the ``train/loss`` record of step 0 that its
``json_logger`` tracker logs. Inside, each process notes when Python starts running its code and
when the training modules are imported (ours: the CLI module, which imports the rest lazily; the
peer: ``levanter`` and ``levanter.main.train_lm``), and sums JAX's own compile events (tracing,
lowering to MLIR, XLA's backend compile, reads from the persistent compilation cache), so a launch
splits into: interpreter start, imports, compilation, and the rest (config checks, data, model and
optimizer init, the first batch and the step itself).

The same model on both sides: GPT-2 with ``config/gpt2_nano.yaml``'s shape (layers, heads,
width, positions), sequence length, batch and vocabulary (the byte tokenizer's 257 ids padded to
384), f32, tied embeddings, no dropout, no gradient checkpointing, AdamW with the same rate,
weight decay, warm-up fraction and clipping, on the same 8 fake CPU devices (``_common``). The
layouts are each side's default: ours as gpt2_nano says (batch over the 8 devices, parameters
replicated); Levanter's default mesh (FSDP: parameters and optimizer state split over ``embed``,
batch over the same axis). The same text: the tokens our launch reads (this Python's standard
library, cut as gpt2_nano's ``data.stdlib_bytes`` says) are written once as a JSON Lines file of
space-separated ids that Levanter reads through a word-level ``tokenizer.json`` mapping each id to
itself (one id per token, eos appended by Levanter as ours appends it). Both sides read a ready
token cache: an untimed launch of each side builds its cache first (ours: ``data.cache_dir``;
Levanter's: its ``data.cache_dir`` under the temporary folder; with ``--tiny``, ours is built by
this script instead, which saves the smoke test a compile). The peer runs with
``HF_HUB_OFFLINE=1``: this machine has no network, and the tokenizer and model config it needs
are local files.

Three kinds of launch take turns, ``--repeats`` rounds, each side after the other within a kind:
without the persistent compilation cache; with an empty cache directory
(``JAX_COMPILATION_CACHE_DIR``, what a first launch with the cache pays to fill it; one directory
per side); and with the cache the previous launch filled (a second launch). The cache is JAX's
own, switched on by the environment variable alone, with JAX's defaults (programs that compile in
under a second are not kept). With the cache on, ``named-train`` compiles for XLA:CPU with
``named._compat.CACHE_SAFE_CPU_FLAG`` (without it, programs loaded back from the cache deadlocked
on these 8 devices); Levanter runs as it is.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common as C  # sets XLA_FLAGS (8 devices), which the launches inherit
import numpy as np
from peer import PEER_DISTS, PEER_PY, ensure_peer_venv

# What both sides' launches run first: the time since the driver started the process, and the
# sum of JAX's compile events by kind.
PREAMBLE = r"""
import collections, json, logging, os, sys, time
t0 = float(os.environ["FIRST_STEP_T0"])
marks = {"python_started_s": time.time() - t0}
import jax
events = collections.defaultdict(float)
jax.monitoring.register_event_duration_secs_listener(lambda e, d, **kw: events.__setitem__(e, events[e] + d))
"""

CHILD = (
    PREAMBLE
    + r"""
from named.trainer.commands.cli import main_train
marks["imported_s"] = time.time() - t0
sys.argv = ["named-train", *json.loads(os.environ["FIRST_STEP_ARGS"])]
try:
    main_train()
finally:
    print("FIRST_STEP " + json.dumps({"marks": marks, "events": events}), file=sys.stderr, flush=True)
"""
)

# The peer: Levanter's train_lm as its CLI runs it. Its json_logger tracker logs every metric as a
# JSON record; the first "train/loss" record is the first step's loss, read back from the devices.
PEER_CHILD = (
    PREAMBLE
    + r"""
import levanter
import levanter.main.train_lm as train_lm
marks["imported_s"] = time.time() - t0
class FirstLoss(logging.Handler):
    def emit(self, record):
        if '"train/loss"' in record.getMessage() and not marks.get("reported"):
            marks["reported"] = 1
            print("[peer 1] loss " + record.getMessage(), flush=True)
            print("FIRST_STEP " + json.dumps({"marks": marks, "events": events}), file=sys.stderr, flush=True)
tracker_log = logging.getLogger("levanter.json_logger")
tracker_log.setLevel(logging.INFO)
tracker_log.addHandler(FirstLoss())
sys.argv = ["train_lm", *json.loads(os.environ["FIRST_STEP_ARGS"])]
levanter.config.main(train_lm.main)()
"""
)
FIRST_LOSS = {"named": "[train 1] loss=", "levanter": "[peer 1] loss "}

COMPILE_EVENTS = ("jaxpr_trace_duration", "jaxpr_to_mlir_module_duration", "backend_compile_duration")
CACHE_EVENTS = ("cache_retrieval_time_sec",)


def launch(side: str, args: list[str], env: dict) -> dict:
    """One launch of ``side`` (``named`` or ``levanter``) with ``args``: its first loss and phases.

    Recorded, not raised: a launch that aborts is a result too (see docs/benchmarks.md §12); one
    that aborts after its first loss keeps its times and says why it ended (``aborted_after``)."""
    python, child = (sys.executable, CHILD) if side == "named" else (str(PEER_PY), PEER_CHILD)
    t0 = time.time()
    env = {**env, "FIRST_STEP_T0": repr(t0), "FIRST_STEP_ARGS": json.dumps(args)}
    with tempfile.TemporaryFile("w+") as stderr:  # a file: a chatty child never blocks on a full pipe
        proc = subprocess.Popen([python, "-c", child], env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
        first = None
        for line in proc.stdout:
            if first is None and line.startswith(FIRST_LOSS[side]):
                first = time.time() - t0
        proc.wait()
        stderr.seek(0)
        err = stderr.read().splitlines()
    report = [line for line in err if line.startswith("FIRST_STEP ")]
    others = [ln for ln in err if not ln.startswith("FIRST_STEP ")]
    why = [ln for ln in others if ln.startswith(("F", "E", "Traceback")) or "Error" in ln] or others or [""]
    ended = f"exit {proc.returncode}: {why[0][:300]}"
    if first is None or not report:
        return {"failed": ended}
    inner = json.loads(report[-1][len("FIRST_STEP ") :])
    events = inner["events"]
    compile_s = sum(v for k, v in events.items() if k.endswith(COMPILE_EVENTS))
    cache_s = sum(v for k, v in events.items() if k.endswith(CACHE_EVENTS))
    marks = inner["marks"]
    run = {
        "first_loss_s": first,
        "python_started_s": marks["python_started_s"],
        "imports_s": marks["imported_s"] - marks["python_started_s"],
        "compile_s": compile_s,
        "cache_read_s": cache_s,
        "rest_s": first - marks["imported_s"] - compile_s - cache_s,
    }
    return run | ({"aborted_after": ended} if proc.returncode != 0 else {})


def _summary(rows: list[dict], phases) -> dict:
    ok = [run for run in rows if "failed" not in run]
    out = {p: statistics.median(run[p] for run in ok) for p in phases} if ok else {}
    return out | {
        "launches": len(rows),
        "failed": [run["failed"] for run in rows if "failed" in run],
        "aborted_after_first_loss": [run["aborted_after"] for run in rows if "aborted_after" in run],
        "all": rows,
    }


def our_args(tiny: bool) -> list[str]:
    train = ["--config", "gpt2_nano", "--trainer.num_train_steps", "1", "--trainer.log_interval", "1"]
    train += ["--trainer.eval_interval", "0", "--trainer.sample_interval", "0", "--trainer.progress_bar", "false"]
    train += ["--checkpoint.interval", "0"]
    if tiny:
        train += ["--model.n_layer", "1", "--model.n_embd", "16", "--model.n_head", "2"]
    return train


def our_tokens(train: list[str]) -> np.ndarray:
    """The tokens our launch ``train`` reads: its token cache (``data.cache_dir``), built here if missing."""
    from named.trainer.config import load_config
    from named.trainer.config.read import resolve_config
    from named.trainer.data import ByteTokenizer, cached_tokens, resolve_sources

    cfg = load_config(resolve_config("gpt2_nano"), train[2:])
    files = resolve_sources(cfg.data.train, stdlib_bytes=cfg.data.stdlib_bytes)
    return np.asarray(cached_tokens(files, ByteTokenizer(), cfg.data.cache_dir))


def peer_config(folder: Path, train: list[str]) -> Path:
    """Levanter's ``train_lm`` config for the model, batch and text of our launch ``train``, with
    the corpus and tokenizer it reads, written under ``folder``; returns the config's path."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from named.trainer.config import load_config
    from named.trainer.config.read import resolve_config
    from named.trainer.config.sections import VOCAB_MULTIPLE
    from named.trainer.data import ByteTokenizer

    cfg = load_config(resolve_config("gpt2_nano"), train[2:])
    m, tok = cfg.model, ByteTokenizer()
    assert (m.vocab_size, m.dropout, m.remat, m.tie_word_embeddings, m.n_inner) == (None, 0.0, "none", True, None)
    assert cfg.data.train == ["stdlib"] and cfg.trainer.microbatches == 1
    vocab = -(-tok.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    # The tokens our launch reads, one document per line without its eos (Levanter appends the
    # tokenizer's eos to every document, as ours does).
    tokens = our_tokens(train)
    ends = np.flatnonzero(tokens == tok.eos_id)
    corpus = folder / "corpus.jsonl"
    with corpus.open("w") as f:
        for start, end in zip([0, *(ends[:-1] + 1)], ends, strict=True):
            f.write(json.dumps({"text": " ".join(map(str, tokens[start:end].tolist()))}) + "\n")
    # A word-level tokenizer.json: the text "104 105" is the ids [104, 105]; ids past the byte
    # tokenizer's pad the vocabulary to ours, so that both embeddings have the same rows.
    words = {str(i): i for i in range(tok.vocab_size)} | {f"<pad_{i}>": i for i in range(tok.vocab_size, vocab)}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token=f"<pad_{tok.vocab_size}>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (folder / "tokenizer").mkdir()
    tokenizer.save(str(folder / "tokenizer" / "tokenizer.json"))
    (folder / "tokenizer" / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": str(tok.eos_id)})
    )
    o = cfg.optimizer
    config = {
        "data": {
            "tokenizer": str(folder / "tokenizer"),
            "cache_dir": str(folder / "levanter-cache"),
            "components": {"stdlib": {"source": {"type": "url", "train_urls": [str(corpus)]}}},
        },
        "model": {
            "type": "gpt2",
            "max_seq_len": m.n_positions,
            "hidden_dim": m.n_embd,
            "num_layers": m.n_layer,
            "num_heads": m.n_head,
            "layer_norm_epsilon": m.layer_norm_epsilon,
            "gradient_checkpointing": False,
            "tokenizer": str(folder / "tokenizer"),  # its HF converter's tokenizer: local, not the Hub's gpt2
        },
        "train_seq_len": cfg.data.seq_len,
        "trainer": {
            "seed": cfg.trainer.seed,
            "mp": "p=f32,c=f32",
            "train_batch_size": cfg.trainer.train_batch_size,
            "num_train_steps": 1,
            "steps_per_eval": 1_000_000,
            "require_accelerator": False,
            "tracker": {"type": "json_logger"},
            "log_dir": str(folder / "levanter-logs"),
            "checkpointer": {"base_path": str(folder / "levanter-checkpoints"), "save_interval": "1000h"},
        },
        "optimizer": {
            "learning_rate": o.learning_rate,
            "weight_decay": o.weight_decay,
            "beta1": o.beta1,
            "beta2": o.beta2,
            "epsilon": o.epsilon,
            "max_grad_norm": o.max_grad_norm,
            "warmup": o.warmup_steps,
            "lr_schedule": o.schedule,
        },
    }
    path = folder / "train_lm.yaml"
    path.write_text(json.dumps(config, indent=2))  # JSON is YAML
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="a 1-layer model of width 16 (smoke test)")
    ap.add_argument("--no-peer", action="store_true", help="time named-train alone")
    ap.add_argument("--no-build", action="store_true", help="skip the peer (with a message) if its venv is missing")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    machine = C.machine()  # the load average before the run
    tmp = Path(tempfile.mkdtemp(prefix="named-bench-"))
    train = our_args(args.tiny)
    base = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    sides: dict[str, list[str]] = {"named": train}
    peer: dict = {"skipped": "--no-peer"} if args.no_peer else {}
    if not args.no_peer:
        if args.no_build and not PEER_PY.exists():
            ok, why = False, f"no {PEER_PY.parent.parent.name} (--no-build)"
        else:
            ok, why = ensure_peer_venv()
        if ok:
            sides["levanter"] = ["--config_path", str(peer_config(tmp, train))]
        else:
            peer = {"skipped": why}
            print(f"peer skipped: {why}", flush=True)
    env = {"named": base, "levanter": {**base, "HF_HUB_OFFLINE": "1"}}
    kinds = ("no persistent cache", "empty cache (first launch)", "warm cache")
    runs = {side: {kind: [] for kind in kinds} for side in sides}
    warmup = {}
    try:
        for side, side_args in sides.items():  # builds each side's token cache, untimed
            if side == "named" and args.tiny:  # the smoke test: the cache built here, not by a fourth compile
                our_tokens(train)
                warmup[side] = {"token cache": "built in the driver (--tiny)"}
                continue
            run = launch(side, [*side_args, *_run_dir(side, tmp / f"warmup-{side}")], env[side])
            warmup[side] = run
            print(f"warm-up {side}: {run.get('failed') or 'ok'}", flush=True)
        for r in range(args.repeats):
            for kind in kinds:
                for side, side_args in sides.items():
                    cache = {"JAX_COMPILATION_CACHE_DIR": str(tmp / f"cache-{side}-{r}")} if kind != kinds[0] else {}
                    run_dir = tmp / f"run-{side}-{r}-{kinds.index(kind)}"
                    run = launch(side, [*side_args, *_run_dir(side, run_dir)], {**env[side], **cache})
                    runs[side][kind].append(run)
                    said = run["failed"] if "failed" in run else f"first loss after {run['first_loss_s']:.1f}s"
                    print(f"round {r + 1}: {kind}: {side}: {said}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    phases = ("first_loss_s", "python_started_s", "imports_s", "compile_s", "cache_read_s", "rest_s")
    launches = {
        side: {kind: _summary(rows, phases) for kind, rows in by_kind.items()} for side, by_kind in runs.items()
    }
    if "levanter" in launches:
        peer = {"launches": launches["levanter"], "warmup": warmup["levanter"], "versions": _peer_versions()}
        peer["named_over_levanter"] = {
            kind: launches["named"][kind]["first_loss_s"] / launches["levanter"][kind]["first_loss_s"]
            for kind in kinds
            if "first_loss_s" in launches["named"][kind] and "first_loss_s" in launches["levanter"][kind]
        }
    result = {
        "benchmark": "first_step",
        "command": C.command_line(),
        "machine": machine,
        "config": "gpt2_nano" + (" (tiny: 1 layer, width 16)" if args.tiny else ""),
        "repeats": args.repeats,
        "launches": launches["named"],
        "warmup": warmup["named"],
        "peer": peer,
    }
    C.write_result("first_step" + ("_tiny" if args.tiny else ""), result, args.out)
    return result


def _run_dir(side: str, folder: Path) -> list[str]:
    """Where a launch of ``side`` writes (ours: its run dir; Levanter's goes under its config's folders)."""
    return ["--trainer.run_dir", str(folder)] if side == "named" else []


def _peer_versions() -> dict:
    code = f"import importlib.metadata as m, json; print(json.dumps({{d: m.version(d) for d in {PEER_DISTS!r}}}))"
    return json.loads(subprocess.run([str(PEER_PY), "-c", code], capture_output=True, text=True, check=True).stdout)


if __name__ == "__main__":
    main()
