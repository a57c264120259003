"""How a config key is declared: its dataclass field says its type and default, and ``key(...)``
adds the rest (the values it may take beyond its type, whether a resumed run may change it, one
line of doc) as the field's metadata. The sections are declared in ``sections``; everything else
about keys is derived from these declarations (``train_config``): the rules table, the keys a
resume may change, the docs' keys table. ``ConfigError``, the error every config check raises,
lies in ``errors``."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError


@dataclass(frozen=True)
class Rule:
    """What a value may be beyond its type: a range (numbers), a set of names (strings), or
    non-empty (strings, lists). A null, where the annotation allows one, always passes."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    names: tuple[str, ...] = ()
    nonempty: bool = False

    def _empty(self, value) -> bool:
        return self.nonempty and not (value.strip() if isinstance(value, str) else len(value) > 0)

    def allows(self, value) -> bool:
        if self._empty(value):
            return False
        if self.names:  # a list (trainer.stop_signals): each of its items
            return all(v in self.names for v in value) if isinstance(value, list) else value in self.names
        if self.nonempty:
            return True
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        return self.high is None or value < self.high or (not self.high_open and value == self.high)

    def check(self, value, key: str) -> None:
        """Raise ConfigError naming ``key`` (a config key or a CLI flag) unless the rule allows ``value``."""
        if value is not None and self._empty(value):
            raise ConfigError(f"{key} must be non-empty, got {value!r}")
        if value is not None and not self.allows(value):
            raise ConfigError(f"{key} must be {self}, got {value!r}")

    def __str__(self) -> str:
        if self.names:
            return "one of " + ", ".join(self.names) + (" (at least one)" if self.nonempty else "")
        if self.nonempty:
            return "non-empty"
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {_number(self.low)}"
        low, high = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"in {low}{_number(self.low)}, {_number(self.high)}{high}"


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def at_least(n: float) -> Rule:
    return Rule(low=n)


def above(n: float) -> Rule:
    return Rule(low=n, low_open=True)


def between(low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> Rule:
    return Rule(low=low, high=high, low_open=low_open, high_open=high_open)


def one_of(*names: str) -> Rule:
    return Rule(names=names)


NONEMPTY = Rule(nonempty=True)
INT_LIMIT = 2**31 - 1  # every integer without a range of its own (JAX's default integer is int32)


@dataclass(frozen=True)
class Key:
    """What a config key is beyond its annotation.

    Args:
        doc: one line for the docs' keys table and ``--help``.
        rule: the values it may take beyond its type (None: any value of its type).
        free: a resumed run may change it (layout, cadence, bookkeeping); every other key defines
            the training trajectory and must match the run's config.yaml.
    """

    doc: str
    rule: Rule | None = None
    free: bool = False


_METADATA = "named.config.key"


def key(
    default: Any = dataclasses.MISSING,
    rule: Rule | None = None,
    *,
    doc: str,
    free: bool = False,
    factory: Callable[[], Any] | None = None,
) -> Any:
    """A dataclass field declared as a config key: ``seed: int = key(0, between(0, 2**32 - 1), doc=...)``.
    ``factory`` makes a mutable default (a list, a mapping)."""
    declared = {_METADATA: Key(doc, rule, free)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=declared)
    return dataclasses.field(default=default, metadata=declared)


def declared(f: dataclasses.Field) -> Key | None:
    """The Key a field was declared with (``key``), None for a field declared without one."""
    return f.metadata.get(_METADATA)
