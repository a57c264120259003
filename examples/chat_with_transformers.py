"""Chat with an exported folder in ``transformers`` (and ``peft``), to check an export by hand.

    python examples/chat_with_transformers.py FOLDER --chat "What is two plus two?"
    python examples/chat_with_transformers.py BASE_FOLDER --adapters ADAPTER_FOLDER --chat "..."

Applies the folder's chat template, decodes greedily and prints the reply (special tokens
dropped). Needs the test extra (torch, transformers, peft).
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="chat_with_transformers")
    p.add_argument("folder", help="a Hugging Face model folder (named-export's output, or the base of --adapters)")
    p.add_argument("--adapters", help="a PEFT adapter folder (named-export --adapters-only) to load on top")
    p.add_argument("--chat", required=True, help="the user message")
    p.add_argument("--tokens", type=int, default=16)
    a = p.parse_args(argv)

    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(a.adapters or a.folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(a.folder)
    if a.adapters:
        import peft

        model = peft.PeftModel.from_pretrained(model, a.adapters)
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": a.chat}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=a.tokens, do_sample=False)
    print(tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
