"""``named-eval``: lm-evaluation-harness tasks scored on a checkpoint of a training run.

    named-eval --checkpoint RUN_DIR --tasks hellaswag,arc_easy [--include TASK_FOLDER] [--limit N]

The model is read onto the run's mesh and parameter mapping when this machine can build it (else
one device) and scored by ``loop.harness.HarnessLM``, batched and under the run's compute mapping
and precision. Every flag, the tasks (each found in ``--include`` or lm-eval's registry) and the
run directory are checked before the checkpoint is read: ConfigError for a flag or a task,
CheckpointError for a path, each naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from named.nn.precision import get_policy

from ..config import ConfigError, data_parallel_size, to_mapping
from ..data import load_tokenizer
from ..loop.checks import require_harness
from ..loop.registry import max_positions
from .export import read_run, restore_model


@dataclass
class EvalReport:
    step: int
    metrics: dict[str, float]  # "<task>/<metric>" -> value
    results: dict  # lm-eval's whole answer (results, configs, versions, samples when asked)

    def __str__(self) -> str:
        from ..loop.harness import PREFIX

        rows = [f"{PREFIX}/{name} {value:.6g}" for name, value in self.metrics.items()]
        return "\n".join([f"step {self.step}:", *rows])


def check_eval_flags(tasks: list[str], *, limit: int | None, num_fewshot: int | None, batch_size: int) -> None:
    if not tasks or any(not t.strip() for t in tasks):
        raise ConfigError(f"--tasks must name one or more tasks, comma-separated, got {','.join(tasks)!r}")
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be an integer >= 1 (documents per task), got {limit}")
    if num_fewshot is not None and num_fewshot < 0:
        raise ConfigError(f"--num-fewshot must be an integer >= 0, got {num_fewshot}")
    if batch_size < 1:
        raise ConfigError(f"--batch-size must be an integer >= 1, got {batch_size}")


def evaluate_checkpoint(
    checkpoint: str | Path,
    tasks: list[str],
    *,
    include: str | Path | None = None,
    step: int | None = None,
    limit: int | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 8,
    samples: bool = False,
) -> EvalReport:
    """``tasks`` scored on the checkpoint ``checkpoint`` (a run directory, its newest checkpoint or
    that of ``step``, or ``<run_dir>/checkpoints/step_N``); see the module docstring."""
    check_eval_flags(tasks, limit=limit, num_fewshot=num_fewshot, batch_size=batch_size)
    require_harness("named-eval")
    from ..loop.harness import HarnessLM, evaluate, task_manager

    manager = task_manager(tasks, include, "--tasks")
    _, cfg, model_cfg, path = read_run(Path(checkpoint), step)
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.data.eos_token)
    model, metadata, mesh = restore_model(cfg, model_cfg, path)
    lm = HarnessLM(
        model,
        tokenizer,
        max_length=max_positions(model_cfg),
        mesh=mesh,
        mapping=to_mapping(cfg.mesh.compute_mapping) if mesh is not None else {},
        policy=get_policy(cfg.trainer.precision),
        batch_size=batch_size,
        batch_multiple=data_parallel_size(cfg, dict(mesh.shape)) if mesh is not None else 1,
    )
    metrics, result = evaluate(lm, tasks, manager=manager, limit=limit, num_fewshot=num_fewshot, samples=samples)
    return EvalReport(int(metadata["step"]), metrics, result)
