"""named-plan's report: parameters by default (nothing compiled), the compiled train step on request."""

from __future__ import annotations

from pathlib import Path


from named.trainer import plan
from named.trainer.config import load_config

CONFIG = Path(__file__).parent.parent / "config" / "gpt2_nano_fsdp.yaml"
SMALL = ["--model.n_layer", "1", "--data.seq_len", "32", "--trainer.train_batch_size", "8"]


def test_plan_report_lists_every_parameter_with_its_layout():
    text = plan.plan_report(load_config(CONFIG, SMALL))
    assert "mesh: {'data': 8}" in text
    assert ".wte.weight" in text and "vocab embed/data" in text
    assert "per device" in text and "train step" not in text  # the default compiles nothing


def test_plan_main_with_compile_reports_the_train_step(capsys):
    assert plan.main(["--config_path", str(CONFIG), "--compile", *SMALL]) == 0
    out = capsys.readouterr().out
    step = out.split("train step (compiled on abstract inputs):")[1]
    assert "all-gather" in step and "data" in step  # FSDP gathers the weights over data
    assert "memory per device:" in step and "FLOPs per device:" in step


def test_plan_main_reports_config_errors(capsys):
    assert plan.main(["--config_path", str(CONFIG), "--trainer.no_such_key", "1"]) == 2
    assert "no_such_key" in capsys.readouterr().err
