"""``named-sample``: text from a checkpoint of a training run: a prompt's continuation, the reply to
a conversation (``--chat MESSAGE``, ``--system``, ``--messages FILE``), or a conversation turn by
turn (``--chat`` alone: ``chat_session``).

Every flag and path is checked before anything is restored or compiled: ``--checkpoint`` must be
a run directory with a committed checkpoint or a checkpoint folder inside one
(``<run_dir>/checkpoints/step_N``), and ``--tokens`` must fit the model's positions after the
prompt. Bad input raises ConfigError (a flag) or CheckpointError (a path), naming it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

import jax

from .. import checkpoint as ckpt
from ..checkpoint.run_places import CONFIG_FILE
from ..config import RULES, ConfigError, ModelChoice, load_config
from ..config.check import check_section
from ..data import ROLES, load_tokenizer
from ..data.chat_template import prompt_ids as chat_ids
from ..data.chat_template import stop_token_ids
from ..loop.generate import continue_ids
from ..loop.model_init import model_shapes
from ..loop.registry import max_positions, model_class, model_config_from_dict


def check_flags(
    n_tokens: int, temperature: float, seed: int, top_k: int | None = None, top_p: float | None = None
) -> None:
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 0:
        raise ConfigError(f"--tokens must be an integer >= 0, got {n_tokens!r}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ConfigError(f"--temperature must be a finite number >= 0 (0 decodes greedily), got {temperature}")
    RULES["trainer.seed"].check(seed, "--seed")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ConfigError(f"--top-k must be an integer >= 1 (the likeliest tokens drawn from), got {top_k!r}")
    if top_p is not None and not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise ConfigError(f"--top-p must be in (0, 1] (the probability mass drawn from), got {top_p}")


def token_logprobs(model, ids: list[int], new: list[int]) -> list[float]:
    """The model's log-probability of each id of ``new`` after ``ids`` and the ones before it (at
    temperature 1, unfiltered: what the model gives the token, however it was drawn)."""
    if not new:
        return []
    import jax.numpy as jnp

    import named as nm

    whole = nm.named(jnp.asarray([ids + new[:-1]], jnp.int32), ("batch", "position"))
    logits = model(whole).rearrange(("batch", "position", "vocab")).array[0, len(ids) - 1 :]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return [float(x) for x in jnp.take_along_axis(logp, jnp.asarray(new)[:, None], axis=-1)[:, 0]]


def _run_dir_and_checkpoint(path: Path) -> tuple[Path, Path]:
    if not path.exists():
        raise ckpt.CheckpointError(f"--checkpoint {path}: no such directory")
    if not path.is_dir():
        raise ckpt.CheckpointError(
            f"--checkpoint {path} is a file; give a run directory (its newest checkpoint is "
            "used) or a checkpoint folder <run_dir>/checkpoints/step_N"
        )
    if (path / ckpt.COMMIT_FILE).exists():
        # the run's config lies two levels up: read it only from where named-train puts it
        if path.parent.name != "checkpoints":
            raise ckpt.CheckpointError(
                f"--checkpoint {path} is a checkpoint outside a run directory; named-sample "
                "needs <run_dir>/checkpoints/step_N (or the run directory) to find the run's config"
            )
        return path.parent.parent, path
    latest = ckpt.latest_checkpoint(path)
    if latest is None:
        raise ckpt.CheckpointError(
            f"--checkpoint {path} holds no committed checkpoint; give a named-train run "
            "directory or a checkpoint folder <run_dir>/checkpoints/step_N"
        )
    return path, latest


def saved_model_config(run_dir: Path):
    path = run_dir / "model_config.json"
    if not path.is_file():
        raise ckpt.CheckpointError(f"{path} is missing: is {run_dir} a named-train run directory?")
    try:
        fields = json.loads(path.read_text())
        model_cfg = model_config_from_dict(fields)
        check_section(ModelChoice, fields, "model")  # as the model section of a config is checked
        return model_cfg
    except ConfigError as e:
        raise ckpt.CheckpointError(f"{path}: {e}") from None
    except (ValueError, TypeError, AttributeError) as e:  # not JSON, or fields of the wrong kind
        raise ckpt.CheckpointError(f"{path} is not a model config written by named-train: {e}") from None


def saved_config(run_dir: Path):
    """The run's ``config.yaml`` with ``trainer.run_dir`` the folder it was read from: a run
    directory is found where it is, not where its config says it was made, so a copied or moved
    one reads its own checkpoints (those under ``checkpoint.base``, when set, stay there)."""
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise ckpt.CheckpointError(f"{path} is missing: is {run_dir} a named-train run directory?")
    return load_config(path, ["--trainer.run_dir", str(run_dir)])


@dataclasses.dataclass
class Sampler:
    """A run's model, config and tokenizer, for prompts and conversations. ``open`` checks the paths
    and reads the config and tokenizer; the model is read by ``restore``, after the caller's checks."""

    checkpoint: Path
    cfg: Any
    model_cfg: Any
    tokenizer: Any
    model: Any = None

    @classmethod
    def open(cls, path: Path) -> Sampler:
        run_dir, checkpoint = _run_dir_and_checkpoint(Path(path))
        model_cfg = saved_model_config(run_dir)
        cfg = saved_config(run_dir)
        return cls(checkpoint, cfg, model_cfg, load_tokenizer(cfg.data.tokenizer, cfg.data.eos_token))

    def restore(self) -> None:
        # The checkpoint holds (model, optimizer state): the model alone is read, built as the run built it.
        if self.model is None:
            target = model_shapes(self.cfg, model_class(self.model_cfg), self.model_cfg)
            (self.model, _), _ = ckpt.restore(self.checkpoint, (target, None), partial=True)

    @property
    def positions(self) -> int:
        return max_positions(self.model_cfg)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """``messages`` rendered with the run's chat template (``data.chat_template`` or the
        tokenizer folder's), ending with the header of the assistant's turn."""
        return chat_ids(self.tokenizer, messages, chat_template=self.cfg.data.chat_template)

    def check_room(self, ids: list[int], n_tokens: int, flag: str) -> None:
        if len(ids) + n_tokens > self.positions:
            raise ConfigError(
                f"--tokens {n_tokens} after the {len(ids)} tokens of {flag} needs {len(ids) + n_tokens} "
                f"positions; the model has {self.positions}"
            )

    def continuation(
        self, ids: list[int], n_tokens: int, *, temperature: float, key, chat: bool, top_k=None, top_p=None
    ) -> str:
        """The text after ``ids``: with ``chat``, a reply that ends at eos or the template's end of turn."""
        return self.tokenizer.decode(self.continuation_ids(ids, n_tokens, temperature, key, chat, top_k, top_p))

    def continuation_ids(self, ids, n_tokens, temperature, key, chat, top_k=None, top_p=None) -> list[int]:
        self.restore()
        stops = tuple(stop_token_ids(self.tokenizer, chat_template=self.cfg.data.chat_template)) if chat else ()
        return continue_ids(
            self.model, ids, n_tokens, temperature=temperature, top_k=top_k, top_p=top_p, key=key, stop_ids=stops
        )

    def logprob_lines(self, ids: list[int], new: list[int]) -> list[str]:
        """One line per new token: its position, id, text and the model's log-probability of it."""
        rows = zip(new, token_logprobs(self.model, ids, new))
        return [
            f"{i}\t{t}\t{self.tokenizer.decode([t], keep_special=True)!r}\t{lp!r}" for i, (t, lp) in enumerate(rows)
        ]


def sample_from_checkpoint(
    path: Path,
    prompt: str,
    n_tokens: int,
    *,
    temperature: float = 0.0,
    seed: int = 0,
    chat: str | None = None,
    system: str | None = None,
    messages: list[dict] | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    logprobs: bool = False,
) -> str:
    """``prompt`` and its continuation; with ``chat`` or ``messages``, the assistant's reply alone
    to the conversation ``messages`` (a ``--messages`` file's), then ``system`` and the user
    message ``chat`` as given: rendered with the run's chat template, the reply ends at eos or
    the template's end-of-turn token. ``top_k``/``top_p`` filter what a sampled token is drawn
    from; ``logprobs`` adds a line per new token: position, id, text, the model's log-probability."""
    check_flags(n_tokens, temperature, seed, top_k, top_p)
    conversation = conversation_of(prompt, chat, system, messages)
    sampler = Sampler.open(Path(path))
    if conversation is None:
        ids = sampler.tokenizer.encode(prompt) or [sampler.tokenizer.eos_id]
        sampler.check_room(ids, n_tokens, "--prompt")
        head, chat_ = prompt, False
    else:
        if conversation[-1]["role"] != "user":
            raise ConfigError(
                f"--messages: the conversation ends with a {conversation[-1]['role']} message; a reply needs a "
                "user message last (add one, or give --chat MESSAGE)"
            )
        ids = sampler.chat_ids(conversation)
        sampler.check_room(ids, n_tokens, "the conversation (with the chat template)")
        head, chat_ = "", True
    new = sampler.continuation_ids(ids, n_tokens, temperature, jax.random.key(seed), chat_, top_k, top_p)
    text = head + sampler.tokenizer.decode(new)
    return "\n".join([text, *sampler.logprob_lines(ids, new)]) if logprobs else text


def conversation_of(
    prompt: str, chat: str | None, system: str | None, messages: list[dict] | None
) -> list[dict] | None:
    """The conversation the chat flags give (None: ``--prompt`` text): ``messages``, then the
    ``system`` prompt (first) and the user message ``chat`` (last)."""
    if prompt and (chat is not None or system is not None or messages is not None):
        raise ConfigError(
            "give --prompt or a conversation (--chat, --messages, --system), not both: a conversation is "
            "rendered with the chat template"
        )
    if chat is None and messages is None:
        if system is not None:
            raise ConfigError("--system needs a conversation: give --chat MESSAGE, --chat (interactive) or --messages")
        return None
    out = list(messages or [])
    if system is not None:
        if not system.strip():
            raise ConfigError("--system: the system prompt is empty")
        if any(m["role"] == "system" for m in out):
            raise ConfigError("--system with --messages that holds a system message: give the system prompt once")
        out.insert(0, {"role": "system", "content": system})
    if chat is not None and chat != INTERACTIVE:
        if not chat.strip():
            raise ConfigError("--chat: the user message is empty")
        out.append({"role": "user", "content": chat})
    return out


INTERACTIVE = "\x00"  # --chat without a message: talk, turn by turn (chat_session)


def read_messages(path: Path) -> list[dict]:
    """``--messages FILE``: a conversation, as a JSON list of ``{role, content}`` (or a chat record
    ``{"messages": [...]}``), or JSON Lines with one message per line. ConfigError naming the file,
    and the line or message, for anything else."""
    flag = f"--messages {path}"
    if not path.is_file():
        raise ConfigError(f"{flag}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{flag}: cannot be read ({e})") from None
    try:
        whole = json.loads(text)
        items = [(f"messages[{i}]", m) for i, m in enumerate(_message_list(whole, flag))]
    except json.JSONDecodeError:
        items = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    items.append((f"line {n}", json.loads(line)))
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{flag}: line {n} is not JSON ({e.msg})") from None
    if not items:
        raise ConfigError(f"{flag}: no messages (a JSON list of {{role, content}}, or one per line)")
    for where, m in items:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ConfigError(
                f'{flag}: {where} must be {{"role": one of {", ".join(ROLES)}, "content": a string}}, got '
                f"{json.dumps(m)[:120]}"
            )
    return [{"role": m["role"], "content": m["content"]} for _, m in items]


def _message_list(whole, flag: str) -> list:
    if isinstance(whole, dict) and "messages" in whole:
        whole = whole["messages"]
    if isinstance(whole, dict):  # one message on one line: JSON Lines of a single message
        return [whole]
    if not isinstance(whole, list):
        raise ConfigError(f"{flag}: a conversation is a list of {{role, content}} messages, got {type(whole).__name__}")
    return whole


def chat_session(
    path: Path,
    n_tokens: int,
    *,
    temperature: float = 0.0,
    seed: int = 0,
    system: str | None = None,
    messages: list[dict] | None = None,
    prompt: str = "",
    top_k: int | None = None,
    top_p: float | None = None,
    read=None,
    write=None,
    ask=None,
) -> int:
    """``named-sample --chat``: a conversation, turn by turn. Each line ``read`` gives is a user
    message; the reply is written (``write``) and both stay in the conversation, which starts from
    ``messages`` and ``system`` (a conversation that ends with a user message is answered first).
    ``/reset`` starts over from them, ``/exit`` or the end of the input ends the session. When the
    conversation outgrows the model's positions, its oldest turns are dropped (``ask`` says so)."""
    check_flags(n_tokens, temperature, seed, top_k, top_p)
    start = conversation_of(prompt, INTERACTIVE, system, messages)
    sampler = Sampler.open(Path(path))
    read = read if read is not None else sys.stdin.readline
    write = write if write is not None else _print
    ask = ask if ask is not None else _note
    if n_tokens < 1:
        raise ConfigError("--tokens must be at least 1 for a conversation")
    sampler.check_room(sampler.chat_ids(start or [{"role": "user", "content": ""}]), n_tokens, "the conversation")
    sampler.restore()
    history, turn = list(start), 0
    pending = bool(history) and history[-1]["role"] == "user"
    while True:
        if not pending:
            ask("> ")
            line = read()
            if not line:
                return 0
            text = line.rstrip("\n")
            if text.strip() == "/exit":
                return 0
            if text.strip() == "/reset":
                history = list(start)
                ask("(conversation reset)\n")
                continue
            if not text.strip():
                continue
            history.append({"role": "user", "content": text})
        pending = False
        ids = _fitted(sampler, history, n_tokens, len(start), ask)
        if ids is None:
            history.pop()
            continue
        key = jax.random.fold_in(jax.random.key(seed), turn)
        reply = sampler.continuation(
            ids, n_tokens, temperature=temperature, key=key, chat=True, top_k=top_k, top_p=top_p
        )
        turn += 1
        history.append({"role": "assistant", "content": reply})
        write(reply)


def _fitted(sampler: Sampler, history: list[dict], n_tokens: int, kept: int, ask) -> list[int] | None:
    """The conversation's ids with room for the reply, its oldest turns after the first ``kept``
    messages dropped as needed (in place); None when the last message alone leaves no room."""
    while True:
        ids = sampler.chat_ids(history)
        if len(ids) + n_tokens <= sampler.positions:
            return ids
        if len(history) - kept <= 1:
            ask(
                f"error: this message takes {len(ids)} tokens with the chat template; with --tokens {n_tokens} the "
                f"model's {sampler.positions} positions have no room for it\n"
            )
            return None
        dropped = history.pop(kept)
        while len(history) - kept > 1 and history[kept]["role"] != "user":
            history.pop(kept)  # a turn starts with the user's message
        ask(
            f"(the oldest {dropped['role']} turn was dropped: the conversation outgrew {sampler.positions} positions)\n"
        )


def _print(text: str) -> None:
    print(text, flush=True)


def _note(text: str) -> None:
    if sys.stdin.isatty():
        sys.stderr.write(text)
        sys.stderr.flush()
    elif not text.startswith("> "):
        sys.stderr.write(text)
