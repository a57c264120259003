"""Hugging Face Hub ids where a config names a folder.

``model.init_from_hf``, ``data.tokenizer`` and a data source's ``hf_dataset`` may name a
repository of the Hub, ``org/name`` or ``org/name@revision`` (a branch, a tag or a commit),
instead of a local folder. A value that names an existing local path is that path; any other
value of that form is a Hub id. It is fetched by ``huggingface_hub`` (``pip install
'named-jax[hub]'``, imported only then) into the Hub's own cache, with its rules: ``HF_HUB_CACHE``
or ``HF_HOME`` place the cache, ``HF_TOKEN`` (or ``hf auth login``) reads private and gated
repositories, and ``HF_HUB_OFFLINE=1`` reads the cache alone. Only the files we read are
fetched (``MODEL_FILES``, ``DATASET_FILES``), and files are read only inside the repository's
snapshot folder (``snapshots/<commit>/``, whose links lead to the repository's own ``blobs/``).

``pin`` turns an id into ``org/name@<commit>``: ``load_config`` pins every id before the config
is decoded (``pinning``), so the run's config.yaml records the exact snapshot and a rerun of it reads the same
files, offline or not. ``folder`` gives the local folder of a value, a path or an id.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from named import NamedError

from .errors import ConfigError

# A repository id as the Hub spells it (an optional owner, a name of letters, digits, '-', '_',
# '.'), then '@' and a revision (a branch or tag may hold '/': refs/pr/1, refs/convert/parquet).
_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*(?:/[A-Za-z0-9][\w.-]*)?)(?:@(?P<revision>[^@\s]+))?")
_COMMIT = re.compile(r"[0-9a-f]{40}")
# A revision is a name (a branch, a tag, a commit), never a path: parts of letters, digits, '_', '-'
# and '.', none empty nor starting with '.', so no '..' can climb out of the Hub cache's folders.
_REVISION = re.compile(r"[\w-][\w.-]*(?:/[\w-][\w.-]*)*")

# What is fetched of a model repository: its config, safetensors weights, tokenizer and chat
# template; never a pickle (*.bin, *.pt), nor TensorFlow, Flax or ONNX weights.
MODEL_FILES = ("*.json", "*.safetensors", "*.jinja")
# What is fetched of a dataset repository: the data files our readers read (data/_sources.py).
DATASET_FILES = ("*.parquet", "*.arrow", "*.jsonl", "*.json", "*.txt", "*.gz", "*.zst")


@dataclass(frozen=True)
class HubId:
    """A Hub repository and the revision asked for (None: its default branch, ``main``)."""

    repo: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo + (f"@{self.revision}" if self.revision else "")


def hub_id(value: str, key: str = "model.init_from_hf", error: type[NamedError] = ConfigError) -> HubId | None:
    """``value`` as a Hub id, or None when it is a local path: one that exists, or one that
    cannot be an id (absolute, ``./``, ``~``, more than one ``/``). An id whose revision is no
    name (``org/name@../x``) is ``error``, naming ``key``."""
    if not isinstance(value, str) or Path(value).expanduser().exists():
        return None
    m = _ID.fullmatch(value)
    if m is None or m.group("repo").endswith((".", "-")) or ".." in m.group("repo"):
        return None
    return HubId(m.group("repo"), _revision(m.group("revision"), value, key, error))


def _revision(revision: str | None, value: str, key: str, error: type[NamedError]) -> str | None:
    if revision is None or (_REVISION.fullmatch(revision) and not revision.endswith(".lock")):
        return revision
    raise error(
        f"{key}={value!r}: the revision {revision!r} is not a branch, tag or commit name (parts of letters, "
        "digits, '_', '-' and '.' joined by '/', none starting with '.'); a revision is a name, never a path"
    )


def snapshot(
    hid: HubId,
    key: str,
    *,
    kind: str = "model",
    patterns: tuple[str, ...] = MODEL_FILES,
    error: type[NamedError] = ConfigError,
) -> Path:
    """The local snapshot folder of ``hid`` (a ``kind`` repository: ``model`` or ``dataset``),
    fetched into the Hub cache unless it is there; ``error`` (naming ``key``) when it cannot be had."""
    try:
        import huggingface_hub as hub
    except ImportError as e:
        raise error(
            f"{key}={str(hid)!r} is no local path, and reading it as a Hugging Face Hub id needs huggingface_hub, "
            f"which does not import ({e}): pip install 'named-jax[hub]', or give a local folder",
        ) from None
    from huggingface_hub import errors

    # a model value may also have meant a local path; a dataset's hf_dataset is always an id
    either = "no such local path, and " if kind == "model" else ""
    cached_only = hid.revision is not None and _COMMIT.fullmatch(hid.revision) is not None
    try:
        if cached_only:  # a pinned snapshot that is there needs no call to the Hub
            try:
                return Path(_download(hub, hid, kind, patterns, local_files_only=True))
            except errors.LocalEntryNotFoundError:
                pass
        return Path(_download(hub, hid, kind, patterns, local_files_only=False))
    except errors.LocalEntryNotFoundError:
        flag = f" --repo-type {kind}" if kind != "model" else ""
        rev = f" --revision {hid.revision}" if hid.revision else ""
        raise error(
            f"{key}={str(hid)!r}: {either}the Hugging Face {kind} {hid} is not in the Hub cache "
            f"({_cache_dir()}), which is all there is to read (HF_HUB_OFFLINE=1, or no network): fetch it "
            f"where there is a network with `hf download {hid.repo}{flag}{rev}` into the same cache "
            "(HF_HUB_CACHE), or give a local folder",
        ) from None
    except errors.RevisionNotFoundError:
        raise error(
            f"{key}={str(hid)!r}: {either}the Hugging Face {kind} {hid.repo} has no revision {hid.revision!r}"
        ) from None
    except errors.RepositoryNotFoundError:  # GatedRepoError too
        raise error(
            f"{key}={str(hid)!r}: {either}the Hugging Face Hub has no {kind} {hid.repo} that this machine may read: "
            "check the id, or for a private or gated one set HF_TOKEN (or run `hf auth login`)",
        ) from None
    except (errors.HfHubHTTPError, errors.HFValidationError, OSError, ValueError) as e:
        raise error(f"{key}={str(hid)!r}: {either}cannot fetch the Hugging Face {kind} {hid}: {e}") from None


def _download(hub, hid: HubId, kind: str, patterns, *, local_files_only: bool) -> str:
    return hub.snapshot_download(
        hid.repo,
        repo_type=kind,
        revision=hid.revision,
        allow_patterns=list(patterns),
        local_files_only=local_files_only,
    )


def _cache_dir() -> str:
    from huggingface_hub import constants

    return str(Path(constants.HF_HUB_CACHE).expanduser())


def pin(value, key: str, *, kind: str = "model", patterns: tuple[str, ...] = MODEL_FILES):
    """``value`` with a Hub id made ``repo@<commit>`` (its snapshot fetched); a local path, or a
    value of another type (the type check names it), as it is."""
    hid = hub_id(value, key)
    if hid is None:
        return value
    folder = snapshot(hid, key, kind=kind, patterns=patterns)
    return str(HubId(hid.repo, folder.name))  # a snapshot folder is named by its commit


def folder(
    value: str,
    key: str,
    *,
    kind: str = "model",
    patterns: tuple[str, ...] = MODEL_FILES,
    error: type[NamedError] = ConfigError,
):
    """The local folder (or file) ``value`` names: the path itself, or a Hub id's snapshot."""
    hid = hub_id(value, key, error)
    if hid is None:
        return Path(value).expanduser()
    return snapshot(hid, key, kind=kind, patterns=patterns, error=error)


def dataset_files(subset: str | None) -> tuple[str, ...]:
    """The files fetched of a dataset repository: its data files, those of the folder ``subset``
    when one is named."""
    return tuple(f"{subset}/{p}" for p in DATASET_FILES) if subset else DATASET_FILES


def dataset_id(value: str, key: str, error: type[NamedError] = ConfigError) -> HubId:
    """A source's ``hf_dataset``: always a Hub id (a local dataset is given by its ``paths``)."""
    m = _ID.fullmatch(value) if isinstance(value, str) else None
    if m is None:
        raise error(f"{key} must be a Hugging Face dataset id, `org/name` or `org/name@revision`, got {value!r}")
    return HubId(m.group("repo"), _revision(m.group("revision"), value, key, error))
