"""``config.json`` <-> ``DecoderConfig`` for the decoder families, and their tensors' names in a Hugging Face
checkpoint (``HF_LAYOUT``). One reader and one writer, driven
by each family's ``HfDecoder`` (in ``registry.py``; an ``HfConfigFormat``): which fields its ``config.json`` has and
what they mean. Every field of the file is either read, accepted at the one value we implement,
or known to change nothing in the model (token ids, init range, ...); any other is an error that
names it, so a checkpoint option we do not implement is never silently dropped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ._common import HfLayout
from ._hf_config import REQUIRED, CheckpointFormatError, build_config, checked_field
from ._rope import ROPE_TYPES, RopeScaling
from .decoder import LAYER_TYPES

# fields that change nothing in the model's numbers: generation and tokenizer ids, init, bookkeeping
_NO_EFFECT = frozenset(
    {
        "architectures",
        "model_type",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "initializer_range",
        "use_cache",
        "_name_or_path",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
    }
)
_SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "max_position_embeddings",
)
# per rope_type, the rope_parameters keys besides rope_type / type / rope_theta, and whether required
_ROPE_KEYS = {
    "default": {},
    "dynamic": {"factor": True},
    "linear": {"factor": True},
    "llama3": {
        "factor": True,
        "low_freq_factor": True,
        "high_freq_factor": True,
        "original_max_position_embeddings": True,
    },
    "yarn": {
        "factor": True,
        "original_max_position_embeddings": False,
        "attention_factor": False,
        "beta_fast": False,
        "beta_slow": False,
        "mscale": False,
        "mscale_all_dim": False,
        "truncate": False,
    },
}
_ROPE_KINDS = {"original_max_position_embeddings": int, "truncate": bool}


@dataclasses.dataclass(frozen=True)
class HfDecoder:
    """What one family's ``config.json`` holds beyond the sizes, eps, tying and RoPE every one has.

    bias: ``attention_bias`` (one flag for q, k, v and o) or ``fixed`` (the family's own: Qwen2's
        q/k/v biases, Mistral's none).
    windows: ``none``; ``all`` (Mistral: ``sliding_window`` for every layer); ``qwen``
        (``use_sliding_window``, ``sliding_window``, ``max_window_layers``, ``layer_types``);
        ``layer_types`` (Gemma: ``sliding_window`` and ``layer_types``, or the pattern).
    gemma: ``query_pre_attn_scalar``, ``final_logit_softcapping`` and (``attn_softcap``) the
        attention soft-cap, which transformers' Gemma 3 does not apply (so neither do we).
    nested_rope: RoPE settings per layer type (Gemma 3), with ``rope_local_base_freq``.
    only: fields we implement at these values only (``mlp_bias: (False,)``).
    no_effect: fields of this family that change nothing (legacy duplicates).
    moe: the mixture of experts every layer has: ``none``; ``mixtral`` (``num_local_experts``,
        weights always renormalised); ``qwen3`` (``num_experts``, ``moe_intermediate_size``,
        ``norm_topk_prob``); ``qwen2`` (``qwen3``'s and a gated shared expert).
    """

    activation_field: str = "hidden_act"
    bias: str = "attention_bias"
    windows: str = "none"
    gemma: bool = False
    attn_softcap: bool = False
    nested_rope: bool = False
    pattern_fields: tuple[str, ...] = ()
    only: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
    no_effect: frozenset = frozenset()
    moe: str = "none"

    def read(self, family, d: Mapping, where: Path):
        """Our config for a ``config.json`` of ``family`` (a ``registry.Family`` whose format this is)."""
        return _read(self, family, d, where)

    def write(self, family, config) -> dict:
        """``config.json`` for ``config``; refuses a config whose settings the family's format cannot hold."""
        return _write(self, family, config)


# What the MoE fields of a config.json say that changes nothing in the logits: whether the model
# returns its router logits (the training loss reads router_aux_loss_coef, which we read).
_MOE_NO_EFFECT = frozenset({"output_router_logits"})


class _Reader:
    """Reads fields of one ``config.json``, remembering which it read."""

    def __init__(self, d: Mapping, where: Path, defaults: Mapping[str, Any]):
        self.d, self.where, self.defaults, self.seen = d, where, defaults, set()

    def get(self, name: str, kind: type, default: Any = REQUIRED, *, null_is_none: bool = False):
        """``d[name]`` checked; ``default`` when missing (or null, unless ``null_is_none``)."""
        self.seen.add(name)
        if null_is_none and name in self.d and self.d[name] is None:
            return None
        return checked_field(self.d, name, kind, default, where=self.where)

    def field(self, name: str, kind: type, **kw):
        """Our config field of the same name; missing means the family's default."""
        return self.get(name, kind, self.defaults[name], **kw)

    def only(self, name: str, kind: type, allowed: tuple, why: str):
        value = self.get(name, kind, allowed[0])
        if value not in allowed:
            raise CheckpointFormatError(f"{self.where}: unsupported {name}={value!r} ({why})")

    def error(self, msg: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{self.where}: {msg}")


def _rope_dict(
    r: _Reader, rope: Mapping, field: str, theta_default: float, max_positions: int
) -> tuple[float, RopeScaling]:
    """``(rope_theta, RopeScaling)`` from one flat ``rope_parameters`` / ``rope_scaling`` dict."""
    kind = checked_field(rope, "rope_type", str, None, where=r.where, prefix=f"{field}.")
    kind = kind or checked_field(rope, "type", str, "default", where=r.where, prefix=f"{field}.")
    if kind not in ROPE_TYPES:
        raise r.error(f"unsupported {field}.rope_type={kind!r} (implemented: {', '.join(ROPE_TYPES)})")
    theta = checked_field(rope, "rope_theta", float, None, where=r.where, prefix=f"{field}.") or theta_default
    keys = _ROPE_KEYS[kind]
    extra = sorted(set(rope) - set(keys) - {"rope_type", "type", "rope_theta"})
    if extra:
        raise r.error(
            f"unsupported {field}.{extra[0]} for rope_type={kind!r} (it reads "
            f"{', '.join(['rope_theta', *keys]) or 'rope_theta only'})"
        )
    values = {}
    for key, required in keys.items():
        value = checked_field(
            rope, key, _ROPE_KINDS.get(key, float), REQUIRED if required else None, where=r.where, prefix=f"{field}."
        )
        if value is not None:
            values[key] = value
    if kind == "yarn":
        values.setdefault("original_max_position_embeddings", max_positions)
    try:
        return theta, RopeScaling(rope_type=kind, **values)
    except ValueError as e:
        raise r.error(f"{field}: {e}") from None


def _rope(r: _Reader, spec: HfDecoder, max_positions: int) -> dict:
    """``rope_theta``, ``rope_scaling`` (and ``rope_local_base_freq``) from ``rope_parameters``
    (transformers 5) or ``rope_scaling`` + ``rope_theta`` (earlier)."""
    theta = r.get("rope_theta", float, r.defaults["rope_theta"])
    field, rope = "rope_parameters", {}
    for name in ("rope_parameters", "rope_scaling"):
        value = r.get(name, dict, {})
        if value and not rope:
            field, rope = name, value
    out = {}
    if spec.nested_rope:
        local = r.get("rope_local_base_freq", float, r.defaults["rope_local_base_freq"])
        if set(rope) & set(LAYER_TYPES):
            extra = sorted(set(rope) - set(LAYER_TYPES))
            if extra:
                raise r.error(f"unsupported {field}.{extra[0]} next to per-layer-type settings")
            sliding = rope.get("sliding_attention") or {}
            if not isinstance(sliding, dict):
                raise r.error(f"field '{field}.sliding_attention' should be a dict (a JSON object), got {sliding!r}")
            local_theta, local_scaling = _rope_dict(r, sliding, f"{field}.sliding_attention", local, max_positions)
            if local_scaling.rope_type != "default":
                raise r.error(
                    f"unsupported {field}.sliding_attention.rope_type={local_scaling.rope_type!r} "
                    "(the local layers use the default rotary embedding)"
                )
            local = local_theta
            field, rope = f"{field}.full_attention", rope.get("full_attention") or {}
            if not isinstance(rope, dict):
                raise r.error(f"field '{field}' should be a dict (a JSON object), got {rope!r}")
        out["rope_local_base_freq"] = local
    out["rope_theta"], out["rope_scaling"] = _rope_dict(r, rope, field, theta, max_positions)
    return out


def _layer_types(r: _Reader, n_layers: int):
    types = r.get("layer_types", list, None)
    if types is None:
        return None
    if len(types) != n_layers or any(t not in LAYER_TYPES for t in types):
        raise r.error(f"field 'layer_types' should list {n_layers} of {', '.join(LAYER_TYPES)}, got {types!r}")
    return tuple(types)


def _windows(r: _Reader, spec: HfDecoder, n_layers: int) -> dict:
    if spec.windows == "none":
        return {}
    # Qwen's class default is a window of 4096 that use_sliding_window turns on; ours is None
    if spec.windows == "qwen" and r.d.get("sliding_window") == 0 and r.d.get("use_sliding_window") is not True:
        r.seen.add("sliding_window")  # Qwen2-MoE's way of saying no window
        window = None
    elif spec.windows == "qwen":
        window = r.get("sliding_window", int, 4096, null_is_none=True)
    else:
        window = r.field("sliding_window", int, null_is_none=True)
    if spec.windows == "all":
        return {"sliding_window": window}
    if spec.windows == "qwen":
        if not r.get("use_sliding_window", bool, False):
            window = None
        first_local = r.get("max_window_layers", int, 28)
        types = _layer_types(r, n_layers) or tuple(
            "sliding_attention" if window is not None and i >= first_local else "full_attention"
            for i in range(n_layers)
        )
        if window is None:
            if "sliding_attention" in types:
                raise r.error(
                    "field 'layer_types' has sliding_attention layers but use_sliding_window is false "
                    "or sliding_window is null"
                )
            return {"sliding_window": None}
        return {"sliding_window": window, "layer_types": types}
    out = {"sliding_window": window, "layer_types": _layer_types(r, n_layers)}
    for name in spec.pattern_fields:  # the legacy way of saying layer_types
        pattern = r.get(name, int, None)
        if pattern is not None and out["layer_types"] is None:
            out["sliding_window_pattern"] = pattern
    return out


def _gemma(r: _Reader, spec: HfDecoder) -> dict:
    if not spec.gemma:
        return {}
    r.only("use_bidirectional_attention", bool, (False,), "we build causal language models")
    out = {
        "query_pre_attn_scalar": r.field("query_pre_attn_scalar", float),
        "final_logit_softcapping": r.field("final_logit_softcapping", float, null_is_none=True),
    }
    cap = r.field("attn_logit_softcapping", float, null_is_none=True)
    if spec.attn_softcap:
        out["attn_logit_softcapping"] = cap
    elif cap is not None:
        raise r.error(
            f"unsupported attn_logit_softcapping={cap!r} (transformers' model for this model_type does "
            "not apply it, so a value here has no agreed meaning)"
        )
    return out


def _coefficient(r: _Reader, name: str, default: float) -> float:
    """A float field that may also be 0 (off), which the positive-float rule of ``checked_field`` refuses."""
    value = r.d.get(name)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
        r.seen.add(name)
        return 0.0
    return r.get(name, float, default)


def _moe(r: _Reader, spec: HfDecoder) -> dict:
    if spec.moe == "none":
        return {}
    out = {
        "num_experts_per_tok": r.field("num_experts_per_tok", int),
        "router_aux_loss_coef": _coefficient(r, "router_aux_loss_coef", r.defaults["router_aux_loss_coef"]),
    }
    if spec.moe == "mixtral":
        out["num_experts"] = r.get("num_local_experts", int, r.defaults["num_experts"])
        if _coefficient(r, "router_jitter_noise", 0.0):
            raise r.error(
                f"unsupported router_jitter_noise={r.d['router_jitter_noise']!r} "
                "(router jitter noise is not implemented)"
            )
        return out
    # transformers 5 writes num_local_experts, earlier versions num_experts
    counts = {n: r.get(n, int, None) for n in ("num_experts", "num_local_experts") if n in r.d}
    if len(set(counts.values())) > 1:
        raise r.error(
            f"fields 'num_experts' ({counts['num_experts']}) and 'num_local_experts' "
            f"({counts['num_local_experts']}) disagree"
        )
    out["num_experts"] = next(iter(counts.values()), None) or r.defaults["num_experts"]
    out["moe_intermediate_size"] = r.field("moe_intermediate_size", int)
    out["norm_topk_prob"] = r.field("norm_topk_prob", bool)
    r.only("decoder_sparse_step", int, (1,), "every layer is a mixture of experts")
    r.only("mlp_only_layers", list, ([],), "every layer is a mixture of experts")
    if spec.moe == "qwen2":
        out["shared_expert_intermediate_size"] = r.field("shared_expert_intermediate_size", int)
    return out


def _read(spec: HfDecoder, family, d: Mapping, where: Path):
    cls = family.config_cls
    r = _Reader(d, where, {f.name: f.default for f in dataclasses.fields(cls)})
    kw: dict[str, Any] = {name: r.get(name, int) for name in _SIZES}
    kw["num_key_value_heads"] = r.get("num_key_value_heads", int, None) or kw["num_attention_heads"]
    kw["head_dim"] = r.field("head_dim", int, null_is_none=True)
    if kw["head_dim"] == kw["hidden_size"] // kw["num_attention_heads"]:
        kw["head_dim"] = None  # the derived size, as our configs say it (we always write it out)
    kw["rms_norm_eps"] = r.field("rms_norm_eps", float)
    kw["tie_word_embeddings"] = r.field("tie_word_embeddings", bool)
    act = r.get(spec.activation_field, str, cls.hidden_act)
    if act != cls.hidden_act:
        raise r.error(
            f"unsupported {spec.activation_field}={act!r} (our {family.name} is tested with {cls.hidden_act} only)"
        )
    if spec.bias == "attention_bias":
        kw["qkv_bias"] = kw["o_bias"] = r.get("attention_bias", bool, False)
    r.only("attention_dropout", float, (0.0,), "attention dropout is not implemented")
    for name, allowed in spec.only.items():
        r.only(name, type(allowed[0]), allowed, f"implemented: {name}={allowed[0]!r}")
    kw.update(_rope(r, spec, kw["max_position_embeddings"]))
    kw.update(_windows(r, spec, kw["num_hidden_layers"]))
    kw.update(_gemma(r, spec))
    kw.update(_moe(r, spec))
    unknown = sorted(set(d) - r.seen - _NO_EFFECT - spec.no_effect - (_MOE_NO_EFFECT if spec.moe != "none" else set()))
    if unknown:
        more = f" (and {', '.join(map(repr, unknown[1:]))})" if len(unknown) > 1 else ""
        raise r.error(
            f"unsupported field {unknown[0]!r}{more}: our {family.name} does not implement it, and "
            "ignoring it could change the model"
        )
    return build_config(cls, kw, where)


# ---- writing -------------------------------------------------------------------------------------


def _rope_out(theta: float, s: RopeScaling, max_positions: int) -> dict:
    out: dict[str, Any] = {"rope_type": s.rope_type, "rope_theta": theta}
    for key in _ROPE_KEYS[s.rope_type]:
        value = getattr(s, key)
        if key == "original_max_position_embeddings":
            value = value or max_positions
        if value is not None:
            out[key] = value
    return out


def _number(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x  # transformers declares some of these int


# How the MoE layer runs and what it adds to the training loss beyond transformers' aux loss:
# no field of config.json, no change to the logits.
_MOE_OURS = {"moe_dispatch", "expert_parallel", "router_z_loss_coef"}


def _moe_out(spec: HfDecoder, c, out: dict) -> set[str]:
    """Writes the MoE fields of ``c`` into ``out``; returns the config fields they hold."""
    if spec.moe == "none":
        return set()
    out.update(
        num_experts_per_tok=c.num_experts_per_tok,
        router_aux_loss_coef=c.router_aux_loss_coef,
        output_router_logits=False,
    )
    held = {"num_experts", "num_experts_per_tok", "router_aux_loss_coef", *_MOE_OURS}
    if c.router_softmax == "after_topk" and c.norm_topk_prob:
        held.add("router_softmax")  # top-k then softmax is softmax then renormalised top-k
    if spec.moe == "mixtral":
        out.update(num_local_experts=c.num_experts, router_jitter_noise=0.0)
        return held
    out.update(
        num_experts=c.num_experts,
        moe_intermediate_size=c.ExpertMlp.size,
        norm_topk_prob=c.norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    held |= {"moe_intermediate_size", "norm_topk_prob"}
    if spec.moe == "qwen2":
        out["shared_expert_intermediate_size"] = c.shared_expert_intermediate_size
        held.add("shared_expert_intermediate_size")
    return held


def _write(spec: HfDecoder, family, c) -> dict:
    out: dict[str, Any] = {
        **{name: getattr(c, name) for name in _SIZES},
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.HeadSize.size,
        "rms_norm_eps": c.rms_norm_eps,
        "tie_word_embeddings": c.tie_word_embeddings,
        spec.activation_field: c.hidden_act,
        "attention_dropout": 0.0,
        **{name: allowed[0] for name, allowed in spec.only.items()},
    }
    held = {
        *_SIZES,
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "tie_word_embeddings",
        "hidden_act",
        "rope_theta",
        "rope_scaling",
        "remat",
    }
    if spec.bias == "attention_bias" and c.qkv_bias == c.o_bias:
        out["attention_bias"] = c.qkv_bias
        held |= {"qkv_bias", "o_bias"}
    local = c.local_layers
    types = ["sliding_attention" if x else "full_attention" for x in local]
    window_fields = {"sliding_window", "sliding_window_pattern", "layer_types"}
    if spec.windows == "all" and len(set(local)) == 1:
        out["sliding_window"] = c.sliding_window if local[0] else None
        held |= window_fields
    elif spec.windows == "qwen":
        leading = local.index(True) if any(local) else c.num_hidden_layers
        out.update(
            use_sliding_window=any(local),
            sliding_window=c.sliding_window if any(local) else None,
            max_window_layers=leading,
            layer_types=types,
        )
        held |= window_fields
    elif spec.windows == "layer_types":
        out.update(sliding_window=c.sliding_window, layer_types=types)
        held |= window_fields
    if spec.gemma:
        out.update(
            query_pre_attn_scalar=_number(c.query_pre_attn_scalar or c.HeadSize.size),
            final_logit_softcapping=c.final_logit_softcapping,
            attn_logit_softcapping=None,
        )
        held |= {"query_pre_attn_scalar", "final_logit_softcapping"}
        if spec.attn_softcap:
            out["attn_logit_softcapping"] = c.attn_logit_softcapping
            held.add("attn_logit_softcapping")
    held |= _moe_out(spec, c, out)
    rope = _rope_out(c.rope_theta, c.rope_scaling, c.max_position_embeddings)
    out["rope_theta"] = c.rope_theta
    if spec.nested_rope:
        local_theta = c.rope_local_base_freq or c.rope_theta
        local_rope = rope if c.rope_local_base_freq is None else {"rope_type": "default", "rope_theta": local_theta}
        out["rope_parameters"] = {"full_attention": rope, "sliding_attention": local_rope}
        held.add("rope_local_base_freq")
    else:
        out["rope_parameters"] = rope
    defaults = {f.name: f.default for f in dataclasses.fields(family.config_cls)}
    for name, default in defaults.items():
        if name not in held and getattr(c, name) != default:
            raise CheckpointFormatError(
                f"{type(c).__name__}.{name}={getattr(c, name)!r}: {family.architecture} has no such setting "
                f"({family.name} has {name}={default!r}); this model cannot be saved as model_type "
                f"{family.model_type!r}"
            )
    return out


# ---- Hugging Face layout ------------------------------------------------------------------
# Our parameter path -> the transformers tensor name; "{i}" is the layer, "{j}" an MoE layer's
# expert. The names are theirs, so the map is the identity under "model." (but for the router,
# which transformers calls "gate"); a model has the subset its config asks for. torch's
# nn.Linear stores its weight [out, in]: the transpose of our Linear's (In, Out) with each side
# flattened, e.g. q_proj [heads * head_size, embed]. OLMo 2's q/k norm weight over (heads,
# head_size) is stored flat, [heads * head_size].

_LAYER = [
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "pre_feedforward_layernorm.weight",
    "post_feedforward_layernorm.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    *(f"self_attn.{p}_proj.{w}" for p in "qkvo" for w in ("weight", "bias")),
]


def moe_hf_keys(block: str, experts: dict[str, str]) -> dict[str, str]:
    """An MoE layer's tensors, in the module ``block`` of a transformers layer: its router
    (``gate``), each expert ``{j}`` (``experts`` names our gate/up/down there) and the shared expert."""
    return {
        "layers.stacked.mlp.router.weight": f"model.layers.{{i}}.{block}.gate.weight",
        **{
            f"layers.stacked.mlp.experts.stacked.{p}.weight": f"model.layers.{{i}}.{block}.experts.{{j}}.{name}.weight"
            for p, name in experts.items()
        },
        **{
            f"layers.stacked.mlp.shared_expert.{p}.weight": f"model.layers.{{i}}.{block}.shared_expert.{p}_proj.weight"
            for p in ("gate", "up", "down")
        },
        "layers.stacked.mlp.shared_expert_gate.weight": f"model.layers.{{i}}.{block}.shared_expert_gate.weight",
    }


HF_LAYOUT = HfLayout(
    linear="out_in",
    base_prefix="model.",
    ignored=(r"\.rotary_emb\.inv_freq$",),  # a buffer some older checkpoints saved
    keys={
        "embed_tokens.weight": "model.embed_tokens.weight",
        **{f"layers.stacked.{name}": f"model.layers.{{i}}.{name}" for name in _LAYER},
        **{f"layers.stacked.mlp.{p}.weight": f"model.layers.{{i}}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")},
        **moe_hf_keys("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),  # Qwen2/3-MoE's names
        "norm.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight",  # untied only
    },
)

# Mixtral keeps its experts in "block_sparse_moe" and calls their gate, up and down w1, w3, w2.
MIXTRAL_HF_LAYOUT = HF_LAYOUT.with_keys(moe_hf_keys("block_sparse_moe", {"gate": "w1", "up": "w3", "down": "w2"}))
