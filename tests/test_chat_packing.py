"""Whole-sample packing of chat sources (``data._binpack``) and the chat loss options: every
conversation lands whole in one row, its tokens and loss mask equal transformers'
``apply_chat_template`` (``return_assistant_tokens_mask``), its loss in a packed row equals
transformers' on the conversation alone; ShareGPT records, ``data.loss_roles``,
``data.train_on_inputs``, every bad record reported, ``data.skip_bad_records``; and
``named-data show``."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from _chat_folder import make_chat_folder
from test_chat_data import CHATML_GEN, GOOD, data_cfg, hf_tokenizer, variant, write_jsonl

from named.trainer.data import DataConfig, DataError, TrainBatches, _binpack, build_data
from named.trainer.data._binpack import PackedSequences, plan_rows
from named.trainer.data._chat import MAX_LISTED

_WORDS = "the quick brown fox jumps over lazy dog what is capital of France Paris two plus four six".split()


def conversations(n: int, seed: int = 0, scales=(0.8, 1.5)) -> list[dict]:
    """Chat records with a realistic spread of lengths: 1-2 exchanges, turns of log-normal length."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": "Be brief."}] if rng.random() < 0.3 else []
        for _ in range(int(rng.integers(1, 3))):
            for role, scale in zip(("user", "assistant"), scales):
                words = rng.choice(_WORDS, size=max(1, int(rng.lognormal(scale, 0.7)))).tolist()
                messages.append({"role": role, "content": " ".join(words) + "."})
        out.append({"messages": messages})
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_chat_folder(tmp_path_factory.mktemp("hf") / "tiny-llama")


@pytest.fixture(scope="module")
def reference(folder, tmp_path_factory):
    """The same tokenizer with the {% generation %}-marked ChatML: transformers' own masks."""
    return hf_tokenizer(variant(folder, tmp_path_factory.mktemp("gen") / "gen", CHATML_GEN))


def hf_sample(hf, record) -> tuple[list[int], list[bool]]:
    out = hf.apply_chat_template(record["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), [bool(x) for x in out["assistant_masks"]]


def samples_of(rows) -> list[tuple[list[int], list[bool]]]:
    """Each segment of each packed row: its tokens and which of them are loss-carrying targets."""
    batch = rows.rows(np.arange(len(rows)))
    out = []
    for ids, seg, mask in zip(*batch):
        for s in sorted(set(seg.tolist()) - {-1}):
            at = np.flatnonzero(seg == s)
            assert np.all(np.diff(at) == 1) and not mask[at[-1]]  # contiguous; the last target is the next sample's
            trained = [False] + mask[at[:-1]].tolist()  # token j is trained when target j-1 is
            out.append((ids[at].tolist(), trained))
    return out


def test_whole_packing_splits_no_conversation_and_equals_transformers(folder, reference, tmp_path, caplog):
    records = conversations(160)
    path = write_jsonl(tmp_path / "chats.jsonl", records)
    want = [hf_sample(reference, r) for r in records]
    mean = np.mean([len(t) for t, _ in want])
    seq_len = 288
    assert 4 < seq_len / mean < 5 and max(len(t) for t, _ in want) <= seq_len  # like the issue: 4.5x the mean
    with caplog.at_level(logging.INFO, logger="named.trainer.data"):
        data = build_data(data_cfg(tmp_path, [path], folder, seq_len=seq_len))
    got = samples_of(data.train)
    # every conversation exactly once, whole, with transformers' tokens and assistant mask
    key = lambda s: (tuple(s[0]), tuple(s[1]))  # noqa: E731
    assert sorted(map(key, got)) == sorted(map(key, [(t, [False] + m[1:]) for t, m in want]))
    rows = data.train
    assert rows.padding_share == pytest.approx(1 - sum(len(t) for t, _ in want) / (len(rows) * seq_len))
    assert rows.padding_share < 0.05  # best-fit decreasing fills rows
    assert f"packed 160 whole samples into {len(rows)} rows of {seq_len} tokens: " in caplog.text
    assert f"{rows.padding_share:.1%} padding" in caplog.text
    # concatenate-and-chunk on the same data splits conversations: the default is what prevents it
    stream = build_data(data_cfg(tmp_path, [path], folder, seq_len=seq_len, chat_packing="stream")).train
    split = sum(1 for s in samples_of(stream) if key(s) not in set(map(key, got)))
    assert split > 10


def test_a_packed_row_gives_each_conversation_transformers_loss(folder, reference, tmp_path):
    # attention never crosses samples: the loss of each conversation in a packed row is its loss alone
    import jax.numpy as jnp
    import torch
    import transformers

    import named as nm
    from named import models
    from named.trainer.loop.loss import token_losses

    records = conversations(12, seed=1, scales=(0.0, 0.5))  # rows of the model's 64 positions
    data = build_data(data_cfg(tmp_path, [write_jsonl(tmp_path / "c.jsonl", records)], folder, seq_len=64))
    batch = data.train.rows(np.arange(len(data.train)))
    assert (batch.segment_ids.max(axis=1) >= 1).sum() >= 3  # rows of several conversations
    _, model = models.load_pretrained(folder)
    axes = lambda a: (nm.Axis("batch", a.shape[0]), nm.Axis("position", a.shape[1]))  # noqa: E731
    named = {k: nm.named(jnp.asarray(v), axes(v)) for k, v in batch._asdict().items()}
    per_token = np.asarray(token_losses(model, named)[0].array)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours, theirs = [], []
    for ids, seg, mask, loss in zip(*batch, per_token):
        for s in set(seg.tolist()) - {-1}:
            at = np.flatnonzero(seg == s)
            ours.append(loss[at].sum() / mask[at].sum())
            with torch.no_grad():
                labels = torch.tensor(np.where(np.r_[False, mask[at][:-1]], ids[at], -100)).long()[None]
                theirs.append(float(hf(torch.tensor(ids[at])[None].long(), labels=labels).loss))
    np.testing.assert_allclose(ours, theirs, rtol=1e-4)
    assert len(ours) == len(records)


def test_best_fit_decreasing_plan():
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(3, 1, 500).astype(np.int64), 1, 64)
    order, starts = plan_rows(lengths, 64)
    assert sorted(order.tolist()) == list(range(500))
    sums = np.add.reduceat(lengths[order], starts[:-1])
    assert sums.max() <= 64
    # best-fit decreasing needs at most 11/9 OPT + 1 rows; OPT >= the tokens over a row
    assert len(sums) <= 11 / 9 * np.ceil(lengths.sum() / 64) + 1
    again = plan_rows(lengths, 64)
    np.testing.assert_array_equal(order, again[0])
    np.testing.assert_array_equal(starts, again[1])
    # a small case by hand: 5 and 3 share a row of 8, as do 4, 2 and 2
    order, starts = plan_rows(np.array([2, 5, 4, 3, 2]), 8)
    assert [sorted(order[a:b].tolist()) for a, b in zip(starts[:-1], starts[1:])] == [[1, 3], [0, 2, 4]]


@pytest.mark.parametrize("too_long", ["truncate", "drop", "error"])
def test_samples_longer_than_a_row(folder, reference, tmp_path, too_long):
    records = conversations(40, seed=2)
    path = write_jsonl(tmp_path / "chats.jsonl", records)
    want = [hf_sample(reference, r) for r in records]
    seq_len = 48
    long = [len(t) > seq_len for t, _ in want]
    assert 0 < sum(long) < len(long)
    cfg = data_cfg(tmp_path, [path], folder, seq_len=seq_len, chat_too_long=too_long)
    if too_long == "error":
        with pytest.raises(DataError, match=rf"{sum(long)} of 40 samples are longer than data.seq_len=48 tokens"):
            build_data(cfg)
        return
    got = sorted(s[0] for s in samples_of(build_data(cfg).train))
    kept = [t[:seq_len] for (t, _), x in zip(want, long) if too_long == "truncate" or not x]
    assert got == sorted(kept)


def test_resumable_and_split_between_processes(folder, tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "chats.jsonl", conversations(120, seed=3))
    cfg = data_cfg(tmp_path, [path], folder, seq_len=64)
    first = build_data(cfg).train
    monkeypatch.setattr(_binpack, "SCAN_FLAGS", 7)  # documents found a few flags at a time: the same rows
    again = build_data(cfg).train
    assert isinstance(first, PackedSequences)
    whole = TrainBatches(first, batch_size=4, seed=7)
    for step in (0, 5, 31):  # a fresh build (a resumed run) gives the same batch at every step
        a, b = whole.batch_at(step), TrainBatches(again, batch_size=4, seed=7).batch_at(step)
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
        parts = [TrainBatches(again, batch_size=4, seed=7, process_index=p, process_count=2) for p in (0, 1)]
        for x, *ys in zip(a, *(p.batch_at(step) for p in parts)):
            np.testing.assert_array_equal(x, np.concatenate(ys))


def test_held_out_samples_are_whole_and_apart(folder, reference, tmp_path):
    records = conversations(50, seed=4)
    path = write_jsonl(tmp_path / "chats.jsonl", records)
    data = build_data(DataConfig(**{**data_cfg(tmp_path, [path], folder, seq_len=256).__dict__, "val_fraction": 0.2}))
    train, val = samples_of(data.train), samples_of(data.validation)
    assert len(train) == 40 and len(val) == 10
    want = [hf_sample(reference, r)[0] for r in records]
    assert sorted(t for t, _ in val) == sorted(want[40:])  # the last samples, as for text the last rows


# ---- what carries loss --------------------------------------------------------------------------

SHAREGPT = {"system": "system", "user": "human", "assistant": "gpt"}


def test_sharegpt_records_are_the_same_conversations(folder, reference, tmp_path):
    records = conversations(20, seed=5)
    shared = [
        {"conversations": [{"from": SHAREGPT[m["role"]], "value": m["content"]} for m in r["messages"]]}
        for r in records
    ]
    data = build_data(data_cfg(tmp_path, [write_jsonl(tmp_path / "s.jsonl", shared)], folder, seq_len=256))
    key = lambda s: (tuple(s[0]), tuple(s[1]))  # noqa: E731
    want = [hf_sample(reference, r) for r in records]
    assert sorted(map(key, samples_of(data.train))) == sorted(key((t, [False] + m[1:])) for t, m in want)
    bad = write_jsonl(
        tmp_path / "bad.jsonl",
        [
            {"conversations": [{"from": "bot", "value": "x"}]},
            {"conversations": [{"from": "human"}]},
            {"conversations": [], "messages": []},
        ],
    )
    with pytest.raises(DataError) as e:
        build_data(data_cfg(tmp_path, [bad], folder))
    assert str(e.value).splitlines()[:3] == [
        f"data.train source 'chat': {bad}:1: conversations[0]: unknown 'from' 'bot'; ShareGPT speakers: system, "
        "human, gpt, user, assistant, tool",
        f"{bad}:2: conversations[0] has no 'value' (the text of the turn)",
        f"{bad}:3: a record has one of 'messages', 'conversations', 'prompt' and 'completion', or 'instruction' "
        "and 'output'; this one has "
        "'messages' and 'conversations'",
    ]


# ChatML with user turns marked too: transformers' mask for loss_roles [user, assistant].
CHATML_USER_GEN = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] in ['user', 'assistant'] %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.mark.parametrize("option", ["loss_roles", "train_on_inputs"])
def test_what_carries_loss_equals_transformers(folder, reference, tmp_path, option):
    records = conversations(20, seed=6)
    path = write_jsonl(tmp_path / "c.jsonl", records)
    if option == "loss_roles":
        cfg = data_cfg(tmp_path, [path], folder, seq_len=256, loss_roles=["user", "assistant"])
        hf = hf_tokenizer(variant(folder, tmp_path / "user-gen", CHATML_USER_GEN))
        want = [hf_sample(hf, r) for r in records]
    else:
        cfg = data_cfg(tmp_path, [path], folder, seq_len=256, train_on_inputs=True)
        hf = hf_tokenizer(folder)
        ids = [
            list(hf.apply_chat_template(r["messages"], tokenize=True, return_dict=True)["input_ids"]) for r in records
        ]
        want = [(t, [True] * len(t)) for t in ids]
    key = lambda s: (tuple(s[0]), tuple(s[1]))  # noqa: E731
    assert sorted(map(key, samples_of(build_data(cfg).train))) == sorted(key((t, [False] + m[1:])) for t, m in want)
    assistant_only = sum(sum(hf_sample(reference, r)[1]) for r in records)
    assert sum(sum(m) for _, m in want) > assistant_only  # more than the assistant's turns


def test_loss_roles_on_prompt_completion_pairs_and_a_system_role(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text(
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | trim }}</>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    records = [
        {
            "messages": [
                {"role": "system", "content": " S "},
                {"role": "user", "content": "u"},
                {"role": "assistant", "content": "a"},
            ]
        },
        {"prompt": "pq", "completion": "c"},
    ]
    path = write_jsonl(tmp_path / "c.jsonl", records)

    def carried(**kw):
        cfg = data_cfg(tmp_path, [path], "byte", seq_len=64, chat_template=str(template), **kw)
        return [
            "".join(chr(t) if t < 256 else "<eos>" for t, m in zip(*s) if m) for s in samples_of(build_data(cfg).train)
        ]

    assert sorted(carried()) == sorted(["a</>", "c<eos>"])
    assert sorted(carried(loss_roles=["system", "user"])) == sorted(["S</>u</>", "q"])
    assert sorted(carried(train_on_inputs=True)) == sorted(["system>S</><user>u</><assistant>a</>", "qc<eos>"])
    with pytest.raises(
        DataError, match=r"c.jsonl:1: no tool message, so no token would carry loss \(data.loss_roles\)"
    ):
        build_data(data_cfg(tmp_path, [path], "byte", chat_template=str(template), loss_roles=["tool"]))


def test_loss_option_settings_are_checked():
    from named.trainer.config import ConfigError, load_config

    # a DataConfig made in code is checked by its declarations, as a config file's values are
    with pytest.raises(ConfigError, match=r"data.chat_packing must be one of whole, stream, got 'ffd'"):
        DataConfig(chat_packing="ffd")
    with pytest.raises(ConfigError, match=r"data.chat_too_long must be one of truncate, drop, error, got 'cut'"):
        DataConfig(chat_too_long="cut")
    with pytest.raises(ConfigError, match=r"data.loss_roles must be one of system, user, assistant, tool \(at least"):
        DataConfig(loss_roles=["gpt"])
    with pytest.raises(ConfigError, match=r"data.loss_roles must be non-empty, got \[\]"):
        DataConfig(loss_roles=[])

    with pytest.raises(
        ConfigError,
        match=r"^data.loss_roles must be one of system, user, assistant, tool \(at least one\), got \['gpt'\]",
    ):
        load_config(None, ["--data.loss_roles", "[gpt]"])


# ---- bad records: all of them, or skipped -----------------------------------------------------------


def test_every_bad_record_is_reported_or_skipped(folder, reference, tmp_path, caplog):
    bad_lines = {2: "{not json", 4: {"text": "hi"}, 5: {"messages": [{"role": "user", "content": "Hi"}]}}
    lines = [bad_lines.get(i, GOOD) for i in range(1, 8)]
    path = write_jsonl(tmp_path / "c.jsonl", lines)
    with pytest.raises(DataError) as e:
        build_data(data_cfg(tmp_path, [path], folder, seq_len=64))
    got = str(e.value).splitlines()
    assert [line.split(": ")[0 if i else 1] for i, line in enumerate(got[:3])] == [f"{path}:{i}" for i in (2, 4, 5)]
    assert got[3] == "3 bad records of 7; fix them, or set data.skip_bad_records: true to train without them"
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())

    with caplog.at_level(logging.WARNING, logger="named.trainer.data"):
        skipped = build_data(data_cfg(tmp_path, [path], folder, seq_len=64, skip_bad_records=True)).train
    assert f"data.skip_bad_records: skipped 3 bad records of 7; the first: {path}:2: not valid JSON" in caplog.text
    tokens, mask = hf_sample(reference, GOOD)  # the four good records, as transformers masks them
    assert samples_of(skipped) == [(tokens, [False] + mask[1:])] * 4

    many = write_jsonl(tmp_path / "many.jsonl", [GOOD] + [{"text": "x"}] * (MAX_LISTED + 5))
    with pytest.raises(DataError, match=rf"\n\.\.\. and 5 more\n{MAX_LISTED + 5} bad records of {MAX_LISTED + 6};"):
        build_data(data_cfg(tmp_path, [many], folder))


# ---- named-data show ------------------------------------------------------------------------------


def test_named_data_show_marks_samples_and_loss(tmp_path, capsys):
    from named.trainer.commands.cli import main_data

    template = tmp_path / "t.jinja"
    template.write_text(
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    chats = write_jsonl(tmp_path / "c.jsonl", [GOOD, {"prompt": "p\n", "completion": "c"}] * 3)
    text = tmp_path / "t.txt"
    text.write_text("plain text " * 40)
    train = f"[{{name: chat, paths: [{chats}], format: chat}}, {{name: text, paths: [{text}]}}]"
    flags = ["--config", "gpt2_nano", "--data.train", train, "--data.tokenizer", "byte"]
    flags += ["--data.chat_template", str(template), "--data.seq_len", "64", "--data.cache_dir", str(tmp_path / "c")]
    assert main_data(["show", *flags, "--source", "chat", "--rows", "3", "--data.val_fraction", "0"]) == 0
    # by hand: a conversation is 31 bytes (9 carry loss: "Hello.</>"), a pair 4 tokens (2: "c", eos)
    conversation, pair = "<user>Hi</><assistant>[[Hello.</>]]", "p\\n[[c<eos>]]"
    conversation_bytes = list(b"<user>Hi</><assistant>Hello.</>")
    assert capsys.readouterr().out.splitlines() == [
        "data.train source 'chat': packed 6 whole samples into 2 rows of 64 tokens: 18.0% padding",
        "[[...]]: the tokens that carry loss",
        "row 0 of 2 (chat): 2 samples, 18 tokens carry loss, 2 padding",
        f"  1| {conversation}",
        f"  2| {conversation}",
        "row 1 of 2 (chat): 4 samples, 15 tokens carry loss, 21 padding",
        f"  1| {conversation}",
        *(f"  {k}| {pair}" for k in (2, 3, 4)),
    ]
    # --ids: each sample's byte ids, and its labels as transformers writes them (-100: no loss)
    assert main_data(["show", *flags, "--source", "chat", "--rows", "1", "--start", "1", "--ids"]) == 0
    out = capsys.readouterr().out.splitlines()
    labels = [-100] * 22 + conversation_bytes[22:]  # "Hello.</>", the last 9 bytes, carry loss
    assert out[3:6] == [
        f"  1| {conversation}",
        f"   ids| {' '.join(map(str, conversation_bytes))}",
        f"labels| {' '.join(map(str, labels))}",
    ]
    assert out[6:9] == [f"  2| {pair}", "   ids| 112 10 99 256", "labels| -100 -100 99 256"]
    assert main_data(["show", *flags, "--source", "nope"]) == 2
    err = capsys.readouterr().err
    assert err == "error: --source 'nope' is not a named source of data.train: ['chat', 'text']\n"
    assert main_data(["show", *flags, "--split", "validation", "--data.val_fraction", "0"]) == 2
    assert "holds out no validation data" in capsys.readouterr().err


def _lost(n: int) -> list[dict]:
    """Conversations whose user turn alone is longer than a row of 32: cut to a row, no reply is left."""
    long = " ".join(_WORDS * 3) + "."
    return [{"messages": [{"role": "user", "content": long}, {"role": "assistant", "content": "Paris."}]}] * n


def test_the_build_summary_counts_samples_cut_before_their_reply(folder, reference, tmp_path):
    records = _lost(3) + conversations(20, seed=5)
    path = write_jsonl(tmp_path / "chats.jsonl", records)
    seq_len = 32
    want = [hf_sample(reference, r) for r in records]
    lost = sum(len(t) > seq_len and any(m) and not any(m[1:seq_len]) for t, m in want)  # transformers' masks
    assert lost >= 3
    summary = build_data(data_cfg(tmp_path, [path], folder, seq_len=seq_len)).train.describe()
    assert f", {lost} of them keeping no loss token (their reply lies past data.seq_len" in summary


@pytest.mark.slow
def test_steps_without_a_loss_token_are_said_and_not_logged_as_0(tmp_path, capsys):
    import json

    from _chat_folder import tiny_run

    path = write_jsonl(tmp_path / "chats.jsonl", _lost(16))
    source = f"[{{name: chat, paths: [{path}], format: chat}}]"
    run = tiny_run(tmp_path, **{"data.train": source, "trainer.num_train_steps": 2, "trainer.log_interval": 1})
    assert "done: 2 steps, loss nan -> nan (2 steps had no loss token: left out)" in capsys.readouterr().out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "train/lr" in r]
    assert [r["step"] for r in train_rows] == [1, 2]
    assert all("train/loss" not in r for r in train_rows)
    assert [r["train/steps_without_loss_tokens"] for r in train_rows] == [1, 2]
    assert "step 1: no token of its batch carries loss" in (run / "logs" / "process_0.log").read_text()
