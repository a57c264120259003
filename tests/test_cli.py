"""The console scripts' shared front: shipped configs by name, mappings on the command line that
replace the YAML's, and the one-line answer when the training extras are not installed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from named.trainer.commands import cli
from named.trainer.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def test_shipped_configs_are_the_repository_configs():
    assert cli.shipped_configs() == sorted(p.stem for p in (ROOT / "config").glob("*.yaml"))
    assert Path(cli.resolve_config("gpt2_nano")).read_text() == (ROOT / "config/gpt2_nano.yaml").read_text()
    assert cli.resolve_config("gpt2_nano.yaml") == cli.resolve_config("gpt2_nano")


def test_a_path_wins_over_a_shipped_name(tmp_path, monkeypatch):
    (tmp_path / "gpt2_nano").write_text("trainer: {num_train_steps: 3}\n")
    monkeypatch.chdir(tmp_path)
    assert cli.resolve_config("gpt2_nano") == "gpt2_nano"


def test_unknown_config_names_the_choices(capsys):
    assert cli.main_plan(["--config", "gpt5_nano"]) == 2
    err = capsys.readouterr().err
    assert "gpt5_nano" in err and "gpt2_nano_fsdp" in err
    assert cli.main_train(["--config", "gpt2_nano", "--config_path", str(ROOT / "config/gpt2_nano.yaml")]) == 2
    assert "not both" in capsys.readouterr().err


@pytest.mark.parametrize(
    "override, expected",
    [
        (["--mesh.param_mapping", "{}"], {}),  # FSDP -> DP: draccus alone would have kept embed: data
        (["--mesh.param_mapping={mlp: data}"], {"mlp": "data"}),
        ([], {"embed": "data"}),
    ],
)
def test_a_mapping_on_the_command_line_replaces_the_yaml(override, expected):
    cfg = load_config(ROOT / "config/gpt2_nano_fsdp.yaml", override)
    assert cfg.mesh.param_mapping == expected
    assert cfg.mesh.compute_mapping == {"batch": "data"}  # untouched


def test_replaced_mappings_are_still_checked(capsys):
    code = cli.main_plan(["--config", "gpt2_nano_fsdp", "--mesh.param_mapping", "{embed: nowhere}"])
    assert code == 2 and "nowhere" in capsys.readouterr().err
    assert cli.main_plan(["--config", "gpt2_nano_fsdp", "--mesh.compute_mapping", "[batch]"]) == 2
    assert "--mesh.compute_mapping" in capsys.readouterr().err


@pytest.mark.parametrize(
    "main, prog", [(cli.main_train, "named-train"), (cli.main_plan, "named-plan"), (cli.main_sample, "named-sample")]
)
def test_without_the_training_extras_one_line_says_what_to_install(monkeypatch, capsys, main, prog):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "draccus" else real(name, *a))
    assert main(["--config", "gpt2_nano"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {prog} needs the training extras (draccus not installed): pip install 'named-jax[train]'"]


def test_named_eval_without_lm_eval_says_what_to_install(monkeypatch, capsys, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a))
    assert cli.main_eval(["--checkpoint", str(tmp_path), "--tasks", "hellaswag"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: named-eval needs lm-evaluation-harness (lm_eval is not installed): pip install 'named-jax[eval]'"
    ]
