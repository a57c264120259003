"""The values each config key may take beyond its type: one table (``RULES``) of ranges, names
and non-empty lists, and the error every config check raises. ``config`` checks the values
against it; docs/trainer.md prints it (``config.rules_table``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from named import NamedError


class ConfigError(NamedError, ValueError):
    """A configuration key is unknown, missing or has a bad value; the message names it."""


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

    def allows(self, value) -> bool:
        if self.names:  # a list (trainer.stop_signals): each of its items
            return all(v in self.names for v in value) if isinstance(value, list) else value in self.names
        if self.nonempty:
            return len(value) > 0
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        return self.high is None or value < self.high or (not self.high_open and value == self.high)

    def check(self, value, key: str) -> None:
        """Raise ConfigError naming ``key`` (a config key or a CLI flag) unless the rule allows ``value``."""
        if value is not None and not self.allows(value):
            raise ConfigError(f"{key} must be {self}, got {value!r}")

    def __str__(self) -> str:
        if self.names:
            return "one of " + ", ".join(self.names)
        if self.nonempty:
            return "non-empty"
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {_number(self.low)}"
        return f"in {'(' if self.low_open else '['}{_number(self.low)}, {_number(self.high)}{')' if self.high_open else ']'}"


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
MODEL_INTEGERS = "model.<every integer>"  # layers, widths, heads, positions, vocab_size (null: the tokenizer's)

# The allowed values of every key beyond its type, in one place: docs/trainer.md shows this
# table (a test keeps the two equal). On top of it: every number must be finite, and the rules
# that tie two keys together are in validate_static; the data section checks its own keys
# (DataError), and the checks that need devices or the model's shapes are in checks.py.
RULES: dict[str, Rule] = {
    "trainer.num_train_steps": at_least(0),  # 0: every check runs, nothing is trained or written
    "trainer.train_batch_size": at_least(1),
    "trainer.microbatches": at_least(1),
    "trainer.seed": between(0, 2**32 - 1),  # jax.random.key keeps 32 bits: 2**32 would be seed 0 again
    "trainer.eval_interval": at_least(0),
    "trainer.eval_batches": at_least(0),
    "trainer.sample_interval": at_least(0),
    "trainer.sample_tokens": at_least(0),
    "trainer.log_interval": at_least(0),
    "trainer.run_dir": NONEMPTY,
    "trainer.nan_policy": one_of("stop", "skip"),
    "trainer.peak_flops_per_device": above(0),
    "trainer.loss_block_size": at_least(1),  # and a divisor of the vocab size (checks.check_loss_block)
    "trainer.stop_signals": one_of("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP"),
    MODEL_INTEGERS: at_least(1),
    "model.dropout": between(0, 1, high_open=True),
    "model.layer_norm_epsilon": above(0),
    "model.rms_norm_eps": above(0),
    "model.rope_theta": above(0),
    "optimizer.learning_rate": above(0),
    "optimizer.weight_decay": at_least(0),
    "optimizer.beta1": between(0, 1, high_open=True),
    "optimizer.beta2": between(0, 1, high_open=True),
    "optimizer.epsilon": above(0),
    "optimizer.max_grad_norm": above(0),
    "optimizer.schedule": one_of("cosine", "linear", "constant", "wsd"),
    "optimizer.warmup_steps": at_least(0),
    "optimizer.decay_fraction": between(0, 1, low_open=True),
    "optimizer.min_lr_ratio": between(0, 1),
    "data.train": NONEMPTY,
    "checkpoint.interval": at_least(0),
    "checkpoint.keep_last": at_least(1),
    "checkpoint.keep_every": at_least(1),
    "checkpoint.every_minutes": above(0),
    "checkpoint.base": NONEMPTY,
    "tracker.wandb_mode": one_of("disabled", "offline", "online"),
    "mesh.mode": one_of("auto", "explicit"),
    "mesh.batch_split": at_least(1),
    "distributed.num_processes": at_least(1),
    "distributed.process_id": at_least(0),
    "distributed.initialization_timeout_s": at_least(1),
    "distributed.heartbeat_timeout_s": at_least(1),
    "quantization.kind": one_of("none", "fp8", "int8"),
    "quantization.targets": NONEMPTY,  # null: every Linear
    "quantization.amax_history": at_least(1),
    "lora.rank": at_least(1),  # and at most every targeted layer's smaller side (model_init)
    "lora.alpha": above(0),
    "lora.dropout": between(0, 1, high_open=True),
    "lora.targets": NONEMPTY,
    "lora.base_dtype": one_of("float32", "bfloat16"),
}


def _rule(key: str, value) -> Rule | None:
    if key in RULES:
        return RULES[key]
    if key.startswith("model.") and isinstance(value, int) and not isinstance(value, bool):
        return RULES[MODEL_INTEGERS]
    return None
