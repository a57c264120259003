"""lm-evaluation-harness on our models: ``named-eval`` and ``trainer.eval_harness_*``.

The tasks are local (examples/eval_tasks: YAML + JSONL, no network): a multiple-choice task, a
rolling-loglikelihood (perplexity) task and a generation task. A two-step fine-tune of the tiny
Llama folder scores them during training and from its checkpoint, and the folder ``named-export``
writes is scored by lm-eval's own Hugging Face backend: the same accuracies, and each request's
loglikelihood within 1e-4 (float32).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from _chat_folder import make_chat_folder, tiny_run

pytest.importorskip("lm_eval")

from named.trainer.commands.cli import main_eval  # noqa: E402
from named.trainer.commands.evaluate import evaluate_checkpoint  # noqa: E402
from named.trainer.commands.export import export  # noqa: E402
from named.trainer.config import ConfigError, load_config  # noqa: E402
from named.trainer.data import load_tokenizer  # noqa: E402

pytestmark = [pytest.mark.lmeval, pytest.mark.procs]  # lm-eval asks git for the commit (a process)


TASKS = Path(__file__).resolve().parents[1] / "examples" / "eval_tasks"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A two-step fine-tune of the tiny Llama that scores tiny_mc after step 2 (in the loop)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return tiny_run(
        tmp_path_factory.mktemp("harness"),
        **{
            "trainer.num_train_steps": 2,
            "trainer.log_interval": 1,
            "trainer.eval_harness_tasks": "[tiny_mc]",
            "trainer.eval_harness_interval": 2,
            "trainer.eval_harness_include": TASKS,
            "trainer.eval_harness_files": True,
            "optimizer.learning_rate": 1e-2,
            "mesh.shape": "{data: 8}",
            "mesh.param_mapping": "{embed: data}",
        },
    )


def _hf_scores(folder: Path, tasks: list[str], **more) -> dict:
    from lm_eval import evaluator
    from lm_eval.tasks import TaskManager

    return evaluator.simple_evaluate(
        model="hf",
        model_args={"pretrained": str(folder), "dtype": "float32", "device": "cpu"},
        tasks=tasks,
        task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
        batch_size=4,
        log_samples=True,
        bootstrap_iters=0,
        **more,
    )


def _loglikelihoods(result: dict, task: str) -> list[float]:
    """Every request's loglikelihood, in document order."""
    docs = sorted(result["samples"][task], key=lambda s: s["doc_id"])
    out = []
    for s in docs:
        for resp in s["resps"]:
            value = resp[0]
            out.append(float(value[0] if isinstance(value, (list, tuple)) else value))
    return out


@pytest.mark.slow
def test_named_eval_equals_lm_evals_hf_backend_on_the_exported_folder(run, tmp_path):
    ours = evaluate_checkpoint(run, ["tiny_mc", "tiny_ppl"], include=TASKS, batch_size=8, samples=True)
    export(run, tmp_path / "hf")
    theirs = _hf_scores(tmp_path / "hf", ["tiny_mc", "tiny_ppl"])
    for task in ("tiny_mc", "tiny_ppl"):
        a, b = _loglikelihoods(ours.results, task), _loglikelihoods(theirs, task)
        assert len(a) == len(b) > 0
        assert a == pytest.approx(b, abs=1e-4), task
    assert ours.metrics["tiny_mc/acc"] == theirs["results"]["tiny_mc"]["acc,none"]
    assert ours.metrics["tiny_mc/acc_norm"] == theirs["results"]["tiny_mc"]["acc_norm,none"]
    for m in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        assert ours.metrics[f"tiny_ppl/{m}"] == pytest.approx(theirs["results"]["tiny_ppl"][f"{m},none"], rel=1e-4)
    # a document longer than the model's 64 positions is scored in several windows
    long = max((json.loads(line)["text"] for line in (TASKS / "tiny_ppl.jsonl").read_text().splitlines()), key=len)
    assert len(load_tokenizer(load_config(run / "config.yaml").data.tokenizer).encode(long)) > 64


@pytest.mark.slow
def test_the_loop_logs_eval_harness_metrics_equal_to_named_eval(run):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = {k: v for r in rows if r["step"] == 2 for k, v in r.items() if k.startswith("eval_harness/")}
    assert set(logged) == {"eval_harness/tiny_mc/acc", "eval_harness/tiny_mc/acc_norm"}
    ours = evaluate_checkpoint(run, ["tiny_mc"], include=TASKS)  # the step-2 checkpoint: the same model
    assert logged == {f"eval_harness/{k}": v for k, v in ours.metrics.items()}
    # trainer.eval_harness_files: lm-eval's results JSON and samples of the step, as named-eval writes them
    (results,) = (run / "eval_harness" / "step_2").rglob("results_*.json")
    written = json.loads(results.read_text())["results"]["tiny_mc"]
    assert {
        "eval_harness/tiny_mc/acc": written["acc,none"],
        "eval_harness/tiny_mc/acc_norm": written["acc_norm,none"],
    } == logged
    (samples,) = (run / "eval_harness" / "step_2").rglob("samples_tiny_mc_*.jsonl")
    assert len(samples.read_text().splitlines()) == len((TASKS / "tiny_mc.jsonl").read_text().splitlines())


@pytest.mark.slow
def test_named_eval_writes_lm_evals_files_and_renders_the_chat_template_as_lm_evals_hf_backend(run, tmp_path, capsys):
    out = tmp_path / "results"
    argv = ["--checkpoint", str(run), "--tasks", "tiny_mc", "--include", str(TASKS), "--output_path", str(out)]
    more = ["--log_samples", "--apply_chat_template", "--fewshot_as_multiturn", "--gen_kwargs", "max_gen_toks=4"]
    assert main_eval(argv + more) == 0
    printed = dict(line.split() for line in capsys.readouterr().out.splitlines()[1:] if line.startswith("eval_"))
    (results,) = out.rglob("results_*.json")
    written = json.loads(results.read_text())
    for metric in ("acc", "acc_norm"):  # printed at full precision: the very float lm-eval wrote
        assert float(printed[f"eval_harness/tiny_mc/{metric}"]) == written["results"]["tiny_mc"][f"{metric},none"]
    (samples,) = out.rglob("samples_tiny_mc_*.jsonl")
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert rows and all("<|im_start|>user" in r["arguments"]["gen_args_0"]["arg_0"] for r in rows)
    # the chat-templated requests score as lm-eval's HF backend scores them on the exported folder
    ours = evaluate_checkpoint(run, ["tiny_mc"], include=TASKS, samples=True, apply_chat_template=True)
    export(run, tmp_path / "hf")
    theirs = _hf_scores(tmp_path / "hf", ["tiny_mc"], apply_chat_template=True)
    a, b = _loglikelihoods(ours.results, "tiny_mc"), _loglikelihoods(theirs, "tiny_mc")
    assert len(a) == len(b) > 0 and a == pytest.approx(b, abs=1e-4)


@pytest.mark.slow
def test_named_eval_cli_generates_and_names_bad_input(run, capsys):
    assert main_eval(["--checkpoint", str(run), "--tasks", "tiny_gen,tiny_mc", "--include", str(TASKS)]) == 0
    out = capsys.readouterr().out
    assert "step 2:" in out and "eval_harness/tiny_gen/exact_match " in out and "eval_harness/tiny_mc/acc " in out
    for argv, culprit in (
        (["--tasks", "no_such_task", "--include", str(TASKS)], "no task 'no_such_task'"),
        (["--tasks", "tiny_mc", "--include", str(run / "nowhere")], "is not a directory"),
        (["--tasks", "tiny_mc", "--limit", "0"], "--limit must be"),
        (["--tasks", " ", "--include", str(TASKS)], "--tasks must name"),
        (["--tasks", "tiny_mc", "--log_samples"], "give --output_path too"),
        (["--tasks", "tiny_mc", "--fewshot_as_multiturn"], "give --apply_chat_template too"),
        (["--tasks", "tiny_mc", "--gen_kwargs", "beams=4"], "'beams' not understood"),
        (["--tasks", "tiny_mc", "--output_path", str(run / "config.yaml")], "is a file; give a folder"),
    ):
        assert main_eval(["--checkpoint", str(run), *argv]) == 2
        assert culprit in capsys.readouterr().err
    assert main_eval(["--checkpoint", str(run / "missing"), "--tasks", "tiny_mc", "--include", str(TASKS)]) == 2
    assert "no such directory" in capsys.readouterr().err


def test_eval_harness_keys_go_together():
    with pytest.raises(ConfigError, match="trainer.eval_harness_tasks and trainer.eval_harness_interval go together"):
        load_config(None, ["--trainer.eval_harness_tasks", "[tiny_mc]"])
    with pytest.raises(ConfigError, match="names no tasks"):
        load_config(None, ["--trainer.eval_harness_interval", "5"])


def test_a_run_asking_for_tasks_without_lm_eval_is_refused_before_anything_is_written(monkeypatch, tmp_path):
    import importlib.util

    from named.trainer.loop.train import train

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a))
    cfg = load_config(
        None,
        [
            "--trainer.eval_harness_tasks",
            "[tiny_mc]",
            "--trainer.eval_harness_interval",
            "1",
            "--trainer.run_dir",
            str(tmp_path / "run"),
            "--model.type",
            "gpt2",
            "--model.n_layer",
            "1",
            "--model.n_embd",
            "16",
            "--model.n_head",
            "2",
        ],
    )
    with pytest.raises(ConfigError, match=r"trainer.eval_harness_tasks needs lm-evaluation-harness.*\[eval\]"):
        train(cfg)
    assert not (tmp_path / "run").exists()


def test_requests_are_tokenised_as_lm_evals_hf_backend_tokenises_them(tmp_path):
    """A tokenizer whose post-processor adds a bos (as Llama 3's does), and special-token text in a
    request: the ids and the prefix token equal those of lm-eval's HF backend, which scores from them."""
    from lm_eval.models.huggingface import HFLM
    from tokenizers import Tokenizer, processors

    from named.trainer.loop.harness import HarnessLM

    folder = make_chat_folder(tmp_path / "bos")
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    bos = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", pair="<|endoftext|> $A $B", special_tokens=[("<|endoftext|>", bos)]
    )
    tok.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": "<|endoftext|>"}))

    ours = HarnessLM(None, load_tokenizer(str(folder)), max_length=64)
    theirs = HFLM(pretrained=str(folder), dtype="float32", device="cpu")
    assert ours.prefix_token_id == theirs.prefix_token_id == bos
    for text in ("Two plus two is four.", "<|im_start|>user\nHi<|im_end|>", "<|endoftext|>Hello", ""):
        assert ours.tok_encode(text) == theirs.tok_encode(text), text
        assert ours.tok_encode(text, add_special_tokens=False) == theirs.tok_encode(text, add_special_tokens=False)
    pair = ("Question: What is two plus two?\nAnswer: ", "four")
    assert ours._encode_pair(*pair) == theirs._encode_pair(*pair)


def test_generate_until_decodes_requests_in_batches_as_one_at_a_time(monkeypatch):
    """Five requests of different prompt lengths, in rows of 4: two calls of ``models.generate``
    (a ragged batch each), and each text is what decoding its request alone gives, cut at ``until``."""
    from types import SimpleNamespace

    from _hf_models import random_model

    from named import models
    from named.models import LlamaConfig, LlamaLMHeadModel
    from named.trainer.data import ByteTokenizer
    from named.trainer.loop.generate import continue_ids
    from named.trainer.loop.harness import HarnessLM

    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=260,
        max_position_embeddings=64,
    )
    model = random_model(LlamaLMHeadModel, config, scale=0.5)
    tok = ByteTokenizer()
    lm = HarnessLM(model, tok, max_length=64, batch_size=4)
    contexts = ["Q: 1+1?", "a", "The quick brown fox", "xyz", "Hello there, world"]
    requests = [SimpleNamespace(args=(c, {"until": ["e"], "max_gen_toks": 6})) for c in contexts]
    calls = []
    generate = models.generate

    def counting(*a, **kw):
        calls.append(a[1].axis_size("batch"))
        return generate(*a, **kw)

    monkeypatch.setattr(models, "generate", counting)
    texts = lm.generate_until(requests)
    assert calls == [4, 4]  # two batches of 4 rows (the second holds one request, padded)
    monkeypatch.setattr(models, "generate", generate)
    for context, text in zip(contexts, texts):
        alone = tok.decode(continue_ids(model, tok.encode(context), 6, stop_ids=(tok.eos_id,)))
        assert text == alone.split("e")[0], context
    assert sum(len(t) for t in texts) > 5, texts  # not all cut at once: the comparison proves something


def test_a_task_file_that_does_not_parse_is_named_with_its_error(tmp_path):
    from named.trainer.loop.harness import task_manager

    (tmp_path / "broken.yaml").write_text("task: broken\ndataset_kwargs: {data_files: [a.jsonl\n")
    with pytest.raises(
        ConfigError, match=rf"no task 'broken' in {tmp_path} .*{tmp_path / 'broken.yaml'}: .*flow sequence"
    ):
        task_manager(["broken"], tmp_path, "--tasks")
