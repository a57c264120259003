"""``named-sample`` conversations: ``--chat`` alone talks turn by turn on stdin, keeping the
conversation; ``--system`` puts a system prompt first; ``--messages FILE`` continues a whole
conversation (JSON or JSON Lines of {role, content}).

The run is one step of the tiny Llama folder (its ChatML template). Greedy replies make the
session checkable against the one-shot path: the session's second reply is the reply to the file
holding its first two turns, so the session kept the conversation.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
from _chat_folder import tiny_run

from named.trainer.commands.cli import main_sample
from named.trainer.commands.sample import Sampler, chat_session, sample_from_checkpoint


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return tiny_run(tmp_path_factory.mktemp("chat"))


def _session(monkeypatch, capsys, run: Path, stdin: str, *flags: str) -> tuple[int, list[str], str]:
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = main_sample(["--checkpoint", str(run), "--chat", "--tokens", "4", *flags])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


def test_a_session_keeps_the_conversation(run, monkeypatch, capsys, tmp_path):
    code, replies, err = _session(monkeypatch, capsys, run, "Hi\n\nTwo?\n", "--system", "Be.")
    assert code == 0 and len(replies) == 2, (replies, err)  # the blank line is no turn; end of input ends it
    assert "dropped" not in err
    turns = [
        {"role": "system", "content": "Be."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": replies[0]},
        {"role": "user", "content": "Two?"},
    ]
    conversation = tmp_path / "conversation.jsonl"
    conversation.write_text("".join(json.dumps(m) + "\n" for m in turns))
    assert main_sample(["--checkpoint", str(run), "--messages", str(conversation), "--tokens", "4"]) == 0
    assert capsys.readouterr().out.splitlines() == [replies[1]]
    # the first turn alone, through the one-shot path: the session's first reply
    assert sample_from_checkpoint(run, "", 4, chat="Hi", system="Be.") == replies[0]

    # /reset starts over from the system prompt: the same first reply; /exit ends the session
    code, again, _ = _session(monkeypatch, capsys, run, "Hi\n/reset\nHi\n/exit\nnever read\n", "--system", "Be.")
    assert code == 0 and again == [replies[0], replies[0]]

    # a --messages file that ends with a user message is answered first, then the session goes on
    as_list = tmp_path / "conversation.json"
    as_list.write_text(json.dumps({"messages": turns}))
    code, more, _ = _session(monkeypatch, capsys, run, "", "--messages", str(as_list))
    assert code == 0 and more == [replies[1]]


def test_a_long_session_drops_its_oldest_turns(run, monkeypatch, capsys):
    lines = "".join(f"Tell me about the quick brown fox number {i}, please.\n" for i in range(6))
    code, replies, err = _session(monkeypatch, capsys, run, lines)
    assert code == 0 and len(replies) == 6
    assert "oldest user turn was dropped" in err and "64 positions" in err


def test_a_session_reads_turns_from_any_reader(run):
    """``chat_session`` itself: the reader, writer and notes are parameters (the CLI passes stdin)."""
    got: list[str] = []
    inputs = iter(["Hi\n", ""])
    assert chat_session(run, 4, read=lambda: next(inputs), write=got.append, ask=lambda _: None) == 0
    assert len(got) == 1 and got[0] == sample_from_checkpoint(run, "", 4, chat="Hi")


@pytest.mark.parametrize(
    "content, culprit",
    [
        ("", "no messages"),
        ('[{"role": "user"}]', 'messages[0] must be {"role": one of system, user, assistant'),
        ('{"role": "user", "content": "hi"}\n{"role": "wizard", "content": "x"}\n', "line 2 must be"),
        ('{"role": "user", "content": "hi"}\nnot json\n', "line 2 is not JSON"),
        ('"text"', "a conversation is a list of {role, content} messages, got str"),
        (
            '[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]',
            "ends with a assistant message",
        ),
        ('[{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]', "give the system prompt once"),
    ],
)
def test_bad_messages_files_are_named(run, tmp_path, capsys, content, culprit):
    path = tmp_path / "m.jsonl"
    path.write_text(content)
    assert main_sample(["--checkpoint", str(run), "--messages", str(path), "--system", "S"]) == 2
    err = capsys.readouterr().err
    assert culprit in err and (str(path) in err or "--messages" in err), err


def test_bad_conversation_flags_are_named(run, capsys, tmp_path):
    for argv, culprit in (
        (["--prompt", "x", "--chat"], "give --prompt or a conversation"),
        (["--prompt", "x", "--system", "S"], "give --prompt or a conversation"),
        (["--system", "S"], "--system needs a conversation"),
        (["--chat", "hi", "--system", " "], "--system: the system prompt is empty"),
        (["--messages", str(tmp_path / "absent.json")], "no such file"),
        (["--chat", "--tokens", "0"], "--tokens must be at least 1"),
    ):
        assert main_sample(["--checkpoint", str(run), *argv]) == 2, argv
        assert culprit in capsys.readouterr().err, argv
    assert Sampler.open(run).model is None  # nothing restored before the checks
