"""Tokenizers: a built-in byte-level one and Hugging Face ``tokenizer.json`` files from disk (or the Hub cache)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from collections.abc import Sequence
from numbers import Integral
from pathlib import Path
from typing import Protocol, runtime_checkable

from ..config.data_section import DataError
from ..config.hub import folder as local_folder

# Tried in order when neither the caller nor a neighbouring tokenizer_config.json names
# the end-of-document token.
_EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline (and sampling) needs from a tokenizer.

    ``fingerprint`` identifies the exact vocabulary, so a token cache made with one
    tokenizer is never read with another.
    """

    @property
    def vocab_size(self) -> int:
        """One more than the largest id ``encode`` can return (ids need not be dense)."""
        ...

    @property
    def eos_id(self) -> int: ...

    @property
    def fingerprint(self) -> str: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus one end-of-document token (256).

    ``decode`` never fails: ids that are not bytes (eos, ids of a padded model vocabulary)
    are dropped and invalid UTF-8 becomes U+FFFD.
    """

    vocab_size = 257
    eos_id = 256
    fingerprint = "byte-v1"

    load_spec = ("byte", None)  # load_tokenizer(*load_spec) makes this tokenizer again (in a worker process)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: Sequence[int], *, keep_special: bool = False) -> str:
        """``keep_special``: eos shows as ``<eos>`` instead of being dropped."""
        if keep_special:
            runs, run = [], []
            for i in ids:
                if int(i) == self.eos_id:
                    runs += [self.decode(run), "<eos>"]
                    run = []
                else:
                    run.append(i)
            return "".join(runs) + self.decode(run)
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def special_id(self, kind: str) -> int | None:
        """The ``eos`` id; bytes have no ``bos`` or ``pad`` token (None)."""
        return self.eos_id if kind == "eos" else None

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=257, eos_id=256)"


class HFTokenizer:
    """A Hugging Face ``tokenizers`` file (``tokenizer.json``) read from a local path.

    Special-token strings that occur in the text (a literal ``<|endoftext|>`` inside a
    source file) are encoded as ordinary text, so only the pipeline decides where
    documents end.
    """

    def __init__(self, path: str | Path, eos_token: str | None = None):
        from tokenizers import Tokenizer as _HF  # imported lazily: only this class needs it

        path = Path(path).expanduser()
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise DataError(f"tokenizer file {str(path)!r} does not exist; give a local tokenizer.json or 'byte'")
        try:
            raw = path.read_bytes()
            self._tok = _HF.from_str(raw.decode("utf-8"))
        except Exception as e:  # tokenizers raises a bare Exception for malformed files
            raise DataError(f"tokenizer file {str(path)!r} cannot be read as a tokenizer.json: {e}") from e
        self._tok.encode_special_tokens = True
        self.path = path
        self._vocab_size = _id_bound(self._tok)
        self._eos_token = eos_token or _token_from_config(path, "eos_token") or _first_known(self._tok)
        if self._eos_token is None:
            raise DataError(
                f"tokenizer {str(path)!r} has none of the usual end-of-document tokens {_EOS_CANDIDATES}; "
                "name one with data.eos_token"
            )
        eos = self._tok.token_to_id(self._eos_token)
        if eos is None:
            raise DataError(f"tokenizer {str(path)!r} has no token {self._eos_token!r} (asked for as eos)")
        self._eos_id = eos
        self._fingerprint = f"hf-{hashlib.sha256(raw).hexdigest()[:32]}-eos{eos}"

    @property
    def load_spec(self) -> tuple[str, str]:
        """``load_tokenizer(*load_spec)`` makes this tokenizer again (in a worker process)."""
        return str(self.path), self._eos_token

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], *, keep_special: bool = False) -> str:
        """``keep_special``: special tokens (``<|im_end|>``) are shown instead of dropped."""
        # tokenizers raises on negative ids and silently skips large ones; make both skip.
        ids = [int(i) for i in ids if 0 <= int(i) < self._vocab_size]
        return self._tok.decode(ids, skip_special_tokens=not keep_special)

    def special_id(self, kind: str) -> int | None:
        """The id of the ``eos`` token (the end of document this tokenizer was loaded with), or of the
        ``bos`` / ``pad`` token that a ``tokenizer_config.json`` beside it names; None when there is none."""
        if kind == "eos":
            return self._eos_id
        token = _token_from_config(self.path, f"{kind}_token")
        return self._tok.token_to_id(token) if token is not None else None

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, vocab_size={self._vocab_size}, eos={self._eos_token!r})"


def check_tokenizer(tokenizer: Tokenizer) -> None:
    """The vocabulary and eos id every token array is checked against must themselves be sane:
    eos ends every document and fills padding rows, so it must be a valid id too."""
    vocab, eos = tokenizer.vocab_size, tokenizer.eos_id
    if not isinstance(vocab, Integral) or vocab < 1:
        raise DataError(f"tokenizer {tokenizer!r}: vocab_size must be a positive int, got {vocab!r}")
    if not isinstance(eos, Integral) or not 0 <= eos < vocab:
        raise DataError(f"tokenizer {tokenizer!r}: eos id {eos!r} is outside its vocabulary of {vocab}")


def load_tokenizer(spec: str, eos_token: str | None = None) -> Tokenizer:
    """``"byte"`` for the built-in tokenizer, else a local ``tokenizer.json``, a folder holding one,
    or a Hugging Face Hub id of a repository holding one (its snapshot: ``config.hub``)."""
    if spec == "byte":
        return ByteTokenizer()
    return HFTokenizer(local_folder(spec, "data.tokenizer", error=DataError), eos_token=eos_token)


# Texts that tell splitting rules apart: contractions in both cases, digit runs, whitespace runs,
# accents and other scripts, code.
PROBES = (
    "Hello world, it's 2024: 12345 apples don't fall far.",
    "I'M SHOUTING, THEY'RE here; we'll see.",
    "  two leading spaces\n\n\tand a tab   three trailing   ",
    "naïve café, ünïcödé, 日本語のテキスト, Ελληνικά",
    "def f(x):\n    return x**2  # 3.14159",
)
_AGREED: set[str] = set()  # fingerprints of tokenizers found to encode as transformers does


def check_transformers_agrees(tokenizer: Tokenizer, key: str = "data.tokenizer") -> None:
    """The tokenizer transformers loads from ``tokenizer``'s folder encodes ``PROBES`` as ``tokenizer``
    does, where transformers is installed: a folder can name a tokenizer class that ignores its
    tokenizer.json's splitting rule (transformers 5's Qwen2Tokenizer for ``model_type: qwen2``), and
    the run would then train on other ids than the export is scored and served with. DataError naming
    both tokenizers, the first probe they split differently and the way out, if not. Nothing is
    checked for the byte tokenizer, a tokenizer file of another name, or a folder transformers
    cannot load on its own."""
    if not isinstance(tokenizer, HFTokenizer) or tokenizer.path.name != "tokenizer.json":
        return
    if tokenizer.fingerprint in _AGREED or importlib.util.find_spec("transformers") is None:
        return
    folder = tokenizer.path.parent
    try:
        import transformers

        theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
    except Exception:  # noqa: BLE001 - a folder transformers cannot load gives it no tokenizer to disagree with
        return
    for text in PROBES:
        ours, got = tokenizer.encode(text), list(theirs(text, add_special_tokens=False)["input_ids"])
        if ours != got:
            raise DataError(
                f"{key}: transformers loads {folder} as {type(theirs).__name__}, which splits text otherwise than "
                f"{tokenizer.path}, the file this run reads: {text!r} is {_ids(ours)} here, {_ids(got)} in "
                "transformers. "
                "Training on these ids, the export would be scored and served with others. Train with "
                "transformers' tokenizer: save it (AutoTokenizer.from_pretrained(folder).save_pretrained(new)) and "
                "give the new folder as data.tokenizer; or name tokenizer_class PreTrainedTokenizerFast in the "
                "folder's tokenizer_config.json to make transformers read tokenizer.json as it is"
            )
    _AGREED.add(tokenizer.fingerprint)


def _ids(ids: list[int], shown: int = 12) -> str:
    return str(ids) if len(ids) <= shown else f"{str(ids[:shown])[:-1]}, ... ({len(ids)} ids)]"


def _token_from_config(path: Path, key: str) -> str | None:
    """The special token ``key`` (``eos_token``, ...) that the tokenizer_config.json beside ``path`` names."""
    cfg = path.parent / "tokenizer_config.json"
    if not cfg.is_file():
        return None
    try:
        token = json.loads(cfg.read_text("utf-8")).get(key)
    except (OSError, ValueError, AttributeError) as e:
        raise DataError(f"{str(cfg)!r} is not a readable JSON object: {e}") from e
    if isinstance(token, dict):  # {"content": "</s>", ...} in older files
        token = token.get("content")
    return token if isinstance(token, str) else None


def _id_bound(tok) -> int:
    """One more than the largest id ``tok`` knows, added and special tokens included.

    ``get_vocab_size`` counts entries, which undercounts when ids are sparse (an id of 1000
    in a vocabulary of four): a model sized by it would index past its embedding.
    """
    ids = [*tok.get_vocab(with_added_tokens=True).values(), *tok.get_added_tokens_decoder()]
    return max(max(ids, default=-1) + 1, tok.get_vocab_size(with_added_tokens=True))


def _first_known(tok) -> str | None:
    return next((t for t in _EOS_CANDIDATES if tok.token_to_id(t) is not None), None)
