"""Console scripts: ``named-train``, ``named-sample``, ``named-plan``.

The boundary: bad input (one of our exception types: ConfigError, DataError, CheckpointError,
TrainingError, a NamedError) prints ``error: ...`` and exits 2; an OSError the input did not
cause (a full disk) prints ``error: ...`` and exits 1; anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


class _ArgumentParser(argparse.ArgumentParser):
    """argparse that raises ConfigError naming the flag, where argparse would print its usage and exit."""

    def error(self, message: str):
        from .config import ConfigError

        raise ConfigError(message)


def _split_config_path(argv: list[str]) -> tuple[str | None, list[str]]:
    parser = _ArgumentParser(add_help=False)
    parser.add_argument("--config_path", default=None)
    known, rest = parser.parse_known_args(argv)
    return known.config_path, rest


def _fail(e: BaseException, code: int = 2) -> int:
    print(f"error: {e}", file=sys.stderr)
    return code


def main_train(argv: list[str] | None = None) -> int:
    """``named-train --config_path config/gpt2_nano.yaml [--section.key value ...]``"""
    argv = sys.argv[1:] if argv is None else argv
    from .config import ConfigError, load_config
    from .data import DataError

    try:
        cfg = load_config(*_split_config_path(argv))
    except (ConfigError, DataError) as e:
        return _fail(e)
    from .distributed import describe_failure, exit_now, maybe_initialize

    try:
        multi = maybe_initialize(cfg.distributed)
    except ConfigError as e:
        return _fail(e)
    except Exception as e:  # noqa: BLE001 - e.g. the coordinator unreachable, or the first collective failing
        _fail(e)
        exit_now(1)
    import jax
    from named import NamedError

    from .checkpoint import CheckpointError
    from .train import TrainingError, train

    try:
        result = train(cfg)
    except (ConfigError, DataError, NamedError, CheckpointError, TrainingError) as e:
        if multi:
            exit_now(_fail(RuntimeError(describe_failure(e))))
        return _fail(e)
    except OSError as e:  # the machine, not the input (a full disk): no traceback, exit 1
        if multi:
            exit_now(_fail(RuntimeError(describe_failure(e)), 1))
        return _fail(e, 1)
    except BaseException as e:
        if multi:  # a peer died, or a bug: report it, then don't wait for the others (see exit_now)
            import traceback

            traceback.print_exc()
            _fail(RuntimeError(describe_failure(e)))
            exit_now(130 if isinstance(e, KeyboardInterrupt) else 1)
        raise
    if result.losses and jax.process_index() == 0:
        print(f"done: {len(result.losses)} steps, loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}; run dir {result.run_dir}")
    elif result.message and jax.process_index() == 0:
        print(result.message)
    return 0


def main_sample(argv: list[str] | None = None) -> int:
    """``named-sample --checkpoint RUN_DIR_OR_CHECKPOINT --prompt "def " [--tokens 100]``"""
    p = _ArgumentParser(prog="named-sample")
    p.add_argument("--checkpoint", required=True, help="a run directory (newest checkpoint) or a checkpoint folder")
    p.add_argument("--prompt", default="")
    p.add_argument("--tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    from named import NamedError

    from .checkpoint import CheckpointError
    from .config import ConfigError
    from .data import DataError
    from .sample import sample_from_checkpoint

    try:
        a = p.parse_args(sys.argv[1:] if argv is None else argv)
        text = sample_from_checkpoint(Path(a.checkpoint), a.prompt, a.tokens, temperature=a.temperature, seed=a.seed)
    except (NamedError, CheckpointError, ConfigError, DataError) as e:
        return _fail(e)
    except OSError as e:  # the machine, not the input: no traceback, exit 1
        return _fail(e, 1)
    print(text)
    return 0


def main_plan(argv: list[str] | None = None) -> int:
    """``named-plan --config_path ... [--compile]``: mesh, each parameter's layout, bytes per device
    and the microbatch plan, without training; ``--compile`` adds the compiled train step's
    collectives, memory per device and FLOPs."""
    from .plan import main

    return main(argv)
