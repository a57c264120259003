"""Chat templates: a tokenizer folder's template, rendered as ``transformers`` renders it, the
characters of each assistant turn, and the tokens that end a turn.

    text = render_prompt("hf-folder", [{"role": "user", "content": "Hi"}])   # ends with the assistant header
    ids = prompt_ids("hf-folder", [{"role": "user", "content": "Hi"}])       # special tokens parsed
    stops = stop_token_ids("hf-folder")                                        # eos and end-of-turn ids

``tokenizer`` is what ``data.tokenizer`` holds (``"byte"``, a ``tokenizer.json`` or a folder
holding one) or a loaded tokenizer; ``chat_template`` is what ``data.chat_template`` holds (a
Jinja file), or None. The template, first found wins: that file; the folder's
``chat_template.jinja`` (what ``transformers`` writes today); the ``chat_template`` of its
``tokenizer_config.json`` (a string, or a list of ``{name, template}`` of which ``default`` is
taken). The folder is the one holding ``tokenizer.json``; nothing outside it is read.

Rendering is ``transformers.apply_chat_template(..., tokenize=False)``'s: a sandboxed
(``ImmutableSandboxedEnvironment``) Jinja environment with ``trim_blocks``, ``lstrip_blocks``
and loop controls; ``raise_exception``, ``strftime_now``, ``dict``, a ``namespace`` that
refuses underscore attributes, a ``tojson`` that does not escape HTML; ``{% generation %}``
blocks render as their body; the variables are the special tokens of tokenizer_config.json
that are set (every ``*_token`` string: ``bos_token``, ``eos_token``, ...; and the
``extra_special_tokens`` mapping; special_tokens_map.json fills what it lacks), ``messages``
(with null-valued keys dropped), ``tools``, ``documents`` and ``add_generation_prompt``.
Rendered text is encoded with special tokens parsed (``<|im_start|>`` is one token), as
transformers encodes it; plain text documents elsewhere in the pipeline are encoded with
special-token strings as ordinary text.

``LOSS`` and ``START`` are the bits of a chat cache's flag bytes (``_chat``).

The stop tokens are the tokenizer's eos, the ``eos_token_id`` (one id or a list) of the
folder's ``generation_config.json``, and the special token that closes an assistant turn in
this template (found by rendering a two-message probe), in that order, without repeats.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from ..config.data_section import DataError
from ._packing import LOSS, START
from ._tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "LOSS",
    "START",
    "ChatFormat",
    "ChatTemplate",
    "assistant_spans",
    "turn_spans",
    "find_template",
    "prompt_ids",
    "render_prompt",
    "stop_token_ids",
]

log = logging.getLogger(__name__)

_PROBE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template, where it came from (for messages), and the special-token variables
    it is rendered with."""

    text: str
    source: str
    variables: dict[str, str] = field(default_factory=dict)

    def render(
        self, messages: Sequence[dict], *, add_generation_prompt: bool = False, tools: list | None = None
    ) -> str:
        """The conversation as text; DataError naming the template and Jinja's message if it fails."""
        compiled = self.compiled()
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            return compiled.render(
                **self.variables,
                messages=chat,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
            )
        except Exception as e:  # noqa: BLE001 - template code is data: any way it fails is bad input
            what = f"raise_exception({str(e)!r})" if isinstance(e, _Raised) else f"{type(e).__name__}: {e}"
            raise DataError(f"the chat template {self.source} failed to render: {what}") from None

    def compiled(self):
        try:
            return _compile(self.text)
        except _syntax_error() as e:
            raise DataError(
                f"the chat template {self.source} is not valid Jinja: line {e.lineno}: {e.message}"
            ) from None

    @property
    def mentions_tools(self) -> bool:
        """Whether the template has anything to say about tool messages (``tool`` is then a role)."""
        return "tool" in self.text


def assistant_spans(
    template: ChatTemplate, messages: Sequence[dict], *, tools: list | None = None
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and, per assistant message, the characters ``[start, end)`` the
    model is to produce (``turn_spans`` for the assistant alone)."""
    return turn_spans(template, messages, ("assistant",), tools=tools)


def turn_spans(
    template: ChatTemplate, messages: Sequence[dict], roles: Sequence[str], *, tools: list | None = None
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and, per message of one of ``roles``, the characters
    ``[start, end)`` of its turn that carry loss, through the end of the message's own rendering
    (its end-of-turn token included). An assistant turn starts where the generation prompt that
    precedes it ends (what the model produces when asked to reply); another role's turn starts at
    its content (found by rendering the message with a probe string for content).

    Found by rendering prefixes of the conversation, so templates that change the content
    (``| trim``) or add headers are handled without knowing their syntax; a template whose
    rendering of the first ``k`` messages is not a beginning of the whole is refused.
    """
    text = template.render(messages, tools=tools)
    spans = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in roles:
            continue
        through = template.render(messages[: i + 1], tools=tools)
        if role == "assistant":
            before = template.render(messages[:i], add_generation_prompt=True, tools=tools)
            start = len(before) if through.startswith(before) else -1
        else:
            start = _content_start(template, messages, i, through, tools)
        if start < 0 or not text.startswith(through):
            raise DataError(
                f"the chat template {template.source} renders message {i} ({role}) differently depending on what "
                "follows it, so its tokens cannot be found by rendering the conversation up to each "
                "message; give a template that renders conversations prefix by prefix with data.chat_template"
            )
        if len(through) == start:
            raise DataError(f"the chat template {template.source} renders nothing for message {i} ({role})")
        spans.append((start, len(through)))
    return text, spans


_CONTENT_PROBE = "NAMEDCONTENTPROBE"


def _content_start(template: ChatTemplate, messages: Sequence[dict], i: int, through: str, tools) -> int:
    """Where message ``i``'s content begins in ``through`` (the rendering of messages ``[0, i]``):
    the message rendered with a probe for its content shows what comes before the content; -1
    when the probe is not there or what precedes it differs."""
    probe = template.render([*messages[:i], {**messages[i], "content": _CONTENT_PROBE}], tools=tools)
    at = probe.rfind(_CONTENT_PROBE)
    if at < 0:
        raise DataError(
            f"the chat template {template.source} does not render message {i} ({messages[i].get('role')})'s "
            "content as given, so the tokens of its turn cannot be found; leave its role out of data.loss_roles"
        )
    return at if through[:at] == probe[:at] else -1


class ChatFormat:
    """A tokenizer and its chat template (None when there is none): encodes rendered text with
    special tokens parsed, each token with the characters ``[start, end)`` it came from."""

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate | None, folder: Path | None):
        self.tokenizer, self.template, self.folder = tokenizer, template, folder
        if isinstance(tokenizer, HFTokenizer):
            from tokenizers import Tokenizer as _HF

            # A second instance of the same file: the pipeline's own encodes special-token strings
            # as text, while a rendered template must have them parsed.
            self._hf = _HF.from_file(str(tokenizer.path))
            self._special = {i for i, t in self._hf.get_added_tokens_decoder().items() if t.special}
        elif isinstance(tokenizer, ByteTokenizer):
            self._hf, self._special = None, set()
        else:
            raise DataError(
                f"chat data needs the byte tokenizer or a tokenizer.json (data.tokenizer), got {tokenizer!r}"
            )
        self.stop_ids = self._stop_ids()

    @classmethod
    def load(
        cls, tokenizer: str | Tokenizer, chat_template: str | None = None, eos_token: str | None = None
    ) -> ChatFormat:
        """``tokenizer`` as ``data.tokenizer`` names it (or loaded), with its folder's template or ``chat_template``."""
        tok = load_tokenizer(tokenizer, eos_token) if isinstance(tokenizer, str) else tokenizer
        folder = tok.path.parent if isinstance(tok, HFTokenizer) else None
        return cls(tok, find_template(folder, chat_template), folder)

    def require_template(self) -> ChatTemplate:
        if self.template is None:
            where = (
                f"{self.folder} has none (no chat_template.jinja, no chat_template in tokenizer_config.json)"
                if self.folder is not None
                else f"the tokenizer {self.tokenizer!r} comes without one"
            )
            raise DataError(
                f"a conversation needs a chat template and {where}; give a Jinja file as data.chat_template"
            )
        return self.template

    def encode(self, texts: Sequence[str]) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """``(ids, starts, ends)`` per text, as int64 arrays; ``starts``/``ends`` are character offsets."""
        if self._hf is None:
            return [_byte_encoding(t) for t in texts]
        out = []
        for e in self._hf.encode_batch(list(texts), add_special_tokens=False):
            offsets = np.asarray(e.offsets, np.int64).reshape(-1, 2)
            out.append((np.asarray(e.ids, np.int64), offsets[:, 0], offsets[:, 1]))
        return out

    @property
    def fingerprint(self) -> str:
        """Everything beyond the tokenizer that decides the tokens and masks of a chat cache."""
        t = self.template
        blob = json.dumps(
            {"template": t.text if t else None, "variables": t.variables if t else None, "stop": list(self.stop_ids)},
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:24]

    def _stop_ids(self) -> tuple[int, ...]:
        ids = [self.tokenizer.eos_id, *_generation_eos(self.folder)]
        if self.template is not None:
            try:
                ids += self._end_of_turn()
            except DataError as e:  # a template may refuse the probe (a system message required): no such stop
                log.debug("no end-of-turn token found by the probe: %s", e)
        vocab = self.tokenizer.vocab_size
        return tuple(dict.fromkeys(i for i in ids if 0 <= i < vocab))

    def _end_of_turn(self) -> list[int]:
        text, [(start, end)] = assistant_spans(self.template, _PROBE)
        reply = _PROBE[1]["content"]
        at = text.rfind(reply, start, end)
        after = at + len(reply) if at >= 0 else start  # a template may rewrite the reply: then its whole turn
        ids, starts, _ = self.encode([text])[0]
        return [int(i) for i, s in zip(ids, starts) if after <= s < end and int(i) in self._special][:1]


def find_template(folder: Path | None, chat_template: str | None = None) -> ChatTemplate | None:
    """The chat template (see the module docstring), or None when neither the file nor the folder has one."""
    specials = _special_tokens(folder) if folder is not None else {}
    if chat_template is not None:
        path = Path(chat_template).expanduser()
        if not path.is_file():
            raise DataError(f"data.chat_template {chat_template!r} is not a file; give a Jinja template file")
        return ChatTemplate(_read_text(path), str(path), specials)
    if folder is None:
        return None
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return ChatTemplate(_read_text(jinja), str(jinja), specials)
    config = folder / "tokenizer_config.json"
    value = _read_json(config).get("chat_template") if config.is_file() else None
    if value is None:
        return None
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" not in named:
            raise DataError(
                f"{config}: chat_template lists templates {sorted(map(str, named))} but none named "
                "'default'; give the one to use as data.chat_template"
            )
        value = named["default"]
    if not isinstance(value, str):
        raise DataError(f"{config}: chat_template must be a string or a list of {{name, template}}, got {value!r}")
    return ChatTemplate(value, f"{config} (chat_template)", specials)


def render_prompt(
    tokenizer: str | Tokenizer,
    messages: Sequence[dict],
    add_generation_prompt: bool = True,
    *,
    chat_template: str | None = None,
) -> str:
    """``messages`` rendered with the tokenizer's chat template (for sampling: ends with the
    header of the assistant's turn)."""
    fmt = ChatFormat.load(tokenizer, chat_template)
    return fmt.require_template().render(list(messages), add_generation_prompt=add_generation_prompt)


def prompt_ids(
    tokenizer: str | Tokenizer,
    messages: Sequence[dict],
    add_generation_prompt: bool = True,
    *,
    chat_template: str | None = None,
) -> list[int]:
    """``render_prompt``'s text as token ids, special tokens parsed (what the model was trained on)."""
    fmt = ChatFormat.load(tokenizer, chat_template)
    text = fmt.require_template().render(list(messages), add_generation_prompt=add_generation_prompt)
    return [int(i) for i in fmt.encode([text])[0][0]]


def stop_token_ids(tokenizer: str | Tokenizer, *, chat_template: str | None = None) -> list[int]:
    """The ids at which a chat reply ends: eos, generation_config.json's eos ids, and the
    template's end-of-turn token."""
    return list(ChatFormat.load(tokenizer, chat_template).stop_ids)


# ---- files --------------------------------------------------------------------------------


def _read_text(path: Path) -> str:
    try:
        return path.read_text("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read the chat template {str(path)!r}: {e}") from None


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text("utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"{str(path)!r} is not a readable JSON file: {e}") from None
    if not isinstance(value, dict):
        raise DataError(f"{str(path)!r} must hold a JSON object, got {type(value).__name__}")
    return value


def _token_string(value: Any) -> str | None:
    if isinstance(value, dict):  # an AddedToken as saved: {"content": "</s>", ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def _special_tokens(folder: Path) -> dict[str, str]:
    """The template's token variables: every ``*_token`` string (``bos_token``, a model's own
    ``image_token``) and the ``extra_special_tokens`` mapping, as transformers passes them."""
    out: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the later file wins
        path = folder / name
        if path.is_file():
            values = _read_json(path)
            extra = values.get("extra_special_tokens")
            named = {k: v for k, v in values.items() if k.endswith("_token")}
            named.update(extra if isinstance(extra, dict) else {})
            out.update({k: s for k, v in named.items() if (s := _token_string(v)) is not None})
    return out


def _generation_eos(folder: Path | None) -> list[int]:
    path = folder / "generation_config.json" if folder is not None else None
    if path is None or not path.is_file():
        return []
    value = _read_json(path).get("eos_token_id")
    ids = value if isinstance(value, list) else [value]
    return [i for i in ids if isinstance(i, int) and not isinstance(i, bool)]


def _byte_encoding(text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    raw = text.encode("utf-8")
    widths = np.fromiter((len(c.encode("utf-8")) for c in text), np.int64, count=len(text))
    starts = np.repeat(np.arange(len(text), dtype=np.int64), widths)
    return np.frombuffer(raw, np.uint8).astype(np.int64), starts, starts + 1


# ---- the Jinja environment ------------------------------------------------------------------


def _syntax_error():
    import jinja2

    return jinja2.TemplateSyntaxError


@functools.lru_cache(maxsize=16)
def _compile(text: str):
    import jinja2
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        # transformers marks assistant text with {% generation %} for its masks; we find assistant
        # text by rendering prefixes instead, so the block only renders its body.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        # Namespaces a template builds may not reach Python internals through dunder names.
        def __init__(*args, **kwargs):
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                Namespace._refuse(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._refuse(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _refuse(name):
            if isinstance(name, str) and name.startswith("_"):
                raise _Raised(f"a namespace attribute may not start with '_': {name!r}")

    def raise_exception(message):
        raise _Raised(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception,
        strftime_now=lambda fmt: datetime.now().strftime(fmt),
        dict=_TemplateDict(),
        namespace=Namespace,
    )
    return env.from_string(text)


class _Raised(DataError):
    """A template refused its input (``raise_exception``): reported with the template's message."""


class _TemplateDict:
    """``dict(...)`` inside a template, without handing it the ``dict`` type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)
