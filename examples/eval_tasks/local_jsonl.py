"""Loads a task's rows from a JSON Lines file beside its YAML, for lm-evaluation-harness
(``custom_dataset: !function local_jsonl.load`` with ``dataset_kwargs: {file: NAME.jsonl}``): the
tasks here need neither the network nor the Hugging Face hub."""

import json
from pathlib import Path

import datasets


def load(file: str, **_metadata) -> dict[str, datasets.Dataset]:
    here = Path(__file__).resolve().parent
    path = (here / file).resolve()
    if path.parent != here:
        raise ValueError(f"dataset_kwargs.file {file!r} must name a file beside {Path(__file__).name}")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return {"test": datasets.Dataset.from_list(rows)}
