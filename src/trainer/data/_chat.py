"""Chat sources: records of conversations, instructions or prompt/completion pairs, tokenised with
a loss flag per token.

A record (one JSON object per line, or one row; other keys are ignored) is one of:

- ``{"messages": [{"role": ..., "content": ...}, ...]}``, optionally with ``"tools": [...]``:
  roles ``system``, ``user``, ``assistant`` (and ``tool`` when the template mentions tools),
  content a string (an assistant message with ``tool_calls`` may have none), at least one
  assistant message, none with blank content. The text is the chat template's rendering; the
  tokens that carry loss are each assistant turn's: from the end of the generation prompt that
  precedes it (``<|im_start|>assistant\\n``) through its last stop token (ChatML's ``<|im_end|>``,
  Llama 3's ``<|eot_id|>``; ``chat_template.stop_token_ids``), so the model learns to end its turn, but
  not what a template puts after that token (ChatML's newline). Without a stop token in the
  turn, the whole turn as the template renders it.
- ``{"conversations": [{"from": ..., "value": ...}, ...]}`` (ShareGPT): the same conversation,
  ``from`` one of ``system``, ``human`` (the user), ``gpt`` (the assistant), or ``user``,
  ``assistant``, ``tool``; ``value`` its content.
- ``{"instruction": "...", "input": "...", "output": "..."}`` (alpaca, as axolotl reads it;
  ``input`` and ``system`` optional): the conversation of a user turn (the instruction, then the
  input after a blank line when it is not blank) and an assistant turn (the output), after a
  system message when ``system`` is given, rendered with the chat template as ``messages`` are.
- ``{"prompt": "...", "completion": "..."}``: plain text, no template (as for a base model);
  the tokens are those of prompt + completion, then eos; the completion's and eos carry loss.

Records are the lines of JSONL files, or the rows of Parquet and Arrow files (``_columnar``: a
``messages`` column of lists of ``{role, content}`` structs, as the Hub's SFT sets ship). A
columnar file's record kind is chosen by its columns, the first found of ``messages``,
``conversations``, ``prompt`` and ``completion``, ``instruction`` and ``output``; the other
columns are not read (UltraChat's ``prompt`` beside its ``messages`` is not a second kind).

``ChatRules`` changes what carries loss: ``loss_roles`` (``data.loss_roles``) lists the roles whose
turns do (an assistant turn from the end of its generation prompt, another role's from the start
of its content; a prompt counts as the user's, a completion as the assistant's), and
``train_on_inputs`` makes every token of a record carry loss. Bad records are all reported (the
first ``MAX_LISTED`` by ``file:line``), or, with ``skip_bad_records``, left out and counted in the log.

Tokens are chosen by character offsets: a token carries loss when its characters overlap the
turn's (a token that straddles the end of a header and the start of a reply counts as reply).
Each document is written as tokens plus one flag byte per token, ``LOSS`` (this token is a
target that carries loss) and ``START`` (the first token of a document). Documents are not
separated by eos, since a template's end-of-turn token is often the eos token itself; the
flags say where each begins.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

from ..config.data_section import MESSAGE_ROLES, DataError
from ._encode import check_ids, chunked
from ._packing import LOSS, START
from ._sources import has_surrogate, json_kind
from .chat_template import ChatFormat, ChatTemplate, turn_spans

log = logging.getLogger(__name__)

CHAT_FORMAT = 1  # these rules (what carries loss, how documents are marked): a change must not reuse old caches
ROLES = tuple(r for r in MESSAGE_ROLES if r != "tool")  # and tool, when the template mentions tools
SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant", "user": "user", "assistant": "assistant"}
MAX_LISTED = 20  # bad records named one by one in the error; the rest are counted
_KIND_KEYS = ("messages", "conversations", "prompt", "completion", "instruction", "output")


@dataclass(frozen=True)
class ChatRules:
    """What carries loss in a chat record, and what a bad record does (``data.loss_roles``,
    ``data.train_on_inputs``, ``data.skip_bad_records``)."""

    loss_roles: tuple[str, ...] = ("assistant",)
    train_on_inputs: bool = False
    skip_bad_records: bool = False

    @staticmethod
    def of(cfg) -> ChatRules:
        """The rules a ``DataConfig`` sets."""
        return ChatRules(tuple(cfg.loss_roles), cfg.train_on_inputs, cfg.skip_bad_records)

    @property
    def key(self) -> list:
        """What of the rules decides a cache's contents (its key)."""
        return [sorted(self.loss_roles), self.train_on_inputs, self.skip_bad_records]


DEFAULT_RULES = ChatRules()


class BadRecords:
    """Collects bad records while a source is read; ``finish`` raises them all, or logs how
    many were skipped."""

    def __init__(self, skip: bool):
        self.skip, self.messages = skip, []

    def add(self, error: DataError) -> None:
        self.messages.append(str(error))

    def finish(self, records: int) -> None:
        n = len(self.messages)
        if not n:
            return
        if self.skip:
            log.warning(
                "data.skip_bad_records: skipped %d bad records of %d; the first: %s", n, records, self.messages[0]
            )
            return
        them = "them" if n > 1 else "it"
        listed = self.messages[:MAX_LISTED] + ([f"... and {n - MAX_LISTED} more"] if n > MAX_LISTED else [])
        raise DataError(
            "\n".join(listed) + f"\n{n} bad record{'s' if n > 1 else ''} of {records}; fix {them}, or set "
            f"data.skip_bad_records: true to train without {them}"
        )


def _checked(make: Callable[[], tuple], bad: BadRecords) -> tuple | None:
    try:
        return make()
    except DataError as e:
        bad.add(e)
        return None


def encode_chat_into(
    tokens_f: BinaryIO,
    flags_f: BinaryIO,
    records: Callable[[Callable[[DataError], None]], Iterator[tuple[str, object]]],
    fmt: ChatFormat,
    dtype: np.dtype,
    rules: ChatRules = DEFAULT_RULES,
) -> int:
    """Render, check and tokenise the ``(where, record)`` pairs of ``records(on_bad)`` (which
    hands unreadable lines to ``on_bad``) into a token file and its flag file; returns the number
    of tokens written. Every record is checked; the bad ones are reported together at the end
    (``BadRecords``), or left out under ``rules.skip_bad_records``."""
    n = count = 0
    eos = fmt.tokenizer.eos_id
    bad = BadRecords(rules.skip_bad_records)

    def unreadable(error: DataError) -> None:
        nonlocal count
        count += 1
        bad.add(error)

    def documents():
        nonlocal count
        for where, record in records(unreadable):
            count += 1
            if (doc := _checked(lambda: document(where, record, fmt, rules), bad)) is not None:
                yield doc

    for chunk in chunked(documents()):
        ids, flags, good = [], [], []
        for (where, _, spans, eos_loss), (tok, starts, ends) in zip(chunk, fmt.encode([c[1] for c in chunk])):
            stops = () if eos_loss is not None or rules.train_on_inputs else fmt.stop_ids
            mask = loss_tokens(tok, starts, ends, spans, stops)
            if eos_loss is not None:
                tok, mask = np.append(tok, eos), np.append(mask, eos_loss)
            if not mask[1:].any():
                bad.add(
                    DataError(f"{where}: no token carries loss (the text of data.loss_roles vanished when tokenised)")
                )
                continue
            f = mask.astype(np.uint8) * LOSS
            f[0] |= START
            ids.append(tok)
            flags.append(f)
            good.append(where)
        if not ids or (bad.messages and not rules.skip_bad_records):
            continue  # nothing more is written once a record is bad: the error comes when every one is checked
        flat = np.concatenate(ids)
        check_ids(flat, np.cumsum([len(t) for t in ids]), good, fmt.tokenizer)
        tokens_f.write(flat.astype(dtype).tobytes())
        flags_f.write(np.concatenate(flags).tobytes())
        n += flat.size
    bad.finish(count)
    return n


def loss_tokens(
    ids: np.ndarray, starts: np.ndarray, ends: np.ndarray, spans: list[tuple[int, int]], stop_ids
) -> np.ndarray:
    """True for the tokens whose characters overlap a span, each span cut after its last stop token."""
    mask = np.zeros(len(ids), bool)
    stops = np.isin(ids, np.asarray(list(stop_ids), np.int64))
    for a, b in spans:
        inside = np.flatnonzero((starts < b) & ((ends > a) | ((starts == ends) & (starts >= a))))
        if inside.size == 0:
            continue
        last = inside[-1]
        closing = inside[stops[inside]]
        mask[inside[0] : (closing[-1] if closing.size else last) + 1] = True
    return mask


def document(
    where: str, record, fmt: ChatFormat, rules: ChatRules = DEFAULT_RULES
) -> tuple[str, str, list[tuple[int, int]], bool | None]:
    """``(where, text, spans, eos_loss)``: the text to tokenise, the characters that carry loss,
    and whether eos follows (None: it does not; prompt/completion pairs: whether it carries loss)."""
    if not isinstance(record, dict):
        raise DataError(
            f"{where}: expected an object with 'messages' or 'conversations', or 'prompt' and 'completion'; "
            f"got {json_kind(record)}"
        )
    kinds = [k for k in ("messages", "conversations", "prompt", "instruction") if k in record]
    kinds += ["prompt"] if "completion" in record and "prompt" not in record else []
    kinds += ["instruction"] if "output" in record and "instruction" not in record else []
    if len(kinds) > 1:
        given = " and ".join(repr(k) for k in _KIND_KEYS if k in record)
        raise DataError(
            f"{where}: a record has one of 'messages', 'conversations', 'prompt' and 'completion', or "
            f"'instruction' and 'output'; this one has {given}"
        )
    if kinds and kinds[0] in ("messages", "conversations", "instruction"):
        template = _template(where, fmt)
        if kinds[0] == "conversations":
            record = {**record, "messages": _sharegpt(where, record["conversations"])}
        elif kinds[0] == "instruction":
            record = {"messages": _alpaca(where, record)}
        messages, tools = _conversation(where, record, template, kinds[0], rules)
        try:
            if rules.train_on_inputs:
                text = template.render(messages, tools=tools)
                spans = [(0, len(text))]
            else:
                text, spans = turn_spans(template, messages, rules.loss_roles, tools=tools)
        except DataError as e:
            raise DataError(f"{where}: {e}") from None
        eos_loss = None
    elif kinds:
        prompt, completion = (_string(where, record, k) for k in ("prompt", "completion"))
        if not completion.strip():
            raise DataError(f"{where}: 'completion' is blank: nothing to train on")
        text, spans = prompt + completion, []
        if rules.train_on_inputs or "user" in rules.loss_roles:
            spans.append((0, len(prompt)))
        eos_loss = rules.train_on_inputs or "assistant" in rules.loss_roles
        if eos_loss:
            spans.append((len(prompt), len(text)))
    else:
        keys = ", ".join(map(repr, record)) or "none"
        raise DataError(
            f"{where}: a chat record needs 'messages' (a list of {{role, content}}), 'conversations' (ShareGPT: "
            f"a list of {{from, value}}), 'prompt' and 'completion', or 'instruction' and 'output' (alpaca); "
            f"its keys: {keys}"
        )
    if has_surrogate(text):
        raise DataError(f"{where}: the record holds a lone UTF-16 surrogate (\\ud800-\\udfff escape)")
    return where, text, spans, eos_loss


def _alpaca(where: str, record: dict) -> list[dict]:
    """An alpaca record (``instruction``, optional ``input`` and ``system``, ``output``) as messages:
    the system message when given, the user's instruction followed by the input after a blank
    line when the input is not blank, and the assistant's output."""
    instruction, output = (_string(where, record, k, "an alpaca record") for k in ("instruction", "output"))
    extra = {k: _string(where, record, k, "an alpaca record") for k in ("input", "system") if k in record}
    user = instruction + (f"\n\n{extra['input']}" if extra.get("input", "").strip() else "")
    system = [{"role": "system", "content": extra["system"]}] if extra.get("system", "").strip() else []
    return [*system, {"role": "user", "content": user}, {"role": "assistant", "content": output}]


def _sharegpt(where: str, turns) -> list[dict]:
    """ShareGPT turns (``{from, value}``) as messages (``{role, content}``)."""
    if not isinstance(turns, list) or not turns:
        got = "an empty list" if isinstance(turns, list) else json_kind(turns)
        raise DataError(f"{where}: 'conversations' must be a non-empty list of {{from, value}} objects, got {got}")
    out = []
    for i, t in enumerate(turns):
        at = f"{where}: conversations[{i}]"
        if not isinstance(t, dict):
            raise DataError(f"{at} must be an object with 'from' and 'value', got {json_kind(t)}")
        who = t.get("from")
        if who not in SHAREGPT_ROLES and who != "tool":
            raise DataError(f"{at}: unknown 'from' {who!r}; ShareGPT speakers: {', '.join([*SHAREGPT_ROLES, 'tool'])}")
        if "value" not in t:
            raise DataError(f"{at} has no 'value' (the text of the turn)")
        out.append({"role": SHAREGPT_ROLES.get(who, who), "content": t["value"]})
    return out


def _template(where: str, fmt: ChatFormat) -> ChatTemplate:
    try:
        return fmt.require_template()
    except DataError as e:
        raise DataError(f"{where}: {e}") from None


def _string(where: str, record: dict, key: str, what: str = "a prompt/completion pair") -> str:
    value = record.get(key)
    if not isinstance(value, str):
        got = "missing" if key not in record else json_kind(value)
        raise DataError(f"{where}: {key!r} must be a string, got {got} ({what} is strings)")
    return value


def _conversation(
    where: str, record: dict, template: ChatTemplate, field: str = "messages", rules: ChatRules = DEFAULT_RULES
) -> tuple[list[dict], list | None]:
    messages, tools = record["messages"], record.get("tools")
    if not isinstance(messages, list) or not messages:
        got = "an empty list" if isinstance(messages, list) else json_kind(messages)
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects, got {got}")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise DataError(f"{where}: 'tools' must be a list of objects (JSON schemas), got {json_kind(tools)}")
    roles = ROLES + (("tool",) if template.mentions_tools else ())
    for i, m in enumerate(messages):
        at = f"{where}: {field}[{i}]"
        if not isinstance(m, dict):
            raise DataError(f"{at} must be an object with 'role' and 'content', got {json_kind(m)}")
        role, content = m.get("role"), m.get("content")
        if role is None:
            what = "has no 'role' field" if "role" not in m else "has a null 'role'"
            raise DataError(f"{at} {what}; give each message a role: {', '.join(roles)}")
        if role not in roles:
            why = "" if role != "tool" else f" (the chat template {template.source} has no tool messages)"
            raise DataError(f"{at}: unknown role {role!r}{why}; roles: {', '.join(roles)}")
        calls = role == "assistant" and bool(m.get("tool_calls"))
        if not isinstance(content, str) and not (content is None and calls):
            got = "missing" if "content" not in m else json_kind(content)
            raise DataError(f"{at}: 'content' must be a string, got {got}")
        if role == "assistant" and not calls and not content.strip():
            raise DataError(
                f"{at}: an assistant message with blank content teaches only to end the turn; drop it or fill it"
            )
    if not rules.train_on_inputs and not any(m["role"] in rules.loss_roles for m in messages):
        which = " or ".join(rules.loss_roles)
        raise DataError(f"{where}: no {which} message, so no token would carry loss (data.loss_roles)")
    return messages, tools
