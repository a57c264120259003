"""Issue 15 end to end, from the shipped configs and the CLI, on 8 devices under FSDP:
init from a transformers-saved chat model -> SFT on chat JSONL -> named-sample --chat ->
named-export -> transformers; and the same with LoRA -> --merge / --adapters-only -> peft.

The pieces have their own tests (tests/test_init_from_hf.py, test_chat_data.py, test_lora.py,
test_export.py); this one checks that they compose as docs/finetune.md says.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from _chat_folder import CHATS, make_chat_folder, write_chats
from tokenizers import Tokenizer

import named as nm
from named.trainer import checkpoint as ckpt
from named.trainer.commands.cli import main_export, main_sample, main_train
from named.trainer.commands.sample import saved_model_config
from named.trainer.config import load_config
from named.trainer.data import TrainBatches, build_data
from named.trainer.data.chat_template import prompt_ids
from named.trainer.loop.model_init import model_shapes
from named.trainer.loop.registry import model_class

QUESTION = "What is two plus two?"


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("finetune")
    make_chat_folder(root / "tiny-llama")
    write_chats(root / "chats.jsonl")
    return root


def _train_args(config: str, demo: Path, run: str, *more: str) -> list[str]:
    return [
        "--config",
        config,
        "--model.init_from_hf",
        str(demo / "tiny-llama"),
        "--data.train",
        f"[{{name: chat, paths: [{demo / 'chats.jsonl'}], format: chat}}]",
        "--data.seq_len",
        "64",
        "--data.val_fraction",
        "0",
        "--data.cache_dir",
        str(demo / "cache"),
        "--trainer.train_batch_size",
        "8",
        "--trainer.num_train_steps",
        "30",
        "--trainer.eval_interval",
        "0",
        "--trainer.log_interval",
        "1",
        "--trainer.progress_bar",
        "false",
        "--trainer.run_dir",
        str(demo / run),
        "--checkpoint.interval",
        "0",
        "--tracker.console",
        "false",
        "--mesh.shape",
        "{data: 8}",
        "--mesh.param_mapping",
        "{embed: data}",
        *more,
    ]


def _losses(run_dir: Path) -> list[float]:
    import json

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train/loss"] for r in rows if "train/loss" in r]


def _ours(run_dir: Path, ids: np.ndarray) -> np.ndarray:
    cfg, model_cfg = load_config(run_dir / "config.yaml"), saved_model_config(run_dir)
    (model, _), _ = ckpt.restore(run_dir, (model_shapes(cfg, model_class(model_cfg), model_cfg), None), partial=True)
    # in float32 (a bf16 base is widened exactly), as transformers runs the exported folders below
    model = jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, model)
    logits = model(nm.named(np.asarray(ids, np.int32), ("batch", "position")))
    return np.asarray(logits.rearrange(("batch", "position", "vocab")).array)


def _theirs(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids, dtype=torch.long)).logits.numpy()


def _reply(model, tokenizer) -> str:
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


@pytest.mark.slow
def test_sft_from_a_folder_then_export_loads_in_transformers_with_our_logits(demo, capsys):
    run = demo / "sft"
    # stream packing: 30 steps of it teach this tiny model the exact reply checked below (whole-sample
    # packing holds fewer conversations per row; tests/test_chat_packing.py trains with it)
    args = _train_args("finetune_llama3.2_1b", demo, "sft", "--optimizer.learning_rate", "3e-3")
    assert main_train([*args, "--data.chat_packing", "stream"]) == 0
    losses = _losses(run)
    assert len(losses) == 30 and losses[-1] < losses[0] - 1.0  # the assistant-token loss falls

    # prompt tokens carry no loss, by construction: every target with loss lies in an assistant reply
    cfg = load_config(run / "config.yaml")
    data = build_data(cfg.data)
    batch = TrainBatches(data.train, batch_size=8, seed=0).batch_at(0)
    tok = data.tokenizer
    targets = [tok.decode([int(t)]) for row, mask in zip(batch.input_ids, batch.loss_mask) for t in row[1:][mask[:-1]]]
    answers = "".join(
        m["content"] + "<|im_end|>" for r in CHATS for m in r.get("messages", []) if m["role"] == "assistant"
    )
    assert targets and all(t in answers + " six.<|im_end|>" for t in targets)

    capsys.readouterr()
    assert main_sample(["--checkpoint", str(run), "--chat", QUESTION, "--tokens", "12"]) == 0
    ours_reply = capsys.readouterr().out.strip()
    assert ours_reply == "Four."  # learned from the data; the reply stops at <|im_end|>
    for bad, culprit in (
        (["--chat", QUESTION, "--prompt", "x"], "give --prompt or a conversation"),
        (["--chat", "  "], "--chat: the user message is empty"),
        (["--chat", QUESTION, "--tokens", "60"], "--tokens 60 after the"),
    ):
        assert main_sample(["--checkpoint", str(run), *bad]) == 2
        assert culprit in capsys.readouterr().err

    out = demo / "sft-hf"
    assert main_export(["--checkpoint", str(run), "--out", str(out)]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager", dtype=torch.float32).eval()
    ids = np.asarray([prompt_ids(str(out), [{"role": "user", "content": QUESTION}])])
    np.testing.assert_allclose(_ours(run, ids), _theirs(hf, ids), atol=1e-4, rtol=0)
    assert _reply(hf, transformers.AutoTokenizer.from_pretrained(out)) == ours_reply


@pytest.mark.slow
def test_lora_from_a_folder_then_merge_and_peft_give_the_runs_logits(demo, capsys):
    run = demo / "lora"
    # float32 base: PEFT applies the adapters to the folder's own float32 weights, so only a run
    # trained against those same weights can match it to 1e-4 (see docs/finetune.md on bfloat16)
    assert (
        main_train(
            _train_args(
                "finetune_llama3.2_1b_lora",
                demo,
                "lora",
                "--lora.rank",
                "4",
                "--lora.base_dtype",
                "float32",
                "--optimizer.learning_rate",
                "1e-2",
            )
        )
        == 0
    )
    losses = _losses(run)
    assert losses[-1] < losses[0] - 0.5
    ids = np.asarray([prompt_ids(str(demo / "tiny-llama"), [{"role": "user", "content": QUESTION}])])
    ours = _ours(run, ids)

    merged, adapters = demo / "lora-merged", demo / "lora-adapters"
    assert main_export(["--checkpoint", str(run), "--merge", "--out", str(merged)]) == 0
    assert main_export(["--checkpoint", str(run), "--adapters-only", "--out", str(adapters)]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        merged, attn_implementation="eager", dtype=torch.float32
    ).eval()
    np.testing.assert_allclose(ours, _theirs(hf, ids), atol=1e-4, rtol=0)
    base = transformers.AutoModelForCausalLM.from_pretrained(
        demo / "tiny-llama", attn_implementation="eager", dtype=torch.float32
    )
    import peft  # here: collecting this file (every worker does) then costs no PEFT import

    with_adapters = peft.PeftModel.from_pretrained(base, adapters).eval()
    np.testing.assert_allclose(ours, _theirs(with_adapters, ids), atol=1e-4, rtol=0)
    # and the adapters did something: the base folder alone gives other logits
    plain = transformers.AutoModelForCausalLM.from_pretrained(
        demo / "tiny-llama", attn_implementation="eager", dtype=torch.float32
    ).eval()
    assert np.abs(ours - _theirs(plain, ids)).max() > 1e-2


def _qwen2_folder(path: Path) -> Path:
    """A tiny byte-level BPE tokenizer.json without a splitting rule, in a folder that transformers
    loads as its own Qwen2Tokenizer (which splits text by its own rule, whatever the file says)."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path.mkdir(parents=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet)
    tok.train_from_iterator(["Hello world, it's 2024: 12345 apples don't fall far."] * 50, trainer)
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|endoftext|>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    return path


def test_a_tokenizer_transformers_reads_otherwise_is_refused_naming_both(tmp_path):
    from named.trainer.data import DataError
    from named.trainer.loop.checks import checked_setup

    folder = _qwen2_folder(tmp_path / "qwen2-tok")
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    text = "Hello world, it's 2024: 12345 apples don't fall far."
    ours = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    assert ours != theirs(text, add_special_tokens=False)["input_ids"]  # the disagreement is real
    cfg = load_config(Path(__file__).resolve().parents[1] / "config/gpt2_nano.yaml", ["--data.tokenizer", str(folder)])
    with pytest.raises(
        DataError,
        match=rf"data.tokenizer: transformers loads {folder} as Qwen2Tokenizer, .*"
        rf"{folder / 'tokenizer.json'}, the file this run reads: \"Hello world.* is \[303\] here, "
        r"\[270, 258, .*\.\.\. \(39 ids\)\] in",
    ):
        checked_setup(cfg)
    # the way out the message gives: train with the tokenizer transformers uses, saved as a folder
    theirs.save_pretrained(tmp_path / "saved")
    checked_setup(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=str(tmp_path / "saved"))))


def test_the_log_has_an_eval_at_step_0_the_first_steps_loss_and_the_steps_of_an_epoch(tmp_path):
    import json

    from _chat_folder import tiny_run

    over = {"trainer.num_train_steps": 3, "trainer.log_interval": 10, "trainer.eval_at_start": "true"}
    run = tiny_run(tmp_path, **over, **{"data.val_fraction": 0.2, "trainer.eval_interval": 0})
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    by_step = {}
    for r in rows:
        by_step.setdefault(r["step"], {}).update(r)
    assert sorted(by_step) == [0, 3]  # before any update, and the end (log_interval 10)
    assert "eval/loss" in by_step[0] and "train/loss" not in by_step[0] and "train/loss" in by_step[3]
    log = (run / "logs" / "process_0.log").read_text()
    assert "one epoch (every one of the " in log and "trainer.num_train_steps=3 is " in log
    first = float(log.split("step 1 (the first): loss ")[1].split()[0])
    assert np.isfinite(first) and first != by_step[3]["train/loss"]
