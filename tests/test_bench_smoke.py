"""The CPU benchmarks in bench/ still run (smallest settings, results to a temporary directory).

No timing is asserted: these only keep the scripts from rotting. The numbers live in
docs/benchmarks.md and come from `make bench`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

pytestmark = pytest.mark.slow


def _load(tmp_path: Path, name: str) -> dict:
    return json.loads((tmp_path / f"{name}.json").read_text())


def test_overhead_tiny(tmp_path):
    import overhead

    overhead.main(["--tiny", "--out", str(tmp_path)])
    r = _load(tmp_path, "overhead_f32_tiny")
    assert r["params"]["named"] == r["params"]["plain"]  # the same model on both sides
    assert r["step_ratio_named_over_plain"] > 0
    first = r["losses_first_and_last"]
    assert abs(first["named"][0] - first["plain"][0]) < 0.1  # both start near log(vocab)
    assert r["hlo"]["named"]["collectives"]["all-gather"]["count"] > 0  # FSDP gathers weights


def test_compile_depth_tiny(tmp_path):
    import compile_depth

    compile_depth.main(["--tiny", "--out", str(tmp_path)])
    r = _load(tmp_path, "compile_depth_tiny")
    assert [row["layers"] for row in r["rows"]] == [2, 4]


def test_memory_tiny(tmp_path):
    import memory

    memory.main(["--tiny", "--out", str(tmp_path)])
    row = _load(tmp_path, "memory_tiny")["rows"]["tiny"]
    m = row["memory"]
    assert m["peak_bytes"] == m["temp_size_in_bytes"] + m["argument_size_in_bytes"] + m["output_size_in_bytes"] - m["alias_size_in_bytes"]
    assert m["alias_size_in_bytes"] > 0  # the donated state aliases the outputs


def test_moe_tiny(tmp_path):
    import moe

    moe.main(["--tiny", "--out", str(tmp_path)])
    r = _load(tmp_path, "moe_tiny")["comparisons"]
    assert set(r["dispatch"]) == {"dropless", "dense"}
    assert "all-to-all" not in r["placement"]["replicated experts"]["collectives"]
    assert r["placement"]["EP auto"]["collectives"]["all-to-all"] > 0  # the tokens travel to their experts
    assert r["placement"]["EP explicit"]["collectives"]["all-to-all"] > 0

def test_data_ckpt_tiny(tmp_path):
    import data_ckpt

    data_ckpt.main(["--tiny", "--out", str(tmp_path), "--tmp", str(tmp_path)])
    r = _load(tmp_path, "data_ckpt_tiny")
    assert r["loader"][0]["tokens_per_s"]["median_s"] > 0
    assert r["checkpoint"]["save_MB_per_s"] > 0


def test_gpu_mfu_unrolled_forward_matches_scan():
    """The unrolled layers of bench/gpu_mfu.py compute what the model's scan computes."""
    import gpu_mfu

    import named as nm
    from named.models import Gpt2Config, Gpt2LMHeadModel, LlamaConfig, LlamaLMHeadModel

    ids = nm.named(np.random.default_rng(0).integers(0, 64, size=(2, 8), dtype=np.int32), ("batch", "position"))
    gpt2 = Gpt2LMHeadModel.init(Gpt2Config(n_layer=2, n_head=2, n_embd=16, n_positions=8, vocab_size=64), key=jax.random.key(0))
    llama = LlamaLMHeadModel.init(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                                              num_key_value_heads=1, vocab_size=64, max_position_embeddings=8),
                                  key=jax.random.key(1))
    for model in (gpt2, llama):
        want = eqx.filter_jit(lambda m, x: m(x))(model, ids)
        got = eqx.filter_jit(lambda m, x: gpu_mfu._forward_unrolled(m, x, "full"))(model, ids)
        np.testing.assert_allclose(got.rearrange(want.names).array, want.array, rtol=1e-5, atol=1e-5)


def test_gpu_mfu_driver_runs_a_sweep_and_prints_the_table(tmp_path, capsys):
    """The GPU sweep end to end at toy size on CPU: a worker subprocess, the JSON (with the
    jax version, cuDNN version and XLA flags beside the numbers) and the printed table."""
    import gpu_mfu

    gpu_mfu.main(["--model", "tiny", "--budget-s", "75", "--steps", "2", "--out", str(tmp_path)])
    r = _load(tmp_path, "gpu_mfu_tiny")
    best = r["best"]
    assert r["install"] == "named was importable" and best["tokens_per_s"] > 0 and 0 < best["mfu"] < 1
    assert best["jax"] == jax.__version__ and "cudnn" in best and "xla_gpu_enable_latency_hiding_scheduler" in best["xla_flags"]
    assert f"| tiny | {best['batch']} | none | scan | tuned |" in capsys.readouterr().out


def test_fetch_wheels_asks_for_what_pyproject_pins():
    import fetch_wheels

    reqs = fetch_wheels.requirements(with_tests=False)
    assert {r.split(">")[0].split("=")[0] for r in reqs} == {"jmp", "draccus", "setuptools", "wheel"}
    assert "pytest>=8" in fetch_wheels.requirements(with_tests=True)


def test_explicit_configs_one_config(tmp_path):
    import explicit_configs

    explicit_configs.main(["--configs", "gpt2_nano_fsdp_tp", "--out", str(tmp_path)])
    row = _load(tmp_path, "explicit_configs")["rows"]["gpt2_nano_fsdp_tp"]
    assert len(row["losses"]["explicit"]) == len(row["losses"]["auto"]) == 3
    assert row["max_relative_difference"] < 1e-5
