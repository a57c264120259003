"""The console scripts' shared front: shipped configs by name, mappings on the command line that
replace the YAML's, and the one-line answer when the training extras are not installed."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from named.trainer.commands import cli
from named.trainer.config import load_config, read

ROOT = Path(__file__).resolve().parents[1]


def test_shipped_configs_are_the_repository_configs():
    assert read.shipped_configs() == sorted(p.stem for p in (ROOT / "config").glob("*.yaml"))
    assert Path(read.resolve_config("gpt2_nano")).read_text() == (ROOT / "config/gpt2_nano.yaml").read_text()
    assert read.resolve_config("gpt2_nano.yaml") == read.resolve_config("gpt2_nano")


def test_a_path_wins_over_a_shipped_name(tmp_path, monkeypatch):
    (tmp_path / "gpt2_nano").write_text("trainer: {num_train_steps: 3}\n")
    monkeypatch.chdir(tmp_path)
    assert read.resolve_config("gpt2_nano") == "gpt2_nano"


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
    "main, prog",
    [
        (cli.main_train, "named-train"),
        (cli.main_plan, "named-plan"),
        (cli.main_sample, "named-sample"),
        (cli.main_data, "named-data"),
    ],
)
def test_without_the_training_extras_one_line_says_what_to_install(monkeypatch, capsys, main, prog):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "draccus" else real(name, *a))
    assert main(["--config", "gpt2_nano"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {prog} needs the training extras (draccus not installed): pip install 'named-jax[train]'"]


def test_named_data_build_writes_the_cache_training_reads(tmp_path, capsys):
    cache = tmp_path / "cache"
    flags = ["--config", "gpt2_nano", "--data.cache_dir", str(cache), "--data.stdlib_bytes", "200000"]
    assert cli.main_data(["build", *flags]) == 0
    out = capsys.readouterr().out
    [built] = cache.iterdir()
    assert f"  {built}" in out.splitlines() and "train: " in out and "validation: " in out
    from named.trainer.data import build_data

    before = built.stat().st_mtime_ns
    cfg = load_config(read.resolve_config("gpt2_nano"), flags[2:])
    build_data(cfg.data)  # what named-train does first: the file is there, so it is only mapped
    assert list(cache.iterdir()) == [built] and built.stat().st_mtime_ns == before


@pytest.mark.parametrize(
    "argv, says",
    [
        (["build", "--config", "gpt2_nano", "--ray", "nonsense"], "--ray 'nonsense': give 'auto'"),
        (["build", "--config", "gpt2_nano", "--ray", "127.0.0.1:1"], "cannot reach the Ray cluster at '127.0.0.1:1'"),
        (["build", "--config", "gpt2_nano", "--data.train", "[/no/such/file.txt]"], "/no/such/file.txt"),
        (["bild", "--config", "gpt2_nano"], "invalid choice: 'bild'"),
    ],
)
def test_named_data_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, says):
    pytest.importorskip("ray") if "--ray" in argv else None
    assert cli.main_data([*argv, "--data.cache_dir", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err and "Traceback" not in err
    assert not (tmp_path / "c").exists()


def test_named_eval_without_lm_eval_says_what_to_install(monkeypatch, capsys, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a))
    assert cli.main_eval(["--checkpoint", str(tmp_path), "--tasks", "hellaswag"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: named-eval needs lm-evaluation-harness (lm_eval is not installed): pip install 'named-jax[eval]'"
    ]


def test_a_compilation_cache_gets_the_flag_its_programs_run_under(monkeypatch):
    from named import _compat

    assert jax.config.jax_compilation_cache_dir  # conftest turns the persistent cache on
    monkeypatch.setattr(_compat, "backends_initialized", lambda: False)  # as in a fresh process
    flags = "--xla_force_host_platform_device_count=8"
    assert _compat.cache_safe_xla_flags(flags).split() == [flags, _compat.CACHE_SAFE_CPU_FLAG]
    # the user's own choice stands, either way
    for choice in ("true", "false"):
        assert (
            _compat.cache_safe_xla_flags(f"{flags} --xla_cpu_enable_concurrency_optimized_scheduler={choice}") is None
        )
    monkeypatch.setattr(_compat, "backends_initialized", lambda: True)  # too late to change XLA's flags
    assert _compat.cache_safe_xla_flags(flags) is None


def test_several_cpu_devices_get_thread_pools_with_room_for_their_collectives(monkeypatch):
    """XLA:CPU's pools hold max(cores, devices) threads, too few for the collectives of 8 devices on
    2 cores (named._compat.collective_safe_env): a process that asks for several CPU devices gets
    PJRT_NPROC for 4 threads per device, or its cores if more; one the user sized keeps its size."""
    from named import _compat

    monkeypatch.setattr(_compat, "backends_initialized", lambda: False)  # as in a fresh process
    monkeypatch.setattr(_compat, "process_cpu_count", lambda: 2)
    flags = "--xla_cpu_use_fusion_emitters=false --xla_force_host_platform_device_count=8"
    assert _compat.collective_safe_env({"XLA_FLAGS": flags}) == {"PJRT_NPROC": "32"}
    assert _compat.collective_safe_env({"XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count=3"}) == {
        "PJRT_NPROC": "12"  # XLA takes the last of a repeated flag
    }
    monkeypatch.setattr(_compat, "process_cpu_count", lambda: 64)
    assert _compat.collective_safe_env({"XLA_FLAGS": flags}) == {"PJRT_NPROC": "64"}  # never fewer than the cores
    for sized in ({"PJRT_NPROC": "4"}, {"NPROC": "4"}):
        assert _compat.collective_safe_env({"XLA_FLAGS": flags, **sized}) == {}
    assert _compat.collective_safe_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}) == {}
    monkeypatch.setattr(_compat, "process_cpu_count", lambda: 2)
    assert _compat.collective_safe_env({"JAX_NUM_CPU_DEVICES": "4"}) == {"PJRT_NPROC": "16"}  # JAX's own setting
    assert _compat.collective_safe_env({"XLA_FLAGS": flags, "JAX_NUM_CPU_DEVICES": "2"}) == {
        "PJRT_NPROC": "8"
    }  # it wins
    assert _compat.collective_safe_env({"XLA_FLAGS": "--xla_cpu_use_fusion_emitters=false"}) == {}  # one device
    monkeypatch.setattr(_compat, "backends_initialized", lambda: True)  # too late: the pools exist
    assert _compat.collective_safe_env({"XLA_FLAGS": flags}) == {}


@pytest.mark.slow
@pytest.mark.procs
def test_a_second_launch_runs_from_a_warm_compilation_cache(tmp_path):
    """Programs XLA:CPU's concurrency-optimized scheduler made deadlock when loaded back from the
    persistent cache (named._compat.CACHE_SAFE_CPU_FLAG): with gpt2_nano on 8 devices every
    second launch aborted in an all-reduce. Both launches must now reach their last step."""
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "NPROC")},  # named-train sizes the pools
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax-cache"),
        # XLA's default code generation (the suite's fast_compile() hid the deadlock in 2 of 3 tries)
        # and a 5 s collective timeout instead of 40 s, so that a deadlock fails fast
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_cpu_collective_call_terminate_timeout_seconds=5",
        "JAX_PLATFORMS": "cpu",
    }
    args = ["--config", "gpt2_nano", "--trainer.num_train_steps", "3", "--trainer.log_interval", "1"]
    args += ["--trainer.eval_interval", "0", "--trainer.sample_interval", "0", "--trainer.progress_bar", "false"]
    args += ["--checkpoint.interval", "0"]
    # the run prints the XLA flags its programs compiled under: a deadlock shows in some launches only,
    # the missing flag in every one (named-train must add CACHE_SAFE_CPU_FLAG before JAX starts)
    main = (
        "import os, sys; from named.trainer.commands.cli import main_train; code = main_train(); "
        "print('PJRT_NPROC=' + os.environ.get('PJRT_NPROC', 'unset')); "
        "print('XLA_FLAGS=' + os.environ['XLA_FLAGS']); sys.exit(code)"
    )
    from named._compat import CACHE_SAFE_CPU_FLAG, COLLECTIVE_THREADS_PER_DEVICE, process_cpu_count

    threads = max(process_cpu_count(), COLLECTIVE_THREADS_PER_DEVICE * 8)

    for launch in ("cold", "warm"):
        run = [*args, "--trainer.run_dir", str(tmp_path / launch)]
        p = subprocess.run([sys.executable, "-c", main, *run], env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, f"{launch} launch: exit {p.returncode}\n{p.stderr[-2000:]}"
        assert p.stdout.count("loss=") == 3, p.stdout
        assert CACHE_SAFE_CPU_FLAG in p.stdout.split("XLA_FLAGS=")[-1].split(), p.stdout
        assert f"PJRT_NPROC={threads}\n" in p.stdout, p.stdout  # set before JAX started (it reads it then)
        if launch == "cold":
            assert any(f.name.startswith("jit_step") for f in (tmp_path / "jax-cache").iterdir())
