"""Console scripts: ``named-train``, ``named-sample``, ``named-plan``, ``named-export``, ``named-data``,
``named-eval``, ``named-plot``.

The boundary: bad input (one of our exception types: ConfigError, DataError, CheckpointError,
TrainingError, a NamedError) prints ``error: ...`` and exits 2; an OSError the input did not
cause (a full disk) prints ``error: ...`` and exits 1; anything else is a bug and keeps its
traceback.

A config is ``--config_path FILE`` or ``--config NAME``: a file, or one of the configs shipped
with the package (``named-train --config gpt2_nano`` works from a pip install).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

# What the console scripts need beyond `pip install named-jax` (the [train] extra).
_TRAIN_EXTRAS = ("draccus", "optax", "tensorstore")


class _ArgumentParser(argparse.ArgumentParser):
    """argparse that raises ConfigError naming the flag, where argparse would print its usage and exit."""

    def error(self, message: str):
        from ..config import ConfigError

        raise ConfigError(message)


def _config_flags(p: argparse.ArgumentParser) -> None:
    from ..config.read import shipped_configs  # the config reader needs the training extras: imported on use

    p.add_argument("--config_path", metavar="FILE", help="a YAML config file")
    p.add_argument("--config", metavar="NAME", help=f"a YAML file or a shipped config: {', '.join(shipped_configs())}")


def _config_of(a: argparse.Namespace) -> str | None:
    from ..config.read import config_file

    return config_file(a.config_path, a.config)


def _missing_extras(prog: str) -> int | None:
    """Exit code 2 with the install line when the training extras are not installed."""
    missing = [m for m in _TRAIN_EXTRAS if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    print(
        f"error: {prog} needs the training extras ({', '.join(missing)} not installed): pip install 'named-jax[train]'",
        file=sys.stderr,
    )
    return 2


def report_failure(e: BaseException, code: int = 2) -> int:
    print(f"error: {e}", file=sys.stderr)
    return code


def _guarded(body) -> int:
    """``body()``'s exit code, with our errors as one line on stderr and exit 2, the machine's
    (OSError) as exit 1, and ``--help`` as argparse's code: never a traceback for either."""
    from named import NamedError

    try:
        return body()
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except NamedError as e:  # ours; one that is an OSError too (FileWriteError) is the machine's: exit 1
        return report_failure(e, 1 if isinstance(e, OSError) else 2)
    except OSError as e:  # the machine, not the input: no traceback, exit 1
        return report_failure(e, 1)


def main_train(argv: list[str] | None = None) -> int:
    """``named-train --config_path config/gpt2_nano.yaml [--section.key value ...]``"""
    argv = sys.argv[1:] if argv is None else argv
    if (code := _missing_extras("named-train")) is not None:
        return code
    from named import NamedError

    from ..config import ConfigError, load_config

    try:
        cfg = load_config(None, argv)
    except NamedError as e:
        return report_failure(e)
    except SystemExit as e:  # --help: every key, from the config's declarations
        return int(e.code or 0)
    from ..loop.distributed import describe_failure, exit_now, maybe_initialize, peer_failed

    _safe_cpu_backends()
    try:
        multi = maybe_initialize(cfg.distributed)
    except ConfigError as e:
        return report_failure(e)
    except Exception as e:  # noqa: BLE001 - e.g. the coordinator unreachable, or the first collective failing
        report_failure(e)
        exit_now(1)
    import jax

    from ..loop.train import train

    try:
        if cfg.mesh.layout == "auto":
            if multi:
                raise ConfigError(
                    "mesh.layout: auto searches on one process; for several, run named-plan --search and give its flags"
                )
            from .plan_search import resolve_layout

            cfg, chosen = resolve_layout(cfg, progress=search_progress)
            print(chosen, flush=True)
        result = train(cfg)
    except NamedError as e:  # every error of ours: ConfigError, DataError, CheckpointError, TrainingError, ...
        if multi:
            exit_now(report_failure(RuntimeError(describe_failure(e))))
        return report_failure(e)
    except OSError as e:  # the machine, not the input (a full disk): no traceback, exit 1
        if multi:
            exit_now(report_failure(RuntimeError(describe_failure(e)), 1))
        return report_failure(e, 1)
    except BaseException as e:
        if multi:  # a peer died, or a bug: report it, then don't wait for the others (see exit_now)
            if not peer_failed(e):  # a bug keeps its traceback; a dead peer's broken collective is one line
                import traceback

                traceback.print_exc()
            report_failure(RuntimeError(describe_failure(e)))
            exit_now(130 if isinstance(e, KeyboardInterrupt) else 1)
        raise
    if result.stopped_by:  # a stop signal: checkpoint committed, resumable (trainer.stop_signals)
        from ..loop.stop import exit_code

        return exit_code(result.stopped_by)
    if result.losses and jax.process_index() == 0:
        counted = [x for x in result.losses if not math.isnan(x)] or [math.nan]  # NaN: a step without loss tokens
        empty = result.steps_without_loss_tokens
        said = f" ({empty} steps had no loss token: left out)" if empty else ""
        print(
            f"done: {len(result.losses)} steps, loss {counted[0]:.4f} -> {counted[-1]:.4f}{said}; "
            f"run dir {result.run_dir}"
        )
    elif result.message and jax.process_index() == 0:
        print(result.message)
    return 0


def main_sample(argv: list[str] | None = None) -> int:
    """``named-sample --checkpoint RUN_DIR_OR_CHECKPOINT (--prompt "def " | --chat ["a user message"]
    [--system TEXT] [--messages FILE] | --messages FILE) [--tokens 100]``"""
    if (code := _missing_extras("named-sample")) is not None:
        return code
    p = _ArgumentParser(prog="named-sample")
    p.add_argument("--checkpoint", required=True, help="a run directory (newest checkpoint) or a checkpoint folder")
    p.add_argument("--prompt", default="")
    from .sample import INTERACTIVE, chat_session, read_messages, sample_from_checkpoint

    p.add_argument(
        "--chat",
        metavar="MESSAGE",
        nargs="?",
        const=INTERACTIVE,
        help="a user message, rendered with the run's chat template; prints the reply, which ends at the "
        "tokenizer's eos or end-of-turn token. Without MESSAGE: a conversation, one user message per "
        "line of stdin (/reset starts over, /exit or end of input ends it)",
    )
    p.add_argument("--system", metavar="TEXT", help="a system prompt, first in the conversation")
    p.add_argument(
        "--messages",
        metavar="FILE",
        help="a conversation to continue: a JSON list of {role, content} or JSON Lines, one message per line",
    )
    p.add_argument("--tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, metavar="K", help="draw a sampled token from the K likeliest")
    p.add_argument("--top-p", type=float, metavar="P", help="draw from the likeliest tokens holding probability P")
    p.add_argument(
        "--logprobs", action="store_true", help="after the text, each new token's id, text and log-probability"
    )
    p.add_argument("--seed", type=int, default=0)

    def body() -> int:
        _safe_cpu_backends()
        a = p.parse_args(sys.argv[1:] if argv is None else argv)
        messages = read_messages(Path(a.messages)) if a.messages is not None else None
        if a.chat == INTERACTIVE:
            if a.logprobs:
                from ..config import ConfigError

                raise ConfigError("--logprobs is for one continuation or reply, not a --chat session")
            return chat_session(
                Path(a.checkpoint),
                a.tokens,
                temperature=a.temperature,
                top_k=a.top_k,
                top_p=a.top_p,
                seed=a.seed,
                system=a.system,
                messages=messages,
                prompt=a.prompt,
            )
        print(
            sample_from_checkpoint(
                Path(a.checkpoint),
                a.prompt,
                a.tokens,
                temperature=a.temperature,
                seed=a.seed,
                chat=a.chat,
                system=a.system,
                messages=messages,
                top_k=a.top_k,
                top_p=a.top_p,
                logprobs=a.logprobs,
            )
        )
        return 0

    return _guarded(body)


def main_export(argv: list[str] | None = None) -> int:
    """``named-export --checkpoint RUN_DIR [--step N] --out FOLDER [--merge | --adapters-only]
    [--max-shard-size 2GB] [--overwrite]``: a checkpoint as a Hugging Face folder (see ``export``)."""
    if (code := _missing_extras("named-export")) is not None:
        return code
    p = _ArgumentParser(
        prog="named-export",
        allow_abbrev=False,
        description="Write a checkpoint of a named-train run as a Hugging Face folder that "
        "transformers (or, with --adapters-only, peft) loads.",
    )
    p.add_argument(
        "--checkpoint",
        required=True,
        metavar="RUN_DIR",
        help="a run directory (its newest checkpoint, or --step) or a checkpoint folder <run_dir>/checkpoints/step_N",
    )
    p.add_argument("--step", type=int, metavar="N", help="the step of the checkpoint to export (default: the newest)")
    p.add_argument(
        "--out", required=True, metavar="FOLDER", help="the folder to write (written whole, then renamed into place)"
    )
    lora = p.add_mutually_exclusive_group()
    lora.add_argument("--merge", action="store_true", help="a LoRA run: fold the adapters into the weights")
    lora.add_argument("--adapters-only", action="store_true", help="a LoRA run: write a PEFT adapter folder")
    p.add_argument(
        "--max-shard-size", metavar="SIZE", help="split the safetensors into files of at most SIZE (e.g. 2GB)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    from .export import export

    def body() -> int:
        a = p.parse_args(sys.argv[1:] if argv is None else argv)
        print(
            export(
                Path(a.checkpoint),
                Path(a.out),
                step=a.step,
                merge=a.merge,
                adapters_only=a.adapters_only,
                max_shard_size=a.max_shard_size,
                overwrite=a.overwrite,
            )
        )
        return 0

    return _guarded(body)


def main_eval(argv: list[str] | None = None) -> int:
    """``named-eval --checkpoint RUN_DIR --tasks T1,T2 [--include FOLDER] [--step N] [--limit N]
    [--num-fewshot K] [--batch-size B] [--output_path PATH] [--log_samples] [--apply_chat_template]
    [--fewshot_as_multiturn] [--gen_kwargs K=V,...]``: lm-evaluation-harness tasks on a checkpoint
    (see ``evaluate``)."""
    if (code := _missing_extras("named-eval")) is not None:
        return code
    p = _ArgumentParser(
        prog="named-eval",
        allow_abbrev=False,
        description="Score lm-evaluation-harness tasks on a checkpoint of a named-train run.",
    )
    p.add_argument(
        "--checkpoint",
        required=True,
        metavar="RUN_DIR",
        help="a run directory (its newest checkpoint, or --step) or a checkpoint folder <run_dir>/checkpoints/step_N",
    )
    p.add_argument("--tasks", required=True, help="lm-eval task names, comma-separated")
    p.add_argument("--include", metavar="FOLDER", help="a folder of task YAML files of your own")
    p.add_argument("--step", type=int, metavar="N", help="the step of the checkpoint (default: the newest)")
    p.add_argument("--limit", type=int, metavar="N", help="score only the first N documents of each task")
    p.add_argument("--num-fewshot", type=int, metavar="K", help="few-shot examples per prompt (default: the task's)")
    p.add_argument("--batch-size", type=int, default=8, metavar="B", help="rows per forward pass (default 8)")
    p.add_argument(
        "--output_path", "--output-path", metavar="PATH", help="write lm-eval's results JSON in this folder (or .json)"
    )
    p.add_argument("--log_samples", "--log-samples", action="store_true", help="write every sample too (JSON Lines)")
    p.add_argument(
        "--apply_chat_template",
        "--apply-chat-template",
        action="store_true",
        help="render prompts with the run's chat template",
    )
    p.add_argument(
        "--fewshot_as_multiturn",
        "--fewshot-as-multiturn",
        action="store_true",
        help="give few-shot examples as chat turns (with --apply_chat_template)",
    )
    p.add_argument(
        "--gen_kwargs", "--gen-kwargs", metavar="K=V,...", help="generation arguments over the tasks' (k=v,k=v)"
    )
    from .evaluate import evaluate_checkpoint

    def body() -> int:
        _safe_cpu_backends()
        a = p.parse_args(sys.argv[1:] if argv is None else argv)
        print(
            evaluate_checkpoint(
                Path(a.checkpoint),
                [t.strip() for t in a.tasks.split(",")],
                include=a.include,
                step=a.step,
                limit=a.limit,
                num_fewshot=a.num_fewshot,
                batch_size=a.batch_size,
                output_path=a.output_path,
                log_samples=a.log_samples,
                apply_chat_template=a.apply_chat_template,
                fewshot_as_multiturn=a.fewshot_as_multiturn,
                gen_kwargs=a.gen_kwargs,
            )
        )
        return 0

    return _guarded(body)


def main_plan(argv: list[str] | None = None) -> int:
    """``named-plan --config NAME [--devices N] [--compile] [--search] [--section.key value ...]``:
    the mesh, every parameter's layout and bytes per device, an activation estimate and the
    microbatch plan, without training; ``--compile`` adds the compiled train step's collectives,
    memory and FLOPs per device; ``--search`` ranks the layouts that fit."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if (code := _missing_extras("named-plan")) is not None:
        return code
    from ..config import ConfigError, load_config

    p = _ArgumentParser(
        prog="named-plan",
        allow_abbrev=False,
        description="What a config would do on a set of devices, without training: the mesh, every "
        "parameter's layout and bytes per device, an activation estimate and the microbatch plan.",
        epilog="Any config key can be overridden as in named-train: --section.key value.",
    )
    _config_flags(p)
    p.add_argument(
        "--devices",
        type=int,
        metavar="N",
        help="plan for N devices (stand-in CPU devices here; nothing to set up); default: this machine's",
    )
    p.add_argument(
        "--device-kind",
        metavar="KIND",
        help="the accelerator to plan for (H100, H200, A100, L4, v5e, v5p, v6e, v4); "
        "default: this machine's, where known",
    )
    p.add_argument("--device-memory", metavar="SIZE", help="memory per device, e.g. 16GiB (default: the device kind's)")
    p.add_argument(
        "--compile",
        action="store_true",
        help="compile the train step on abstract inputs: collectives, memory and FLOPs per device",
    )
    p.add_argument(
        "--search",
        action="store_true",
        help="compile every layout that fits the devices (DP, FSDP, FSDP+TP, TP x remat x microbatches) "
        "and rank them by a roofline estimate",
    )
    p.add_argument(
        "--measure",
        type=int,
        metavar="K",
        default=0,
        help="with --search: also train the first K layouts that fit for a few steps on this machine's devices "
        "and rank those by the measured step time",
    )
    p.add_argument(
        "--html",
        metavar="PAGE",
        help="also write one self-contained HTML page: memory per device of every layout --search tries first "
        "(remat none/full, 1/2/4 microbatches; selects pick one), the device grid, and --search's ranking",
    )

    def body() -> int:
        a, rest = p.parse_known_args(argv)
        if a.devices is not None and not 1 <= a.devices <= MAX_STAND_INS:
            raise ConfigError(f"--devices must be in [1, {MAX_STAND_INS}], got {a.devices}: {_STAND_IN_LIMIT}")
        from .plan import Target, plan_report
        from .plan_search import roofline, search_report

        # What needs no devices comes first: standing many in takes minutes, and a refusal needs none.
        if a.measure and not a.search:
            raise ConfigError("--measure K times the first K layouts of --search: give --search too")
        if a.measure < 0:
            raise ConfigError(f"--measure must be at least 0, got {a.measure}")
        if a.measure and (a.device_kind is not None or a.devices is not None):
            raise ConfigError(
                "--measure times layouts on this machine's own devices: leave out --device-kind and --devices"
            )
        cfg = load_config(_config_of(a), rest)
        target = Target.of(a.device_kind, a.device_memory, stand_ins=a.devices is not None, calibrate=a.search)
        if a.search:
            roofline(cfg, target)
        if a.html is not None:
            from ..data import check_target

            folder = os.path.dirname(os.path.abspath(a.html))
            if not os.path.isdir(a.html) and not os.path.isdir(folder):
                raise ConfigError(
                    f"--html {a.html} is in a folder that does not exist ({folder}): name the page's file, "
                    "e.g. --html plan.html"
                )
            check_target(Path(a.html), "--html", "plan.html")
        if a.devices is not None:
            from ..loop.checks import check_device_count

            check_device_count(cfg, a.devices, 1)
            if not stand_in_devices(a.devices):
                return plan_in_child(argv, a.devices)
        print(plan_report(cfg, compile=a.compile, target=target))
        from .explore import Explorer

        explorer = Explorer(cfg, target=target) if a.html is not None else None
        if a.search:
            ranked = (explorer or Explorer(cfg, target=target)).search(
                search_progress, measure=a.measure, measured=measure_progress
            )
            print("\n" + search_report(cfg, target, ranked))
        if explorer is not None:
            from ..data import atomic_write
            from .explore import report_page

            page = report_page(explorer, compile=a.compile, search=a.search)
            with atomic_write(Path(a.html)) as f:
                f.write(page.encode("utf-8"))
            print(f"\nwrote {a.html}")
        return 0

    return _guarded(body)


def main_plot(argv: list[str] | None = None) -> int:
    """``named-plot RUN [RUN ...] [--out curves.png]``: loss, evaluation losses per source, learning
    rate, gradient norm and tokens/s from each run's metrics.jsonl, the runs overlaid."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if importlib.util.find_spec("matplotlib") is None:
        print("error: named-plot needs matplotlib: pip install 'named-jax[notebook]'", file=sys.stderr)
        return 2
    p = _ArgumentParser(
        prog="named-plot",
        allow_abbrev=False,
        description="Training curves from run directories (their metrics.jsonl), several runs overlaid.",
    )
    p.add_argument("runs", nargs="+", type=Path, metavar="RUN", help="a run directory (or its metrics.jsonl)")
    p.add_argument("--out", type=Path, default=Path("curves.png"), help="a .png or .html file (default: curves.png)")
    p.add_argument(
        "--smooth", type=float, default=0.0, metavar="W", help="smooth each curve, TensorBoard's weight in [0, 1)"
    )

    def body() -> int:
        from .plot import plot_runs

        a = p.parse_args(argv)
        print("\n".join(plot_runs(a.runs, a.out, a.smooth)))
        return 0

    return _guarded(body)


def main_data(argv: list[str] | None = None) -> int:
    """``named-data build --config NAME [--ray ADDRESS|auto] [--section.key value ...]``: tokenise the
    config's data into ``data.cache_dir`` ahead of training, on this machine or a Ray cluster.
    ``named-data show --config NAME [--rows 3] [--start 0] [--split train] [--source NAME]
    [--section.key value ...]``: packed rows as the model sees them, each sample on its line and
    the tokens that carry loss in ``[[...]]`` (``data._show``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if (code := _missing_extras("named-data")) is not None:
        return code
    from ..config import ConfigError, load_config

    p = _ArgumentParser(prog="named-data", allow_abbrev=False, description="Prepare or inspect a config's data.")
    commands = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    epilog = "Any config key can be overridden as in named-train: --section.key value."
    build = commands.add_parser(
        "build",
        allow_abbrev=False,
        help="tokenise every source of the config's data section into its cache (data.cache_dir)",
        epilog=epilog,
    )
    _config_flags(build)
    build.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="tokenise on the Ray cluster at ADDRESS ('auto': the one this machine belongs to; "
        "ray://HOST:10001 through Ray client); every node must see the sources and data.cache_dir",
    )
    show = commands.add_parser(
        "show",
        allow_abbrev=False,
        help="packed rows of the config's data: the sample boundaries and the tokens that carry loss",
        epilog=epilog,
    )
    _config_flags(show)
    show.add_argument("--rows", type=int, default=3, metavar="N", help="how many rows (default 3)")
    show.add_argument("--start", type=int, default=0, metavar="ROW", help="the first row shown (default 0)")
    show.add_argument("--split", choices=["train", "validation"], default="train")
    show.add_argument("--source", metavar="NAME", help="one named source of data.train (default: all, as one range)")
    show.add_argument(
        "--ids", action="store_true", help="each sample's token ids and labels (-100: no loss) under its text"
    )

    def run_build(a, rest) -> int:
        from ..data import ClusterError
        from .data import build_report

        cfg = load_config(_config_of(a), rest)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")  # the build's progress lines
        try:
            print(build_report(cfg.data, ray=a.ray))
        except ClusterError as e:  # the cluster's fault, not the input's: as an OSError is
            return report_failure(e, 1)
        return 0

    def run_show(a, rest) -> int:
        from ..data import Mixture, build_data, show_rows

        if a.rows < 1 or a.start < 0:
            raise ConfigError(f"--rows must be at least 1 and --start at least 0, got {a.rows} and {a.start}")
        data = build_data(load_config(_config_of(a), rest).data)
        rows = data.train if a.split == "train" else data.validation
        if rows is None:
            raise ConfigError("--split validation: this config holds out no validation data (data.val_fraction: 0)")
        if a.source is not None:
            if a.split == "validation":
                named = data.validation_sources
            else:
                named = dict(zip(rows.names, rows.sources)) if isinstance(rows, Mixture) else {}
            if a.source not in named:
                raise ConfigError(f"--source {a.source!r} is not a named source of data.{a.split}: {sorted(named)}")
            rows = named[a.source]
        if a.start >= len(rows):
            raise ConfigError(f"--start {a.start} is past the {len(rows)} rows of the {a.split} split")
        indices = range(a.start, min(a.start + a.rows, len(rows)))
        print(show_rows(rows, data.tokenizer, list(indices), a.split if a.source is None else a.source, ids=a.ids))
        return 0

    def body() -> int:
        a, rest = p.parse_known_args(argv)
        return (run_build if a.command == "build" else run_show)(a, rest)

    return _guarded(body)


def search_progress(done: int, total: int, c, best) -> None:
    """One line on stderr per layout ``--search`` (or ``mesh.layout: auto``) has planned and compiled."""
    from .plan_search import describe

    what = f"cannot run ({c.error})" if c.error else f"{c.memory / 2**30:.3g} GiB/device"
    lead = f"; best so far: {describe(best)}" if best is not None and not best.error else ""
    print(f"search {done}/{total}: {describe(c)}: {what}{lead}", file=sys.stderr, flush=True)


def measure_progress(c) -> None:
    from .plan_search import describe

    print(f"measured {describe(c)}: {c.measured * 1e3:.3g} ms/step", file=sys.stderr, flush=True)


# How many CPU devices named-plan stands in, at most. Each costs host memory and start-up time (8192
# took 16 s and 1 GB to plan here; 100000 crashed XLA), and XLA's flag parser aborts on a count past
# int32. The largest single slices people train on (a TPU v5p pod, 8960 chips) fit under it.
MAX_STAND_INS = 16384
_STAND_IN_LIMIT = (
    "each planned device is a CPU device standing in on this machine; plan a slice of a larger "
    "cluster (its layout repeats across slices)"
)


def _safe_cpu_backends() -> None:
    """Before JAX starts its backends: with the persistent compilation cache on
    (``JAX_COMPILATION_CACHE_DIR``), compile for XLA:CPU with the flag under which programs loaded
    back from the cache run (``named.internal.cache_safe_xla_flags`` says why); with several CPU
    devices, give XLA:CPU's thread pools room for their collectives (``named.internal.safe_cpu_env``)."""
    from named.internal import safe_cpu_env

    os.environ.update(safe_cpu_env(os.environ))


def stand_in_devices(n: int) -> bool:
    """Make JAX see ``n`` CPU devices, unless this process already started its backends (then
    False: the caller plans in a fresh process). The planned-for kind comes from --device-kind."""
    import jax

    from named.internal import backends_initialized

    if backends_initialized():
        return len(jax.devices()) == n
    os.environ["XLA_FLAGS"] = stand_in_flags(os.environ.get("XLA_FLAGS", ""), n)
    jax.config.update("jax_platforms", "cpu")
    return True


def stand_in_flags(flags: str, n: int) -> str:
    """``flags`` for ``n`` stand-in CPU devices. Their programs are compiled to be read (collectives,
    FLOPs, buffers: XLA's HLO passes), never run or timed (--measure refuses --devices), so their
    machine code is made the cheapest way (``named.internal.cheap_codegen_flags``). The README's 1-layer GPT-2 search
    on 8 stand-ins, 2 cores: 140 s of wall and 208 s of CPU at LLVM's default level, 96 s and 126 s at
    0; then 63 s and 82 s against 40 s and 43 s without the fusion emitters, the same layouts in the
    same order and the same memory, the HBM column within 0.3 % (without the emitters XLA rewrites a
    scatter into a loop); docs/trainer.md has the figure for one LLVM module per program. An option
    the user set is kept."""
    from named.internal import cheap_codegen_flags

    kept = [f for f in flags.split() if not f.startswith("--xla_force_host_platform_device_count")]
    for option in cheap_codegen_flags():
        if not any(f.split("=")[0] == option.split("=")[0] for f in kept):
            kept.append(option)
    return " ".join([*kept, f"--xla_force_host_platform_device_count={n}"])


def plan_in_child(argv: list[str], n: int) -> int:
    env = {**os.environ, "XLA_FLAGS": stand_in_flags(os.environ.get("XLA_FLAGS", ""), n), "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "named.trainer.commands.cli", "plan", *argv], env=env).returncode


if __name__ == "__main__":  # `python -m named.trainer.commands.cli plan|train|sample|export|data|eval|plot ...`
    _MAINS = {
        "plan": main_plan,
        "train": main_train,
        "sample": main_sample,
        "export": main_export,
        "data": main_data,
        "eval": main_eval,
        "plot": main_plot,
    }
    if len(sys.argv) < 2 or sys.argv[1] not in _MAINS:
        sys.exit(f"usage: python -m named.trainer.commands.cli {{{'|'.join(_MAINS)}}} ...")
    sys.exit(_MAINS[sys.argv[1]](sys.argv[2:]))
