"""Every Hugging Face Hub id of a config pinned to its commit, before the config is decoded.

``load_config`` calls ``pin_config`` on the merged YAML + CLI values: ``model.init_from_hf``,
``data.tokenizer`` and each data source's ``hf_dataset`` become ``org/name@<commit>`` with their
snapshots fetched (``hub``), so the run's config.yaml records exactly what it read.
"""

from __future__ import annotations

from . import hub
from .data_section import SourceSpec, parse_sources


def pin_config(raw: dict) -> dict:
    """The merged config values with every Hub id pinned (``pin``): ``model.init_from_hf``,
    ``data.tokenizer`` and the ``hf_dataset`` of each source of ``data.train`` and
    ``data.validation``. Values of the wrong type are left for the checks that name them."""
    model, data = raw.get("model"), raw.get("data")
    out = dict(raw)
    if isinstance(model, dict) and isinstance(model.get("init_from_hf"), str):
        out["model"] = {**model, "init_from_hf": hub.pin(model["init_from_hf"], "model.init_from_hf")}
    if not isinstance(data, dict):
        return out
    data = dict(data)
    if isinstance(data.get("tokenizer"), str) and data["tokenizer"] != "byte":
        data["tokenizer"] = hub.pin(data["tokenizer"], "data.tokenizer")
    for split in ("train", "validation"):
        entries = data.get(split)
        if isinstance(entries, list) and any(isinstance(e, dict) and "hf_dataset" in e for e in entries):
            # every entry's own checks first (DataError naming data.<split>[i].<key>), then the fetches
            specs = parse_sources(entries, f"data.{split}", weighted=split == "train")
            data[split] = [
                _pinned(e, s, f"data.{split}[{i}].hf_dataset") for i, (e, s) in enumerate(zip(entries, specs))
            ]
    out["data"] = data
    return out


def _pinned(entry: dict, spec: SourceSpec, key: str) -> dict:
    if spec.hf_dataset is None:
        return entry
    hid = hub.dataset_id(spec.hf_dataset, key)
    folder = hub.snapshot(hid, key, kind="dataset", patterns=hub.dataset_files(spec.subset))
    return {**entry, "hf_dataset": str(hub.HubId(hid.repo, folder.name))}
