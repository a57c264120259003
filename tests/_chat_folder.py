"""The fine-tuning tests' tiny Hugging Face folder: the one docs/finetune.md builds
(examples/tiny_chat_model.py), imported from there so that both use the same model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "examples" / "tiny_chat_model.py"
_spec = importlib.util.spec_from_file_location("tiny_chat_model", _PATH)
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)

CHATML, CHATS, SPECIAL = _module.CHATML, _module.CHATS, _module.SPECIAL
hf_logits, make_chat_folder, make_tokenizer, write_chats = (
    _module.hf_logits,
    _module.make_chat_folder,
    _module.make_tokenizer,
    _module.write_chats,
)
