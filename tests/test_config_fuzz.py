"""Seeded random mutations of the shipped configs, fed to the CLI as a user would feed them.

Each case takes one file of config/, applies one mutation (a value of the wrong type, a number
out of range, NaN or infinity, a missing key or section, a key or section given twice, an unknown
key) and runs ``named-plan`` and, for the configs sized for a CPU, ``named-train
--trainer.num_train_steps 0`` in this process (through the console scripts' main functions).
Every run must end in exit 0, or exit 2 with one ``error: ...`` line from one of our exception
types; never an uncaught exception or a traceback, never a compile, never a run directory left
behind. Where the mutation is certainly wrong (wrong type, NaN, duplicate, unknown, no model)
the run must fail and name the key. Two cases run the console scripts in a subprocess.
"""

from __future__ import annotations

import copy
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from _chat_folder import make_chat_folder
from _procs import xla_flags
from test_bad_input import no_compile  # noqa: F401 (autouse: nothing compiles)

from named.trainer.commands import cli

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "config").glob("*.yaml"))
CPU_SIZED = {"gpt2_nano.yaml", "gpt2_nano_fsdp.yaml", "gpt2_nano_fsdp_tp.yaml", "llama_tiny.yaml"}
KINDS = ("wrong type", "out of range", "not finite", "missing", "duplicate", "unknown key")
CASES = len(CONFIGS) * len(KINDS) + 6  # the first len(CONFIGS) * len(KINDS) cover every (config, kind) pair once
CORPUS = "\n".join(f"def f_{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(600))
# Keys whose default would send a case elsewhere (the whole standard library, runs/default):
# they are set per case and never deleted.
PINNED = {("trainer", "run_dir"), ("data", "train"), ("data", "cache_dir")}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("fuzz-corpus")
    (d / "code.txt").write_text(CORPUS)
    make_chat_folder(d / "tiny-llama")  # the folder the fine-tuning configs start from
    return d


def _base(path: Path, corpus: Path, run_dir: Path) -> dict:
    d = yaml.safe_load(path.read_text())
    d["trainer"].update(run_dir=str(run_dir), progress_bar=False)
    d["data"].update(train=[str(corpus / "code.txt")], cache_dir=str(corpus / "cache"))
    if "init_from_hf" in d["model"]:
        d["model"]["init_from_hf"] = str(corpus / "tiny-llama")
        d["data"]["seq_len"] = 32  # the tiny model's 64 positions
    return d


def _leaves(d: dict, path: tuple = ()) -> list[tuple[tuple, object]]:
    out = []
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out += _leaves(v, path + (k,))
        else:
            out.append((path + (k,), v))
    return out


def _set(d: dict, path: tuple, value) -> None:
    for k in path[:-1]:
        d = d[k]
    d[path[-1]] = value


def _wrong_values(path: tuple, value) -> list:
    """Values that no annotation of this leaf can accept (judged from the shipped value's type)."""
    if isinstance(value, bool):
        return ["maybe", 1, [True], 0.5]
    if isinstance(value, int):
        return ["many", True, [1], {"a": 1}, 2.5, math.nan]
    if isinstance(value, float):
        return ["fast", True, [0.1], {"a": 1}]
    if isinstance(value, str):
        mapping_value = path[0] == "mesh"  # a mapping value may be a list of mesh axes
        return [7, True, {"k": "v"}] + ([] if mapping_value else [["x"]])
    if isinstance(value, list):
        return ["stdlib", 3, {"a": 1}]
    return []


def mutate(d: dict, kind: str, rng: random.Random) -> tuple[str, str | None]:
    """Mutate ``d`` (or return YAML text) -> (the YAML text, a key the error must name or None
    when either outcome is fine)."""
    leaves = [(p, v) for p, v in _leaves(d) if p[:2] not in PINNED]
    if kind == "wrong type":
        path, value = rng.choice([(p, v) for p, v in leaves if _wrong_values(p, v)])
        _set(d, path, rng.choice(_wrong_values(path, value)))
        return yaml.safe_dump(d, sort_keys=False), ".".join(path)
    if kind == "out of range":
        path, _ = rng.choice([(p, v) for p, v in leaves if isinstance(v, (int, float)) and not isinstance(v, bool)])
        _set(d, path, rng.choice([-1, 0, -(10**6), 10**12, -0.5, 1e300]))
        return yaml.safe_dump(d, sort_keys=False), None
    if kind == "not finite":
        path, _ = rng.choice([(p, v) for p, v in leaves if isinstance(v, (int, float)) and not isinstance(v, bool)])
        _set(d, path, rng.choice([math.nan, math.inf, -math.inf]))
        return yaml.safe_dump(d, sort_keys=False), ".".join(path)
    if kind == "missing":
        if rng.random() < 0.3:
            section = rng.choice([s for s in d if s not in ("data", "trainer")])  # they hold PINNED keys
            del d[section]
            return yaml.safe_dump(d, sort_keys=False), "model" if section == "model" else None
        path, _ = rng.choice(leaves)
        parent = d
        for k in path[:-1]:
            parent = parent[k]
        del parent[path[-1]]
        return yaml.safe_dump(d, sort_keys=False), "model" if path[:2] == ("model", "type") else None
    if kind == "duplicate":
        section = rng.choice(list(d))
        if rng.random() < 0.3:  # the whole section again, at the end
            return yaml.safe_dump(d, sort_keys=False) + yaml.safe_dump({section: d[section]}, sort_keys=False), section
        key = rng.choice(list(d[section]))
        lines = yaml.safe_dump(d, sort_keys=False).splitlines()
        at = lines.index(f"{section}:") + 1
        again = yaml.safe_dump({key: d[section][key]}, sort_keys=False).splitlines()
        return "\n".join(lines[:at] + ["  " + line for line in again] + lines[at:]) + "\n", f"{section}.{key}"
    assert kind == "unknown key"
    section = rng.choice(list(d) + ["trainr"])
    name = rng.choice(["frobnicate", "num_steps", "lr", "typo_key"])
    if section == "trainr":
        d["trainr"] = {"seed": 1}
        return yaml.safe_dump(d, sort_keys=False), "trainr"
    d[section][name] = rng.choice([1, "x", True])
    return yaml.safe_dump(d, sort_keys=False), f"{section}.{name}"


def _run(main, args: list[str], capsys, monkeypatch) -> tuple[int, str, BaseException | None]:
    """(exit code, stderr, the exception the CLI reported) of one in-process run."""
    failed: list[BaseException] = []
    real_fail = cli.report_failure

    def spy(e, code=2):
        failed.append(e)
        return real_fail(e, code)

    monkeypatch.setattr(cli, "report_failure", spy)
    code = main(args)  # an uncaught exception fails the test here
    return code, capsys.readouterr().err, failed[-1] if failed else None


def _check(code: int, stderr: str, err: BaseException | None, expect: str | None, what: str) -> None:
    assert code in (0, 2), (what, code, err)
    assert "Traceback" not in stderr, (what, stderr)
    if code == 2:
        assert err is not None and type(err).__module__.split(".")[0] == "named", (what, type(err), err)
        assert stderr.count("error: ") == 1 and f"error: {err}" in stderr, (what, stderr)
    if expect is not None:
        assert code == 2 and expect in str(err), (what, expect, err)


@pytest.mark.parametrize("case", range(CASES))
def test_mutated_config(corpus, tmp_path, capsys, monkeypatch, case):
    rng = random.Random(case)
    config = CONFIGS[case % len(CONFIGS)]
    kind = KINDS[(case // len(CONFIGS)) % len(KINDS)]
    run_dir = tmp_path / "run"
    d = _base(config, corpus, run_dir)
    text, expect = mutate(copy.deepcopy(d), kind, rng)
    path = tmp_path / config.name
    path.write_text(text)
    what = f"{config.name}, {kind}: expect {expect}\n{text}"

    code, stderr, err = _run(cli.main_plan, ["--config_path", str(path)], capsys, monkeypatch)
    _check(code, stderr, err, expect, "named-plan " + what)
    assert not run_dir.exists()
    if config.name in CPU_SIZED:
        # the CLI's num_train_steps replaces the file's, so a mutation of that key decides nothing here
        masked = expect == "trainer.num_train_steps" and kind != "duplicate"
        code, stderr, err = _run(
            cli.main_train, ["--config_path", str(path), "--trainer.num_train_steps", "0"], capsys, monkeypatch
        )
        _check(code, stderr, err, None if masked else expect, "named-train " + what)
        assert not run_dir.exists()


def test_the_cases_cover_every_kind_and_config():
    pairs = {(CONFIGS[i % len(CONFIGS)].name, KINDS[(i // len(CONFIGS)) % len(KINDS)]) for i in range(CASES)}
    assert len(pairs) == len(CONFIGS) * len(KINDS)


def test_the_unmutated_configs_pass(corpus, tmp_path, capsys, monkeypatch):
    # the control: every failure above comes from its mutation
    for config in CONFIGS:
        path = tmp_path / config.name
        path.write_text(yaml.safe_dump(_base(config, corpus, tmp_path / "run"), sort_keys=False))
        assert _run(cli.main_plan, ["--config_path", str(path)], capsys, monkeypatch)[0] == 0, config
        if config.name in CPU_SIZED:
            args = ["--config_path", str(path), "--trainer.num_train_steps", "0"]
            assert _run(cli.main_train, args, capsys, monkeypatch)[0] == 0, config
    assert not (tmp_path / "run").exists()


def test_every_config_passes_the_explicit_mode_checks(corpus, tmp_path, capsys, monkeypatch):
    # named-plan traces the model's loss and its gradient with the layer stack run per device
    # (checks.check_activations), on abstract shapes: every shipped layout (FSDP, FSDP+TP, expert
    # parallel, LoRA) is one explicit mode drives, at the config's real size
    for config in CONFIGS:
        path = tmp_path / config.name
        path.write_text(yaml.safe_dump(_base(config, corpus, tmp_path / "run"), sort_keys=False))
        code, out = _run(cli.main_plan, ["--config_path", str(path), "--mesh.mode", "explicit"], capsys, monkeypatch)[
            :2
        ]
        assert code == 0, (config, out)


# a duplicate-key case of gpt2_nano and an unknown-key case of llama_tiny (both CPU-sized)
_NANO, _TINY = [c.name for c in CONFIGS].index("gpt2_nano.yaml"), [c.name for c in CONFIGS].index("llama_tiny.yaml")


@pytest.mark.parametrize(
    "script, case",
    [
        ("named-plan", len(CONFIGS) * KINDS.index("duplicate") + _NANO),
        ("named-train", len(CONFIGS) * KINDS.index("unknown key") + _TINY),
    ],
)
@pytest.mark.procs
def test_console_scripts(corpus, tmp_path, script, case):
    # one duplicate-key case and one unknown-key case, through the installed console scripts
    rng = random.Random(case)
    config = CONFIGS[case % len(CONFIGS)]
    kind = KINDS[(case // len(CONFIGS)) % len(KINDS)]
    assert kind in ("duplicate", "unknown key")
    run_dir = tmp_path / "run"
    text, expect = mutate(_base(config, corpus, run_dir), kind, rng)
    path = tmp_path / config.name
    path.write_text(text)
    env = {**os.environ, "XLA_FLAGS": xla_flags(8), "JAX_PLATFORMS": "cpu"}
    extra = ["--trainer.num_train_steps", "0"] if script == "named-train" else []
    r = subprocess.run(
        [str(Path(sys.executable).parent / script), "--config_path", str(path), *extra],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.startswith("error: ") and expect in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert not run_dir.exists()
