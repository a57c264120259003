"""lm-evaluation-harness on our models: ``named-eval`` and the loop's ``trainer.eval_harness_*`` keys.

``HarnessLM`` is lm-eval's ``LM`` (through its ``TemplateLM``, which encodes a context and its
continuation exactly as its Hugging Face backend does) over a model laid out on a mesh:

- ``loglikelihood``: each request's tokens, cut to the model's positions from the left as the
  HF backend cuts them, scored in batches of ``batch_size`` rows (padded to a multiple of the
  data-parallel devices and to a power-of-two length, so a few programs serve every request)
  by one jitted forward under the compute mapping; a row's log-probability is the sum over its
  continuation's tokens, and it is greedy when each of them is the argmax;
- ``loglikelihood_rolling``: lm-eval's own disjoint windows of the model's positions (each
  token scored once, after the bos or eos prefix), scored as above and summed per document;
- ``generate_until``: decoding (``models.generate``) of at most ``max_gen_toks`` tokens, stopped
  at eos and cut before the first of the request's ``until`` strings: greedy, the requests
  ``batch_size`` rows at a time (prompts of different lengths together, padded to a power-of-two
  length; a batch ends when each of its rows has given eos), or, when ``do_sample`` is true,
  sampled as transformers' generate samples (``temperature``, ``top_k``, ``top_p``), one request
  at a time with its own key from ``seed``;
- ``apply_chat_template``: the run's chat template (lm-eval's ``--apply_chat_template``).

``evaluate`` runs tasks by name, from lm-eval's registry or from YAML files in a folder of
one's own (``include``; searched alone first, so a folder holding every task asked for needs no
index of lm-eval's thousands), and returns the metrics as ``{"<task>/<metric>": value}``.

lm-eval is an optional extra (``pip install 'named-jax[eval]'``): this module imports it, so its
callers import it only after ``checks.require_harness`` said that lm-eval is there.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM

import named as nm
from named import models
from named.nn.precision import cast_for_compute

from ..config import ConfigError

MIN_BUCKET = 16  # the shortest padded length: shorter rows share its program
PREFIX = "eval_harness"  # the metrics' names: eval_harness/<task>/<metric>, in named-eval and in the loop


class HarnessLM(TemplateLM):
    """lm-eval's model interface over ``model`` (laid out on ``mesh``; forward under the compute ``mapping``)."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        max_length: int,
        mesh=None,
        mapping: dict | None = None,
        policy=None,
        batch_size: int = 8,
        batch_multiple: int = 1,
        chat_template=None,
        seed: int = 0,
    ):
        super().__init__()
        self.model, self._tok, self.max_length = model, tokenizer, max_length
        self._chat, self._seed = chat_template, seed  # a data.chat_template.ChatTemplate, for apply_chat_template
        self._hf = _as_transformers_reads(tokenizer)
        self.mesh, self.mapping = mesh, dict(mapping or {})
        self.batch_rows = math.ceil(max(batch_size, 1) / batch_multiple) * batch_multiple

        def score(model, ids, targets):
            m = cast_for_compute(model, policy) if policy is not None else model
            logits, _ = models.forward_with_aux(m, ids)
            logp = jax.nn.log_softmax(logits.rearrange(("batch", "position", "vocab")).array.astype(jnp.float32))
            tgt = targets.rearrange(("batch", "position")).array
            picked = jnp.take_along_axis(logp, tgt[..., None], axis=-1)[..., 0]
            greedy = jnp.argmax(logp, axis=-1) == tgt
            return nm.named(picked, ("batch", "position")), nm.named(greedy, ("batch", "position"))

        self._score = nm.named_jit(score, mapping=self.mapping, out_mapping={})

    # ---- what TemplateLM asks of a model -------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self._tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        """The token before a document or an empty context: bos where the tokenizer has one, else
        eos (as lm-eval's HF backend chooses)."""
        bos = self._tok.special_id("bos") if hasattr(self._tok, "special_id") else None
        return bos if bos is not None else self._tok.eos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """``string``'s ids as lm-eval's HF backend takes them from ``transformers``: special-token
        text parsed, and the tokenizer's own special tokens (a bos its post-processor adds) unless
        ``add_special_tokens`` is False or the text already starts with the prefix token."""
        if self._hf is None:  # the byte tokenizer: no special tokens to add or parse
            return list(self._tok.encode(string))
        if add_special_tokens is None:
            prefix = self._hf.id_to_token(self.prefix_token_id)
            add_special_tokens = not (prefix and string.startswith(prefix))
        return self._hf.encode(string, add_special_tokens=add_special_tokens).ids

    def tok_decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))

    # ---- chat templates (lm-eval's --apply_chat_template) --------------------------------------------

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self._tok, "path", "byte"))

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self._chat.text if self._chat is not None and chat_template not in (False, None) else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation rendered with the run's chat template, as the run's chat data was."""
        if self._chat is None:
            raise ConfigError("--apply_chat_template: this evaluation was set up without the run's chat template")
        return self._chat.render(chat_history, add_generation_prompt=add_generation_prompt)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        rows = []
        for _, context_enc, continuation_enc in requests:
            whole = (list(context_enc) + list(continuation_enc))[-(self.max_length + 1) :]
            rows.append((whole, len(continuation_enc)))
        return self.score_rows(rows)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for (string,) in [r.args for r in requests]:
            windows = map(
                lm_utils.make_disjoint_window,
                lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            )
            scored = self._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in windows])
            out.append(sum(lp for lp, _ in scored))
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        jobs = []
        for context, gen_kwargs in [r.args for r in requests]:
            kwargs = dict(gen_kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = max(min(int(kwargs.pop("max_gen_toks", 256)), self.max_length - 1), 1)
            ids = self.tok_encode(context) or [self.prefix_token_id]
            jobs.append((ids[-(self.max_length - max_new) :], max_new, until, sampling(kwargs)))
        out: list[str | None] = [None] * len(jobs)

        def finish(i: int, new: list[int]) -> None:
            text = self.tok_decode(new)
            for stop in jobs[i][2]:
                if stop and stop in text:
                    text = text[: text.index(stop)]
            out[i] = text

        # a sampled request is decoded alone, with its own key (from seed and its index), as
        # transformers samples each; greedy ones in batches of one token budget, the longest
        # prompts first: one padded length per batch
        sampled = [i for i, job in enumerate(jobs) if job[3]["temperature"] > 0]
        for i in sampled:
            finish(i, self._sample(jobs[i][0], jobs[i][1], jobs[i][3], i))
        greedy = sorted(set(range(len(jobs))) - set(sampled))
        order = sorted(greedy, key=lambda i: (jobs[i][1], -len(jobs[i][0])))
        for start in range(0, len(order), self.batch_rows):
            chunk = order[start : start + self.batch_rows]
            for max_new in sorted({jobs[i][1] for i in chunk}):
                rows = [i for i in chunk if jobs[i][1] == max_new]
                longest = max(len(jobs[i][0]) for i in rows)
                width = min(max(MIN_BUCKET, 1 << max(longest - 1, 0).bit_length()), self.max_length - max_new)
                for i, new in zip(rows, self._generate([jobs[i][0] for i in rows], max_new, width)):
                    finish(i, new)
        return out

    # ---- scoring ---------------------------------------------------------------------------------

    def score_rows(self, rows: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
        """For each ``(tokens, n)``: the log-probability of the last ``n`` tokens given the ones
        before them, and whether each was the argmax."""
        out: list[tuple[float, bool] | None] = [None] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))  # one padded length per batch
        for start in range(0, len(order), self.batch_rows):
            chunk = order[start : start + self.batch_rows]
            length = max(len(rows[i][0]) - 1 for i in chunk)
            width = min(max(MIN_BUCKET, 1 << max(length - 1, 0).bit_length()), self.max_length)
            ids = np.zeros((self.batch_rows, width), np.int32)
            targets = np.zeros((self.batch_rows, width), np.int32)
            for r, i in enumerate(chunk):
                tokens = rows[i][0]
                ids[r, : len(tokens) - 1], targets[r, : len(tokens) - 1] = tokens[:-1], tokens[1:]
            logp, greedy = self._run(ids, targets)
            for r, i in enumerate(chunk):
                tokens, n = rows[i]
                end = len(tokens) - 1
                out[i] = (float(logp[r, end - n : end].sum()), bool(greedy[r, end - n : end].all()))
        return out

    def _placed(self, arr: np.ndarray) -> nm.NamedArray:
        axes = (nm.Axis("batch", arr.shape[0]), nm.Axis("position", arr.shape[1]))
        if self.mesh is None:
            return nm.named(jnp.asarray(arr), axes)
        sharding = nm.sharding_for(axes, self.mapping, self.mesh)
        return nm.NamedArray(jax.make_array_from_callback(arr.shape, sharding, lambda idx: arr[idx]), axes)

    def _run(self, ids: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        with nm.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            logp, greedy = self._score(self.model, self._placed(ids), self._placed(targets))
        return np.asarray(logp.array), np.asarray(greedy.array)

    def _generate(self, rows: list[list[int]], n_tokens: int, width: int) -> list[list[int]]:
        from .generate import continue_rows

        with nm.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            return continue_rows(
                self.model,
                rows,
                n_tokens,
                temperature=0.0,
                stop_ids=(self._tok.eos_id,),
                width=width,
                batch=self.batch_rows,
            )

    def _sample(self, ids: list[int], n_tokens: int, how: dict, index: int) -> list[int]:
        from .generate import continue_ids

        key = jax.random.fold_in(jax.random.key(self._seed), index)
        with nm.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            return continue_ids(self.model, ids, n_tokens, key=key, stop_ids=(self._tok.eos_id,), **how)


GEN_KWARGS = ("until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p")


def sampling(kwargs: dict) -> dict:
    """``{temperature, top_k, top_p}`` of a request's generation arguments, as transformers' generate
    reads them: greedy unless ``do_sample`` is true (then ``temperature``, default 1, and the
    filters); ``temperature: 0`` is greedy too. Other arguments are not ours to act on."""
    sample = str(kwargs.get("do_sample", False)).lower() in ("true", "1")
    temperature = float(kwargs.get("temperature", 1.0 if sample else 0.0))
    if not sample or temperature <= 0:
        return {"temperature": 0.0, "top_k": None, "top_p": None}
    top_k, top_p = kwargs.get("top_k"), kwargs.get("top_p")
    return {
        "temperature": temperature,
        "top_k": int(top_k) if top_k not in (None, 0) else None,
        "top_p": float(top_p) if top_p not in (None, 1, 1.0) else None,
    }


def check_gen_kwargs(text: str | None, what: str = "--gen_kwargs") -> dict | None:
    """lm-eval's ``k=v,k=v`` generation arguments, parsed as lm-eval parses them; ConfigError naming
    a key named-eval does not act on (``GEN_KWARGS``) or a value that is not a number."""
    if text is None:
        return None
    try:
        parsed = lm_utils.simple_parse_args_string(text)
    except (ValueError, IndexError) as e:
        raise ConfigError(f"{what} {text!r} is not k=v,k=v ({e})") from None
    unknown = sorted(set(parsed) - set(GEN_KWARGS))
    if unknown:
        raise ConfigError(
            f"{what}: {', '.join(map(repr, unknown))} not understood; named-eval reads {', '.join(GEN_KWARGS)}"
        )
    try:
        sampling(parsed)
        int(parsed.get("max_gen_toks", 1))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{what} {text!r}: {e}") from None
    return parsed


def check_output_path(path: str | Path | None, what: str = "--output_path") -> Path | None:
    """Where lm-eval's files will go: a ``.json`` file's folder, or a folder; ConfigError naming
    ``what`` when it is a file that is not ``.json`` or lies where nothing can be written."""
    if path is None:
        return None
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir() and path.suffix != ".json":
        raise ConfigError(f"{what} {path} is a file; give a folder, or a .json file name")
    existing = path if path.is_dir() else path.parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {path}: {existing} is not a folder this process can write into")
    return path


def write_results(result: dict, output_path: Path, *, model_name: str) -> list[Path]:
    """lm-eval's files for ``result``, as its ``--output_path`` writes them (its own
    ``EvaluationTracker``): ``results_<time>.json`` and, when samples were logged,
    ``samples_<task>_<time>.jsonl``, in ``<output_path>/<model_name>/`` (or beside a ``.json``
    ``output_path``, its name stamped). Returns the files written."""
    from lm_eval.loggers import EvaluationTracker

    tracker = EvaluationTracker(output_path=str(output_path))
    tracker.general_config_tracker.model_name = model_name
    tracker.general_config_tracker.model_name_sanitized = lm_utils.sanitize_model_name(model_name)
    before = _files_under(output_path)
    samples = result.get("samples")
    results = {k: v for k, v in result.items() if k != "samples"}
    tracker.save_results_aggregated(results=results, samples=samples)
    for task in samples or {}:
        tracker.save_results_samples(task_name=task, samples=samples[task])
    written = sorted(_files_under(output_path) - before)
    if not any(p.name.startswith(("results_", output_path.stem)) for p in written):
        raise ConfigError(f"--output_path {output_path}: lm-eval wrote no results file there")
    return written


def _files_under(path: Path) -> set[Path]:
    folder = path.parent if path.suffix == ".json" else path
    return set(folder.rglob("*")) if folder.is_dir() else set()


def _as_transformers_reads(tokenizer):
    """The ``tokenizer.json`` of an HF tokenizer as ``transformers`` reads it (special-token text is
    parsed, which our data pipeline never does), or None for the byte tokenizer."""
    path = getattr(tokenizer, "path", None)
    if path is None:
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def task_manager(tasks: Sequence[str], include: str | Path | None, what: str):
    """lm-eval's TaskManager that knows every one of ``tasks``: the ``include`` folder's alone when
    it holds them all, else with lm-eval's own; ConfigError naming ``what`` and the unknown ones."""
    from lm_eval.tasks import TaskManager

    if include is not None:
        folder = Path(include)
        if not folder.is_dir():
            raise ConfigError(f"{what}: the task folder {folder} is not a directory")
        local = TaskManager(include_path=str(folder), include_defaults=False)
        if not set(tasks) - set(local.all_tasks):
            return local
    manager = TaskManager(include_path=str(include) if include is not None else None)
    unknown = sorted(set(tasks) - set(manager.all_tasks))
    if unknown:
        where = f"in {include} or " if include is not None else ""
        broken = _unparsed_task_files(Path(include)) if include is not None else []
        said = f"; lm-eval skipped what does not parse: {'; '.join(broken)}" if broken else ""
        raise ConfigError(f"{what}: no task {', '.join(map(repr, unknown))} {where}in lm-eval's registry{said}")
    return manager


def _unparsed_task_files(folder: Path) -> list[str]:
    """``file: parse error`` for each task YAML under ``folder`` that does not parse (lm-eval skips
    those with a log line, and then knows no task by their names)."""
    import yaml

    class Lenient(yaml.SafeLoader):  # lm-eval's own tags (!function) are no parse error
        pass

    Lenient.add_multi_constructor("!", lambda loader, suffix, node: None)
    found = []
    for path in sorted(folder.rglob("*.yaml")):
        try:
            loader = Lenient(path.read_text(encoding="utf-8"))  # a SafeLoader: nothing is constructed but data
            try:
                loader.get_single_data()
            finally:
                loader.dispose()
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
            found.append(f"{path}: {' '.join(str(e).split())}")
    return found


def evaluate(
    lm: HarnessLM,
    tasks: Sequence[str],
    *,
    include: str | Path | None = None,
    limit: int | None = None,
    num_fewshot: int | None = None,
    manager=None,
    samples: bool = False,
    bootstrap_iters: int = 0,
    apply_chat_template: bool = False,
    fewshot_as_multiturn: bool = False,
    gen_kwargs: dict | None = None,
) -> tuple[dict[str, float], dict]:
    """``({"<task>/<metric>": value}, lm-eval's whole result)`` for ``tasks`` scored by ``lm``.
    A metric under a filter other than lm-eval's ``none`` is ``<metric>_<filter>``; standard errors
    need ``bootstrap_iters`` > 0 (lm-eval's own default is 100000). ``apply_chat_template``,
    ``fewshot_as_multiturn`` and ``gen_kwargs`` are lm-eval's (the prompts rendered with the run's
    chat template, its few-shot examples as turns, generation arguments over the tasks')."""
    from lm_eval import evaluator

    manager = manager if manager is not None else task_manager(tasks, include, "tasks")
    result = evaluator.simple_evaluate(
        model=lm,
        tasks=list(tasks),
        task_manager=manager,
        limit=limit,
        num_fewshot=num_fewshot,
        log_samples=samples,
        bootstrap_iters=bootstrap_iters,
        verbosity="WARNING",
        apply_chat_template=apply_chat_template,
        fewshot_as_multiturn=fewshot_as_multiturn,
        gen_kwargs=gen_kwargs,
    )
    return metrics_of(result), result


def metrics_of(result: dict) -> dict[str, float]:
    """lm-eval's ``results`` as flat metric names: ``acc,none`` of task t is ``t/acc``."""
    out = {}
    for task, values in result["results"].items():
        for name, value in values.items():
            if "," not in name or isinstance(value, str) or value is None:
                continue
            metric, filt = name.split(",", 1)
            out[f"{task}/{metric if filt == 'none' else f'{metric}_{filt}'}"] = float(value)
    return out
