"""A run's layout: the keys of a config that decide how a run is laid out over the devices and
what it keeps in memory, as one value named with the keys' own words. ``named-plan --search``
varies it (a search candidate is a ``Layout`` and its measurements), the layout explorer lets a
user change it, and ``mesh.layout: auto`` writes the one it picks into the config
(``Layout.apply``), which the run's config.yaml records."""

from __future__ import annotations

import dataclasses
from typing import Any

import yaml

from .rules import ConfigError
from .sections import mesh_mapping

# each field of a Layout, and the config key it is
KEYS = {
    "mesh_shape": "mesh.shape",
    "compute_mapping": "mesh.compute_mapping",
    "param_mapping": "mesh.param_mapping",
    "remat": "model.remat",
    "microbatches": "trainer.microbatches",
    "loss_block_size": "trainer.loss_block_size",
    "mode": "mesh.mode",
    "gather": "mesh.gather",
}
_MAPS = ("mesh_shape", "compute_mapping", "param_mapping")  # dicts, held as tuples of pairs


def _frozen(value) -> tuple:
    """A dict or pairs as pairs, each list of mesh axes a tuple (``mesh_mapping``, the config's own)."""
    return tuple(mesh_mapping(dict(value)).items())


@dataclasses.dataclass(frozen=True)
class Layout:
    """The config keys ``KEYS`` names, one field each. The mesh shape and the mappings may be given
    as dicts; they are held as tuples of pairs (a list of mesh axes as a tuple), so a layout is
    hashable and plans can be cached by it."""

    mesh_shape: tuple[tuple[str, int], ...]
    compute_mapping: tuple[tuple[str, Any], ...]
    param_mapping: tuple[tuple[str, Any], ...]
    remat: str = "none"
    microbatches: int = 1
    loss_block_size: int | None = None
    mode: str = "auto"
    gather: str = "auto"

    def __post_init__(self):
        for name in _MAPS:
            object.__setattr__(self, name, _frozen(getattr(self, name)))

    @classmethod
    def of(cls, cfg) -> Layout:
        """The layout ``cfg`` (a TrainConfig) sets; a model family without remat has ``none``."""

        def read(key: str):
            section, name = key.split(".")
            return getattr(getattr(cfg, section), name, "none")

        return cls(**{f: read(key) for f, key in KEYS.items()})

    def replace(self, **changes) -> Layout:
        """This layout with some fields changed (a ConfigError naming an unknown field)."""
        unknown = sorted(set(changes) - set(KEYS))
        if unknown:
            raise ConfigError(f"unknown layout field(s) {unknown}: a layout has {', '.join(KEYS)}")
        return dataclasses.replace(self, **changes)

    def fields(self) -> dict[str, Any]:
        """Every field by name, the mesh shape and the mappings as dicts (a list of mesh axes as a
        list), as a config file writes them."""
        return {
            f: {k: list(v) if isinstance(v, tuple) else v for k, v in getattr(self, f)}
            if f in _MAPS
            else getattr(self, f)
            for f in KEYS
        }

    def overrides(self) -> dict[str, Any]:
        """The config keys this layout sets, dotted (``mesh.shape``, ``trainer.loss_block_size``, ...),
        with their values as ``fields`` gives them."""
        return {KEYS[f]: value for f, value in self.fields().items()}

    def flags(self) -> list[str]:
        """``overrides`` as command-line flags, each value in YAML's flow style as a flag's text is
        read (``--mesh.shape '{data: 8}' --mesh.mode explicit ...``): given to ``named-train`` after a
        config's own, they train it with this layout (what ``apply`` makes)."""

        def text(value) -> str:  # a lone scalar's dump ends with YAML's document-end marker
            return (
                yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=2**31)
                .removesuffix("\n")
                .removesuffix("\n...")
            )

        return [x for key, value in self.overrides().items() for x in (f"--{key}", text(value))]

    def apply(self, cfg):
        """``cfg`` (a TrainConfig) with this layout (``overrides``), checked as ``load_config``
        checks a config (each key against its declaration, then the rules that tie keys together):
        a bad value is a ConfigError naming its key."""
        from . import validate_static
        from .check import check_section

        sections: dict[str, dict[str, Any]] = {}
        for key, value in self.overrides().items():
            section, name = key.split(".")
            sections.setdefault(section, {})[name] = value
        out = dataclasses.replace(
            cfg, **{section: dataclasses.replace(getattr(cfg, section), **kv) for section, kv in sections.items()}
        )
        check_section(type(out), out, "")
        validate_static(out)
        return out
