"""named-plan: parameters and an activation estimate by default (nothing compiled), the compiled
train step on request, a plan for devices this machine does not have, and the layout search."""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

import pytest

from named.trainer.commands import cli, plan
from named.trainer.config import load_config
from named.trainer.config.layout import Layout

CONFIG = Path(__file__).parent.parent / "config" / "gpt2_nano_fsdp.yaml"
SMALL = ["--model.n_layer", "1", "--data.seq_len", "32", "--trainer.train_batch_size", "8"]


def test_plan_report_lists_every_parameter_with_its_layout():
    text = plan.plan_report(load_config(CONFIG, SMALL))
    assert "mesh: {'data': 8}" in text
    assert ".wte.weight" in text and "vocab embed/data" in text
    assert "per device" in text and "train step" not in text  # the default compiles nothing


def test_plan_main_with_compile_reports_the_train_step(capsys):
    assert cli.main_plan(["--config_path", str(CONFIG), "--compile", *SMALL]) == 0
    out = capsys.readouterr().out
    step = out.split("train step (compiled on abstract inputs):")[1]
    assert re.search(r"^all-gather\s+data\s+\d+", step, re.M)  # FSDP gathers the weights over data
    assert "memory per device:" in step and "FLOPs per device:" in step
    assert "CPU buffer assignment" in step  # the caveat on compiled memory


def test_plan_main_reports_config_errors(capsys):
    assert cli.main_plan(["--config_path", str(CONFIG), "--trainer.no_such_key", "1"]) == 2
    assert "no_such_key" in capsys.readouterr().err


def test_help_lists_the_plan_flags(capsys):
    assert cli.main_plan(["--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--compile", "--devices", "--device-kind", "--device-memory", "--search", "--config NAME"):
        assert flag in out, flag


def test_logits_estimate_follows_the_formula():
    # GPT-2 nano, byte vocab rounded up to 384, seq 32; 8 sequences over data=8: 1 per device.
    # The logits and their gradient in float32: 2 * b * s * V * 4; a loss block of 128 holds 128 of V.
    # The FSDP head (384 x 128, float32) is held gathered, with its whole gradient, by both paths.
    for flags, vocab in (([], 384), (["--trainer.loss_block_size", "128"], 128)):
        text = plan.plan_report(load_config(CONFIG, [*SMALL, *flags]))
        got = float(re.search(r"logits per device \(estimate, one microbatch, [^)]*\): ([\d.]+) MiB", text).group(1))
        assert got == pytest.approx((2 * 1 * 32 * vocab * 4 + 2 * 384 * 128 * 4) / 2**20, abs=0.01)
        state = float(re.search(r"params \+ grads \+ moments: ([\d.]+) MiB per device", text).group(1))
        acts = float(re.search(r"remat none\): ([\d.]+) MiB", text).group(1))
        assert float(re.search(r"in all: ([\d.]+) MiB", text).group(1)) == pytest.approx(state + acts + got, abs=0.02)


def test_activation_estimate_follows_the_formula():
    # GPT-2 nano under FSDP+TP: 4 layers, width 128, 4 heads, seq 32; 8 sequences over 4 data
    # devices = 2 per device; heads over model=2. Planned for this CPU: per layer, per token and
    # unit of width, 8 float32 values replicated over TP and 28 split over it (what XLA:CPU's step
    # keeps, measured: tests/test_plan_memory.py), not Korthikanti et al.'s 10 + 24/t at 16-bit.
    cfg = load_config(
        Path(CONFIG).parent / "gpt2_nano_fsdp_tp.yaml", ["--data.seq_len", "32", "--trainer.train_batch_size", "8"]
    )
    s, b, h, t, L, a = 32, 2, 128, 2, 4, 4
    # at 32 positions (one block of keys) "auto" takes the XLA path on CPU, whose scores count: two
    # float32 [batch, heads/t, T, T] tensors per layer
    expected = L * s * b * h * (8 + 28 / t) * 4 + L * 2 * b * (a / t) * s * s * 4
    text = plan.plan_report(cfg)
    assert "attention: XLA (keeps [batch, heads, T, T] scores)" in text
    got = float(
        re.search(r"activations per device \(estimate, one microbatch, remat none\): ([\d.]+) MiB", text).group(1)
    )
    assert got == pytest.approx(expected / 2**20, abs=0.01)
    full = plan.plan_report(
        load_config(
            Path(CONFIG).parent / "gpt2_nano_fsdp_tp.yaml",
            ["--data.seq_len", "32", "--trainer.train_batch_size", "8", "--model.remat", "full"],
        )
    )
    got_full = float(re.search(r"remat full\): ([\d.]+) MiB", full).group(1))
    assert got_full == pytest.approx((2 * s * b * h * L + expected / L / 2) * 2 / 2**20, abs=0.01)


@pytest.mark.procs
def test_plan_for_a_device_count_this_process_does_not_have(capsys):
    # this process runs 8 devices; --devices 2 re-plans in a fresh process with 2 stand-ins
    code = cli.main_plan(["--config", "gpt2_nano", "--devices", "2", "--device-kind", "H100", *SMALL])
    assert code == 0
    assert cli.main_plan(["--config", "gpt2_nano", "--devices", "8", "--device-kind", "H100", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "mesh: {'data': 8}" in out and "planned for H100" in out and "of 74.5 GiB per device" in out


def test_plan_refuses_unknown_devices_and_sizes(capsys):
    assert cli.main_plan(["--config", "gpt2_nano", "--device-kind", "Z80", *SMALL]) == 2
    assert "Z80" in capsys.readouterr().err
    assert cli.main_plan(["--config", "gpt2_nano", "--device-memory", "lots", *SMALL]) == 2
    assert "lots" in capsys.readouterr().err
    assert cli.main_plan(["--config", "gpt2_nano", "--devices", "0", *SMALL]) == 2
    assert cli.main_plan(["--config", "gpt2_nano", "--devices", "8", "--search", *SMALL]) == 2  # stand-ins: no speeds
    assert "--device-kind" in capsys.readouterr().err
    assert cli.main_plan(["--config", "gpt2_nano", "--measure", "2", *SMALL]) == 2
    assert "give --search too" in capsys.readouterr().err
    assert cli.main_plan(["--config", "gpt2_nano", "--search", "--measure", "2", "--device-kind", "H100", *SMALL]) == 2
    assert "this machine's own devices" in capsys.readouterr().err


def test_stand_ins_compile_the_cheapest_machine_code_unless_the_user_chose():
    """Stand-in devices' programs are read, never run: their XLA flags turn LLVM's optimisation,
    XLA:CPU's fusion emitters and its parallel split of a program's code off (the README's search
    took 140 s, 96 s, 40 s, then 12 % less CPU, its ranking the same); the device count replaces
    one already there; an option the user set stays."""
    from named.internal import xla_knows_option

    emitters = ["--xla_cpu_use_fusion_emitters=false"] if xla_knows_option("xla_cpu_use_fusion_emitters") else []
    one_module = "--xla_cpu_parallel_codegen_split_count=1"
    split = [one_module] if xla_knows_option(one_module) else []
    flags = cli.stand_in_flags("--xla_force_host_platform_device_count=2 --xla_dump_to=d", 8).split()
    assert flags == [
        "--xla_dump_to=d",
        "--xla_backend_optimization_level=0",
        *emitters,
        *split,
        "--xla_force_host_platform_device_count=8",
    ]
    mine = cli.stand_in_flags("--xla_backend_optimization_level=3 --xla_cpu_use_fusion_emitters=true", 4).split()
    assert mine == [
        "--xla_backend_optimization_level=3",
        "--xla_cpu_use_fusion_emitters=true",
        *split,
        "--xla_force_host_platform_device_count=4",
    ]
    assert xla_knows_option("--xla_backend_optimization_level=0") and not xla_knows_option("--xla_no_such_option")


def test_absurd_device_counts_and_device_free_refusals_come_before_any_stand_in(monkeypatch, capsys):
    """--devices 2^31 used to abort in XLA's flag parser, 100000 to crash after 83 s, and 10000 to
    take minutes to reach a refusal that needs no devices (issue 30)."""

    def never(*args):
        raise AssertionError("devices were stood in for a plan that needs none")

    monkeypatch.setattr(cli, "stand_in_devices", never)
    monkeypatch.setattr(cli, "plan_in_child", never)
    for n in ("2147483648", "100000", "0"):
        assert cli.main_plan(["--config", "gpt2_nano", "--devices", n]) == 2
        assert f"--devices must be in [1, {cli.MAX_STAND_INS}], got {n}" in capsys.readouterr().err
    refusals = {  # flags: what the one error line says
        ("--devices", "10000"): "the microbatch of 16 sequences (trainer.train_batch_size=16 / trainer.microbatches=1) "
        "does not split over the 10000 devices of the batch mesh axes",
        ("--devices", "9", "--mesh.shape", "{data: -1, model: 2}"): "9 is not divisible by 2",
        ("--devices", "16", "--search"): "--search ranks layouts by a device's speeds: name it with --device-kind",
        ("--devices", "16", "--device-kind", "Z80"): "--device-kind 'Z80' is not in the device table",
        ("--devices", "16", "--model.n_headd", "2"): "--model.n_headd is not a key of the model section",
    }
    for flags, message in refusals.items():
        assert cli.main_plan(["--config", "gpt2_nano", *flags]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


def test_the_roofline_uses_the_peak_of_the_compute_dtype():
    from named.trainer.commands.plan_search import Roofline
    from named.trainer.loop import hardware

    h100, v5e = hardware.find("H100"), hardware.find("v5e")
    f32 = load_config(CONFIG)  # compute=float32
    bf16 = load_config(CONFIG, ["--trainer.precision", "params=float32,compute=bfloat16,output=float32"])
    assert (Roofline.of(f32, h100).peak_flops, Roofline.of(f32, h100).peak_kind) == (494e12, "TF32")
    assert (Roofline.of(bf16, h100).peak_flops, Roofline.of(bf16, h100).peak_kind) == (989e12, "bf16")
    # exact float32 runs on the CUDA cores; a TPU computes float32 as bf16 passes (one by default)
    assert h100.matmul_peak("float32", "highest") == (67e12, "float32")
    assert v5e.matmul_peak("float32") == (197e12, "bf16")
    assert v5e.matmul_peak("float32", "highest") == (197e12 / 6, "bf16 x6 passes")


def test_recomputation_ranks_after_the_same_layout_without_it_when_that_fits():
    from named.trainer.commands.plan_search import Candidate, Roofline, format_table, rank
    from named.trainer.loop import hardware

    roof = Roofline(hardware.find("H100"), 494e12, "TF32")
    gib = 2**30

    def layout(name, remat, flops, hbm, memory):  # XLA:CPU counts fewer HBM bytes for the recomputing program
        return Candidate(
            name,
            Layout({"data": 8}, {"batch": "data"}, {}, remat),
            flops=flops,
            hbm_bytes=hbm,
            comm_bytes=1e9 if name == "FSDP" else 1e6,
            memory=memory,
        )

    found = [
        layout("FSDP", "full", 1.3e12, 1e9, 1 * gib),
        layout("FSDP", "none", 1e12, 2e9, 2 * gib),
        layout("DP", "full", 1.3e12, 1e9, 9 * gib),
        layout("DP", "none", 1e12, 2e9, 20 * gib),
    ]
    ranked = rank(found, roof, memory_budget=10 * gib)
    # DP without recomputation is over the budget, so DP with it is the best layout; FSDP fits without it
    assert [(c.name, c.layout.remat) for c in ranked] == [
        ("DP", "full"),
        ("FSDP", "none"),
        ("FSDP", "full"),
        ("DP", "none"),
    ]
    assert ranked[1].seconds(roof)[1] == ranked[2].seconds(roof)[1] == 1e9 / roof.device.hbm_bandwidth  # the smaller
    # plenty of memory for all: each layout ranks before itself with recomputation, the best has none
    plenty = [(c.name, c.layout.remat) for c in rank(found, roof, memory_budget=80 * gib)]
    assert plenty[0] == ("DP", "none")
    assert all(plenty.index((name, "none")) < plenty.index((name, "full")) for name in ("DP", "FSDP"))
    header = format_table(ranked, roof, 10 * gib).splitlines()[0].split("  ")
    assert [h.strip() for h in header if h.strip()][3:] == [
        "mode",
        "gather",
        "remat",
        "microbatches",
        "loss block",
        "est. ms/step",
        "compute ms",
        "HBM ms",
        "comm ms",
        "memory GiB/device",
    ]


def test_ranked_for_a_cpu_each_layout_is_charged_its_own_hbm_count():
    # On a CPU the XLA:CPU program counted is the one that runs: recomputing, which moves fewer
    # bytes there, ranks first when it is faster by the estimate (docs/benchmarks.md section 2).
    from named.trainer.commands.plan_search import Candidate, Roofline, format_table, rank
    from named.trainer.loop.hardware import Device

    cpu = Device("this CPU", 20e9, 3e9, 1.2e9, 1.6e9, platform="cpu")
    roof = Roofline(cpu, 20e9, "f32")

    def layout(remat, flops, hbm):
        return Candidate("FSDP", Layout({"data": 8}, {"batch": "data"}, {"embed": "data"}, remat), flops, hbm, 1e6)

    ranked = rank([layout("none", 18e9, 1.6e9), layout("full", 20.7e9, 1.35e9)], roof, memory_budget=2**30)
    assert [c.layout.remat for c in ranked] == ["full", "none"]
    assert [c.seconds(roof)[1] for c in ranked] == [1.35e9 / 1.2e9, 1.6e9 / 1.2e9]  # each its own count
    assert "the smaller count" not in format_table(ranked, roof, 2**30)
    gpu = Roofline(dataclasses.replace(cpu, platform="gpu"), 20e9, "f32")  # the same counts for a GPU: the twin rule
    assert [c.layout.remat for c in rank(ranked, gpu, memory_budget=2**30)] == ["none", "full"]
    assert "the smaller count" in format_table(ranked, gpu, 2**30)


def test_the_loss_block_the_search_tries_divides_the_vocab_near_an_eighth():
    from named.trainer.commands.plan_search import loss_block_for
    from named.trainer.config import ConfigError

    assert loss_block_for(50304) == 6288  # GPT-2's padded vocab: exactly an eighth
    assert loss_block_for(384) == 48
    assert loss_block_for(50257) == 1733  # GPT-2's own, 29 x 1733: an eighth (6282.1) is no divisor
    assert loss_block_for(100) == 10  # 12.5 lies between 10 and 20, nearer 10 by ratio
    assert loss_block_for(6) == 2  # nearer an eighth (0.75) by ratio than 3
    with pytest.raises(ConfigError, match="trainer.loss_block_size: the vocab size 50261 has no divisor"):
        loss_block_for(50261)  # a prime


def test_the_second_stage_tries_the_best_layouts_in_the_other_mode_and_loss():
    from named.trainer.commands.plan_search import Candidate, Roofline, format_table, rank, refinements
    from named.trainer.loop import hardware

    roof = Roofline(hardware.find("H100"), 494e12, "TF32")

    def measured(name, remat, flops, memory, mode="auto", block=None, error=None):
        c = Candidate(name, Layout({"data": 8}, {"batch": "data"}, {}, remat, 1, block, mode), error=error)
        c.flops, c.hbm_bytes, c.memory = flops, 1e6, memory
        return c

    ranked = rank(
        [
            measured("FSDP", "none", 1e9, 1),
            measured("FSDP", "full", 1.1e9, 1),  # FSDP's remat twin: the same program in explicit mode
            measured("DP", "none", 2e9, 1),
            measured("TP", "none", 1, 0, error="heads do not split"),  # cannot run: never refined
            measured("FSDP+TP2", "none", 3e9, 2**40),  # over the budget, yet third among those that compile
            measured("FSDP+TP4", "none", 4e9, 2**40),  # over it and slower: beyond the best 3
        ],
        roof,
        memory_budget=2**30,
    )
    second = refinements(ranked, 384)
    assert [(c.name, c.layout.remat, c.layout.mode, c.layout.loss_block_size) for c in second] == [
        (name, "none", mode, block)
        for name in ("FSDP", "DP", "FSDP+TP2")
        for mode, block in (("explicit", None), ("auto", 48), ("explicit", 48))
    ]
    assert not any(c.error or c.flops for c in second)  # to be measured
    assert {c.layout.gather for c in second} == {"auto"}  # these store no weight split: nothing to gather
    # a layout that stores its weights split (FSDP): also each weight gathered where it is used, in
    # auto mode (explicit mode gathers its own), with either loss
    fsdp = measured("FSDP", "none", 1e9, 1)
    fsdp.layout = fsdp.layout.replace(param_mapping={"embed": "data"})
    assert [(c.layout.mode, c.layout.loss_block_size, c.layout.gather) for c in refinements([fsdp], 384)] == [
        ("explicit", None, "auto"),
        ("auto", 48, "auto"),
        ("explicit", 48, "auto"),
        ("auto", None, "per_use"),
        ("auto", 48, "per_use"),
    ]
    # one that gathers per use already: the other way is GSPMD's
    per_use = measured("FSDP", "none", 1e9, 1)
    per_use.layout = fsdp.layout.replace(gather="per_use")
    assert [(c.layout.mode, c.layout.loss_block_size, c.layout.gather) for c in refinements([per_use], 384)] == [
        ("explicit", None, "auto"),
        ("auto", 48, "per_use"),
        ("explicit", 48, "auto"),
        ("auto", None, "auto"),
        ("auto", 48, "auto"),
    ]
    # a config already in explicit mode with blocks: the other mode, the full logits, both
    blocked = refinements([measured("FSDP", "none", 1e9, 1, "explicit", 96)], 384)
    assert [(c.layout.mode, c.layout.loss_block_size) for c in blocked] == [
        ("auto", 96),
        ("explicit", None),
        ("auto", None),
    ]
    # a vocab with no block: the blockwise variants are rows that cannot run, naming the key
    prime = refinements(ranked, 383, best=1)
    assert [(c.layout.mode, c.error is None) for c in prime] == [
        ("explicit", True),
        ("auto", False),
        ("explicit", False),
    ]
    table = format_table(rank([*ranked, *prime], roof, 2**30), roof, 2**30)
    assert re.search(r"FSDP\s+data8\s+auto\s+auto\s+none\s+1\s+none\s.*cannot run: trainer.loss_block_size", table)


def test_a_layout_explicit_mode_cannot_run_is_a_row_that_says_so():
    from named.trainer.commands.plan_search import Candidate, Roofline, format_table, measure
    from named.trainer.loop import hardware

    cfg = load_config(CONFIG, SMALL)
    # tensor-parallel activations over weights stored whole: auto mode gathers them, explicit mode refuses
    odd = Candidate("odd", Layout({"data": 4, "model": 2}, {"batch": "data", "mlp": "model"}, {}, mode="explicit"))
    assert measure(cfg, odd) is odd
    assert odd.error.startswith("mesh.mode: explicit:") and "'mlp'" in odd.error and not odd.flops
    roof = Roofline(hardware.find("H100"), 494e12, "TF32")
    table = format_table([odd], roof, 2**30)
    assert "explicit  auto    none" in table and "cannot run: mesh.mode: explicit" in table


def test_a_layouts_flags_give_the_config_apply_gives():
    """``Layout.flags`` (what ``--search`` prints for the layout ranked first) read by ``load_config``
    make the config ``Layout.apply`` makes: every key of the layout, mappings with a list of mesh axes too."""
    base = load_config(CONFIG, SMALL)
    lay = Layout.of(base).replace(
        mesh_shape={"replica": 2, "data": 2, "model": 2},
        compute_mapping={"batch": ["replica", "data"], "mlp": "model", "heads": "model"},
        param_mapping={"embed": "data", "mlp": "model", "heads": "model"},
        remat="full",
        microbatches=2,
        loss_block_size=128,
        mode="explicit",
    )
    applied = lay.apply(base)
    assert Layout.of(applied) == lay
    assert load_config(CONFIG, [*SMALL, *lay.flags()]) == applied
    assert " ".join(lay.flags()[:2]) == "--mesh.shape {replica: 2, data: 2, model: 2}"
    assert lay.flags()[lay.flags().index("--mesh.mode") + 1] == "explicit"
    assert lay.overrides()["mesh.compute_mapping"] == {"batch": ["replica", "data"], "mlp": "model", "heads": "model"}


def test_the_search_compiles_on_threads_and_reports_in_order():
    """Candidates traced here and compiled on two threads come back in order, with the numbers
    they have compiled one at a time, a refused one among them."""
    from named.trainer.commands.plan_search import Candidate, measured

    cfg = load_config(CONFIG, SMALL)

    def cands():
        return [
            Candidate("FSDP", Layout({"data": 8}, {"batch": "data"}, {"embed": "data"})),
            Candidate("odd", Layout({"data": 4, "model": 2}, {"batch": "data", "mlp": "model"}, {}, mode="explicit")),
            Candidate("TP", Layout({"model": 8}, {"mlp": "model"}, {"mlp": "model"})),
            Candidate("DP", Layout({"data": 8}, {"batch": "data"}, {})),
        ]

    one, two = list(measured(cfg, cands(), threads=1)), list(measured(cfg, cands(), threads=2))
    assert [c.name for c in two] == ["FSDP", "odd", "TP", "DP"]
    assert [c.error is None for c in two] == [True, False, True, True]
    assert len({c.comm_bytes for c in two}) == 4  # four different programs, each its own numbers
    for a, b in zip(one, two, strict=True):
        assert (a.flops, a.hbm_bytes, a.comm_bytes, a.memory, a.error) == (
            b.flops,
            b.hbm_bytes,
            b.comm_bytes,
            b.memory,
            b.error,
        )


@pytest.mark.slow
def test_search_ranks_the_layouts_that_fit():
    """One search of a tiny GPT-2 (one layout refined, to keep it short): the ranking, the second
    stage's rows, and the config of the layout ranked first."""
    from named.trainer.commands.plan import Target
    from named.trainer.commands.plan_search import loss_block_for, search, search_report, stores_split
    from named.trainer.loop.checks import checked_setup, model_config_for

    tiny = ["--model.n_embd", "32", "--model.n_head", "2", *SMALL]
    cfg = load_config(CONFIG.with_name("gpt2_nano.yaml"), tiny)
    target = Target.of("H100", "5MiB")
    seen = []
    ranked = search(cfg, target, refine=1, progress=lambda *a: seen.append(a))
    assert [a[:2] for a in seen] == [(i, len(ranked)) for i in range(1, len(ranked) + 1)]  # done, of how many
    assert all(best in ranked for *_, best in seen)
    text = search_report(cfg, target, ranked)
    block = loss_block_for(model_config_for(cfg)[0].vocab_size)
    assert "then the best 1 (one per layout" in text and f"with loss blocks of {block}" in text
    table = text.split("layouts for 8 x H100")[1]
    rows = [r.split() for r in table.splitlines() if re.match(r"\d+\s", r)]
    assert len(rows) == len(ranked)
    # columns: rank layout mesh mode gather remat microbatches loss-block est compute HBM comm peak [note]
    ok = [r for r in rows if r[8] != "-" and r[13:14] != ["over"]]
    over = [r for r in rows if r[13:14] == ["over"]]
    blocked = [r for r in rows if r[13:15] == ["cannot", "run:"]]
    assert len(ok) + len(over) + len(blocked) == len(rows)
    assert {"DP", "FSDP", "FSDP+TP2"} <= {r[1] for r in rows}
    blocked_text = [" ".join(r) for r in blocked]
    assert blocked and all("heads" in r or "does not split" in r for r in blocked_text)  # TP over 8 of 2 heads
    estimates = [float(r[8]) for r in ok]
    assert estimates == sorted(estimates)  # ranked by the estimate
    assert rows.index((ok or over)[0]) < rows.index(blocked[0])
    for r in over:  # over budget sorts after every row that fits
        assert all(rows.index(r) > rows.index(o) for o in ok)
        assert float(r[12]) * 2**30 > 5 * 2**20
    plain = [r for r in ok if r[3:5] == ["auto", "auto"] and r[7] == "none"]
    fits = {(r[1], r[6], r[5]): i for i, r in enumerate(plain)}  # (layout, microbatches, remat)
    pairs = [(n, m) for n, m, remat in fits if remat == "full" and (n, m, "none") in fits]
    assert pairs and all(fits[(n, m, "none")] < fits[(n, m, "full")] for n, m in pairs)  # no needless recompute
    head = " ".join(table.split("\n", 3)[2].split())
    assert "mode gather remat microbatches loss block est. ms/step compute ms HBM ms comm ms memory GiB/device" in head

    # the second stage: the first stage's best, in explicit mode, with loss blocks, and with both;
    # where it stores weights split, also gathering each where it is used (auto mode), with either loss
    def plain_layout(c):
        return c.layout.mode == "auto" and c.layout.loss_block_size is None and c.layout.gather == "auto"

    best = min((c for c in ranked if plain_layout(c) and not c.error), key=ranked.index)
    same = [
        c
        for c in ranked
        if c.name == best.name and c.layout.replace(mode="auto", loss_block_size=None, gather="auto") == best.layout
    ]
    variants = {(mode, b, "auto") for mode in ("auto", "explicit") for b in (None, block)}
    if stores_split(best.layout):
        variants |= {("auto", None, "per_use"), ("auto", block, "per_use")}
    assert {(c.layout.mode, c.layout.loss_block_size, c.layout.gather) for c in same} == variants
    assert all(c.error is None and c.flops > 0 for c in same)
    assert sum(not plain_layout(c) for c in ranked) == len(variants) - 1
    # the layout ranked first, as a config: its keys set, and the trainer's checks pass it
    top = ranked[0]
    run = top.layout.apply(cfg)
    lay = top.layout.fields()
    assert (run.mesh.shape, run.mesh.compute_mapping, run.mesh.param_mapping) == (
        lay["mesh_shape"],
        lay["compute_mapping"],
        lay["param_mapping"],
    )
    assert (run.mesh.mode, run.model.remat, run.trainer.microbatches, run.trainer.loss_block_size) == (
        lay["mode"],
        lay["remat"],
        lay["microbatches"],
        lay["loss_block_size"],
    )
    checked_setup(run)
    flags = shlex.split(text.split("the layout ranked first, as flags after the config's: ")[1])
    assert load_config(CONFIG.with_name("gpt2_nano.yaml"), [*tiny, *flags]) == run


def test_tensor_parallel_layouts_split_the_vocab():
    from named.trainer.commands.plan_search import candidates, param_axes, planned

    cfg = load_config(CONFIG, SMALL)  # GPT-2 nano: vocab 384, seq 32, 8 sequences on 8 devices
    found = list(candidates(8, param_axes(cfg), 8))
    tp = [c.layout.fields() | {"name": c.name} for c in found if "TP" in c.name]
    assert tp and all(c["compute_mapping"]["vocab"] == c["param_mapping"]["vocab"] == "model" for c in tp)
    assert not any("vocab" in c.layout.fields()["compute_mapping"] for c in found if "TP" not in c.name)
    c = next(c for c in found if (c.name, c.layout.remat, c.layout.microbatches) == ("FSDP+TP2", "none", 1))
    trial, s = planned(cfg, c)
    assert c.error is None and trial.mesh.compute_mapping["vocab"] == "model"
    # the logits and their gradient in float32, 2 sequences per device (data=4), half the vocab each;
    # and the head's half (split along embed over data) gathered with its gradient, 128 wide
    assert plan.make_plan(trial, None, s).logits == 2 * 2 * 32 * (384 / 2) * 4 + 2 * (384 // 2) * 128 * 4


def _fresh(c):
    import dataclasses

    return dataclasses.replace(c, memory=0.0, error=None)


def test_estimate_explorer_page_and_search_agree_on_memory_and_fit():
    """One rule: the report's "in all", the explorer's total, the page's and the search's memory
    are one figure for the same flags, and each says "fits" alike against the device's memory."""
    from named.trainer.commands.explore import Explorer, report_page
    from named.trainer.commands.plan_search import candidates, fits, param_axes, planned

    cfg = load_config(CONFIG, SMALL)
    layouts = [c for c in candidates(8, param_axes(cfg), 8) if c.layout.microbatches == 1]
    sizes = sorted(c.memory for c in map(_fresh, layouts) if planned(cfg, c)[0] is not None)
    budget = (sizes[0] + sizes[-1]) / 2  # some fit, some do not
    target = plan.Target.of("H100", f"{budget:.0f}b")
    ex = Explorer(cfg, target=target)
    page = report_page(ex)
    verdicts = set()
    for c in map(_fresh, layouts):
        planned(cfg, c, target)
        v = ex.view(c.layout)
        if c.error is not None:
            assert v.error is not None and c.error in v.error
            continue
        text = plan.plan_report(c.layout.apply(cfg), target=target)
        total = re.search(r"in all: ([\d.]+) MiB", text).group(1)
        assert f"{c.memory / 2**20:.2f}" == f"{v.total_bytes / 2**20:.2f}" == total
        key = rf"data-key='{re.escape(c.name)}\|{c.layout.remat}\|1'>(.*?)</section>"
        section = re.search(key, page, re.S).group(1)
        assert f"data-figure='total'>{total} MiB" in section
        fit = fits(c, target.memory)
        assert fit == (not v.plan.over_budget) == ("OVER BUDGET" not in text) == ("OVER BUDGET" not in section)
        verdicts.add(fit)
    assert verdicts == {True, False}


_SEVEN_B = """
import json, re, sys
from named.trainer.commands import plan
from named.trainer.commands.explore import Explorer
from named.trainer.commands.plan_search import candidates, fits, param_axes, planned
from named.trainer.config import load_config
from named.trainer.config.layout import Layout

cfg = load_config(sys.argv[1], sys.argv[2:])
target = plan.Target.of("H100", None)
ex = Explorer(cfg, target=target)
out = []
for c in candidates(64, param_axes(cfg), cfg.trainer.train_batch_size):
    if c.layout.remat != "none" or (c.name, c.layout.microbatches) not in {("FSDP", 1), ("FSDP+TP8", 1), *(
        (f"FSDP+TP{t}", 4) for t in (2, 4, 8))}:
        continue
    planned(cfg, c, target)
    v = ex.view(c.layout)
    text = plan.plan_report(c.layout.apply(cfg), target=target)
    out.append(dict(name=c.name, micro=c.layout.microbatches, search=c.memory, fits=fits(c, target.memory),
        explorer=v.total_bytes, explorer_over=v.plan.over_budget, logits=v.plan.logits,
        report=float(re.search(r"in all: ([\\d.]+) MiB", text).group(1)), report_over="OVER BUDGET" in text))
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.procs
def test_a_7b_llama_on_64_h100s_from_shapes_alone():
    """Issue 41's case, planned from shapes (nothing of a 7B compiled) in a process with 64 CPU
    devices standing in: the search, the explorer and the report give one figure per layout, the
    hand count (state 16N/devices in float32 with Adam, activations after Korthikanti et al.
    without the T x T scores flash attention never keeps, float32 logits and their gradient over
    the vocab's shards); FSDP x TP 2/4/8 with 4 microbatches fit an H100's 80 GB in all of them
    (the search said 112-160 GiB before)."""
    import json
    import os
    import subprocess
    import sys

    h, ffn, L, heads, V, s, batch = 4096, 11008, 32, 32, 32000, 4096, 128
    flags = [
        *("--model.hidden_size", str(h), "--model.intermediate_size", str(ffn)),
        *("--model.num_hidden_layers", str(L), "--model.num_attention_heads", str(heads)),
        *("--model.num_key_value_heads", str(heads), "--model.vocab_size", str(V)),
        *("--model.tie_word_embeddings", "false", "--model.max_position_embeddings", str(s)),
        *("--data.seq_len", str(s), "--trainer.train_batch_size", str(batch)),
    ]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=64", "JAX_PLATFORMS": "cpu"}
    config = str(CONFIG.with_name("llama_1b.yaml"))  # bf16 compute, float32 parameters
    done = subprocess.run(
        [sys.executable, "-c", _SEVEN_B, config, *flags], env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    n = 2 * V * h + L * (4 * h * h + 3 * h * ffn + 2 * h) + h  # Llama: embedding, head, attention, SwiGLU, norms
    assert n == 6_738_415_616
    assert len(rows) == 5
    for r in rows:
        t = int(r["name"].removeprefix("FSDP+TP")) if "TP" in r["name"] else 1
        b = batch / r["micro"] / (64 / t)  # sequences per device in one microbatch
        acts = L * s * b * h * (10 + 24 / t)  # bytes at 16-bit
        # float32 logits and their gradient, plus the FSDP head (split along embed) the loss holds
        # gathered with its whole gradient, in bfloat16 compute: its vocab rows are the device's
        # share; in a microbatch loop twice that (the gathered head's copy and the gradient's
        # reduction beside them: tests/test_plan_memory.py)
        logits = 2 * b * s * (V / t) * 4 + 2 * (V / t) * h * 2 * (2 if r["micro"] > 1 else 1)
        assert r["logits"] == pytest.approx(logits)
        # state: float32 parameters, gradients and Adam's two moments, 16N/64; with microbatches
        # the float32 gradient accumulator (4N/64) beside the microbatch's gradient
        state = 16 * n / 64 + (4 * n / 64 if r["micro"] > 1 else 0)
        assert r["search"] == pytest.approx(state + acts + logits, rel=1e-3)
        assert r["search"] == r["explorer"] and r["report"] == pytest.approx(r["search"] / 2**20, abs=0.01)
        assert r["fits"] == (not r["explorer_over"]) == (not r["report_over"])
        assert r["fits"] == (state + acts + logits <= 80e9)
    by = {(r["name"], r["micro"]): r for r in rows}
    assert all(r["fits"] for r in rows if r["micro"] == 4) and by[("FSDP", 1)]["fits"]
    assert not by[("FSDP+TP8", 1)]["fits"]  # 16 sequences per device: 104 GiB of activations
    # the count by hand (37.5 GiB), plus the gathered bfloat16 head and its gradient (0.49 GiB)
    assert by[("FSDP", 1)]["search"] / 2**30 == pytest.approx(37.5 + 2 * V * h * 2 / 2**30, abs=0.1)
    assert by[("FSDP+TP8", 1)]["logits"] == pytest.approx(2.16e9, rel=0.01)  # not 16.8 GB: the vocab is split


def test_this_cpu_is_measured_once_and_cached(tmp_path, monkeypatch):
    from named.trainer.commands.plan_search import Roofline
    from named.trainer.loop import hardware

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    dev = hardware.this_cpu()
    assert (dev.name, dev.platform) == ("this CPU", "cpu")
    # any CPU this runs on does more than 0.1 GFLOP/s and moves more than 10 MB/s
    assert dev.f32_flops > 1e8 and dev.hbm_bandwidth > 1e7 and dev.link_bandwidth > 1e7
    [cached] = (tmp_path / "named" / "calibration").glob("*.json")
    monkeypatch.setattr(hardware, "measure_cpu", lambda *a: pytest.fail("measured again"))
    assert hardware.this_cpu() == dev
    assert plan.Target.of(None, None, calibrate=True).device == dev  # what --search ranks by on a CPU
    assert plan.Target.of(None, None).device is None  # the plain report measures nothing
    assert Roofline.of(load_config(CONFIG), dev).peak_flops == dev.f32_flops  # a float32 config
    cached.write_text("{not json")
    monkeypatch.setattr(hardware, "measure_cpu", lambda *a: {"f32_flops": 1, "hbm_bandwidth": 2, "link_bandwidth": 3})
    assert hardware.this_cpu().f32_flops == 1  # a damaged cache is measured again


def test_measure_takes_turns_within_the_memory_budget(monkeypatch):
    """--measure K runs the layouts' steps in turns (a change of load falls on all alike), holding
    at once only layouts whose planned memory fits the budget together, and ranks by the median."""
    from named.trainer.commands import plan_search
    from named.trainer.commands.plan_search import Candidate, timed

    log, times = [], {"a": [5.0, 1.0, 2.0], "b": [1.5, 1.6, 9.0], "c": [3.0, 3.0, 3.0]}

    def warm(cfg, c):
        log.append(f"warm {c.name}")
        left = iter(times[c.name])

        def run():
            log.append(c.name)
            return next(left)

        return run

    monkeypatch.setattr(plan_search, "warm_step", warm)
    a, b, c = (Candidate(n, Layout({"data": 8}, {"batch": "data"}, {})) for n in "abc")
    for cand, mem in ((a, 40), (b, 50), (c, 30)):
        cand.memory = mem
    out = timed(None, [a, b, c], 3, 100, steps=3)
    # a and b fit the budget together (90 <= 100); c would not fit beside them, so it runs alone
    assert log == ["warm a", "warm b", "a", "b", "a", "b", "a", "b", "warm c", "c", "c", "c"]
    assert (a.measured, b.measured, c.measured) == (2.0, 1.6, 3.0)  # medians, not the best or the mean
    assert out == [b, a, c]


@pytest.mark.slow
def test_measure_times_the_layouts_that_fit_and_ranks_them_by_the_time():
    from named.trainer.commands.plan_search import Candidate, Roofline, format_table, planned, timed
    from named.trainer.loop import hardware

    cfg = load_config(CONFIG, SMALL)
    dp = Candidate("DP", Layout({"data": 8}, {"batch": "data"}, {}))
    fsdp = Candidate("FSDP", Layout({"data": 8}, {"batch": "data"}, {"embed": "data"}))
    big = Candidate("FSDP", Layout({"data": 8}, {"batch": "data"}, {"embed": "data"}, "full"))
    for c in (dp, fsdp, big):
        planned(cfg, c)
    big.memory = 2**40  # over the budget: never timed
    seen = []
    out = timed(cfg, [dp, big, fsdp], 2, 2**30, steps=2, progress=seen.append)
    assert seen == [dp, fsdp] and big.measured is None
    assert out[:2] == sorted([dp, fsdp], key=lambda c: c.measured) and out[2] is big
    assert all(c.measured > 0 for c in (dp, fsdp))
    table = format_table(out, Roofline(hardware.find("H100"), 494e12, "TF32"), 2**30)
    assert "measured ms/step" in table.splitlines()[0] and "over budget" in table.splitlines()[3]


@pytest.mark.slow
def test_mesh_layout_auto_trains_with_the_first_ranked_layout_and_a_resume_keeps_it(tmp_path, monkeypatch, capsys):
    from named.trainer.commands import plan_search

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    # to keep the test short, the first stage only and, of it, each layout once (no remat, one
    # microbatch): each candidate costs a compile, and test_search_ranks_the_layouts_that_fit ranks them all
    monkeypatch.setattr(plan_search, "REFINED", 0)
    every = plan_search.candidates
    once = lambda c: c.layout.remat == "none" and c.layout.microbatches == 1  # noqa: E731
    monkeypatch.setattr(plan_search, "candidates", lambda *a, **k: filter(once, every(*a, **k)))
    nano = CONFIG.with_name("gpt2_nano.yaml")
    base = [*SMALL, "--model.n_embd", "32", "--model.n_head", "2", "--data.stdlib_bytes", "200000"]
    base += ["--data.cache_dir", str(tmp_path / "data"), "--trainer.run_dir", str(tmp_path / "run")]
    base += ["--trainer.eval_interval", "0", "--trainer.sample_interval", "0", "--mesh.layout", "auto"]
    assert cli.main_train(["--config_path", str(nano), *base, "--trainer.num_train_steps", "2"]) == 0
    out, err = capsys.readouterr()
    assert re.search(r"^search 1/5: ", err, re.M) and "best so far" in err  # progress on stderr
    assert re.search(r"^search 5/5: ", err, re.M)  # DP, FSDP, FSDP+TP2, FSDP+TP4, TP: each once
    flags = shlex.split(re.search(r"^mesh.layout auto: .*; flags: (.*)$", out, re.M).group(1))
    saved = load_config(tmp_path / "run" / "config.yaml")
    assert saved.mesh.layout == "config"  # the resolved layout, not "auto"
    chosen = load_config(nano, [*base[:-2], *flags])
    assert Layout.of(saved) == Layout.of(chosen)

    def never(*a, **k):
        raise AssertionError("a resume searched again")

    monkeypatch.setattr(plan_search, "search", never)
    more = ["--trainer.num_train_steps", "3", "--optimizer.schedule_steps", "2"]
    assert cli.main_train(["--config_path", str(nano), *base, *more]) == 0
    out = capsys.readouterr().out
    assert f"mesh.layout auto: the layout recorded in {tmp_path / 'run' / 'config.yaml'}" in out
    assert Layout.of(load_config(tmp_path / "run" / "config.yaml")) == Layout.of(saved)


def test_candidates_with_one_program_share_its_compile(monkeypatch):
    """``mesh.gather: per_use`` changes nothing where every weight is also split for tensor
    parallelism: that pair compiles once and reports one set of figures; FSDP's pair differs."""
    from named.trainer.commands import plan_search
    from named.trainer.commands.plan_search import Candidate, candidates, measured, param_axes

    cfg = load_config(CONFIG.with_name("gpt2_nano.yaml"), SMALL)
    compiles = []
    compile_report = plan_search.compiled_step_report
    monkeypatch.setattr(
        plan_search, "compiled_step_report", lambda lowered, s: compiles.append(s) or compile_report(lowered, s)
    )
    first = {
        c.name: c
        for c in candidates(8, param_axes(cfg), 8)
        if c.layout.remat == "none" and c.layout.microbatches == 1 and c.name in ("FSDP", "FSDP+TP2")
    }
    pairs = [
        Candidate(name, lay) for name, c in first.items() for lay in (c.layout, c.layout.replace(gather="per_use"))
    ]
    fsdp, fsdp_per_use, tp, tp_per_use = measured(cfg, pairs)
    assert len(compiles) == 3
    assert (tp.flops, tp.hbm_bytes, tp.comm_bytes) == (tp_per_use.flops, tp_per_use.hbm_bytes, tp_per_use.comm_bytes)
    assert tp.flops > 0 and tp.comm_bytes > 0
    assert (fsdp.hbm_bytes, fsdp.comm_bytes) != (fsdp_per_use.hbm_bytes, fsdp_per_use.comm_bytes)


def test_the_search_traces_each_forward_once_for_what_remat_and_gather_leave_alone(monkeypatch):
    """The search's activation check (the forward traced on abstract inputs) runs once for a layout
    and its ``model.remat`` and ``mesh.gather`` variants, again for any other change; a layout the
    check refuses is refused again for each of its variants, with the same error."""
    from named.trainer.commands.plan_search import Candidate, planned
    from named.trainer.loop import checks

    cfg = load_config(CONFIG.with_name("gpt2_nano.yaml"), SMALL)
    traced = []
    check = checks.check_activations
    monkeypatch.setattr(
        checks, "check_activations", lambda trial, *a: traced.append(Layout.of(trial)) or check(trial, *a)
    )
    fsdp = Layout({"data": 8}, {"batch": "data"}, {"embed": "data"})
    clash = Layout({"data": 8}, {"batch": "data", "embed": "data"}, {})  # activations with both axes on data
    lays = [
        fsdp,
        fsdp.replace(remat="full"),
        fsdp.replace(gather="per_use"),
        fsdp.replace(mesh_shape={"data": 4, "model": 2}),
    ]
    lays += [clash, clash.replace(remat="full")]

    passed: set = set()
    found = [Candidate(str(i), lay) for i, lay in enumerate(lays)]
    setups = [planned(cfg, c, None, passed) for c in found]
    assert traced == [fsdp, fsdp.replace(mesh_shape={"data": 4, "model": 2}), clash, clash.replace(remat="full")]
    assert [c.error is None for c in found] == [True] * 4 + [False] * 2
    assert all(s is not None and c.memory > 0 for c, (_, s) in zip(found[:4], setups))
    assert found[4].error == found[5].error and "embed" in found[4].error and "batch" in found[4].error
    assert Layout.of(setups[1][0]) == lays[1]  # a variant keeps its own config, remat and all

    traced.clear()  # without a record of what passed, every layout is traced
    for lay in lays:
        planned(cfg, Candidate("again", lay))
    assert traced == lays
