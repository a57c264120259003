"""``named-export``: a checkpoint of a training run as a Hugging Face folder.

    named-export --checkpoint RUN_DIR [--step N] --out FOLDER [--merge | --adapters-only]
                 [--max-shard-size 2GB] [--overwrite]

The run's ``config.yaml`` and ``model_config.json`` say what was trained; the checkpoint's model
(not its optimizer state) is read onto the run's mesh when this machine can build it, else onto
one device (a checkpoint restores onto any mesh). The folder gets ``config.json`` (with the ids of the
special tokens, which transformers and vLLM read there: ``token_ids``), safetensors
(sharded past ``--max-shard-size``, each file fetched to the host on its own) and the tokenizer
files of the run (``data.tokenizer``, else ``model.init_from_hf``): every one the source has of
``TOKENIZER_FILES`` (tokenizer.json, tokenizer_config.json, special_tokens_map.json,
generation_config.json, chat_template.jinja, the slow tokenizers' vocabularies, ...). The chat
template the run read (``data.chat_template``, or its tokenizer folder's) is written as
``chat_template.jinja`` when the run gave one or the folder would lack it, and, where transformers
is installed, the export is checked after writing: transformers' ``apply_chat_template`` on the
written folder must render a probe conversation as the run's template does, else DataError
naming the file.

A LoRA run (a ``lora`` section) is exported one of two ways, chosen explicitly:

- ``--merge``: the adapters folded into the weights (``W + alpha/r · A · B``), a plain folder
  (every tensor in one dtype: the widest of the model's, so a bfloat16 base merged with float32
  adapters is written in float32);
- ``--adapters-only``: a PEFT folder, ``adapter_config.json`` + ``adapter_model.safetensors``
  (``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and ``lora_B.weight`` ``[out, r]``),
  for the base folder ``model.init_from_hf`` names.

Every input is checked before anything is read or written. ``--out`` is taken with its symlinks
resolved (the folder written is the one a link points to), and is refused when it is, lies inside
or holds a run directory, a checkpoint folder or a checkpoint of any run (``run_places``): an
export would write into what a run keeps, and ``--overwrite`` would delete it. The folder is
written next to ``--out`` under a temporary name and renamed into place when complete: a failed
export (a full disk, a file-size limit: ``FileWriteError`` naming the file) leaves no
half-written folder, and an existing non-empty ``--out`` is replaced only with ``--overwrite``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import uuid
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import named as nm
from named import nn
from named.models.hf import CheckpointFormatError, folder_file, save_pretrained
from named.models.registry import family_for

from .. import checkpoint as ckpt
from ..checkpoint import run_places
from ..checkpoint.rundir import checkpoint_root
from ..config import ConfigError, TrainConfig, hub, pretrained
from ..data import DataError, load_tokenizer, remove_abandoned, working_in
from ..data.chat_template import find_template
from ..loop.model_init import hf_linears, model_shapes
from ..loop.registry import model_class
from .sample import saved_config, saved_model_config

# Every file of a tokenizer folder that transformers reads for the tokenizer, its chat template or
# generation (whichever the source has is copied): the fast tokenizer, the slow tokenizers' vocabularies,
# and the template as transformers writes it today (chat_template.jinja) or wrote it before.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
)
# The special tokens' ids, which transformers and vLLM read from config.json (generation_config.json
# only guides generate()); token_ids says where each comes from.
TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


@dataclasses.dataclass
class ExportResult:
    out: Path
    step: int
    kind: str  # "model", "merged" or "adapters"
    files: list[str]
    notes: list[str]

    def __str__(self) -> str:
        what = {
            "model": "Hugging Face folder",
            "merged": "Hugging Face folder (LoRA merged)",
            "adapters": "PEFT adapter folder",
        }[self.kind]
        return "\n".join([f"wrote {what} {self.out} from step {self.step}: {', '.join(self.files)}", *self.notes])


def export(
    checkpoint: str | Path,
    out: str | Path,
    *,
    step: int | None = None,
    merge: bool = False,
    adapters_only: bool = False,
    max_shard_size: int | str | None = None,
    overwrite: bool = False,
) -> ExportResult:
    """Write the checkpoint ``checkpoint`` (a run directory, or ``<run_dir>/checkpoints/step_N``)
    as a Hugging Face folder ``out``; see the module docstring. Bad input raises ConfigError (a
    flag) or CheckpointError (a path) naming it, before anything is read or written."""
    if merge and adapters_only:
        raise ConfigError("give --merge or --adapters-only, not both")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ConfigError(f"--step must be a checkpoint's step (an integer >= 0), got {step!r}")
    run_dir, cfg, model_cfg, path = read_run(Path(checkpoint), step)
    kind = _kind(cfg, run_dir, merge, adapters_only)
    out = _check_out(Path(out), overwrite)
    if max_shard_size is not None:
        from named.models.hf import parse_size  # the one parser of sizes like 2GB

        try:
            parse_size(max_shard_size)
        except CheckpointFormatError as e:
            raise ConfigError(f"--max-shard-size: {e}") from None
    model, metadata, _ = restore_model(cfg, model_cfg, path)
    prefix = f".{out.name}.tmp-"
    left = [p for p in out.parent.iterdir() if p.name.startswith(prefix)] if out.parent.is_dir() else []
    left = remove_abandoned(left, f"an export to {out}")  # what a killed export to --out left behind
    tmp = out.parent / f"{prefix}{uuid.uuid4().hex[:8]}"
    held = contextlib.ExitStack()  # a live export's folder: never removed as a leftover
    try:
        held.enter_context(working_in(tmp, lambda: tmp.mkdir(parents=True, exist_ok=True)))
        if kind == "adapters":
            _write_adapters(model, cfg, tmp)
        else:
            if kind == "merged":
                model = _one_dtype(nn.lora.merge(model))
            save_pretrained(model, model_cfg, tmp, max_shard_size=max_shard_size)
        notes = copy_tokenizer(cfg, tmp)
        write_template(cfg, tmp, out)
        if kind != "adapters":
            notes += write_token_ids(cfg, model_cfg.vocab_size, tmp)
        files = sorted(p.name for p in tmp.iterdir())
        _move_into_place(tmp, out)
    except OSError as e:  # the machine (a full disk, a size limit): named as the file of --out it was writing
        name = Path(e.filename).name if e.filename and Path(e.filename).parent == tmp else None
        raise nm.FileWriteError(
            e.errno or 0,
            f"{e.strerror or e}; --out is unchanged (an export is renamed into place whole, or not at all)",
            str(out / name if name else out),
        ) from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        held.close()
    notes += [f"removed {p}, left behind by an export to {out} that was stopped before it finished" for p in left]
    return ExportResult(out, int(metadata["step"]), kind, files, notes)


# ---- checks ------------------------------------------------------------------------------------------


def read_run(checkpoint: Path, step: int | None = None) -> tuple[Path, TrainConfig, object, Path]:
    """``(run_dir, config, model config, checkpoint)`` of ``--checkpoint`` (a run directory, its newest
    checkpoint or the one of ``step``, or a checkpoint folder ``<run_dir>/checkpoints/step_N``), each
    file checked, before anything is read from the checkpoint."""
    run_dir, path = _locate(checkpoint, step)
    model_cfg = saved_model_config(run_dir)
    cfg = saved_config(run_dir)  # trainer.run_dir: where the run is now (a copy exports its own checkpoints)
    if path is None:
        path = _checkpoint_of(run_dir, checkpoint_root(cfg), step)
    return run_dir, cfg, model_cfg, path


def _locate(path: Path, step: int | None) -> tuple[Path, Path | None]:
    """``(run_dir, checkpoint)`` for ``--checkpoint``: a checkpoint folder names both; a run
    directory names no checkpoint yet (its config says where they live)."""
    if not path.exists():
        raise ckpt.CheckpointError(f"--checkpoint {path}: no such directory")
    if not path.is_dir():
        raise ckpt.CheckpointError(
            f"--checkpoint {path} is a file; give a run directory or a checkpoint folder <run_dir>/checkpoints/step_N"
        )
    if not (path / ckpt.COMMIT_FILE).exists():
        return path, None
    if path.parent.name != "checkpoints":  # the run's config lies two levels up: read it only from there
        raise ckpt.CheckpointError(
            f"--checkpoint {path} is a checkpoint outside a run directory; give "
            "<run_dir>/checkpoints/step_N or the run directory"
        )
    if step is not None and path.name != f"step_{step}":
        raise ConfigError(
            f"--step {step} with --checkpoint {path}, a checkpoint of another step; give the run "
            "directory with --step, or the checkpoint folder alone"
        )
    return path.parent.parent, path


def _checkpoint_of(run_dir: Path, root, step: int | None):
    """The newest good checkpoint of the run (kept under ``root``), or the one of ``step``."""
    if step is None:
        found = ckpt.latest_checkpoint(root)
        if found is None:
            raise ckpt.CheckpointError(
                f"--checkpoint {run_dir}: no committed checkpoint under {ckpt.checkpoint_dir(root)}"
            )
        return found
    saved = ckpt.list_checkpoints(root)
    for n, found in saved:
        if n == step:
            return found
    have = ", ".join(str(n) for n, _ in saved) or "none"
    raise ckpt.CheckpointError(
        f"--step {step}: {run_dir} has no committed checkpoint of step {step}; its checkpoints: steps {have}"
    )


def _kind(cfg: TrainConfig, run_dir: Path, merge: bool, adapters_only: bool) -> str:
    if cfg.lora is None:
        if merge or adapters_only:
            flag = "--merge" if merge else "--adapters-only"
            raise ConfigError(
                f"{flag}: the run in {run_dir} has no LoRA adapters (its config.yaml has no lora section); "
                "export it without the flag to write its weights as they are"
            )
        return "model"
    if not (merge or adapters_only):
        raise ConfigError(
            f"the run in {run_dir} trained LoRA adapters (lora.rank={cfg.lora.rank}, targets "
            f"{cfg.lora.targets}): give --merge (a plain Hugging Face folder, the adapters folded into "
            "the weights) or --adapters-only (a PEFT adapter folder for the base model)"
        )
    if adapters_only and cfg.model.init_from_hf is None:
        raise ConfigError(
            f"--adapters-only: the run in {run_dir} started from random weights (no model.init_from_hf), "
            "so there is no base folder for the adapters; export it with --merge"
        )
    return "adapters" if adapters_only else "merged"


def _check_out(given: Path, overwrite: bool) -> Path:
    """``--out`` with its symlinks resolved, where nothing a run keeps is written into or over."""
    out = given.resolve()
    shown = f"--out {given}" + (f" (a link to {out})" if out != given.absolute() else "")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{shown} is a file; give a folder")
    inside = run_places.enclosing(out)
    if inside is not None:
        kind, place = inside
        where = "is" if place == out else "lies inside"
        raise ConfigError(
            f"{shown} {where} the {kind} {place}; an export never writes into what a run keeps: give a "
            "folder outside it"
        )
    if out.is_dir() and any(out.iterdir()):
        held = run_places.held_below(out)
        if held is not None:
            kind, place = held
            raise ConfigError(
                f"{shown} holds the {kind} {place}, which --overwrite would delete; give a folder outside it"
            )
        if not overwrite:
            raise ConfigError(f"{shown} exists and is not empty; give another folder, or --overwrite to replace it")
    return out


# ---- reading the checkpoint ----------------------------------------------------------------------------


def restore_model(cfg: TrainConfig, model_cfg, path):
    """``(model, metadata, mesh)``: the checkpoint's model on the run's mesh and parameter mapping when
    these devices can hold it, else on one device (mesh None)."""
    shapes = model_shapes(cfg, model_class(model_cfg), model_cfg)
    param_mapping = cfg.mesh.param_mapping
    try:
        mesh = nm.make_mesh(cfg.mesh.shape)
        nm.check_sharding(shapes, param_mapping, mesh)
    except (nm.NamedError, ValueError):
        mesh = None  # another machine than the run's: one device

    def leaf(x):
        if isinstance(x, nm.NamedArray) and mesh is not None:
            sharding = nm.sharding_for(x, param_mapping, mesh)
            return nm.NamedArray(jax.ShapeDtypeStruct(x.array.shape, x.array.dtype, sharding=sharding), x.axes)
        return x

    target = jax.tree.map(leaf, shapes, is_leaf=nm.is_named_array)
    (model, _), metadata = ckpt.restore(path, (target, None), partial=True)
    return model, metadata, mesh


def _one_dtype(model):
    """Every floating array of ``model`` in the widest floating dtype among them."""
    floats = [x.dtype for x in jax.tree.leaves(model) if jnp.issubdtype(x.dtype, jnp.floating)]
    dtype = jnp.result_type(*floats)
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, model)


# ---- writing -------------------------------------------------------------------------------------------


def peft_tensors(model) -> dict[str, np.ndarray]:
    """The adapters of a LoRA model as PEFT names and lays them out: for each adapted module of
    each layer, ``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and ``lora_B.weight``
    ``[out, r]`` (in and out flattened as the Hugging Face weight flattens them)."""
    modules = hf_linears(model)
    flat = jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda x: isinstance(x, nn.LoraLinear))[0]
    out = {}
    for keypath, layer in flat:
        if not isinstance(layer, nn.LoraLinear):
            continue
        module = modules[jax.tree_util.keystr(keypath, simple=True, separator=".")]
        own = (
            [a.name for a in nm.axis_spec_to_tuple(layer.In)]
            + [nn.lora.RANK]
            + [a.name for a in nm.axis_spec_to_tuple(layer.Out)]
        )
        extra = [a for a in layer.lora_a.axes if a.name not in own]
        if len(extra) != ("{i}" in module):
            raise CheckpointFormatError(
                f"{module}: adapters with axes {layer.lora_a.axes} do not match its Hugging Face "
                "name (one per layer, or one)"
            )
        a = np.asarray(
            layer.lora_a.rearrange(
                (*[e.name for e in extra], *[x.name for x in nm.axis_spec_to_tuple(layer.In)], nn.lora.RANK)
            ).array
        )
        b = np.asarray(
            layer.lora_b.rearrange(
                (*[e.name for e in extra], nn.lora.RANK, *[x.name for x in nm.axis_spec_to_tuple(layer.Out)])
            ).array
        )
        r = layer.rank
        per_layer = [(module.format(i=i), a[i], b[i]) for i in range(a.shape[0])] if extra else [(module, a, b)]
        for name, ai, bi in per_layer:
            out[f"base_model.model.{name}.lora_A.weight"] = np.ascontiguousarray(ai.reshape(-1, r).T)
            out[f"base_model.model.{name}.lora_B.weight"] = np.ascontiguousarray(bi.reshape(r, -1).T)
    return out


def peft_config(cfg: TrainConfig, model) -> dict:
    """``adapter_config.json`` for the run's adapters (PEFT's LoraConfig fields)."""
    lora = cfg.lora
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        **peft_base_model(cfg.model.init_from_hf),
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": list(lora.targets),
        "bias": "none",
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        # GPT-2's Conv1D stores its weight [in, out]; PEFT needs to know to merge into it
        "fan_in_fan_out": family_for(model).layout.linear == "in_out",
    }


def peft_base_model(value: str) -> dict:
    """The base model as PEFT names it: a folder, or a Hub id and its commit (PEFT's ``revision``)."""
    hid = hub.hub_id(value)
    if hid is None:
        return {"base_model_name_or_path": value}
    return {"base_model_name_or_path": hid.repo, "revision": hid.revision}


def _write_adapters(model, cfg: TrainConfig, folder: Path) -> None:
    nm.save_safetensors(peft_tensors(model), folder / "adapter_model.safetensors", metadata={"format": "pt"})
    (folder / "adapter_config.json").write_text(json.dumps(peft_config(cfg, model), indent=2, sort_keys=True) + "\n")


def _tokenizer_sources(cfg: TrainConfig) -> list[tuple[Path, tuple[str, ...]]]:
    """Where each tokenizer file may come from, first choice first: the run's tokenizer (a folder,
    or a tokenizer.json file), then the folder the run started from."""
    sources = []
    spec = cfg.data.tokenizer
    if spec != "byte":
        p = hub.folder(spec, "data.tokenizer")
        sources.append((p, TOKENIZER_FILES) if p.is_dir() else (p.parent, (p.name,)))
    if cfg.model.init_from_hf is not None:
        sources.append((pretrained.folder(cfg.model.init_from_hf), TOKENIZER_FILES))
    return sources


def copy_tokenizer(cfg: TrainConfig, folder: Path) -> list[str]:
    done: set[str] = set()
    for root, names in _tokenizer_sources(cfg):
        for name in names:
            target = "tokenizer.json" if name not in TOKENIZER_FILES else name  # a tokenizer file of another name
            if target in done or not (root / name).is_file():
                continue
            try:
                source = folder_file(root, name)  # never a file outside the folder, through a symlink
            except CheckpointFormatError:
                continue
            shutil.copyfile(source, folder / target)
            done.add(target)
    if "tokenizer.json" not in done:
        what = (
            "the built-in byte tokenizer" if cfg.data.tokenizer == "byte" else f"{cfg.data.tokenizer} (not found now)"
        )
        return [f"note: no tokenizer.json written: the run's tokenizer is {what}"]
    return []


_TEMPLATE_PROBE = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]


def write_template(cfg: TrainConfig, folder: Path, out: Path) -> None:
    """The run's chat template (``data.chat_template``, else its tokenizer folder's) into the export
    being written in ``folder`` as ``chat_template.jinja``, unless the copied files hold it; then,
    where transformers is installed, checked: transformers renders probes with it as the run does
    (DataError naming the file)."""
    spec = cfg.data.tokenizer
    source = None if spec == "byte" else hub.folder(spec, "data.tokenizer")
    try:
        template = find_template(
            None if source is None else source if source.is_dir() else source.parent, cfg.data.chat_template
        )
    except DataError:
        return  # the template is gone since the run: nothing of it to write
    if template is None:
        return
    jinja = folder / "chat_template.jinja"
    copied = find_template(folder)  # chat_template.jinja first, as transformers reads it
    if copied is None or copied.text != template.text:
        jinja.write_text(template.text, encoding="utf-8")
    check_template(folder, template, out / jinja.name)


def check_template(folder: Path, template, shown: Path) -> None:
    """transformers' ``apply_chat_template`` with the tokenizer of ``folder`` renders probe
    conversations as ``template`` (ours, what the run trained on) does; DataError naming ``shown``
    if not. Nothing is checked without transformers or a tokenizer it loads."""
    try:
        import transformers
    except ImportError:
        return
    if not (folder / "tokenizer.json").is_file():
        return
    try:  # not AutoTokenizer: it reads config.json, which imports torch (2.8 s of a 5.7 s export); the fast
        # tokenizer classes it would pick render chat templates with this same base implementation
        tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(folder))
    except Exception:  # noqa: BLE001 - a tokenizer transformers cannot load has no template to compare
        return
    for probe, prompt in ((_TEMPLATE_PROBE[:3], False), (_TEMPLATE_PROBE, True), (_TEMPLATE_PROBE[1:3], False)):
        try:
            ours = template.render(probe, add_generation_prompt=prompt)
        except DataError:
            continue  # the template refuses this conversation (a system message, say): no check from it
        try:
            theirs = tok.apply_chat_template(probe, tokenize=False, add_generation_prompt=prompt)
        except Exception as e:  # noqa: BLE001 - transformers' failure, whatever its type, is the finding
            theirs = f"<{type(e).__name__}: {e}>"
        if theirs != ours:
            raise DataError(
                f"{shown}: transformers renders the exported chat template otherwise than the run's "
                f"({template.source}): {theirs[:200]!r} against {ours[:200]!r}; the export was not written"
            )


def token_ids(cfg: TrainConfig, vocab_size: int, folder: Path) -> tuple[dict, list[str]]:
    """The ``bos``/``eos``/``pad`` ids for the ``config.json`` of the export being written in
    ``folder``, and notes on files that could not be read. Each id comes from the first source
    that gives one inside the vocabulary: the ``config.json`` of ``model.init_from_hf`` (the ids
    the model was pretrained with), the ``generation_config.json`` copied into ``folder``, then
    the run's tokenizer (eos: the end of document it trained on; bos and pad as its
    ``tokenizer_config.json`` names them). None (null) where none does: left out of the file,
    transformers would fill in its class defaults (GPT-2's 50256 for a 257-token byte model)."""
    notes: list[str] = []
    sources = []
    if cfg.model.init_from_hf is not None:
        sources.append(_ids_in(pretrained.folder(cfg.model.init_from_hf), "config.json", notes))
    sources.append(_ids_in(folder, "generation_config.json", notes))
    try:
        tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.data.eos_token)
        sources.append({f"{kind}_token_id": tokenizer.special_id(kind) for kind in ("bos", "eos", "pad")})
    except DataError as e:  # the tokenizer is gone since the run
        notes.append(f"note: the run's tokenizer gave no token ids: {e}")
    ids = {
        name: next((s[name] for s in sources if _in_vocab(s.get(name), vocab_size)), None) for name in TOKEN_ID_FIELDS
    }
    return ids, notes


def _ids_in(folder: Path, name: str, notes: list[str]) -> dict:
    try:
        path = folder_file(folder, name)
        content = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (CheckpointFormatError, OSError, UnicodeDecodeError, ValueError) as e:
        notes.append(f"note: token ids not read from {folder / name}: {e}")
        return {}
    return content if isinstance(content, dict) else {}


def _in_vocab(value, vocab_size: int) -> bool:
    """An id (or a list of ids, as Llama 3's eos) of the vocabulary."""
    values = value if isinstance(value, list) and value else [value]
    return all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < vocab_size for v in values)


def write_token_ids(cfg: TrainConfig, vocab_size: int, folder: Path) -> list[str]:
    ids, notes = token_ids(cfg, vocab_size, folder)
    path = folder / "config.json"
    hf_config = json.loads(path.read_text(encoding="utf-8"))
    path.write_text(json.dumps({**hf_config, **ids}, indent=2, sort_keys=True) + "\n")
    return notes


def _move_into_place(tmp: Path, out: Path) -> None:
    """``tmp`` renamed to ``out``; an existing ``out`` is moved aside first and removed after, so
    ``out`` is always either the old folder or the whole new one."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        out.rename(old)
    try:
        tmp.rename(out)
    except OSError:
        if old is not None:
            old.rename(out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
