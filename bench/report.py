"""Fill the tables of docs/benchmarks.md from bench/results/*.json.

    .venv/bin/python bench/report.py          # rewrites the blocks between <!-- bench:NAME --> markers

Only the marked blocks change; the prose around them is written by hand. A result file that
is missing leaves its block saying so.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DOC = ROOT / "docs" / "benchmarks.md"


def load(name: str, results: Path = RESULTS) -> dict | None:
    path = results / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def ms(s: float) -> str:
    return f"{s * 1e3:,.0f} ms" if s >= 0.1 else f"{s * 1e3:.1f} ms"


def sec(s: float) -> str:
    return f"{s:.2f} s"


def mib(b: float) -> str:
    return f"{b / 2**20:,.1f} MiB"


def table(header: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def load_note(r: dict) -> str:
    m = r["machine"]
    a, b = m.get("load_average_at_start", ["?"])[0], m.get("load_average_at_end", ["?"])[0]
    return f"1-minute load average {a} at the start, {b} at the end"


def provenance(r: dict) -> str:
    m = r["machine"]
    dirty = m.get("dirty_src") or []
    code = f"commit `{m.get('commit')}`" + (
        f" + uncommitted changes in {len(dirty)} src/ paths (others' work in progress)" if dirty else ""
    )
    return f"Run {m.get('date_utc')}, {code}; {load_note(r)}.\n\n```\n{r['command']}\n```"


def unavailable(name: str, r: dict | None) -> str | None:
    """What a block says when the result ``name`` is missing or was skipped (else None)."""
    if r is None:
        return f"_not run: bench/results/{name}.json is missing_"
    if r.get("skipped"):
        return f"**Skipped**: {r['reason']}\n\n{provenance(r)}"
    return None


def machine_block() -> str:
    r = next((x for x in (load(n) for n in ("overhead_f32", "compile_depth", "memory", "data_ckpt")) if x), None)
    if r is None:
        return "_no results yet: run `make bench`_"
    m = r["machine"]
    v = m["versions"]
    rows = [
        ["CPU", f"{m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB"],
        ["devices", f"{m['devices']} fake `{m['backend']}` devices (`--xla_force_host_platform_device_count=8`)"],
        ["Python / JAX", f"{v['python']} / jax {v['jax']}, jaxlib {v.get('jaxlib')}"],
        ["libraries", ", ".join(f"{k} {v[k]}" for k in ("equinox", "optax", "numpy", "tensorstore") if k in v)],
    ]
    peer = load("peer_f32")
    if peer and peer.get("peer_versions"):
        pv = peer["peer_versions"]
        lev, hal = pv.get("marin-levanter") or pv.get("levanter"), pv.get("marin-haliax") or pv.get("haliax")
        rows.append(["peer (bench/.venv-peer)", f"levanter {lev}, haliax {hal}, jax {pv['jax']}"])
    return table(["", ""], rows)


def overhead_block(name: str) -> str:
    r = load(name)
    if (text := unavailable(name, r)) is not None:
        return text
    st, lc = r["step"], r["lower_plus_compile_s"]
    cpu = r["step_cpu"]
    rows = [
        [
            side,
            ms(st[side]["median_s"]),
            f"{ms(st[side]['min_s'])} – {ms(st[side]['max_s'])}",
            st[side]["n"],
            ms(cpu[side]["median_s"]),
            sec(r["lower_s"][side]["median_s"]),
            sec(r["compile_s"][side]["median_s"]),
            sec(lc[side]["median_s"]),
        ]
        for side in ("named", "plain")
    ]
    rows.append(
        [
            "**named / plain**",
            f"**{r['step_ratio_named_over_plain']:.3f}**",
            "",
            "",
            f"**{r['step_cpu_ratio_named_over_plain']:.3f}**",
            f"{r['lower_s']['named']['median_s'] / r['lower_s']['plain']['median_s']:.2f}",
            f"{r['compile_s']['named']['median_s'] / r['compile_s']['plain']['median_s']:.2f}",
            f"**{r['compile_ratio_named_over_plain']:.3f}**",
        ]
    )
    t1 = table(
        [
            "side",
            "step wall (median)",
            "wall range",
            "steps",
            "step CPU time (median)",
            "lower",
            "XLA compile",
            "lower + compile",
        ],
        rows,
    )
    per_round = ", ".join(f"{x:.3f}" for x in r["step_ratio_per_round"])
    robust = (
        f"median of the per-turn ratios {r['step_ratio_median_of_rounds']:.3f}, ratio of the fastest steps "
        f"{r['step_ratio_min_named_over_plain']:.3f}"
    )
    h = r["hlo"]
    hrows = []
    for side in ("named", "plain"):
        c = h[side]["collectives"]
        hrows.append(
            [side, h[side]["total_instructions"], h[side]["fusions"]]
            + [
                f"{c[k]['count']} ({mib(c[k]['bytes'])})" if c[k]["count"] else "0"
                for k in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all")
            ]
            + [mib(r["memory"][side]["peak_bytes"])]
        )
    t2 = table(
        [
            "side",
            "HLO instructions",
            "fusions",
            "all-gather",
            "reduce-scatter",
            "all-reduce",
            "all-to-all",
            "peak memory/device",
        ],
        hrows,
    )
    diff = ", ".join(f"{k} {v:+d}" for k, v in r["hlo_opcode_difference_named_minus_plain"].items())
    cfg = r["config"]
    return (
        f"{cfg['n_layer']} layers, embed {cfg['n_embd']}, "
        f"{cfg['n_head']} heads, seq {cfg['seq']}, batch {cfg['batch']}, "
        f"vocab {cfg['vocab_size']}, {cfg['dtype']}, FSDP on 8 devices, {r['params']['named']:,} parameters on each "
        "side.\n\n"
        f"{t1}\n\nPer-turn step ratios (named / plain): {per_round}; {robust}.\n\nOptimized HLO of the two "
        f"steps:\n\n{t2}\n\n"
        f"Opcode counts, named minus plain: {diff or 'none'}.\n\n{provenance(r)}"
    )


def peer_block(name: str) -> str:
    r = load(name)
    if (text := unavailable(name, r)) is not None:
        return text
    st, c = r["step"], r["compile_s"]
    cpu = r["step_cpu"]
    rows = [
        [
            side,
            ms(st[side]["median_s"]),
            f"{ms(st[side]['min_s'])} – {ms(st[side]['max_s'])}",
            st[side]["n"],
            ms(cpu[side]["median_s"]),
            sec(c[side]["median_s"]),
            f"{r['losses_first_and_last'][side][0]:.3f} → {r['losses_first_and_last'][side][1]:.3f}",
        ]
        for side in ("named", "peer")
    ]
    rows.append(
        [
            "**named / peer**",
            f"**{r['step_ratio_named_over_peer']:.3f}**",
            "",
            "",
            f"**{r['step_cpu_ratio_named_over_peer']:.3f}**",
            f"{r['compile_ratio_named_over_peer']:.2f}",
            "",
        ]
    )
    per = ", ".join(f"{x:.3f}" for x in r["step_ratio_per_round"])
    robust = (
        f"median of the per-turn ratios {r['step_ratio_median_of_rounds']:.3f}, ratio of the fastest steps "
        f"{r['step_ratio_min_named_over_peer']:.3f}"
    )
    cfg = r["config"]
    loss = f"; peer loss: {cfg['peer_loss']}" if "peer_loss" in cfg else ""
    return (
        f"{cfg.get('model', 'gpt2')}, {cfg['dtype']}, remat "
        f"`{cfg['remat']}`{loss}; {r['params']['named']:,} parameters "
        f"(named), {r['params']['peer']:,} (peer).\n\n"
        + table(
            [
                "side",
                "step wall (median)",
                "wall range",
                "steps",
                "step CPU time (median)",
                "compile (lower + compile)",
                "loss (first → last)",
            ],
            rows,
        )
        + f"\n\nPer-turn step ratios (named / peer): {per}; {robust}. Protocol: {r['protocol']}.\n\n{provenance(r)}"
    )


def _layout(c: dict) -> str:
    """A ``named-plan --search`` candidate in a few words."""
    mesh = "x".join(f"{k}{v}" for k, v in c["mesh_shape"].items())
    extra = [f"{c['mode']} mode"] if c.get("mode") not in (None, "auto") else []
    if c.get("gather") not in (None, "auto"):
        extra.append(f"weights gathered {c['gather']}")
    if c.get("loss_block_size"):
        extra.append(f"loss block {c['loss_block_size']}")
    return ", ".join([f"{c['name']} ({mesh})", f"remat {c['remat']}", f"{c['microbatches']} microbatch(es)", *extra])


def recommended_block(name: str) -> str:
    """``peer.py --setup recommended``: each side's recommended setup, step and peak memory."""
    r = load(name)
    if (text := unavailable(name, r)) is not None:
        return text
    st, cpu, mem, cost = r["step"], r["step_cpu"], r["memory"], r.get("cost", {})
    chosen = r["search"]["chosen"]
    ps = r.get("peer_setup") or {}
    peer_layout = (
        f"Levanter's defaults: FSDP (data8), gradient checkpointing {ps.get('gradient_checkpointing')}, "
        f"attention {ps.get('attn_backend')}, loss {ps.get('loss')}"
    )
    rows = []
    for side in st:
        suffix = "" if side in ("named", "peer") else f"_{side.removeprefix('named_')}"
        is_peer = side == "peer"
        rows.append(
            [
                side,
                peer_layout if is_peer else _layout(chosen[side]),
                ms(st[side]["median_s"]),
                ms(cpu[side]["median_s"]),
                mib(mem[side]["peak_bytes"]),
                f"{r['config']['batch'] * r['config']['seq'] / st[side]['median_s']:,.0f}",
                f"{cost[side]['flops'] / 1e9:.1f} / {cost[side]['bytes accessed'] / 1e9:.2f}" if side in cost else "–",
                "1"
                if is_peer
                else f"**{r[f'step_ratio_named_over_peer{suffix}']:.3f}** "
                f"(CPU {r[f'step_cpu_ratio_named_over_peer{suffix}']:.3f})",
                "1" if is_peer else f"**{r[f'peak_memory_ratio_named_over_peer{suffix}']:.3f}**",
            ]
        )
    per = "; ".join(
        f"{k.removeprefix('step_ratio_per_round').lstrip('_') or 'named'}: " + ", ".join(f"{x:.3f}" for x in v)
        for k, v in r.items()
        if k.startswith("step_ratio_per_round")
    )
    srch = r["search"]
    cfg = r["config"]
    k = srch.get("measure") or 0
    cpu = srch["device_kind"] == "cpu"
    by = "this CPU (measured, as the search does when run here)" if cpu else f"the {srch['device_kind']} roofline"
    timed = f", the first {k} of each search then timed here and re-ranked" if k else ""
    return (
        f"{cfg['model']}, {cfg['dtype']}, batch {cfg['batch']} × seq {cfg['seq']}. Our layouts: what "
        f"`named-plan --search{f' --measure {k}' if k else ''}` ranks first by {by}{timed}, "
        f"run on the same 8 CPU devices, "
        f"without a memory limit (`named`) and with the peer's compiled peak per device as `--device-memory` "
        f"(`named_at_peer_memory`): {srch['candidates']} layouts each, both searches {srch['search_s']:.0f} s"
        + (
            ""
            if "named_at_peer_memory" in chosen
            else " (one row: both ranked the same layout first, within the peer's memory)"
            if srch.get("fastest_fits_peer_memory")
            else " (one row: no layout fits within the peer's memory)"
        )
        + ".\n\n"
        + table(
            [
                "side",
                "setup",
                "step wall (median)",
                "step CPU time",
                "peak memory / device",
                "tokens/s",
                "XLA GFLOP / GB accessed (loop bodies once)",
                "step ÷ peer's",
                "memory ÷ peer's",
            ],
            rows,
        )
        + f"\n\nPer-turn step ratios over the peer's: {per}. Protocol: {r['protocol']}.\n\n{provenance(r)}"
    )


def compile_block() -> str:
    r = load("compile_depth")
    if (text := unavailable("compile_depth", r)) is not None:
        return text
    base = r["reference_depth"]
    rows = [
        [
            row["layers"],
            f"{row['params']:,}",
            sec(row["lower_s"]["median_s"]),
            sec(row["compile_s"]["median_s"]),
            sec(row["lower_plus_compile_s"]["median_s"]),
            f"{sec(row['lower_plus_compile_s']['min_s'])} – {sec(row['lower_plus_compile_s']['max_s'])}",
            f"**{r['ratios_to_smallest_reference'][str(row['layers'])]:.2f}**",
            f"{row['optimized_hlo']['instructions']:,} / {row['optimized_hlo']['while_loops']}",
        ]
        for row in r["rows"]
    ]
    return (
        table(
            [
                "layers",
                "parameters",
                "lower",
                "XLA compile",
                "lower + compile (median)",
                "range",
                f"÷ {base} layers",
                "optimized HLO instructions / while loops",
            ],
            rows,
        )
        + f"\n\n{provenance(r)}"
    )


def memory_block() -> str:
    r = load("memory")
    if (text := unavailable("memory", r)) is not None:
        return text
    rows = []
    for name, row in r["rows"].items():
        c, m = row["config"], row["memory"]
        rows.append(
            [
                f"`{name}`",
                f"{row['params']:,}",
                f"{c['batch']}×{c['seq']}",
                c.get("dtype", "f32"),
                c["remat"] + (", weights gathered per use" if c.get("weight_gather") == "per_use" else ""),
                c["loss"] + (f", head {c['head_gather']}" if c.get("head_gather") else ""),
                mib(m["argument_size_in_bytes"]),
                mib(m["output_size_in_bytes"]),
                mib(m["alias_size_in_bytes"]),
                mib(m["temp_size_in_bytes"]),
                mib(m["peak_bytes"]),
                mib(row["floor_16N_over_8_bytes"]),
                f"**{row['ratio_peak_over_floor']:.2f}**",
                f"{row['state_ratio']:.3f}",
            ]
        )
    return (
        table(
            [
                "config",
                "N",
                "batch×seq",
                "compute",
                "remat",
                "loss",
                "argument",
                "output",
                "alias",
                "temp",
                "peak",
                "16·N/8",
                "peak ÷ 16·N/8",
                "state ratio",
            ],
            rows,
        )
        + f"\n\n{provenance(r)}"
    )


def data_block() -> str:
    r = load("data_ckpt")
    if (text := unavailable("data_ckpt", r)) is not None:
        return text
    rows = [
        [
            row["seq_len"],
            row["batch_size"],
            row["steps"],
            f"{row['tokens_per_s']['median_s'] / 1e6:.1f} M",
            f"{row['tokens_per_s']['min_s'] / 1e6:.1f} – {row['tokens_per_s']['max_s'] / 1e6:.1f} M",
        ]
        for row in r["loader"]
    ]
    t1 = table(["seq_len", "batch", "batches timed", "tokens/s (median)", "range"], rows)
    c, dd = r["checkpoint"], r.get("dd") or {}

    def of_dd(key: str) -> str:
        return f"**{c[key]:.2f}**" if key in c else "–"

    def cpu(op: str) -> str:
        if f"{op}_cpu_s" not in c:
            return "–"
        per_gib = f" ({c[f'{op}_cpu_s_per_GiB']:.2f} s per GiB)" if f"{op}_cpu_s_per_GiB" in c else ""
        return sec(c[f"{op}_cpu_s"]["median_s"]) + per_gib

    rows = [
        [
            "`save_checkpoint`",
            sec(c["save_s"]["median_s"]),
            f"{c['save_MB_per_s']:,.0f}",
            of_dd("save_over_dd_write"),
            cpu("save"),
        ],
        [
            "`restore`",
            sec(c["restore_s"]["median_s"]),
            f"{c['restore_MB_per_s']:,.0f}",
            of_dd("restore_over_dd_read"),
            cpu("restore"),
        ],
    ]
    if "checkpointer_commit_s" in c:
        rows.append(
            [
                "`Checkpointer.save` + `wait` (the train loop's)",
                f"{sec(c['checkpointer_commit_s']['median_s'])} (`save` returns after "
                f"{sec(c['checkpointer_save_s']['median_s'])})",
                f"{c['checkpointer_commit_MB_per_s']:,.0f}",
                of_dd("checkpointer_commit_over_dd_write"),
                "",
            ]
        )
    head = f"{c['bytes'] / 2**20:,.0f} MiB in {c['leaves']} leaves, {c['layout']}; medians of {c['save_s']['n']}."
    if "restore_from" in c:
        head += f" Restores read from the {c['restore_from']}."
    if "write_direct_MB_per_s_all" in dd:
        head += (
            f" dd in the same directory, taking turns with the checkpoint in each round: "
            f"{dd['write_direct_MB_per_s']:,.0f} MB/s writing (`oflag=direct`; rounds "
            f"{', '.join(f'{x:,}' for x in dd['write_direct_MB_per_s_all'])}), {dd['read_direct_MB_per_s']:,.0f} MB/s "
            f"reading (`iflag=direct`; rounds {', '.join(f'{x:,}' for x in dd['read_direct_MB_per_s_all'])})."
        )
    elif "write_direct_MB_per_s" in dd:
        head += (
            f" dd in the same directory just before: {dd['write_direct_MB_per_s']:,.0f} MB/s writing "
            f"(`oflag=direct`), {dd['read_direct_MB_per_s']:,.0f} MB/s reading (`iflag=direct`)."
        )
    goal = "÷ dd (goal ≥ 0.8)" if "write_direct_MB_per_s_all" in dd else "÷ dd (goal ≥ 0.5)"
    t2 = head + "\n\n" + table(["operation", "wall (median)", "MB/s", goal, "CPU time"], rows)
    if "fresh_memory_cpu_s_per_GiB" in c:
        t2 += (
            f"\n\nFresh memory for the restored values, mapped as a restore maps it, alone: "
            f"{sec(c['fresh_memory_s']['median_s'])}, {c['fresh_memory_cpu_s_per_GiB']:.2f} s of CPU per GiB. "
            f"1-minute load average at the start of each round: "
            f"{', '.join(str(x) for x in c['load_average_1min_per_round'])}."
        )
    return f"{t1}\n\n{t2}\n\n{provenance(r)}"


def s3_block() -> str:
    r = load("data_ckpt_s3")
    if (text := unavailable("data_ckpt_s3", r)) is not None:
        return text
    rows = []

    def cpu(c: dict, key: str) -> str:
        return sec(c[key]["median_s"]) if key in c else "–"

    for where, key in (("local disk", "local"), (f"S3 ({r['s3_server']})", "s3")):
        c = r[key]
        rows.append(
            [
                where,
                sec(c["save_s"]["median_s"]),
                f"{c['save_MB_per_s']:,.0f}",
                cpu(c, "save_cpu_s"),
                sec(c["restore_s"]["median_s"]),
                f"{c['restore_MB_per_s']:,.0f}",
                cpu(c, "restore_cpu_s"),
            ]
        )
    b = r.get("boto3")
    if b:
        rows.append(
            [
                f"boto3 `put_object` / `get_object` of the same bytes ({b['objects']} objects)",
                sec(b["put_s"]["median_s"]),
                f"{b['bytes'] / 1e6 / b['put_s']['median_s']:,.0f}",
                cpu(b, "put_cpu_s"),
                sec(b["get_s"]["median_s"]),
                f"{b['bytes'] / 1e6 / b['get_s']['median_s']:,.0f}",
                cpu(b, "get_cpu_s"),
            ]
        )
    f = r.get("first_in_new_process")
    if f:
        nbytes = r["s3"]["bytes"]
        for where, side in (
            ("S3, the first restore in a new process", "restore"),
            ("boto3, its first download in a new process", "boto3"),
        ):
            wall = f[f"{side}_wall"]["median_s"]
            rows.append(
                [where, "", "", "", sec(wall), f"{nbytes / 1e6 / wall:,.0f}", sec(f[f"{side}_cpu"]["median_s"])]
            )
    t = table(
        ["where", "save (median)", "save MB/s", "save CPU", "restore (median)", "restore MB/s", "restore CPU"], rows
    )
    c = r["local"]
    head = (
        f"{c['bytes'] / 2**20:,.0f} MiB in {c['leaves']} leaves, {c['layout']}; medians of {c['save_s']['n']} rounds."
    )
    ratio = ""
    if "s3_save_over_boto3" in r:
        ratio = (
            f"\n\nS3 against boto3 for the same bytes (goal ≥ 0.5 saving, ≥ 0.8 restoring): "
            f"save **{r['s3_save_over_boto3']:.2f}**, "
            f"restore **{r['s3_restore_over_boto3']:.2f}**."
        )
        if "s3_restore_over_boto3_per_round" in r:
            ratio += (
                f" Round by round: save {', '.join(map(str, r['s3_save_over_boto3_per_round']))}; restore "
                f"{', '.join(map(str, r['s3_restore_over_boto3_per_round']))}. CPU is this process's, all threads "
                "(the server's is not counted). 1-minute load average at the start of each round: "
                f"{', '.join(str(x) for x in r['load_average_1min_per_round'])}."
            )
    if f:
        ratio += (
            f"\n\nThe first restore in a new process against boto3's first download in another (goal ≥ 0.8): "
            f"**{f['restore_over_boto3']:.2f}**; round by round "
            f"{', '.join(map(str, f['restore_over_boto3_per_round']))}."
        )
    return f"{head}\n\n{t}{ratio}\n\n{provenance(r)}"


def moe_block() -> str:
    r = load("moe")
    if (text := unavailable("moe", r)) is not None:
        return text
    what = {
        "dispatch": "dispatch (parameters replicated, `{batch: data}`)",
        "placement": "placement (dropless, `{batch: expert}`)",
    }
    rows = []
    for comparison, sides in r["comparisons"].items():
        best = {k: min(v[k]["median_s"] for v in sides.values()) for k in ("wall", "cpu")}
        for i, (name, v) in enumerate(sides.items()):
            cells = [f"{1e3 * v[k]['median_s']:,.0f}" for k in ("wall", "cpu")]
            cells = [f"**{c}**" if v[k]["median_s"] == best[k] else c for c, k in zip(cells, ("wall", "cpu"))]
            coll = ", ".join(f"{k} {n}" for k, n in v["collectives"].items()) or "none"
            rows.append([what.get(comparison, comparison) if i == 0 else "", name, *cells, coll])
    s = r["settings"]
    head = (
        f"Mixtral-style, {s['layers']} layers of width {s['embed']} ({s['heads']} heads over {s['kv_heads']} "
        f"key/value heads), {s['experts']} experts of {s['mlp']} per layer, top-{s['top_k']}, vocab {s['vocab']}; "
        f"batch {s['batch']} × seq {s['seq']}, f32; median train step (lower is better)."
    )
    return (
        head
        + "\n\n"
        + table(["comparison", "side", "wall (ms)", "CPU (ms)", "collectives in the step"], rows)
        + f"\n\n{provenance(r)}"
    )


def loss_block() -> str:
    """``bench/loss.py``: the loss's gradient step, fused against full logits and against a baseline commit."""
    r = load("loss")
    if (text := unavailable("loss", r)) is not None:
        return text
    what = {
        "full": "full logits (`cross_entropy_loss`)",
        "blockwise": "fused, blocks of {block} (this commit)",
        "baseline": f"the scan over blocks of {{block}} (`{r.get('baseline')}`)",
    }
    rows = []
    for name, v in r["sides"].items():
        coll = v["collectives"]
        cells = [
            f"{k} {c['runs']}" + (f" (from {c['in_loop']} in loops)" if c["in_loop"] else "") for k, c in coll.items()
        ]
        rows.append(
            [
                what[name].format(block=v["shapes"]["block"]),
                ms(v["wall"]["median_s"]),
                ms(v["cpu"]["median_s"]),
                ", ".join(cells) or "none",
                mib(v["memory"]["peak_bytes"]),
                f"{v['loss']:.6f}",
            ]
        )
    s = next(iter(r["sides"].values()))["shapes"]
    ratios = "; ".join(
        f"fused / {k.split('_over_')[1]}: wall **{v['wall']:.2f}**, CPU **{v['cpu']:.2f}**"
        for k, v in r.items()
        if k.startswith("blockwise_over_")
    )
    head = (
        f"`value_and_grad` of the mean next-token loss over the hidden states and the head, batch {s['batch']} x "
        f"seq {s['seq']}, embed {s['embed']}, vocab {s['vocab']}, f32, FSDP on 8 devices ({r['protocol']})."
    )
    return (
        head
        + "\n\n"
        + table(["loss", "step wall", "step CPU", "collectives per step", "peak per device", "loss value"], rows)
        + f"\n\n{ratios}.\n\n{provenance(r)}"
    )


def decode_block() -> str:
    r = load("decode")
    if (text := unavailable("decode", r)) is not None:
        return text
    rows = []
    for f in r["families"]:
        for row in f["rows"]:
            ttft = row.get("ttft_median_s")
            rows.append(
                [
                    f"{f['family']} ({f['params']:,} parameters)",
                    row["side"],
                    row["batch"],
                    f"{row['tokens_per_s']:,.0f}",
                    ms(row["call_s"]["median_s"]),
                    ms(row["call_cpu_s"]),
                    ms(ttft) if ttft is not None else "",
                ]
            )

    def cpu_ratio(f: dict, b: str) -> float:  # transformers' CPU time per call over ours
        cpu = {row["side"]: row["call_cpu_s"] for row in f["rows"] if str(row["batch"]) == b}
        return cpu["transformers"] / cpu["named"]

    ratios = "; ".join(
        f"{f['family']} "
        + ", ".join(
            f"batch {b} **{cpu_ratio(f, b):.2f}×** (tokens/s {x:.2f}×)"
            for b, x in f["named_over_transformers_tokens_per_s"].items()
        )
        for f in r["families"]
    )
    compiles = ", ".join(f"{f['family']} {f['compiles_during_timing']}" for f in r["families"])
    agree = ", ".join(
        f"{f['family']} batch {b} {x:.0%}" for f in r["families"] for b, x in f["greedy_tokens_agree"].items()
    )
    head = (
        f"Greedy, KV cache, prompt {r['prompt_tokens']} tokens, {r['new_tokens']} new tokens per call; "
        f"transformers {r['transformers']} on torch {r['torch']} ({r['torch_threads']} threads); "
        f"{r['rounds']} rounds taking turns, medians; CPU time is the process's (all its threads)."
    )
    t = table(["model", "side", "batch", "new tokens/s", "call (wall)", "call (CPU)", "time to first token"], rows)
    return (
        f"{head}\n\n{t}\n\ntransformers / named, CPU time per call: {ratios}. XLA compilations during the "
        f"timed calls: {compiles}. Greedy tokens equal to transformers': {agree}.\n\n{provenance(r)}"
    )


def first_step_block() -> str:
    r = load("first_step")
    if (text := unavailable("first_step", r)) is not None:
        return text
    phases = ("first_loss_s", "python_started_s", "imports_s", "compile_s", "cache_read_s", "rest_s")
    peer = r.get("peer") or {}
    sides = {"named-train": r["launches"]} | ({"Levanter train_lm": peer["launches"]} if "launches" in peer else {})
    rows = []
    for kind in r["launches"]:
        for side, launches in sides.items():
            x = launches[kind]
            failed, late = len(x.get("failed", [])), len(x.get("aborted_after_first_loss", []))
            cells = [sec(x[p]) if p in x else "–" for p in phases]
            if failed:
                cells[0] = f"{cells[0]} ({failed} of {x['launches']} aborted)"
            if late:
                cells[0] = f"{cells[0]} ({late} of {x['launches']} aborted after it)"
            rows.append([kind, side, *cells])
    # one line per distinct reason: without the log prefix (time, thread, source line), backticks as quotes
    prefix = re.compile(r"^(exit -?\d+): [EF]\d{4} [\d:.]+\s+\d+ \S+\] (\[id=\d+\] )?")
    aborts = sorted(
        {
            f"{side}: " + prefix.sub(r"\1: ", why).replace("`", "'")
            for side, launches in sides.items()
            for x in launches.values()
            for why in x.get("failed", []) + x.get("aborted_after_first_loss", [])
        }
    )
    t = table(
        [
            "launch",
            "side",
            "first loss (median)",
            "interpreter",
            "imports",
            "compiling",
            "reading the cache",
            "the rest (config, data, init, first step)",
        ],
        rows,
    )
    head = f"`named-train --config {r['config']}` and Levanter's `train_lm` on the same model and text, 1 step; "
    head += f"medians of {r['repeats']} launches each."
    if "launches" in peer:
        ratios = ", ".join(f"{kind} **{x:.2f}**" for kind, x in peer["named_over_levanter"].items())
        v = peer["versions"]
        tail = (
            f"\n\nnamed / Levanter, time to the first loss (medians): {ratios}. Peer: marin-levanter "
            f"{v['marin-levanter']}, marin-haliax {v['marin-haliax']}, jax {v['jax']}."
        )
    else:
        tail = f"\n\nLevanter: skipped ({peer.get('skipped', 'not run')})."
    why = "".join(f"\n\nAborted: `{a}`" for a in aborts)
    return f"{head}\n\n{t}{tail}{why}\n\n{provenance(r)}"


def gpu_block(results: Path = RESULTS, name: str = "gpu_mfu") -> str:
    """bench/gpu_mfu.py's runs (it prints this too, from its --out folder): the training runs,
    then attention alone, then where and with what they ran."""
    r = load(name, results)
    runs = (r or {}).get("runs", [])
    train = [x for x in runs if x.get("model") != "attention"]
    if not train:
        return "_No GPU was lent to this task: no GPU numbers yet._"
    rows = []
    for x in train:
        head = [
            x["model"],
            x["batch"],
            x.get("loss_block") or "",
            x["remat"],
            x["attention"],
            x["mode"],
            x["flags"],
            x.get("segments", "packed"),
        ]
        if "error" in x:
            last = next((ln.strip() for ln in reversed(x["error"].splitlines()) if ln.strip()), "")
            rows.append(head + ["error: " + last[:120].replace("|", "/"), "", "", "", "", ""])
            continue
        peak = x.get("peak_bytes_in_use")
        rows.append(
            head
            + [
                f"{x['step_s']['median_s'] * 1e3:,.1f} ms",
                f"{x['tokens_per_s']:,.0f}",
                "n/a" if x["mfu"] is None else f"{x['mfu']:.1%}",
                "yes" if x["cudnn_attention"] else "no",
                "" if peak is None else f"{peak / 2**30:,.1f} GiB",
                f"{x['compile_s']:.0f} s",
            ]
        )
    out = [
        table(
            [
                "model",
                "batch",
                "loss block",
                "remat",
                "attention",
                "mode",
                "XLA flags",
                "segment ids",
                "step",
                "tokens/s",
                "MFU",
                "cuDNN fMHA in program",
                "peak memory",
                "compile",
            ],
            rows,
        )
    ]
    att = [x for x in runs if x.get("model") == "attention" and "error" not in x]
    arows = []
    for row in att[0]["rows"] if att else []:
        cells = [
            row["shape"],
            f"{row['batch']} × {row['seq']}, heads {row['heads']}/{row['kv_heads']}, d {row['head_size']}",
        ]
        for impl in ("cudnn", "xla"):
            v = row.get(impl, {})
            cells.append(
                "unavailable" if "error" in v else f"{v['median_s'] * 1e3:.2f} ms ({v['tflop_per_s']:.0f} TFLOP/s)"
            )
        cells.append(f"{row['xla_over_cudnn']:.2f}" if "xla_over_cudnn" in row else "")
        err = row.get("cudnn", {}).get("relative_error_vs_f32")
        cells.append(", ".join(f"{k} {v:.1e}" for k, v in err.items()) if err else "")
        arows.append(cells)
    if arows:
        out.append(
            table(
                [
                    "attention alone (fwd + bwd, causal)",
                    "shape",
                    "cuDNN",
                    "XLA",
                    "XLA / cuDNN",
                    "cuDNN vs f32 (relative L2)",
                ],
                arows,
            )
        )
    m = r["machine"]
    ok = [x for x in train if "error" not in x]
    b = ok[0] if ok else train[0]
    out.append(
        f"{m.get('gpu') or b.get('device_kind')} (name, driver, memory, max SM clock); jax {b.get('jax')}, "
        f"jaxlib {m.get('versions', {}).get('jaxlib')}, cuDNN {b.get('cudnn')}; tuned XLA flags "
        f"`{' '.join(r['tuned_xla_flags'])}`"
        + (
            f" (dropped as unknown to this XLA: `{' '.join(r['dropped_xla_flags'])}`)"
            if r.get("dropped_xla_flags")
            else ""
        )
        + f". {provenance(r)}"
    )
    return "\n\n".join(out)


BLOCKS = {
    "machine": machine_block,
    "overhead_f32": lambda: overhead_block("overhead_f32"),
    "overhead_bf16": lambda: overhead_block("overhead_bf16"),
    "peer_f32": lambda: peer_block("peer_f32"),
    "peer_f32_remat_full": lambda: peer_block("peer_f32_remat_full"),
    "peer_llama_f32": lambda: peer_block("peer_llama_f32"),
    "peer_f32_recommended": lambda: recommended_block("peer_f32_recommended"),
    "peer_llama_f32_recommended": lambda: recommended_block("peer_llama_f32_recommended"),
    "compile_depth": compile_block,
    "memory": memory_block,
    "data_ckpt": data_block,
    "data_ckpt_s3": s3_block,
    "moe": moe_block,
    "loss": loss_block,
    "decode": decode_block,
    "first_step": first_step_block,
    "gpu": gpu_block,
    "gpu_segments": lambda: gpu_block(RESULTS, "gpu_mfu_segments"),
}


def main() -> int:
    text = DOC.read_text()
    for name, render in BLOCKS.items():
        pattern = re.compile(rf"(<!-- bench:{name} -->\n).*?(<!-- /bench:{name} -->)", re.S)
        if not pattern.search(text):
            continue
        block = render()
        text = pattern.sub(lambda m: m.group(1) + block + "\n" + m.group(2), text)
    DOC.write_text(text)
    print(f"updated {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
