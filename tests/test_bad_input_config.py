"""The configuration's one validation layer and the CLI boundary.

Each bad value is refused with one of our exceptions naming the key (or flag, or path), before
anything is compiled (the compile listener of test_bad_input counts zero) and with no run
directory created. Types are checked against the dataclass annotations (``true`` is not an
integer, null only where the annotation allows it), ranges against an independent table of
what each key may be (below, written from the spec, not from the declarations), YAML files for
keys given twice, and the checks that need the model's shapes (a compute mapping that puts two
axes of one activation on one mesh axis) run in ``named-plan`` exactly as in ``named-train``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_bad_input import NANO, _args, _fails, _save_run, files, no_compile  # noqa: F401 (fixtures)

from named.trainer.checkpoint import CheckpointError, rundir
from named.trainer.commands import cli
from named.trainer.config import RULES, ConfigError, declarations, dump_config, keys_table, load_config
from named.trainer.data import DataError
from named.trainer.loop import distributed as dist

ROOT = Path(__file__).resolve().parents[1]
LLAMA = ROOT / "config/llama_tiny.yaml"


# ---- types: YAML files -----------------------------------------------------------------------

YAML = {
    "true for an integer": (
        "trainer:\n  num_train_steps: true\n",
        r"trainer\.num_train_steps must be an integer, got true",
    ),
    "false for a number": (
        "optimizer:\n  learning_rate: false\n",
        r"optimizer\.learning_rate must be a number, got false",
    ),
    "true for a model integer": (
        "model:\n  type: gpt2\n  n_layer: true\n",
        r"model\.n_layer must be an integer, got true",
    ),
    "integer for a boolean": ("trainer:\n  progress_bar: 1\n", r"trainer\.progress_bar must be true or false, got 1"),
    "integer for a string": ("trainer:\n  sample_prompt: 5\n", r"trainer\.sample_prompt must be a string, got 5"),
    "null for a string": ("trainer:\n  run_dir: null\n", r"trainer\.run_dir must be a string, got null"),
    "empty value for a boolean": (
        "checkpoint:\n  save_at_end:\n",
        r"checkpoint\.save_at_end must be true or false, got null",
    ),
    "null for a mapping": ("mesh:\n  shape: null\n", r"mesh\.shape must be a mapping of names to integers, got null"),
    "string for a list": (
        "data:\n  train: stdlib\n",
        r"data\.train must be a list of strings or mappings, got 'stdlib'",
    ),
    "integer in a list of strings": (
        "data:\n  train: [stdlib, 3]\n",
        r"data\.train\[1\] must be a string or a mapping .*, got 3",
    ),
    "true in a list of integers": (
        "distributed:\n  local_device_ids: [0, true]\n",
        r"distributed\.local_device_ids\[1\]",
    ),
    "true for a mesh size": ("mesh:\n  shape: {data: true}\n", r"mesh\.shape\.data must be an integer, got true"),
    "no space after the colon": (
        "mesh:\n  shape: {model:2}\n",
        r"mesh\.shape\.model:2 must be an integer, got null.*\{model: 2\}",
    ),
    "nan": ("optimizer:\n  learning_rate: .nan\n", r"optimizer\.learning_rate must be a finite number, got nan"),
    "inf": ("optimizer:\n  epsilon: .inf\n", r"optimizer\.epsilon must be a finite number, got inf"),
    "-inf": ("optimizer:\n  weight_decay: -.inf\n", r"optimizer\.weight_decay must be a finite number, got -inf"),
    "nan in the model": ("model:\n  type: gpt2\n  dropout: .nan\n", r"model\.dropout must be a finite number"),
    "empty run_dir": ("trainer:\n  run_dir: ''\n", r"trainer\.run_dir must be non-empty"),
    "empty data.train": ("data:\n  train: []\n", r"data\.train must be non-empty"),
    "an integer past int32": (
        "model:\n  type: gpt2\n  n_positions: 1000000000000\n",
        r"model\.n_positions must be at most 2147483647 in size.*1000000000000",
    ),
    "a negative integer past int32": (
        "trainer:\n  log_interval: -9223372036854775808\n",
        r"trainer\.log_interval must be at most",
    ),
    "seed past 32 bits": (
        "trainer:\n  seed: 4294967296\n",
        r"trainer\.seed must be in \[0, 4294967295\], got 4294967296",
    ),
    "duplicate key": (
        "trainer:\n  seed: 1\n  log_interval: 3\n  seed: 2\n",
        r"key trainer\.seed is given twice, at lines 2 and 4",
    ),
    "duplicate model key": (
        "model:\n  type: gpt2\n  n_layer: 2\n  n_layer: 3\n",
        r"key model\.n_layer is given twice, at lines 3 and 4",
    ),
    "duplicate section": (
        "trainer:\n  seed: 1\nmodel:\n  type: gpt2\ntrainer:\n  seed: 2\n",
        r"section trainer is given twice, at lines 1 and 5",
    ),
    "duplicate in a flow mapping": ("mesh:\n  shape: {data: 2, data: 4}\n", r"key mesh\.shape\.data is given twice"),
    "no model section": (
        "trainer:\n  seed: 1\n",
        r"model: missing.*`model: \{type: gpt2, \.\.\.\}`.*registered types: gpt2, llama",
    ),
    "model without a type": ("model:\n  n_layer: 2\n", r"model\.type missing.*registered types: gpt2, llama"),
    "unregistered model type": ("model:\n  type: [gpt2]\n", r"model\.type \['gpt2'\] is not a registered model type"),
    "unknown key, with a suggestion": (
        "trainer:\n  num_train_step: 3\n",
        r"trainer\.num_train_step is not a key of the trainer section; did you mean trainer\.num_train_steps\?",
    ),
    "unknown model key": ("model:\n  type: llama\n  n_layer: 2\n", r"model\.n_layer is not a key of the model section"),
    "draccus' !include is not safe YAML": ("trainer: !include other.yaml\n", r"not valid YAML.*'!include'"),
    "a Python tag": ("trainer:\n  seed: !!python/name:os.getcwd\n", r"not valid YAML"),
}


@pytest.mark.parametrize("name", list(YAML))
def test_yaml_values(tmp_path, name):
    text, match = YAML[name]
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    _fails(ConfigError, match, load_config, path)


def test_duplicate_keys_name_the_file(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text(NANO.read_text() + "trainer:\n  seed: 3\n")
    err = _fails(ConfigError, r"section trainer is given twice", load_config, path)
    assert str(path) in str(err)


def test_a_yaml_anchor_merge_is_not_a_duplicate(tmp_path):
    # `<<:` repeats keys by design; the later key wins over the merged one, as YAML says
    path = tmp_path / "merge.yaml"
    path.write_text(NANO.read_text().replace("optimizer:\n", "optimizer:\n  <<: {learning_rate: 0.5, beta1: 0.8}\n"))
    cfg = load_config(path)
    assert (cfg.optimizer.learning_rate, cfg.optimizer.beta1) == (0.002, 0.8)


# ---- types: CLI overrides ------------------------------------------------------------------

CLI = {
    "true for an integer": (
        ["--trainer.num_train_steps", "true"],
        r"trainer\.num_train_steps must be an integer, got true",
    ),
    "nan": (["--optimizer.learning_rate", "nan"], r"optimizer\.learning_rate must be a finite number, got nan"),
    "inf": (["--optimizer.max_grad_norm", "inf"], r"optimizer\.max_grad_norm must be a finite number, got inf"),
    "a mapping with a null value": (["--mesh.shape", "{model:2}"], r"mesh\.shape\.model"),
    "null for an integer": (["--trainer.seed", "null"], r"trainer\.seed must be an integer, got null"),
    "empty data.train": (["--data.train", "[]"], r"data\.train must be non-empty"),
    "empty run_dir": (["--trainer.run_dir", ""], r"trainer\.run_dir must be non-empty"),
    "num_processes 0": (["--distributed.num_processes", "0"], r"distributed\.num_processes must be >= 1, got 0"),
    "a mapping key that is no name": (["--mesh.compute_mapping", "{1: data}"], r"mesh\.compute_mapping: the key 1"),
    "draccus' include tag": (
        ["--trainer.sample_prompt", "!include other.yaml"],
        r"^--trainer\.sample_prompt: .*'!include'",
    ),
    "a value that is not YAML": (["--trainer.seed", "[1"], r"^--trainer\.seed: '\[1' is not a YAML value"),
    "a Python tag in a value": (
        ["--data.train", "[a, !!python/name:os.getcwd]"],
        r"^--data\.train: .* is not a YAML value",
    ),
    "a key given twice in a value": (["--mesh.shape", "{data: 1, data: 2}"], r"key mesh\.shape\.data is given twice"),
    "a flag under a choice's type": (
        ["--model.type.x", "5"],
        r"^--model\.type\.x is not a key: model\.type takes one value",
    ),
}


@pytest.mark.parametrize("name", list(CLI))
def test_cli_values(name):
    args, match = CLI[name]
    _fails(ConfigError, match, load_config, NANO, args)


# A key typo gets one message and one suggestion, from the file and from the command line alike
# (argparse alone said "unrecognized arguments" and blamed the file).
TYPOS = {  # the file's YAML, the same on the command line, the message for each
    "trainer key": (
        "trainer:\n  num_train_step: 3\n",
        ["--trainer.num_train_step", "3"],
        "{0}trainer.num_train_step is not a key of the trainer section; did you mean {0}trainer.num_train_steps?",
    ),
    "model key": (
        "model:\n  type: gpt2\n  n_headd: 2\n",
        ["--model.n_headd", "2"],
        "{0}model.n_headd is not a key of the model section; did you mean {0}model.n_head?",
    ),
    "lora key": (
        "lora:\n  rnak: 4\n",
        ["--lora.rnak", "4"],
        "{0}lora.rnak is not a key of the lora section; did you mean {0}lora.rank?",
    ),
    "section": (
        "modle:\n  n_head: 2\n",
        ["--modle.n_head", "2"],  # a flag is shown whole, and corrected whole
        "{0}modle{1} is not a key of the config; did you mean {0}model{1}?",
    ),
}


@pytest.mark.parametrize("name", list(TYPOS))
def test_a_key_typo_gets_the_same_suggestion_in_the_file_and_on_the_command_line(tmp_path, capsys, name):
    text, flags, message = TYPOS[name]
    path = tmp_path / "typo.yaml"
    path.write_text(text)
    _fails(ConfigError, "^" + re.escape(message.format("", "")), load_config, path)
    rest = flags[0].partition(".")[2] if name == "section" else ""
    err = _fails(
        ConfigError, "^" + re.escape(message.format("--", "." + rest if rest else "")), load_config, NANO, flags
    )
    assert "unrecognized" not in str(err) and str(NANO) not in str(err)
    assert cli.main_train(["--config_path", str(NANO), *flags]) == 2
    assert capsys.readouterr().err.strip() == f"error: {err}"


def test_named_train_names_a_missing_config_file_and_exits_2(tmp_path, capsys):
    missing = tmp_path / "nope.yaml"
    assert cli.main_train(["--config_path", str(missing), "--trainer.num_train_steps", "5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(missing) in err and "Traceback" not in err


def test_a_value_on_the_command_line_is_never_a_file_to_include(tmp_path, monkeypatch):
    # draccus opened the file a value starting with "include" names, relative to the working
    # directory, and took its YAML instead; our flags are read as YAML values alone
    monkeypatch.chdir(tmp_path)
    (tmp_path / "other.yaml").write_text("not: the prompt\n")
    cfg = load_config(NANO, ["--trainer.sample_prompt", "include other.yaml"])
    assert cfg.trainer.sample_prompt == "include other.yaml"


def test_a_negative_number_is_a_flag_value():
    # argparse took -1e-8 for a flag and said "expected one argument"
    _fails(
        ConfigError,
        r"^optimizer\.epsilon must be > 0, got -1e-08$",
        load_config,
        NANO,
        ["--optimizer.epsilon", "-1e-8"],
    )
    assert load_config(NANO, ["--trainer.seed", "-0"]).trainer.seed == 0


def test_a_flag_under_a_single_value_is_named():
    _fails(
        ConfigError,
        r"^--mesh\.shape\.data is not a key: mesh\.shape takes one value .*--mesh\.shape VALUE",
        load_config,
        NANO,
        ["--mesh.shape.data", "4"],
    )


# A value that only its section's own check refuses (the model config's __post_init__) is blamed on
# where it came from: the command line's flags, or the file.
FROM_THE_CLI = {
    "heads that do not divide the width": (NANO, ["--model.n_head", "3"], "n_embd=128 is not divisible by n_head=3"),
    "top-k above the experts": (
        ROOT / "config/mixtral_tiny.yaml",
        ["--model.num_experts_per_tok=9"],
        r"num_experts_per_tok=9 must be in \[1, num_experts=8\]",
    ),
}


@pytest.mark.parametrize("name", list(FROM_THE_CLI))
def test_a_bad_value_from_the_command_line_is_blamed_on_it(tmp_path, name):
    config, flags, problem = FROM_THE_CLI[name]
    flag = flags[0].partition("=")[0]
    value = flags[-1].rpartition("=")[2]
    err = _fails(
        ConfigError,
        re.escape(f"({flag} {value} on the command line, the rest of model from {config}): model: ") + problem,
        load_config,
        config,
        flags,
    )
    assert f"in {config}" not in str(err)
    # the same value written in a file is blamed on the file
    path = tmp_path / "bad.yaml"
    field = flag.split(".")[-1]
    path.write_text(re.sub(rf"^  {field}: .*$", f"  {field}: {value}", config.read_text(), count=1, flags=re.M))
    _fails(ConfigError, re.escape(f"bad configuration in {path}: model: ") + problem, load_config, path)


# ---- ranges: an independent table of what each key may be ------------------------------------

# key: (config, values refused, values accepted at or inside the edge)
RANGES = {
    "trainer.num_train_steps": (NANO, ["-1"], ["0", "30"]),  # 0: check only, even with warmup_steps 30
    "trainer.train_batch_size": (NANO, ["0", "-16"], ["1"]),
    "trainer.microbatches": (NANO, ["0"], ["1"]),
    "trainer.seed": (NANO, ["-1", "4294967296"], ["0", "4294967295"]),
    "trainer.eval_interval": (NANO, ["-1"], ["0"]),
    "trainer.eval_batches": (NANO, ["-1"], ["0"]),
    "trainer.sample_interval": (NANO, ["-1"], ["0"]),
    "trainer.sample_tokens": (NANO, ["-1"], ["0"]),
    "trainer.log_interval": (NANO, ["-1"], ["0"]),
    "trainer.sample_temperature": (NANO, ["-0.1", "nan"], ["0", "1.5"]),
    "trainer.sample_top_k": (NANO, ["0", "-1"], ["null", "1"]),
    "trainer.nan_policy": (NANO, ["ignore"], ["skip"]),
    "trainer.peak_flops_per_device": (NANO, ["0", "-1e12", "inf"], ["null", "1e12"]),
    "trainer.loss_block_size": (NANO, ["0", "-128"], ["null", "1", "128"]),  # a divisor of the vocab: SAME below
    "trainer.eval_harness_interval": (NANO, ["-1"], ["0"]),  # more than 0 needs trainer.eval_harness_tasks
    "trainer.eval_harness_include": (NANO, ['""'], ["null", "my_tasks"]),
    "trainer.eval_harness_limit": (NANO, ["0", "-1"], ["null", "1"]),
    "optimizer.learning_rate": (NANO, ["0", "-0.001", "inf"], ["1e-9"]),
    "optimizer.weight_decay": (NANO, ["-0.1", "nan"], ["0"]),
    "optimizer.beta1": (NANO, ["-0.1", "1", "1.5"], ["0", "0.999"]),
    "optimizer.beta2": (NANO, ["-0.1", "1"], ["0", "0.999"]),
    "optimizer.epsilon": (NANO, ["0", "-1e-8"], ["1e-12"]),
    "optimizer.max_grad_norm": (NANO, ["0", "-1", "nan"], ["null", "0.5"]),
    "optimizer.warmup_steps": (NANO, ["-1", "301"], ["0", "300"]),
    "optimizer.decay_fraction": (NANO, ["0", "1.5"], ["1", "0.01"]),
    "optimizer.min_lr_ratio": (NANO, ["-0.1", "1.01"], ["0", "1"]),
    "optimizer.schedule": (NANO, ["sawtooth"], ["wsd"]),
    "optimizer.schedule_steps": (NANO, ["0", "-1"], ["null", "300"]),  # at least the warmup: tests/test_optim.py
    "checkpoint.interval": (NANO, ["-1"], ["0"]),
    "checkpoint.keep_last": (NANO, ["0"], ["1"]),
    "checkpoint.keep_every": (NANO, ["0", "-3"], ["null", "1"]),
    "checkpoint.every_minutes": (NANO, ["0", "-1", "nan"], ["null", "0.5"]),
    "checkpoint.base": (NANO, ['""', "ftp://host/x", "s3://UPPER/x"], ["null", "s3://my-bucket/runs/a"]),
    "checkpoint.checksum": (NANO, ["md5", "CRC32C"], ["sha256", "crc32c"]),
    "tracker.wandb_mode": (NANO, ["loud"], ["offline"]),
    "data.chat_packing": (NANO, ["ffd"], ["stream"]),
    "data.seq_len": (NANO, ["1", "0"], ["2"]),
    "data.val_fraction": (NANO, ["1", "-0.1", "1.5"], ["0", "0.5"]),
    "data.bin_dtype": (NANO, ["int8", "uint64"], ["uint32"]),
    "data.stdlib_bytes": (NANO, ["0", "-1"], ["1"]),
    "data.chat_template": (NANO, ['""', '"  "'], ["null", "t.jinja"]),
    "data.chat_too_long": (NANO, ["cut"], ["drop"]),
    "mesh.mode": (NANO, ["manual", "Explicit"], ["explicit", "auto"]),
    "mesh.batch_split": (NANO, ["0", "-2"], ["1"]),  # more than 1 needs mesh.mode: explicit
    "trainer.loss_scale": (NANO, ["static", "Dynamic"], ["none"]),  # dynamic: float16 (tests/test_silent_results.py)
    "mesh.layout": (NANO, ["search", "Auto"], ["config", "auto"]),  # auto: resolved by named-train (test_plan.py)
    "mesh.gather": (
        NANO,
        ["per-use", "PER_USE"],
        ["auto", "per_use"],
    ),  # per_use with mode explicit: test_gather_per_use.py
    "distributed.num_processes": (NANO, ["0", "-2"], ["null", "1"]),
    "distributed.process_id": (NANO, ["-1"], ["null", "0"]),
    "distributed.initialization_timeout_s": (NANO, ["0"], ["1"]),
    "distributed.heartbeat_timeout_s": (NANO, ["0", "-5"], ["1"]),
    "model.n_layer": (NANO, ["0", "-2"], ["1"]),
    "model.n_positions": (NANO, ["0"], ["1"]),
    "model.vocab_size": (NANO, ["0", "-1"], ["null", "512"]),
    "model.dropout": (NANO, ["1", "-0.1", "nan"], ["0", "0.5"]),
    "model.layer_norm_epsilon": (NANO, ["0", "-1e-5"], ["1e-6"]),
    "model.rms_norm_eps": (LLAMA, ["0"], ["1e-6"]),
    "model.rope_theta": (LLAMA, ["0", "-1", "inf"], ["10"]),
    "model.num_key_value_heads": (LLAMA, ["0"], ["1"]),
    "quantization.kind": (NANO, ["fp16", "int8_weight"], ["none", "fp8", "int8"]),  # int8_weight: inference only
    "quantization.targets": (NANO, ["[]"], ["null"]),
    "quantization.amax_history": (NANO, ["0", "-1"], ["1", "16"]),
    "lora.rank": (NANO, ["0", "-4"], ["1", "16"]),  # at most a targeted layer's smaller side: test_lora.py
    "lora.alpha": (NANO, ["0", "-1", "inf"], ["0.5", "32"]),
    "lora.dropout": (NANO, ["1", "-0.1", "nan"], ["0", "0.5"]),
    "lora.targets": (NANO, ["[]"], []),  # names the family has: test_lora.py
    "lora.base_dtype": (NANO, ["float16", "fp8"], ["bfloat16", "float32"]),
}


def _get(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


@pytest.mark.parametrize("key", list(RANGES))
def test_ranges(key):
    config, bad, good = RANGES[key]
    for value in bad:
        _fails(ConfigError, "^" + re.escape(key) + "[= ]", load_config, config, [f"--{key}={value}"])
    for value in good:
        got = _get(load_config(config, [f"--{key}={value}"]), key)
        want = None if value == "null" else type(got)(value)
        assert got == want, (key, value, got)


def _docs_table(header: str) -> list[str]:
    lines = (ROOT / "docs/trainer.md").read_text().splitlines()
    assert header in lines, "docs/trainer.md has no keys table"
    start = lines.index(header)
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return lines[start:end]


def test_the_docs_keys_table_is_the_declarations():
    # docs/trainer.md shows every key as declared (type, default, rule, resume, doc): the whole
    # table, row for row, so a key added, removed or changed on either side fails here
    table = keys_table().splitlines()
    assert _docs_table(table[0]) == table, "docs/trainer.md shows other keys: run docs/keys_table.py"


def test_every_range_of_the_declarations_is_tested():
    untested = (
        set(RULES)
        - set(RANGES)
        - {
            "model.<every integer>",
            "trainer.run_dir",
            "data.train",
            "trainer.stop_signals",  # a list: tests/test_preemption.py
            "data.loss_roles",  # a list: tests/test_chat_packing.py
            "model.type",
        }
    )  # tests/test_bad_input.py, "bad choice"
    assert untested == set(), untested


# ---- the declarations and the line that reads a config ----------------------------------------


def test_no_rule_of_a_key_lives_outside_its_declaration():
    # a key's allowed values are its key(...) rule, checked by config/check.py alone (so the keys table
    # shows them): no other module of the trainer words a "KEY must be" of its own for a declared key
    src = ROOT / "src" / "trainer"
    keys = [d.name for d in declarations() if "<" not in d.name]
    found = []
    for path in src.rglob("*.py"):
        if path.name in ("rules.py", "check.py"):
            continue
        text = path.read_text()
        found += [f"{path.relative_to(ROOT)}: {k}" for k in keys if re.search(re.escape(k) + r"`? must be", text)]
    assert found == [], found


def test_a_mapping_is_decoded_with_tuples_of_mesh_axes(tmp_path):
    # YAML gives a list of mesh axes; every consumer of the decoded config gets a tuple (jit's caches
    # key on mappings), from the file, from a flag, and for a config section built in code
    path = tmp_path / "tp.yaml"
    mesh = "  shape: {data: 4, model: 2}\n  compute_mapping: {batch: [data, model], mlp: model}\n"
    path.write_text(re.sub(r"(?m)^mesh:\n(  .*\n)+", "mesh:\n" + mesh, NANO.read_text()))
    cfg = load_config(path, ["--mesh.param_mapping", "{embed: [data], mlp: model, heads: null}"])
    assert cfg.mesh.compute_mapping == {"batch": ("data", "model"), "mlp": "model"}
    assert cfg.mesh.param_mapping == {"embed": ("data",), "mlp": "model", "heads": None}
    built = type(cfg.mesh)(compute_mapping={"batch": ["data", "model"]})
    assert built.compute_mapping == {"batch": ("data", "model")}
    assert "- data\n" in dump_config(cfg)  # written back as YAML's list


def test_a_mapping_is_converted_in_one_place():
    # the list -> tuple conversion is written once (config's mesh_mapping, run when a config is
    # decoded): no module wraps a decoded mapping (`f(cfg.mesh.param_mapping)`) in a conversion of its own
    idiom = re.compile(r"tuple\(\w+\) if isinstance\(\w+, (list|\(list, tuple\)|\(tuple, list\))\)")
    wrapped = re.compile(r"\w+\(\w+\.mesh\.(compute|param)_mapping\)")
    written, wraps = [], []
    for path in [*(ROOT / "src" / "trainer").rglob("*.py"), *(ROOT / "bench").glob("*.py")]:  # not bench's venvs
        text = path.read_text()
        written += [str(path.relative_to(ROOT))] * len(idiom.findall(text))
        wraps += [f"{path.relative_to(ROOT)}: {m.group(0)}" for m in wrapped.finditer(text)]
    assert written == ["src/trainer/config/sections.py"], written
    assert wraps == [], wraps


def test_the_trainers_error_types_live_in_one_module_and_keep_their_public_names():
    # ConfigError, DataError and CheckpointError are defined in config/errors.py alone, and reached
    # where users import them (the config, data and checkpoint packages)
    from named.trainer import checkpoint, config, data
    from named.trainer.config import errors

    assert (config.ConfigError, data.DataError, checkpoint.CheckpointError, config.CheckpointError) == (
        errors.ConfigError,
        errors.DataError,
        errors.CheckpointError,
        errors.CheckpointError,
    )
    defined = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in (ROOT / "src" / "trainer").rglob("*.py")
        for name in re.findall(r"(?m)^class (ConfigError|DataError|CheckpointError)\b", path.read_text())
    ]
    assert sorted(defined) == [
        f"src/trainer/config/errors.py: {n}" for n in ("CheckpointError", "ConfigError", "DataError")
    ]


def test_a_resume_may_change_exactly_the_keys_declared_free():
    # rundir.TRAJECTORY_FREE comes from the declarations: a key's `free` alone decides whether a
    # resumed run may change it (a whole section is free when each of its keys is)
    for d in declarations():
        if "<" in d.name:
            continue
        saved, new = {}, {}
        for raw, value in ((saved, 1), (new, 2)):
            section, name = d.name.split(".")
            raw.setdefault(section, {})[name] = value
        changed = rundir.trajectory_changes(saved, new)
        assert bool(changed) != d.key.free, (d.name, d.key.free, changed)
    assert "mesh" in rundir.TRAJECTORY_FREE and "trainer.seed" not in rundir.TRAJECTORY_FREE


def test_no_decode_hook_is_registered_with_draccus():
    # load_config decodes what it has checked; nothing global changes how draccus decodes a TrainConfig
    import draccus.parsers.decoding

    ours = [cls for cls in draccus.parsers.decoding.decode.registry if cls.__module__.startswith("named")]
    assert ours == []


def test_a_value_on_the_command_line_replaces_a_whole_section(tmp_path):
    # replace, not merge: the flag's mapping is the section, the file's keys are gone
    path = tmp_path / "lora.yaml"
    path.write_text(NANO.read_text() + "lora:\n  rank: 4\n  alpha: 8\n  targets: [c_attn]\n")
    cfg = load_config(path, ["--lora", "{rank: 2}"])
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.lora.targets) == (2, 16.0, ["q_proj", "v_proj"])
    assert load_config(path, ["--lora.rank", "2"]).lora.alpha == 8  # a key of it: the rest stays
    cfg = load_config(NANO, ["--model", "{type: llama, hidden_size: 64}"])  # gpt2's n_layer is not carried over
    assert (type(cfg.model).__name__, cfg.model.hidden_size) == ("LlamaConfigSection", 64)


def test_help_lists_every_key_from_its_declaration(capsys):
    with pytest.raises(SystemExit) as info:
        load_config(None, ["--help"])
    assert info.value.code == 0
    assert cli.main_train(["--config", "gpt2_nano", "--help"]) == 0
    out = capsys.readouterr().out
    for d in declarations():
        assert f"--{d.name}: " in out and d.key.doc in out, d.name
    assert "--trainer.seed: an integer, in [0, 4294967295]; default 0" in out


# ---- distributed settings -------------------------------------------------------------------

DIST = {
    "initialize without a coordinator": ({"initialize": True}, {}, r"distributed\.coordinator_address is not set"),
    "process_id past num_processes": (
        {"coordinator_address": "127.0.0.1:1234", "num_processes": 2, "process_id": 2},
        {},
        r"distributed\.process_id=2 must be below distributed\.num_processes=2",
    ),
    "a coordinator without a port": (
        {"coordinator_address": "127.0.0.1", "num_processes": 2, "process_id": 0},
        {},
        r"distributed\.coordinator_address '127\.0\.0\.1' must be host:port",
    ),
    "num_processes 0 from the environment": (
        {},
        {"NAMED_NUM_PROCESSES": "0", "NAMED_PROCESS_ID": "0", "NAMED_COORDINATOR": "h:1"},
        r"NAMED_NUM_PROCESSES must be >= 1",
    ),
    "process id from the environment past the count": (
        {"num_processes": 2},
        {"NAMED_PROCESS_ID": "5", "NAMED_COORDINATOR": "h:1"},
        r"NAMED_PROCESS_ID=5 must be below distributed\.num_processes=2",
    ),
}


@pytest.fixture
def no_cluster(monkeypatch):
    for name in (
        "JAX_COORDINATOR_ADDRESS",
        "SLURM_JOB_ID",
        "OMPI_MCA_orte_hnp_uri",
        "KUBERNETES_SERVICE_HOST",
        "NAMED_COORDINATOR",
        "NAMED_NUM_PROCESSES",
        "NAMED_PROCESS_ID",
        "NAMED_HEARTBEAT_TIMEOUT",
    ):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("name", list(DIST))
def test_distributed_settings(no_cluster, name):
    fields, env, match = DIST[name]
    for k, v in env.items():
        no_cluster.setenv(k, v)
    cfg = load_config(NANO, [arg for k, v in fields.items() for arg in (f"--distributed.{k}", str(v).lower())])
    _fails(ConfigError, match, dist.checked_settings, cfg.distributed)


@pytest.mark.procs
def test_distributed_settings_that_are_fine(no_cluster):
    # the control: a full set from the config, and one from named-launch's variables
    cfg = load_config(
        NANO,
        [
            "--distributed.coordinator_address",
            "127.0.0.1:1234",
            "--distributed.num_processes",
            "2",
            "--distributed.process_id",
            "1",
        ],
    )
    assert dist.settings(cfg.distributed)["process_id"] == 1
    for k, v in {"NAMED_COORDINATOR": "127.0.0.1:99", "NAMED_NUM_PROCESSES": "4", "NAMED_PROCESS_ID": "3"}.items():
        no_cluster.setenv(k, v)
    got = dist.settings(load_config(NANO).distributed)
    assert (got["coordinator_address"], got["num_processes"], got["process_id"]) == ("127.0.0.1:99", 4, 3)


# ---- the CLI boundary: named-train and named-plan refuse the same configs ----------------------

SAME = {
    "two axes of one activation on one mesh axis": (
        {"mesh.compute_mapping": "{batch: data, embed: data}"},
        r"mesh\.compute_mapping\.batch and mesh\.compute_mapping\.embed both map "
        r"to mesh axis 'data'",
    ),
    "heads and head_size on one mesh axis": (
        {"mesh.shape": "{data: 4, model: 2}", "mesh.compute_mapping": "{batch: data, heads: model, head_size: model}"},
        r"mesh\.compute_mapping\.heads and mesh\.compute_mapping\.head_size",
    ),
    "sequence longer than the positions": ({"data.seq_len": 128}, r"data\.seq_len=128 .* 64 positions"),
    "batch that does not split": ({"trainer.train_batch_size": 6}, r"trainer\.train_batch_size=6"),
    "vocabulary below the tokenizer's": ({"model.vocab_size": 100}, r"model\.vocab_size=100"),
    "unknown axis in a mapping": ({"mesh.param_mapping": "{embd: data}"}, r"mesh\.param_mapping\.embd"),
    "mesh larger than the devices": ({"mesh.shape": "{data: 16}"}, r"needs 16 devices but 8"),
    "initialize without a coordinator": ({"distributed.initialize": "true"}, r"distributed\.coordinator_address"),
    "a value draccus would take": ({"trainer.log_interval": "true"}, r"trainer\.log_interval must be an integer"),
    "a loss block that does not divide the vocabulary": (
        {"trainer.loss_block_size": 100},
        r"trainer\.loss_block_size: block_size=100 does not divide the size 384 of axis 'vocab'; try 96 or 128",
    ),
    "a loss block that does not split like the vocabulary": (
        {
            "trainer.loss_block_size": 3,
            "mesh.shape": "{data: 4, model: 2}",
            "mesh.compute_mapping": "{batch: data, vocab: model}",
            "mesh.param_mapping": "{vocab: model}",
        },
        r"trainer\.loss_block_size=3: a block of the vocab must split like the head's vocab .*3 is not divisible by 2",
    ),
}


def _run_main(main, args, capsys) -> tuple[int, str]:
    code = main(args)
    err = capsys.readouterr().err
    return code, err


@pytest.mark.parametrize("name", list(SAME))
def test_plan_refuses_what_train_refuses(files, tmp_path, capsys, no_cluster, name):
    over, match = SAME[name]
    run_dir = tmp_path / "run"
    args = ["--config_path", str(NANO), *_args(files, run_dir, **over)]
    errors = []
    for main, extra in ((cli.main_plan, []), (cli.main_train, ["--trainer.num_train_steps", "0"])):
        code, err = _run_main(main, args + extra, capsys)
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
        assert re.search(match, err), err
        errors.append(err)
    assert errors[0] == errors[1]
    assert not run_dir.exists()


def test_the_shipped_layouts_pass_the_activation_check(files, tmp_path, capsys):
    # the control for the clash cases: TP over heads and mlp (and Llama's kv_heads) is fine
    for config, over in (
        (
            NANO,
            {"mesh.shape": "{data: 4, model: 2}", "mesh.compute_mapping": "{batch: data, heads: model, mlp: model}"},
        ),
        (ROOT / "config/llama_1b_fsdp_tp.yaml", {}),
    ):
        code = cli.main_plan(
            [
                "--config_path",
                str(config),
                "--trainer.run_dir",
                str(tmp_path / "run"),
                *[a for k, v in over.items() for a in (f"--{k}", v)],
            ]
        )
        assert code == 0, capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_train_runs_in_check_only_mode_with_warmup_longer_than_zero_steps(files, tmp_path, capsys):
    # gpt2_nano has warmup_steps 30: with num_train_steps 0 that is no error
    cfg = load_config(
        NANO, _args(files, tmp_path / "run", **{"trainer.num_train_steps": 0, "optimizer.warmup_steps": 30})
    )
    assert cfg.trainer.num_train_steps == 0 and cfg.optimizer.warmup_steps == 30
    assert (
        cli.main_plan(["--config_path", str(NANO), *_args(files, tmp_path / "run", **{"trainer.num_train_steps": 0})])
        == 0
    )
    assert not (tmp_path / "run").exists()


def test_run_dir_that_is_a_file(files, tmp_path, capsys):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a run")
    for run_dir in (blocker, blocker / "run"):
        code, err = _run_main(cli.main_train, ["--config_path", str(NANO), *_args(files, run_dir)], capsys)
        assert code == 2 and err.startswith("error: ") and str(blocker) in err and "Traceback" not in err, err
    assert blocker.read_text() == "not a run"


def test_bad_flags_of_the_cli_itself(capsys):
    for main, args, needle in (
        (cli.main_train, ["--config_path"], "--config_path"),
        (cli.main_plan, ["--config_path", "/nonexistent/x.yaml"], "/nonexistent/x.yaml"),
        (cli.main_sample, [], "--checkpoint"),
        (cli.main_sample, ["--checkpoint", "x", "--tokens", "many"], "--tokens"),
    ):
        code, err = _run_main(main, args, capsys)
        assert code == 2 and err.startswith("error: ") and needle in err and "Traceback" not in err, (args, err)


# ---- named-sample -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sample_run(files, tmp_path_factory) -> Path:
    """A run directory as named-train leaves it, written from zeros (no compile)."""
    run_dir = tmp_path_factory.mktemp("sample") / "run"
    _save_run(files, run_dir)
    cfg = load_config(NANO, _args(files, run_dir))
    model_cfg = cfg.model.model_config(vocab_size=384)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    (run_dir / "model_config.json").write_text(json.dumps({"type": "gpt2", **model_cfg.__dict__}))
    return run_dir


SAMPLE = {
    "negative --tokens": (["--tokens", "-3"], ConfigError, r"--tokens must be an integer >= 0, got -3"),
    "--tokens past the positions": (
        ["--tokens", "500"],
        ConfigError,
        r"--tokens 500 after the 4 tokens of --prompt needs 504 positions; the model has 64",
    ),
    "negative --temperature": (["--temperature", "-1"], ConfigError, r"--temperature must be a finite number >= 0.*-1"),
    "nan --temperature": (["--temperature", "nan"], ConfigError, r"--temperature .*nan"),
    "--seed past 32 bits": (["--seed", "4294967296"], ConfigError, r"--seed must be in \[0, 4294967295\]"),
}


@pytest.mark.parametrize("name", list(SAMPLE))
def test_sample_flags(sample_run, capsys, name):
    flags, exc, match = SAMPLE[name]
    args = ["--checkpoint", str(sample_run), "--prompt", "def ", *flags]
    _fails(exc, match, lambda: _sample(args))
    code, err = _run_main(cli.main_sample, args, capsys)
    assert code == 2 and re.match("error: " + match, err), err


def _sample(args):
    from named.trainer.commands.sample import sample_from_checkpoint

    a = dict(zip(args[::2], args[1::2]))
    return sample_from_checkpoint(
        Path(a["--checkpoint"]),
        a["--prompt"],
        int(a.get("--tokens", 10)),
        temperature=float(a.get("--temperature", 0)),
        seed=int(a.get("--seed", 0)),
    )


def test_sample_paths(sample_run, tmp_path, capsys):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "empty").mkdir()
    stray = tmp_path / "stray_step"
    stray.mkdir()
    (stray / "commit.json").write_text("{}")
    for path, match in (
        (tmp_path / "nope", r"nope: no such directory"),
        (tmp_path / "a_file", r"a_file is a file"),
        (tmp_path / "empty", r"empty holds no committed checkpoint"),
        (stray, r"stray_step is a checkpoint outside a run directory"),
    ):
        _fails(CheckpointError, match, _sample, ["--checkpoint", str(path), "--prompt", "x"])
        code, err = _run_main(cli.main_sample, ["--checkpoint", str(path)], capsys)
        assert code == 2 and err.startswith("error: ") and str(path) in err and "Traceback" not in err, err


def test_sample_run_dir_with_a_broken_model_config(files, sample_run, tmp_path):
    run_dir = tmp_path / "run"
    _save_run(files, run_dir)  # a committed checkpoint, and nothing else
    _fails(CheckpointError, r"model_config\.json is missing", _sample, ["--checkpoint", str(run_dir), "--prompt", "x"])
    (run_dir / "model_config.json").write_text("{not json")
    _fails(
        CheckpointError,
        r"model_config\.json is not a model config",
        _sample,
        ["--checkpoint", str(run_dir), "--prompt", "x"],
    )
    (run_dir / "model_config.json").write_text(json.dumps({"type": "gpt2", "n_layer": "two"}))
    _fails(
        CheckpointError,
        r"model_config\.json: model\.n_layer must be an integer, got 'two'",
        _sample,
        ["--checkpoint", str(run_dir), "--prompt", "x"],
    )
    (run_dir / "model_config.json").write_text(json.dumps({"type": "gpt2", "n_positions": 0}))
    _fails(
        CheckpointError,
        r"model_config\.json: model\.n_positions must be >= 1, got 0",
        _sample,
        ["--checkpoint", str(run_dir), "--prompt", "x"],
    )
    (run_dir / "model_config.json").write_text((sample_run / "model_config.json").read_text())
    _fails(CheckpointError, r"config\.yaml is missing", _sample, ["--checkpoint", str(run_dir), "--prompt", "x"])


def test_range_messages_say_the_range_and_the_value():
    err = _fails(ConfigError, "beta1", load_config, NANO, ["--optimizer.beta1", "1.5"])
    assert str(err) == "optimizer.beta1 must be in [0, 1), got 1.5"


def test_the_data_section_raises_one_error_type_per_kind_of_fault(tmp_path):
    # a data key's value is checked by its declaration like every other key's (ConfigError), from a
    # config file and from code alike; the structure of its sources is the data section's (DataError)
    from named.trainer.data import DataConfig

    err = _fails(ConfigError, r"data\.seq_len", load_config, NANO, ["--data.seq_len", "1"])
    assert str(err) == "data.seq_len must be >= 2, got 1"
    with pytest.raises(ConfigError) as made:
        DataConfig(seq_len=1)
    assert str(made.value) == str(err)
    _fails(
        DataError,
        r"data\.train\[0\]\.weight",
        load_config,
        NANO,
        ["--data.train", "[{name: a, paths: [x], weight: -1}]"],
    )
