"""The layout explorer (named.trainer.commands.explore): its figures are named-plan's, refused
layouts name their key, views are cached, the widget redraws, named-plan --html writes the page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from named.trainer.commands import cli, plan
from named.trainer.commands.explore import Explorer, report_page
from named.trainer.commands.plan_search import candidates, rank
from named.trainer.config import ConfigError, load_config
from named.trainer.config.layout import Layout

CONFIG = Path(__file__).parent.parent / "config" / "gpt2_nano.yaml"
SMALL = ["--model.n_layer", "1", "--data.seq_len", "32", "--trainer.train_batch_size", "8"]


@pytest.fixture(scope="module")
def explorer():
    return Explorer(load_config(CONFIG, SMALL), device_kind="H100")


def _plan_total_mib(flags: list[str]) -> float:
    """The per-device total named-plan prints, for the config read with ``flags``, planned for an
    H100 as the explorer is (a CPU's plan counts what XLA:CPU keeps: ``plan.activation_bytes``)."""
    text = plan.plan_report(load_config(CONFIG, [*SMALL, *flags]), target=plan.Target.of("H100", None))
    return float(re.search(r"in all: ([\d.]+) MiB", text).group(1))


@pytest.mark.parametrize(
    "changes, flags",
    [
        ({}, []),
        ({"param_mapping": {"embed": "data"}}, ["--mesh.param_mapping", "{embed: data}"]),
        (
            {
                "mesh_shape": {"data": 4, "model": 2},
                "compute_mapping": {"batch": "data", "mlp": "model", "heads": "model"},
                "param_mapping": {"embed": "data", "mlp": "model", "heads": "model"},
                "microbatches": 2,
            },
            [
                "--mesh.shape",
                "{data: 4, model: 2}",
                "--mesh.compute_mapping",
                "{batch: data, mlp: model, heads: model}",
                "--mesh.param_mapping",
                "{embed: data, mlp: model, heads: model}",
                "--trainer.microbatches",
                "2",
            ],
        ),
        ({"remat": "full"}, ["--model.remat", "full"]),
        ({"loss_block_size": 128}, ["--trainer.loss_block_size", "128"]),
    ],
    ids=["config", "fsdp", "fsdp+tp, 2 microbatches", "remat full", "loss blocks"],
)
def test_the_explorers_memory_is_named_plans(explorer, changes, flags):
    v = explorer.view(**changes)
    assert v.error is None
    assert f"{v.total_bytes / 2**20:.2f}" == f"{_plan_total_mib(flags):.2f}"
    mem = v.memory()
    assert set(mem) == {"parameters", "gradients", "optimizer state", "activations", "logits"}  # nothing compiled
    assert f"data-figure='total'>{v.total_bytes / 2**20:.2f} MiB" in v.html()


def test_fsdp_divides_the_state_by_the_data_axis(explorer):
    dp, fsdp = explorer.view(param_mapping={}), explorer.view(param_mapping={"embed": "data"})
    assert fsdp.memory()["parameters"] < dp.memory()["parameters"] / 4
    assert fsdp.memory()["activations"] == dp.memory()["activations"]


def test_views_are_cached_and_refusals_name_the_key(explorer):
    assert explorer.view(param_mapping={"embed": "data"}) is explorer.view(param_mapping={"embed": "data"})
    assert "mesh.param_mapping.nope" in explorer.view(param_mapping={"nope": "data"}).error
    assert "trainer.microbatches" in explorer.view(microbatches=3).error
    assert "mesh.mode" in explorer.view(mode="sideways").error
    with pytest.raises(ConfigError, match="mesh.param_mapping.nope"):
        explorer.view(param_mapping={"nope": "data"}).memory()  # a refused layout has no figures
    with pytest.raises(ConfigError, match="unknown layout field"):
        explorer.view(mapping={"batch": "data"})
    with pytest.raises(ConfigError, match="devices=4, but this process has 8"):
        Explorer(explorer.cfg, devices=4)


def test_a_views_rank_is_its_place_among_the_search_candidates(explorer):
    """The ranking is --search's (measured figures stood in here: compiling them all is the slow test's)."""
    found = []
    for i, c in enumerate([*candidates(8, {"mlp", "heads"}, 8), *candidates(8, set(), 8, mode="explicit")]):
        c.flops, c.hbm_bytes, c.memory = 1e9 * (i + 1), 1e6, 2**20
        found.append(c)
    explorer._ranked = rank(found, explorer.roof, explorer.budget)
    try:

        def place(name, mode):
            return next(
                i
                for i, c in enumerate(explorer._ranked, 1)
                if (c.name, c.layout.remat, c.layout.microbatches, c.layout.mode) == (name, "none", 1, mode)
            )

        fsdp = place("FSDP", "auto")
        assert explorer.view(param_mapping={"embed": "data"}).rank == (fsdp, len(found))
        assert explorer.view(param_mapping={"embed": "data"}, mode="explicit").rank == (
            place("FSDP", "explicit"),
            len(found),
        )
        odd = explorer.view(param_mapping={"vocab": "data"})  # no candidate of --search: ranked only once compiled
        assert odd.rank is None
        page = report_page(explorer, search=True)  # the ranking table, and each section's rank
        assert "layouts ranked by --search" in page
        assert "<th>mode</th>" in page and "<th>loss block</th>" in page and "<td>explicit</td>" in page
        section = re.search(r"data-key='FSDP\|none\|1'>(.*?)</section>", page, re.S).group(1)
        assert f"ranks <b data-figure='rank'>{fsdp}</b> of {len(found)}" in section
    finally:
        explorer._ranked = None


def test_compiling_on_request_adds_collectives_the_cpu_peak_and_the_roofline(explorer):
    v = explorer.view(param_mapping={"embed": "data"}, compile=True)
    assert v.collectives().get("all-gather", 0) > 0  # FSDP gathers the weights
    # this CPU's compiled peak is shown beside the estimate, never added to what is judged against an H100
    assert set(v.memory()) == {"parameters", "gradients", "optimizer state", "activations", "logits"}
    assert f"data-figure='compiled peak'>{v.compiled.peak_bytes / 2**20:.2f} MiB" in v.html()
    assert set(v.step_seconds()) == {"compute", "HBM", "communication"}
    assert explorer.view(param_mapping={"embed": "data"}).compiled is v.compiled  # cached
    assert "data-figure='collective all-gather'" in v.html()


def test_the_widget_replans_when_a_mapping_changes(explorer):
    pytest.importorskip("ipywidgets")
    box = explorer.widget()
    texts = {c.description: c for row in box.children[:-1] for c in row.children}
    out = box.children[-1]
    before = explorer.view().total_bytes
    texts["parameters"].value = "embed: data"
    after = explorer.view(param_mapping={"embed": "data"}).total_bytes
    assert after < before and f"{after / 2**20:.2f} MiB" in out.value
    texts["compile the step"].value = True  # compiled once per layout (the compile test's, when it ran first)
    assert "data-figure='collective all-gather'" in out.value and "compiled peak" in out.value
    texts["compile the step"].value = False
    texts["remat"].value = "full"
    assert "remat full" in out.value
    assert f"{explorer.view(param_mapping={'embed': 'data'}, remat='full').total_bytes / 2**20:.2f} MiB" in out.value
    texts["microbatches"].value = 2  # 4 sequences over 8 devices: refused, and said so
    assert "trainer.microbatches=2" in out.value
    texts["parameters"].value = "embed: [data"
    assert "mesh.param_mapping" in out.value  # the YAML error, named


def test_named_plan_html_writes_the_page(tmp_path, capsys):
    page = tmp_path / "plan.html"
    assert cli.main_plan(["--config_path", str(CONFIG), "--device-kind", "H100", "--html", str(page), *SMALL]) == 0
    out = capsys.readouterr().out
    total = re.search(r"in all: ([\d.]+) MiB", out).group(1)
    text = page.read_text()
    shown = re.search(r"data-key='config\|none\|1'>.*?data-figure='total'>([\d.]+) MiB", text, re.S).group(1)
    assert shown == total
    assert "http" not in text.replace("http-equiv", "")  # self-contained: nothing fetched
    assert {"FSDP|full|2", "DP|none|4"} <= set(re.findall(r"data-key='([^']+)'", text))
    assert list(tmp_path.iterdir()) == [page]  # no temporary file left beside it


def test_named_plan_html_refuses_a_missing_folder(tmp_path, capsys):
    assert cli.main_plan(["--config_path", str(CONFIG), "--html", str(tmp_path / "no" / "p.html"), *SMALL]) == 2
    assert "--html" in capsys.readouterr().err and not (tmp_path / "no").exists()
    assert cli.main_plan(["--config_path", str(CONFIG), "--html", str(tmp_path), *SMALL]) == 2
    assert "is a folder" in capsys.readouterr().err


def test_named_plan_html_refuses_an_unwritable_folder_before_planning(tmp_path, monkeypatch, capsys):
    import os

    from named.trainer.commands import plan

    monkeypatch.setattr(plan, "plan_report", lambda *a, **k: pytest.fail("planned before checking --html"))
    access = os.access  # a folder this user may not write (the tests may run as root, who may)
    monkeypatch.setattr(os, "access", lambda p, mode: access(p, mode) and os.fspath(p) != str(tmp_path))
    assert cli.main_plan(["--config_path", str(CONFIG), "--html", str(tmp_path / "p.html"), *SMALL]) == 2
    assert f"--html {tmp_path / 'p.html'} cannot be written: the folder {tmp_path} is not writable" in (
        capsys.readouterr().err
    )


def test_a_live_module_is_planned_in_place_of_the_configs_model():
    """A module built (or changed) in a notebook: its shapes are planned, checked against both mappings."""
    import jax

    from named.trainer.loop.checks import model_config_for

    two_layers = load_config(CONFIG, [*SMALL, "--model.n_layer", "2"])
    model_cfg, cls = model_config_for(two_layers)
    module = cls.init(model_cfg, key=jax.random.key(0))
    ex = Explorer(load_config(CONFIG, SMALL), model=module)  # the config says one layer
    fsdp = {"embed": "data"}
    expected = plan.make_plan(Layout.of(two_layers).replace(param_mapping=fsdp).apply(two_layers))
    v = ex.view(param_mapping=fsdp)
    assert v.memory()["parameters"] == expected.params.bytes_per_device
    assert v.memory()["activations"] == expected.activations  # the estimate reads the layers off the shapes
    assert "mesh.param_mapping.nope" in ex.view(param_mapping={"nope": "data"}).error
    import named as nm

    other = Explorer(
        load_config(CONFIG, SMALL),
        model=nm.nn.Linear.init(nm.Axis("embed", 4), nm.Axis("mlp", 8), key=jax.random.key(0)),
    )
    assert "the live module is a Linear" in other.view().error
