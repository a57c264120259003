"""``named-eval``: lm-evaluation-harness tasks scored on a checkpoint of a training run.

    named-eval --checkpoint RUN_DIR --tasks hellaswag,arc_easy [--include TASK_FOLDER] [--limit N]
               [--output_path PATH [--log_samples]] [--apply_chat_template [--fewshot_as_multiturn]]
               [--gen_kwargs k=v,k=v]

The model is read onto the run's mesh and parameter mapping when this machine can build it (else
one device) and scored by ``loop.harness.HarnessLM``, batched and under the run's compute mapping
and precision. Every flag, the tasks (each found in ``--include`` or lm-eval's registry) and the
run directory are checked before the checkpoint is read: ConfigError for a flag or a task,
CheckpointError for a path, each naming it. The lm-eval flags are lm-eval's: ``--output_path``
writes its results JSON (``--log_samples`` its samples too, as JSON Lines per task) with lm-eval's
own writer; ``--apply_chat_template`` renders prompts with the run's chat template
(``data.chat_template``, else its tokenizer folder's), ``--fewshot_as_multiturn`` gives few-shot
examples as turns; ``--gen_kwargs`` overrides the tasks' generation arguments (``until``,
``max_gen_toks``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``). Metrics print at full
precision (Python's shortest exact form of each float).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from named.nn.precision import get_policy

from ..config import ConfigError, data_parallel_size
from ..data import load_tokenizer
from ..data.chat_template import ChatFormat
from ..loop.checks import require_harness
from ..loop.registry import max_positions
from .export import read_run, restore_model


@dataclass
class EvalReport:
    step: int
    metrics: dict[str, float]  # "<task>/<metric>" -> value
    results: dict  # lm-eval's whole answer (results, configs, versions, samples when asked)
    files: list[Path] = field(default_factory=list)  # what --output_path wrote

    def __str__(self) -> str:
        from ..loop.harness import PREFIX

        rows = [f"{PREFIX}/{name} {value!r}" for name, value in self.metrics.items()]
        return "\n".join([f"step {self.step}:", *rows, *(f"wrote {p}" for p in self.files)])


def check_eval_flags(
    tasks: list[str],
    *,
    limit: int | None,
    num_fewshot: int | None,
    batch_size: int,
    log_samples: bool = False,
    output_path=None,
    apply_chat_template: bool = False,
    fewshot_as_multiturn: bool = False,
) -> None:
    if not tasks or any(not t.strip() for t in tasks):
        raise ConfigError(f"--tasks must name one or more tasks, comma-separated, got {','.join(tasks)!r}")
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be an integer >= 1 (documents per task), got {limit}")
    if num_fewshot is not None and num_fewshot < 0:
        raise ConfigError(f"--num-fewshot must be an integer >= 0, got {num_fewshot}")
    if batch_size < 1:
        raise ConfigError(f"--batch-size must be an integer >= 1, got {batch_size}")
    if log_samples and output_path is None:
        raise ConfigError("--log_samples writes the samples beside the results: give --output_path too")
    if fewshot_as_multiturn and not apply_chat_template:
        raise ConfigError(
            "--fewshot_as_multiturn gives few-shot examples as chat turns: give --apply_chat_template too"
        )


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
    output_path: str | Path | None = None,
    log_samples: bool = False,
    apply_chat_template: bool = False,
    fewshot_as_multiturn: bool = False,
    gen_kwargs: str | None = None,
) -> EvalReport:
    """``tasks`` scored on the checkpoint ``checkpoint`` (a run directory, its newest checkpoint or
    that of ``step``, or ``<run_dir>/checkpoints/step_N``); see the module docstring. ``samples``
    keeps lm-eval's samples in the report; ``log_samples`` writes them under ``output_path``."""
    check_eval_flags(
        tasks,
        limit=limit,
        num_fewshot=num_fewshot,
        batch_size=batch_size,
        log_samples=log_samples,
        output_path=output_path,
        apply_chat_template=apply_chat_template,
        fewshot_as_multiturn=fewshot_as_multiturn,
    )
    require_harness("named-eval")
    from ..loop.harness import HarnessLM, check_gen_kwargs, check_output_path, evaluate, task_manager, write_results

    out = check_output_path(output_path)
    generation = check_gen_kwargs(gen_kwargs)
    manager = task_manager(tasks, include, "--tasks")
    run_dir, cfg, model_cfg, path = read_run(Path(checkpoint), step)
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.data.eos_token)
    template = ChatFormat.load(tokenizer, cfg.data.chat_template).require_template() if apply_chat_template else None
    model, metadata, mesh = restore_model(cfg, model_cfg, path)
    lm = HarnessLM(
        model,
        tokenizer,
        max_length=max_positions(model_cfg),
        mesh=mesh,
        mapping=cfg.mesh.compute_mapping if mesh is not None else {},
        policy=get_policy(cfg.trainer.precision),
        batch_size=batch_size,
        batch_multiple=data_parallel_size(cfg, dict(mesh.shape)) if mesh is not None else 1,
        chat_template=template,
        seed=cfg.trainer.seed,
    )
    metrics, result = evaluate(
        lm,
        tasks,
        manager=manager,
        limit=limit,
        num_fewshot=num_fewshot,
        samples=samples or log_samples,
        apply_chat_template=apply_chat_template,
        fewshot_as_multiturn=fewshot_as_multiturn,
        gen_kwargs=generation,
    )
    done = int(metadata["step"])
    files = [] if out is None else write_results(result, out, model_name=f"{run_dir.resolve().name}/step_{done}")
    return EvalReport(done, metrics, result, files)
