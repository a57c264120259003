"""Chat sources: JSONL records of conversations or prompt/completion pairs, tokenised with a
loss flag per token.

A record (one JSON object per line; other keys are ignored) is one of:

- ``{"messages": [{"role": ..., "content": ...}, ...]}``, optionally with ``"tools": [...]``:
  roles ``system``, ``user``, ``assistant`` (and ``tool`` when the template mentions tools),
  content a string (an assistant message with ``tool_calls`` may have none), at least one
  assistant message, none with blank content. The text is the chat template's rendering; the
  tokens that carry loss are each assistant turn's: from the end of the generation prompt that
  precedes it (``<|im_start|>assistant\\n``) through its last stop token (ChatML's ``<|im_end|>``,
  Llama 3's ``<|eot_id|>``; ``chat.stop_token_ids``), so the model learns to end its turn, but
  not what a template puts after that token (ChatML's newline). Without a stop token in the
  turn, the whole turn as the template renders it.
- ``{"prompt": "...", "completion": "..."}``: plain text, no template (as for a base model);
  the tokens are those of prompt + completion, then eos; the completion's and eos carry loss.

Tokens are chosen by character offsets: a token carries loss when its characters overlap the
turn's (a token that straddles the end of a header and the start of a reply counts as reply).
Each document is written as tokens plus one flag byte per token, ``LOSS`` (this token is a
target that carries loss) and ``START`` (the first token of a document). Documents are not
separated by eos, since a template's end-of-turn token is often the eos token itself; the
flags say where each begins.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import BinaryIO

import numpy as np

from ..config.data_section import DataError
from ._encode import check_ids, chunked
from ._packing import LOSS, START
from ._sources import has_surrogate, json_kind
from .chat import ChatFormat, ChatTemplate, assistant_spans

CHAT_FORMAT = 1  # these rules (what carries loss, how documents are marked): a change must not reuse old caches
ROLES = ("system", "user", "assistant")


def encode_chat_into(
    tokens_f: BinaryIO, flags_f: BinaryIO, records: Iterator[tuple[str, object]], fmt: ChatFormat, dtype: np.dtype
) -> int:
    """Render, check and tokenise ``(where, record)`` pairs into a token file and its flag file;
    returns the number of tokens written. Every record of a chunk is checked and rendered
    before the chunk is tokenised."""
    n = 0
    eos = fmt.tokenizer.eos_id
    for chunk in chunked(document(where, record, fmt) for where, record in records):
        ids, flags = [], []
        for (where, _, spans, add_eos), (tok, starts, ends) in zip(chunk, fmt.encode([c[1] for c in chunk])):
            mask = loss_tokens(tok, starts, ends, spans, () if add_eos else fmt.stop_ids)
            if add_eos:
                tok, mask = np.append(tok, eos), np.append(mask, True)
            if not mask.any():
                raise DataError(f"{where}: no token carries loss (the assistant's text vanished when tokenised)")
            f = mask.astype(np.uint8) * LOSS
            f[0] |= START
            ids.append(tok)
            flags.append(f)
        flat = np.concatenate(ids)
        check_ids(flat, np.cumsum([len(t) for t in ids]), [c[0] for c in chunk], fmt.tokenizer)
        tokens_f.write(flat.astype(dtype).tobytes())
        flags_f.write(np.concatenate(flags).tobytes())
        n += flat.size
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


def document(where: str, record, fmt: ChatFormat) -> tuple[str, str, list[tuple[int, int]], bool]:
    """``(where, text, spans, add_eos)``: the text to tokenise, the characters that carry loss,
    and whether eos follows (prompt/completion pairs)."""
    if not isinstance(record, dict):
        raise DataError(
            f"{where}: expected an object with 'messages', or 'prompt' and 'completion'; got {json_kind(record)}"
        )
    if "messages" in record:
        if "prompt" in record or "completion" in record:
            raise DataError(f"{where}: a record has either 'messages' or 'prompt' and 'completion', not both")
        template = _template(where, fmt)
        messages, tools = _conversation(where, record, template)
        try:
            text, spans = assistant_spans(template, messages, tools=tools)
        except DataError as e:
            raise DataError(f"{where}: {e}") from None
        add_eos = False
    elif "prompt" in record or "completion" in record:
        prompt, completion = (_string(where, record, k) for k in ("prompt", "completion"))
        if not completion.strip():
            raise DataError(f"{where}: 'completion' is blank: nothing to train on")
        text, spans, add_eos = prompt + completion, [(len(prompt), len(prompt) + len(completion))], True
    else:
        keys = ", ".join(map(repr, record)) or "none"
        raise DataError(
            f"{where}: a chat record needs 'messages' (a list of {{role, content}}) or 'prompt' and "
            f"'completion'; its keys: {keys}"
        )
    if has_surrogate(text):
        raise DataError(f"{where}: the record holds a lone UTF-16 surrogate (\\ud800-\\udfff escape)")
    return where, text, spans, add_eos


def _template(where: str, fmt: ChatFormat) -> ChatTemplate:
    try:
        return fmt.require_template()
    except DataError as e:
        raise DataError(f"{where}: {e}") from None


def _string(where: str, record: dict, key: str) -> str:
    value = record.get(key)
    if not isinstance(value, str):
        got = "missing" if key not in record else json_kind(value)
        raise DataError(f"{where}: {key!r} must be a string, got {got} (a prompt/completion pair is two strings)")
    return value


def _conversation(where: str, record: dict, template: ChatTemplate) -> tuple[list[dict], list | None]:
    messages, tools = record["messages"], record.get("tools")
    if not isinstance(messages, list) or not messages:
        got = "an empty list" if isinstance(messages, list) else json_kind(messages)
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects, got {got}")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise DataError(f"{where}: 'tools' must be a list of objects (JSON schemas), got {json_kind(tools)}")
    roles = ROLES + (("tool",) if template.mentions_tools else ())
    for i, m in enumerate(messages):
        at = f"{where}: messages[{i}]"
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
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: no assistant message, so no token would carry loss")
    return messages, tools
