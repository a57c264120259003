"""A tiny Hugging Face model folder with a chat template, saved by ``transformers`` itself.

    python examples/tiny_chat_model.py OUT      # OUT/tiny-llama (the folder) and OUT/chats.jsonl

docs/finetune.md walks through fine-tuning it (it needs the test extra: torch and
transformers); the test suite fine-tunes the same folder (tests/_chat_folder.py).

``make_chat_folder(path)`` writes a byte-level BPE ``tokenizer.json`` (trained here on a few
sentences, with ChatML's special tokens), a ``tokenizer_config.json`` holding a ChatML chat
template, ``special_tokens_map.json``, ``generation_config.json``, and a random tiny
``LlamaForCausalLM`` (config.json + model.safetensors) whose vocabulary is the tokenizer's.
``write_chats(path)`` writes a small chat JSONL the tests fine-tune on.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? Paris is the capital of France.",
    "Two plus two is four. Three plus three is six.",
    "user assistant system: you are a helpful assistant.",
    "Hello! How can I help you today? Thanks, goodbye.",
]
CHATS = [
    {"messages": [{"role": "system", "content": "You are terse."},
                  {"role": "user", "content": "What is two plus two?"},
                  {"role": "assistant", "content": "Four."}]},
    {"messages": [{"role": "user", "content": "Capital of France?"},
                  {"role": "assistant", "content": "Paris."},
                  {"role": "user", "content": "Thanks!"},
                  {"role": "assistant", "content": "Goodbye."}]},
    {"prompt": "Three plus three is", "completion": " six."},
]


def make_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 4, trainer)
    return tok


def make_chat_folder(path: Path, *, seed: int = 0, layers: int = 2) -> Path:
    """The folder described above, in ``path`` (created)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer()
    tok.save(str(path / "tokenizer.json"))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    eos = tok.token_to_id("<|im_end|>")
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "bos_token": None, "model_max_length": 64}, indent=1))
    (path / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=eos, pad_token_id=tok.token_to_id("<|endoftext|>"))
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path, safe_serialization=True)  # also writes generation_config.json
    return path


def write_chats(path: Path, repeat: int = 8) -> Path:
    path = Path(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in CHATS * repeat))
    return path


def hf_logits(folder: Path, ids: np.ndarray) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager",
                                                              dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids), dtype=torch.long)).logits.numpy()


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python examples/tiny_chat_model.py OUT", file=sys.stderr)
        return 2
    out = Path(argv[0])
    folder = make_chat_folder(out / "tiny-llama")
    chats = write_chats(out / "chats.jsonl")
    print(f"wrote {folder} and {chats}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
