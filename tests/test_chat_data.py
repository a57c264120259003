"""Chat data (``format: chat`` sources, ``trainer.data.chat_template``): templates rendered as
``transformers`` renders them, a loss mask on assistant tokens only (checked against
transformers' own ``{% generation %}`` masks and by decoding), packing of flagged streams
against a token-by-token reference, the cache pair, bad records and templates, and a short
fine-tune whose assistant-token loss falls."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import transformers
from _chat_folder import CHATML, CHATS, make_chat_folder, write_chats
from tokenizers import Tokenizer as HFTok

from named.trainer.config import ConfigError
from named.trainer.data import ByteTokenizer, DataConfig, DataError, Sequences, TokenStream, _cache, build_data
from named.trainer.data import chat_template as chat_api
from named.trainer.data._packing import LOSS, START

# ChatML with the assistant's text marked for transformers' return_assistant_tokens_mask: the
# independent reference for our masks (it renders the same text as CHATML).
CHATML_GEN = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Shaped like Llama 3's: bos, a default system prompt, headers, trimmed content, raise_exception.
LLAMA3 = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] | trim %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = 'You are a helpful assistant.' %}{% endif %}"
    "{{ '<|start_header_id|>system<|end_header_id|>\n\n' + system + '<|eot_id|>' }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['user', 'assistant'] %}{{ raise_exception('Only user and assistant roles "
    "are supported after the system message') }}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}"
    "{% endgeneration %}{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
# Shaped like Gemma's: no system role (raise_exception), alternation checked, loop controls,
# a namespace, tojson on tools.
GEMMA = (
    "{{ bos_token }}{% if image_token is defined %}{{ image_token }}{% endif %}{% set ns = namespace(turns=0) %}"
    "{% if tools %}{{ '<tools>' + tools | tojson + '</tools>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% set ns.turns = ns.turns + 1 %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% if ns.turns > 50 %}{% break %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "Hello"}],
    CHATS[1]["messages"],
    [
        {"role": "user", "content": "  Spaces ü\n"},
        {"role": "assistant", "content": " Trimmed? \n"},
        {"role": "user", "content": "Yes: {{ not jinja }} <b>&</b>"},
    ],
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_chat_folder(tmp_path_factory.mktemp("hf") / "tiny-llama")


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    return write_chats(tmp_path_factory.mktemp("chats") / "chats.jsonl")


def variant(folder: Path, dest: Path, template, special=(), **config) -> Path:
    """``folder``'s tokenizer with another template (and more special tokens, other settings)."""
    dest.mkdir(parents=True, exist_ok=True)
    tok = HFTok.from_file(str(folder / "tokenizer.json"))
    if special:
        tok.add_special_tokens(list(special))
    tok.save(str(dest / "tokenizer.json"))
    shutil.copy(folder / "generation_config.json", dest / "generation_config.json")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.update(config)
    if template is None:
        cfg.pop("chat_template")
    else:
        cfg["chat_template"] = template
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dest


def hf_tokenizer(path: Path):
    return transformers.AutoTokenizer.from_pretrained(path)


def data_cfg(tmp_path, paths, tokenizer, *, seq_len=16, **kw) -> DataConfig:
    source = {"name": "chat", "paths": [str(p) for p in paths], "format": "chat"}
    return DataConfig(
        train=[source],
        tokenizer=str(tokenizer),
        seq_len=seq_len,
        val_fraction=0,
        cache_dir=str(tmp_path / "cache"),
        **kw,
    )


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


# ---- templates: the same text and ids as transformers ---------------------------------------


@pytest.mark.parametrize("name", ["chatml", "chatml-generation", "llama3", "gemma"])
def test_templates_render_as_transformers(folder, tmp_path, name):
    template, special, config = {
        "chatml": (CHATML, (), {}),
        "chatml-generation": (CHATML_GEN, (), {}),
        "llama3": (LLAMA3, LLAMA3_SPECIAL, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
        "gemma": (GEMMA, (), {"bos_token": "<|endoftext|>", "image_token": "<|im_start|>"}),  # a model's own token
    }[name]
    path = folder if name == "chatml" else variant(folder, tmp_path / name, template, special, **config)
    hf = hf_tokenizer(path)
    for messages in CONVERSATIONS:
        for gen in (False, True):
            want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert chat_api.render_prompt(str(path), messages, gen) == want
            ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen)["input_ids"]
            assert chat_api.prompt_ids(str(path), messages, gen) == ids
    tools = [{"type": "function", "function": {"name": "f", "description": "é <x>", "parameters": {}}}]
    fmt = chat_api.ChatFormat.load(str(path))
    assert fmt.template.render(CONVERSATIONS[0], tools=tools) == hf.apply_chat_template(
        CONVERSATIONS[0], tools=tools, tokenize=False
    )


def test_where_the_template_comes_from(folder, tmp_path):
    listed = variant(
        folder,
        tmp_path / "listed",
        [{"name": "default", "template": CHATML}, {"name": "tool_use", "template": "{{ 'tools' }}"}],
    )
    jinja = variant(folder, tmp_path / "jinja", CHATML)
    (jinja / "chat_template.jinja").write_text(GEMMA)  # transformers prefers the file to the config's
    for path in (listed, jinja):
        want = hf_tokenizer(path).apply_chat_template(CHATS[1]["messages"], tokenize=False)
        assert chat_api.render_prompt(str(path), CHATS[1]["messages"], False) == want
    given = tmp_path / "given.jinja"
    given.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    assert (
        chat_api.render_prompt(str(folder), CHATS[1]["messages"][:1], False, chat_template=str(given))
        == "user: Capital of France?\n"
    )


def test_raise_exception_is_a_data_error_like_transformers_refusal(folder, tmp_path):
    path = variant(folder, tmp_path / "gemma", GEMMA, bos_token="<|endoftext|>")
    system = CHATS[0]["messages"]
    with pytest.raises(Exception, match="System role not supported"):
        hf_tokenizer(path).apply_chat_template(system, tokenize=False)
    with pytest.raises(
        DataError,
        match=r"chat template .*tokenizer_config.json.* failed to render: "
        r"raise_exception\('System role not supported'\)",
    ):
        chat_api.render_prompt(str(path), system)


def test_stop_tokens(folder, tmp_path):
    hf = hf_tokenizer(folder)
    assert chat_api.stop_token_ids(str(folder)) == [hf.convert_tokens_to_ids("<|im_end|>")]
    # a base model's tokenizer: eos is <|endoftext|>, the template's turns end with <|im_end|>
    base = variant(folder, tmp_path / "base", CHATML, eos_token="<|endoftext|>")
    (base / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 7]}))
    ids = {t: hf.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")}
    assert chat_api.stop_token_ids(str(base)) == [ids["<|endoftext|>"], 7, ids["<|im_end|>"]]


# ---- the loss mask, by construction -------------------------------------------------------------


def _reference_stream(hf, records):
    """Tokens, document index and loss per token of ``records``, from transformers alone: its
    {% generation %} assistant masks, and for a prompt/completion pair the tokens after the
    prompt's (as TRL does) plus eos."""
    ids, doc, loss = [], [], []
    for d, r in enumerate(records):
        if "messages" in r:
            out = hf.apply_chat_template(
                r["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            t, m = out["input_ids"], out["assistant_masks"]
        else:
            p = hf(r["prompt"], add_special_tokens=False)["input_ids"]
            t = hf(r["prompt"] + r["completion"], add_special_tokens=False)["input_ids"] + [hf.eos_token_id]
            assert t[: len(p)] == p
            m = [0] * len(p) + [1] * (len(t) - len(p))
        ids += t
        doc += [d] * len(t)
        loss += list(m)
    return np.array(ids), np.array(doc), np.array(loss, bool)


@pytest.mark.parametrize("name", ["chatml", "llama3"])
def test_the_mask_is_the_assistant_tokens(folder, tmp_path, name, chats):
    # Ours renders the plain template and finds assistant text by prefixes; the reference is
    # transformers' masks from the same template with {% generation %} marks.
    if name == "chatml":
        ours, reference, records, end = folder, variant(folder, tmp_path / "gen", CHATML_GEN), CHATS * 3, "<|im_end|>"
    else:
        special = dict(special=LLAMA3_SPECIAL, bos_token="<|begin_of_text|>", eos_token="<|endoftext|>")
        plain = LLAMA3.replace("{% generation %}", "").replace("{% endgeneration %}", "")
        ours = variant(folder, tmp_path / "plain", plain, **special)
        reference = variant(folder, tmp_path / "gen", LLAMA3, **special)
        records = [
            {"messages": [{"role": "system", "content": "Be brief. "}, *m["messages"][-2:]]}
            for m in CHATS
            if "messages" in m
        ] * 3
        end = "<|eot_id|>"
    path = write_jsonl(tmp_path / "chats.jsonl", records)
    data = build_data(data_cfg(tmp_path, [path], ours, seq_len=16, chat_packing="stream"))
    hf = hf_tokenizer(reference)
    ids, doc, loss = _reference_stream(hf, records)
    rows = len(ids) // 16
    assert len(data.train) == rows
    batch = data.train.rows(np.arange(rows))
    ids, doc, loss = (a[: rows * 16].reshape(rows, 16) for a in (ids, doc, loss))
    np.testing.assert_array_equal(batch.input_ids, ids)
    first = np.concatenate([np.ones((rows, 1), bool), doc[:, 1:] != doc[:, :-1]], axis=1)
    np.testing.assert_array_equal(batch.segment_ids, np.cumsum(first, axis=1) - 1)
    want = np.zeros((rows, 16), bool)
    want[:, :-1] = (doc[:, 1:] == doc[:, :-1]) & loss[:, 1:]
    np.testing.assert_array_equal(batch.loss_mask, want)
    assert want.sum() > 0 and (~want).sum() > want.sum()  # both kinds of token are there

    # decoded, the loss-carrying targets of each whole document are its assistant contents
    flags = np.asarray(data.train.stream.flags[0])
    tokens = np.asarray(data.train.stream.arrays[0])
    starts = np.flatnonzero(flags & START).tolist() + [len(tokens)]
    for r, lo, hi in zip(records, starts[:-1], starts[1:]):
        carried = [int(t) for t, f in zip(tokens[lo:hi], flags[lo:hi]) if f & LOSS]
        if "messages" in r:
            trim = (lambda c: c.strip()) if name == "llama3" else (lambda c: c)  # LLAMA3 trims contents
            want_text = "".join(trim(m["content"]) + end for m in r["messages"] if m["role"] == "assistant")
        else:
            want_text = r["completion"] + hf.eos_token
        assert hf.decode(carried, skip_special_tokens=False) == want_text


def test_byte_tokenizer_and_a_template_file(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text(
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    records = [
        {"messages": [{"role": "user", "content": "hé"}, {"role": "assistant", "content": "ça va"}]},
        {"prompt": "1+1=", "completion": "2"},
    ]
    path = write_jsonl(tmp_path / "c.jsonl", records)
    data = build_data(data_cfg(tmp_path, [path], "byte", seq_len=8, chat_template=str(template)))
    stream = data.train.stream
    tokens, flags = np.asarray(stream.arrays[0]), np.asarray(stream.flags[0])
    carried = bytes(int(t) for t, f in zip(tokens, flags) if f & LOSS and t < 256).decode()
    assert carried == "ça va</>2" and int(tokens[-1]) == ByteTokenizer.eos_id and flags[-1] & LOSS
    assert flags.tolist().count(START) + flags.tolist().count(START | LOSS) == 2


def test_tool_messages_when_the_template_knows_them(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text(
        "{% for m in messages %}<{{ m['role'] }}>"
        "{% if m['role'] == 'assistant' and m['tool_calls'] is defined %}{{ m['tool_calls'] | tojson }}"
        "{% else %}{{ m['content'] }}{% endif %}</>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    call = [{"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]
    record = {
        "messages": [
            {"role": "user", "content": "1+1?"},
            {"role": "assistant", "content": None, "tool_calls": call},
            {"role": "tool", "content": "2"},
            {"role": "assistant", "content": "Two."},
        ]
    }
    path = write_jsonl(tmp_path / "c.jsonl", [record] * 2)
    stream = build_data(data_cfg(tmp_path, [path], "byte", seq_len=8, chat_template=str(template))).train.stream
    tokens, flags = np.asarray(stream.arrays[0]), np.asarray(stream.flags[0])
    carried = bytes(int(t) for t, f in zip(tokens, flags) if f & LOSS).decode()
    assert carried == (json.dumps(call, ensure_ascii=False) + "</>Two.</>") * 2


# ---- packing flagged streams -------------------------------------------------------------------


def _reference_rows(arrays, seq_len, eos):
    """(tokens, segments, mask) per row by walking the arrays token by token: a flagged array
    starts documents at START and counts only LOSS targets; others split after eos."""
    flat, doc, loss, d = [], [], [], 0
    for tokens, flags in arrays:
        for i, t in enumerate(tokens):
            if i and (flags[i] & START if flags is not None else tokens[i - 1] == eos):
                d += 1
            flat.append(int(t))
            doc.append(d)
            loss.append(bool(flags[i] & LOSS) if flags is not None else True)
        d += 1
    rows = []
    for r in range(len(flat) // seq_len):
        s = slice(r * seq_len, (r + 1) * seq_len)
        docs, lo = doc[s], loss[s]
        relabel = {x: i for i, x in enumerate(dict.fromkeys(docs))}
        mask = [i + 1 < seq_len and docs[i + 1] == docs[i] and lo[i + 1] for i in range(seq_len)]
        rows.append((flat[s], [relabel[x] for x in docs], mask))
    return rows


@pytest.mark.parametrize("seq_len", [2, 5, 16])
def test_packing_flagged_and_plain_arrays_matches_a_reference(seq_len):
    rng = np.random.default_rng(seq_len)
    eos = 9
    arrays = []
    for k in range(4):
        tokens = rng.integers(0, 10, 40).astype(np.uint16)  # eos appears inside chat documents too
        if k % 2:
            arrays.append((tokens, None))
            continue
        flags = (rng.random(40) < 0.5).astype(np.uint8) * LOSS
        flags[rng.random(40) < 0.15] |= START
        flags[0] |= START
        arrays.append((tokens, flags))
    seqs = Sequences(TokenStream([a for a, _ in arrays], eos, [f for _, f in arrays]), seq_len)
    batch = seqs.rows(np.arange(len(seqs)))
    ref = _reference_rows(arrays, seq_len, eos)
    assert len(ref) == len(seqs)
    for r, (tokens, seg, mask) in enumerate(ref):
        assert batch.input_ids[r].tolist() == tokens
        assert batch.segment_ids[r].tolist() == seg
        assert batch.loss_mask[r].tolist() == mask
    # the rows of a split, concatenated, keep their flags
    half = len(seqs) // 2
    joined = Sequences.concat(
        [Sequences(seqs.stream, seq_len, half, len(seqs) - half), Sequences(seqs.stream, seq_len, 0, half)]
    )
    again = joined.rows(np.arange(len(joined)))
    order = np.r_[half : len(seqs), 0:half]
    for a, b in zip(again, batch):
        np.testing.assert_array_equal(a, b[order])


def test_a_mixture_of_chat_and_text_and_held_out_validation(folder, chats, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    cfg = DataConfig(
        train=[
            {"name": "chat", "paths": [str(chats)], "format": "chat", "weight": 1},
            {"name": "text", "paths": [str(text)], "weight": 1},
        ],
        tokenizer=str(folder),
        seq_len=16,
        val_fraction=0.2,
        cache_dir=str(tmp_path / "cache"),
    )
    data = build_data(cfg)
    chat_rows, text_rows = data.validation_sources["chat"], data.validation_sources["text"]
    b_chat, b_text = chat_rows.rows(np.arange(len(chat_rows))), text_rows.rows(np.arange(len(text_rows)))
    assert 0 < b_chat.loss_mask.mean() < 0.6  # prompts carry none
    assert b_text.loss_mask[:, :-1].all()  # one text document: every target but the row's last
    both = data.validation.rows(np.arange(len(data.validation)))
    np.testing.assert_array_equal(both.loss_mask, np.concatenate([b_chat.loss_mask, b_text.loss_mask]))


# ---- the cache pair ------------------------------------------------------------------------------


def _cache_files(tmp_path):
    return sorted(p.name for p in (tmp_path / "cache").iterdir()) if (tmp_path / "cache").exists() else []


def test_the_cache_is_reused_and_keyed_by_the_template(folder, chats, tmp_path, monkeypatch):
    cfg = data_cfg(tmp_path, [chats], folder)
    first = build_data(cfg).train.rows(np.arange(4))
    files = _cache_files(tmp_path)
    assert len(files) == 2 and files[0].startswith("flags-") and files[1].startswith("tokens-")
    calls = []
    monkeypatch.setattr(_cache, "encode_chat_into", lambda *a: calls.append(a))
    again = build_data(cfg).train.rows(np.arange(4))
    assert calls == []  # read back, not tokenised again
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    monkeypatch.undo()
    other = tmp_path / "other.jinja"
    other.write_text(CHATML + "{# the same text, another template #}")  # another template: another cache
    build_data(data_cfg(tmp_path, [chats], folder, chat_template=str(other)))
    assert len(_cache_files(tmp_path)) == 4
    # a token file whose flags are gone is rebuilt; flags of another length are refused
    flags = tmp_path / "cache" / files[0]
    flags.unlink()
    build_data(cfg)
    assert flags.is_file()
    flags.write_bytes(flags.read_bytes()[:-1])
    with pytest.raises(DataError, match=r"holds \d+ tokens but its flags .*flags-.* \d+; delete both"):
        build_data(cfg)


def test_text_sources_are_untouched_by_chat_support(tmp_path):
    # the text cache file has the name (key) and bytes it had before chat sources existed
    text = tmp_path / "a.txt"
    text.write_text("hello world")
    data = build_data(DataConfig(train=[str(text)], seq_len=4, val_fraction=0, cache_dir=str(tmp_path / "cache")))
    assert data.train.stream.flags == [None]
    (cache,) = (tmp_path / "cache").iterdir()
    assert cache.read_bytes() == np.array([*b"hello world", 256], np.uint16).tobytes()


# ---- bad input ------------------------------------------------------------------------------------

GOOD = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
BAD = {
    "no messages": (
        {"text": "hi"},
        r"a chat record needs 'messages' .* or 'instruction' and 'output' \(alpaca\); its keys: 'text'",
    ),
    "not an object": (
        [1, 2],
        r"expected an object with 'messages' or 'conversations', or 'prompt' and 'completion'; got an array",
    ),
    "empty messages": ({"messages": []}, r"'messages' must be a non-empty list .* got an empty list"),
    "messages not a list": ({"messages": "hi"}, r"'messages' must be a non-empty list .* got a string"),
    "unknown role": (
        {"messages": [{"role": "bot", "content": "x"}]},
        r"messages\[0\]: unknown role 'bot'; roles: "
        r"system, user, assistant\n",
    ),
    "no role": (
        {"messages": [{"content": "x"}]},
        r"messages\[0\] has no 'role' field; give each message a role: "
        r"system, user, assistant\n",
    ),
    "null role": ({"messages": [{"role": None, "content": "x"}]}, r"messages\[0\] has a null 'role'; give each "),
    "tool role without tools": (
        {"messages": [{"role": "tool", "content": "x"}]},
        r"messages\[0\]: unknown role 'tool' \(the chat template .* has no tool messages\)",
    ),
    "message not an object": ({"messages": ["hi"]}, r"messages\[0\] must be an object with 'role' and 'content'"),
    "content parts": (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]},
        r"messages\[0\]: 'content' must be a string, got an array",
    ),
    "no content": ({"messages": [{"role": "user"}]}, r"messages\[0\]: 'content' must be a string, got missing"),
    "blank assistant": (
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " "}]},
        r"messages\[1\]: an assistant message with blank content",
    ),
    "no assistant": ({"messages": [{"role": "user", "content": "Hi"}]}, r"no assistant message, so no token"),
    "both kinds": (
        {**GOOD, "prompt": "a", "completion": "b"},
        r"a record has one of 'messages', 'conversations', 'prompt' and 'completion', or 'instruction' and "
        r"'output'; this one has 'messages' "
        r"and 'prompt' and 'completion'",
    ),
    "prompt only": ({"prompt": "a"}, r"'completion' must be a string, got missing"),
    "blank completion": ({"prompt": "a", "completion": ""}, r"'completion' is blank"),
    "tools not a list": ({**GOOD, "tools": "x"}, r"'tools' must be a list of objects"),
    "bad json": ("{not json", r"not valid JSON"),
    "surrogate": ({"prompt": "a", "completion": "\ud800"}, r"the record holds a lone UTF-16 surrogate"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_records_name_file_and_line_and_leave_nothing(folder, tmp_path, case):
    record, pattern = BAD[case]
    path = write_jsonl(tmp_path / "c.jsonl", [GOOD, record, GOOD])
    with pytest.raises(DataError, match=f"^data.train source 'chat': {path}:2: " + pattern):
        build_data(data_cfg(tmp_path, [path], folder))
    assert _cache_files(tmp_path) == []


def test_bad_templates(folder, chats, tmp_path):
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m['content'] }")
    with pytest.raises(DataError, match=rf"chat template {broken} is not valid Jinja: line 1: "):
        build_data(data_cfg(tmp_path, [chats], folder, chat_template=str(broken)))
    with pytest.raises(DataError, match=r"data.chat_template '.*missing.jinja' is not a file"):
        build_data(data_cfg(tmp_path, [chats], folder, chat_template=str(tmp_path / "missing.jinja")))
    failing = tmp_path / "failing.jinja"
    failing.write_text("{{ messages[0]['content'] + 1 }}")
    with pytest.raises(DataError, match=rf"{chats}:1: the chat template {failing} failed to render: TypeError"):
        build_data(data_cfg(tmp_path, [chats], folder, chat_template=str(failing)))
    gemma = variant(folder, tmp_path / "gemma", GEMMA, bos_token="<|endoftext|>")
    with pytest.raises(
        DataError,
        match=rf"{chats}:1: the chat template .*gemma.*failed to render: "
        r"raise_exception\('System role not supported'\)",
    ):
        build_data(data_cfg(tmp_path, [chats], gemma))
    assert _cache_files(tmp_path) == []


def test_a_folder_without_a_template(folder, chats, tmp_path):
    bare = variant(folder, tmp_path / "bare", None)
    with pytest.raises(
        DataError,
        match=rf"{chats}:1: a conversation needs a chat template and {bare} has none "
        r".*give a Jinja file as data.chat_template",
    ):
        build_data(data_cfg(tmp_path, [chats], bare))
    with pytest.raises(DataError, match=r"has none"):
        chat_api.render_prompt(str(bare), GOOD["messages"])
    # prompt/completion pairs need no template
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "Two plus two is", "completion": " four."}] * 4)
    assert len(build_data(data_cfg(tmp_path, [pairs], bare)).train) > 0


def test_bad_source_settings(folder, chats, tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("hello")
    with pytest.raises(DataError, match=r"a.txt' is a text file; a chat source reads JSON Lines"):
        build_data(data_cfg(tmp_path, [text], folder))
    with pytest.raises(DataError, match=r"data.train\[0\].format must be one of text, chat, got 'sharegpt'"):
        DataConfig(train=[{"name": "c", "paths": [str(chats)], "format": "sharegpt"}])
    with pytest.raises(DataError, match=r"data.train\[0\].text_field: a chat source reads whole records"):
        DataConfig(train=[{"name": "c", "paths": [str(chats)], "format": "chat", "text_field": "x"}])
    with pytest.raises(ConfigError, match=r"data.chat_template must be non-empty, got ''"):
        DataConfig(chat_template="")
    with pytest.raises(DataError, match=r"chat data needs the byte tokenizer or a tokenizer.json"):
        build_data(data_cfg(tmp_path, [chats], folder), tokenizer=_OtherTokenizer())
    template = tmp_path / "t.jinja"
    template.write_text(
        "{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['content'] }}{% endif %}{% endfor %}"
    )
    with pytest.raises(DataError, match=r":1: the chat template .* renders nothing for message 2 \(assistant\)"):
        build_data(data_cfg(tmp_path, [chats], "byte", chat_template=str(template)))
    template.write_text("{% for m in messages %}{{ m['content'] }}{% if loop.last %}!{% endif %}{% endfor %}")
    with pytest.raises(
        DataError,
        match=r":1: the chat template .* renders message 2 \(assistant\) differently "
        r"depending on what follows it",
    ):
        build_data(data_cfg(tmp_path, [chats], "byte", chat_template=str(template)))
    assert _cache_files(tmp_path) == []


class _OtherTokenizer:
    """A tokenizer of the protocol that is neither ours nor a tokenizer.json."""

    vocab_size, eos_id, fingerprint = 257, 256, "other"

    def encode(self, text):
        return list(text.encode())

    def decode(self, ids):
        return bytes(ids).decode()


# ---- a short fine-tune ---------------------------------------------------------------------------


def test_sft_from_the_folder_lowers_the_assistant_loss(folder, chats, tmp_path):
    from named.trainer.config import load_config
    from named.trainer.loop.train import train

    over = {
        "model.init_from_hf": str(folder),
        "trainer.num_train_steps": 8,
        "trainer.train_batch_size": 8,
        "trainer.log_interval": 1,
        "trainer.eval_interval": 0,
        "trainer.progress_bar": "false",
        "trainer.run_dir": str(tmp_path / "run"),
        "optimizer.warmup_steps": 0,
        "optimizer.learning_rate": 3e-3,
        "data.train": f"[{{name: chat, paths: [{chats}], format: chat}}]",
        "data.seq_len": 32,
        "data.val_fraction": 0,
        "data.cache_dir": str(tmp_path / "cache"),
        "mesh.shape": "{data: 8}",
        "mesh.param_mapping": "{embed: data}",
        "tracker.console": "false",
    }
    cfg = load_config(None, [x for k, v in over.items() for x in (f"--{k}", str(v))])
    assert cfg.data.train[0]["format"] == "chat" and cfg.data.tokenizer == str(folder)
    result = train(cfg)
    # the loss is the mean over loss-mask tokens, which are the assistant's alone (tested above)
    assert len(result.losses) == 8 and result.losses[-1] < result.losses[0] - 0.3, result.losses
    # the run's log gives the padding share of the whole-sample packing (data.chat_packing: whole)
    logged = (tmp_path / "run" / "logs" / "process_0.log").read_text()
    assert "data.train source 'chat': packed 24 whole samples into " in logged and "% padding" in logged


# ---- Parquet and Arrow chats, alpaca records --------------------------------------------------------


def _assert_stream(data, hf, records) -> None:
    """The chat cache of ``data`` holds transformers' tokens of ``records``, a START flag on each
    record's first token and LOSS on the tokens of its {% generation %} mask."""
    ids, doc, loss = _reference_stream(hf, records)
    tokens, flags = (np.asarray(a[0]) for a in (data.train.stream.arrays, data.train.stream.flags))
    np.testing.assert_array_equal(tokens, ids)
    np.testing.assert_array_equal((flags & LOSS) > 0, loss)
    np.testing.assert_array_equal(np.flatnonzero(flags & START), np.flatnonzero(np.diff(doc, prepend=-1)))


def test_parquet_arrow_and_alpaca_chats_are_read_as_transformers_renders_them(folder, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    hf = hf_tokenizer(variant(folder, tmp_path / "gen", CHATML_GEN))
    records = [c for c in CHATS if "messages" in c] * 2
    # UltraChat's columns: a prompt and its id beside the messages (a list of {role, content} structs)
    table = pa.Table.from_pylist(
        [{"prompt": r["messages"][0]["content"], "prompt_id": str(i), **r} for i, r in enumerate(records)]
    )
    pq.write_table(table, tmp_path / "chats.parquet", row_group_size=3)
    with pa.OSFile(str(tmp_path / "chats.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table, max_chunksize=2)
    for name in ("chats.parquet", "chats.arrow"):
        cfg = data_cfg(tmp_path, [tmp_path / name], folder, chat_packing="stream")
        _assert_stream(build_data(cfg), hf, records)

    alpaca = [
        {"instruction": "Add the numbers.", "input": "2 and 2", "output": "Four."},
        {"instruction": "Say hello.", "input": "", "output": "Hello!"},
        {"instruction": "Name a colour.", "output": "Blue.", "system": "Be brief."},
    ]
    as_messages = [
        {
            "messages": [
                {"role": "user", "content": "Add the numbers.\n\n2 and 2"},
                {"role": "assistant", "content": "Four."},
            ]
        },
        {"messages": [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello!"}]},
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": "Blue."},
            ]
        },
    ]
    columns = ("instruction", "input", "output", "system")  # null where a record lacks one
    pq.write_table(pa.table({c: [r.get(c) for r in alpaca] for c in columns}), tmp_path / "alpaca.parquet")
    for path in (write_jsonl(tmp_path / "alpaca.jsonl", alpaca), tmp_path / "alpaca.parquet"):
        cfg = data_cfg(tmp_path, [path], folder, chat_packing="stream")
        _assert_stream(build_data(cfg), hf, as_messages)


def test_a_columnar_file_without_its_columns_is_named_as_listed_never_as_its_blob(folder, tmp_path):
    """A Hub snapshot's files are links to blobs named by hash: errors name the link."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    blob = tmp_path / "blobs" / "3f2a9c0e1d"
    blob.parent.mkdir()
    pq.write_table(pa.Table.from_pylist([{"messages": [{"role": "user", "content": "Hi"}], "id": "a"}]), blob)
    link = tmp_path / "snapshots" / "main" / "train.parquet"
    link.parent.mkdir(parents=True)
    link.symlink_to(blob)
    text = DataConfig(train=[str(link)], tokenizer=str(folder), seq_len=16, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError, match=rf"^{link}: no column 'text' .*format: chat") as e:
        build_data(text)
    assert "3f2a9c0e1d" not in str(e.value)
    pq.write_table(pa.Table.from_pylist([{"question": "Hi", "id": "a"}]), blob)
    with pytest.raises(
        DataError, match=rf"^data.train source 'chat': {link}: no chat columns \(its columns: question, id\)"
    ):
        build_data(data_cfg(tmp_path, [link], folder))
