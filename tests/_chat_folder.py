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

TEXT = "The quick brown fox jumps over the lazy dog. What is two plus two? Two plus two is four.\n" * 40


def tiny_run(root: Path, **overrides) -> Path:
    """A run directory of a short fine-tune of the tiny folder on a plain-text file, under ``root``;
    ``overrides``: more config keys (``{"trainer.num_train_steps": 2, ...}``)."""
    from named.trainer.commands.cli import main_train

    make_chat_folder(root / "tiny-llama")
    (root / "text.txt").write_text(TEXT)
    args = {
        "model.init_from_hf": root / "tiny-llama",
        "data.train": f"[{root / 'text.txt'}]",
        "data.seq_len": 32,
        "data.val_fraction": 0,
        "data.cache_dir": root / "cache",
        "trainer.train_batch_size": 8,
        "trainer.num_train_steps": 1,
        "trainer.eval_interval": 0,
        "trainer.progress_bar": "false",
        "trainer.run_dir": root / "run",
        "tracker.console": "false",
        **overrides,
    }
    assert main_train([x for k, v in args.items() for x in (f"--{k}", str(v))]) == 0
    return root / "run"
