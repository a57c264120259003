"""Greedy decoding with a KV cache: ``models.generate`` (and ``continue_ids``, what ``named-sample``
calls) against transformers' ``generate`` on the same Hugging Face folders.

    .venv/bin/python bench/decode.py
    .venv/bin/python bench/decode.py --tiny

For a small Llama and a small GPT-2 (random weights saved with ``save_pretrained``, then loaded by
``models.load_pretrained``: the same folder on both sides), a prompt of ``--prompt`` random tokens
is continued by ``--new`` tokens, greedily, with the KV cache, at batch 1 and batch 8. Sides take
turns in this one process (``_common.alternate``): ours, transformers, ours, ... Reported per side:
tokens/s (new tokens of all rows / wall time of the call, medians) and time to first token (a call
for one new token: the prefill and the first token, read back to the host).

Both sides must give the same tokens (greedy, the same number of new tokens: transformers is held
to ``min_new_tokens``); the script fails after writing its result when they do not. CPU time is
this process's (``time.process_time``: user + system time of all its threads, XLA's and torch's
included), per call; the load average is printed before and after each family.

Ours runs on the default device (one of the 8 fake CPU devices, no mapping); transformers on
``--torch-threads`` CPU threads (default 1, recorded): on this shared 2-core machine torch's
default of 2 threads made its decoding 20-40x slower (its threads wait on each other for cores
that other work holds), so the default is the peer's faster setting. Every timed call of ours must reuse
its compiled program: the script counts XLA compilations during the timed calls and records them
(0 expected; tests/test_generate.py checks the same without timing).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import _common as C  # sets XLA_FLAGS before jax is imported
import jax
import jax.numpy as jnp
import numpy as np

import named as nm
from named import models
from named.trainer.loop.generate import continue_ids

LLAMA = dict(
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=8192,
    max_position_embeddings=512,
)
GPT2 = dict(n_layer=4, n_head=4, n_embd=256, n_positions=512, vocab_size=8192, bos_token_id=0, eos_token_id=0)
TINY = {
    "llama": dict(LLAMA, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4),
    "gpt2": dict(GPT2, n_layer=1, n_embd=32),
}


def hf_folder(family: str, sizes: dict, root: Path) -> tuple[object, Path]:
    import torch
    import transformers

    torch.manual_seed(0)
    if family == "llama":
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes))
    else:
        hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**sizes))
    hf.eval()
    folder = root / family
    hf.save_pretrained(folder)
    return hf, folder


class _Compiles:
    """Counts XLA compilations (or persistent-cache hits) while it is on."""

    def __init__(self):
        self.n = 0

    def __call__(self, event: str, duration: float, **kw) -> None:
        if event.endswith(("backend_compile_duration", "cache_retrieval_time_sec")):
            self.n += 1


def bench_family(family: str, sizes: dict, root: Path, batches, prompt_len: int, new: int, rounds: int) -> dict:
    import torch

    hf, folder = hf_folder(family, sizes, root)
    config, model = models.load_pretrained(folder)
    vocab = config.vocab_size
    rng = np.random.default_rng(0)
    prompts = {b: rng.integers(1, vocab, size=(b, prompt_len)) for b in batches}

    def ours(b: int, n: int):
        ids = nm.named(jnp.asarray(prompts[b], jnp.int32), ("batch", "position"))
        return lambda: np.asarray(models.generate(model, ids, n, temperature=0).array)

    def sample(n: int):  # named-sample's call: one prompt, a list of new ids back
        return lambda: continue_ids(model, prompts[1][0].tolist(), n)

    def theirs(b: int, n: int):
        prompt = torch.tensor(prompts[b])

        def run():
            with torch.no_grad():
                return hf.generate(
                    prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, use_cache=True, pad_token_id=0
                ).numpy()

        return run

    sides = {}
    for b in batches:
        sides[f"named b{b}"] = ours(b, new)
        sides[f"transformers b{b}"] = theirs(b, new)
        sides[f"named b{b} ttft"] = ours(b, 1)
        sides[f"transformers b{b} ttft"] = theirs(b, 1)
    sides["named-sample b1"] = sample(new)
    agree = {}
    print(f"{family}: load average {C.load_average()}", flush=True)
    for b in batches:  # warm-up (compiles ours), and the two sides' tokens compared
        a, h = sides[f"named b{b}"](), sides[f"transformers b{b}"]()
        agree[b] = float((a == h).mean()) if a.shape == h.shape else 0.0
        sides[f"named b{b} ttft"](), sides[f"transformers b{b} ttft"]()
    sides["named-sample b1"]()
    compiles = _Compiles()
    jax.monitoring.register_event_duration_secs_listener(compiles)
    try:
        wall, cpu = C.alternate(sides, rounds, 1)
    finally:
        jax.monitoring.unregister_event_duration_listener(compiles)
    rows = []
    for b in batches:
        for side in ("named", "transformers"):
            w, t = statistics.median(wall[f"{side} b{b}"]), statistics.median(wall[f"{side} b{b} ttft"])
            rows.append(
                {
                    "side": side,
                    "batch": b,
                    "tokens_per_s": b * new / w,
                    "call_s": C.summary(wall[f"{side} b{b}"]),
                    "call_cpu_s": statistics.median(cpu[f"{side} b{b}"]),
                    "ttft_s": C.summary(wall[f"{side} b{b} ttft"]),
                    "ttft_median_s": t,
                }
            )
    w = statistics.median(wall["named-sample b1"])
    rows.append(
        {
            "side": "named-sample (continue_ids)",
            "batch": 1,
            "tokens_per_s": new / w,
            "call_s": C.summary(wall["named-sample b1"]),
            "call_cpu_s": statistics.median(cpu["named-sample b1"]),
        }
    )
    ratio = {b: rows[2 * i]["tokens_per_s"] / rows[2 * i + 1]["tokens_per_s"] for i, b in enumerate(batches)}
    cpu_ratio = {b: rows[2 * i + 1]["call_cpu_s"] / rows[2 * i]["call_cpu_s"] for i, b in enumerate(batches)}
    print(f"{family}: load average {C.load_average()} after timing", flush=True)
    return {
        "family": family,
        "sizes": sizes,
        "params": C.count_params(model),
        "rows": rows,
        "named_over_transformers_tokens_per_s": ratio,
        "transformers_over_named_cpu_per_call": cpu_ratio,
        "greedy_tokens_agree": agree,
        "compiles_during_timing": compiles.n,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    ap.add_argument("--new", type=int, default=128, help="new tokens per call")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--torch-threads", type=int, default=1, help="torch.set_num_threads for transformers")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import torch
    import transformers

    torch.set_num_threads(args.torch_threads)
    machine = C.machine()  # the load average before the run
    sizes, batches = {"llama": LLAMA, "gpt2": GPT2}, (1, 8)
    if args.tiny:
        sizes, batches, args.new, args.rounds = TINY, (1, 2), 4, 1
    with tempfile.TemporaryDirectory(prefix="named-bench-") as tmp:
        families = [
            bench_family(f, s, Path(tmp), batches, args.prompt, args.new, args.rounds) for f, s in sizes.items()
        ]
    result = {
        "benchmark": "decode",
        "command": C.command_line(),
        "machine": machine,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "prompt_tokens": args.prompt,
        "new_tokens": args.new,
        "rounds": args.rounds,
        "goal": "CPU time per call: transformers >= 1.5 x named, every family, batch 1 and 8; the same tokens;"
        " no compilation while timing",
        "families": families,
    }
    C.write_result("decode" + ("_tiny" if args.tiny else ""), result, args.out)
    differ = {(f["family"], b): a for f in families for b, a in f["greedy_tokens_agree"].items() if a != 1.0}
    if differ:
        raise SystemExit(f"the two sides gave different tokens (fraction equal): {differ}")
    return result


if __name__ == "__main__":
    main()
