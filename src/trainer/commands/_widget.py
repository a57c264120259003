"""ipywidgets controls over ``explore.Explorer`` (the ``notebook`` extra): each change plans the
new layout from shapes (cached) and redraws ``explore.view_html``; compiling and ranking run only
when their buttons are pressed."""

from __future__ import annotations

import html

import named as nm

from ..config import ConfigError
from ..config.layout import Layout


def parse_flow(text: str, key: str) -> dict:
    """``"data: 4, model: 2"`` or ``"{batch: data, mlp: model}"`` as a dict, read as the flag
    ``--<key>`` is read (``config.read.read_value``: YAML, no key twice); a ConfigError naming the key."""
    from ..config.read import Flag, read_value

    t = text.strip()
    if not t:
        return {}
    return read_value(Flag(key, t if t.startswith("{") else "{" + t + "}"), mapping=True)


def _flow(pairs) -> str:
    return ", ".join(f"{k}: {list(v) if isinstance(v, tuple) else v}" for k, v in pairs)


def explorer_widget(ex):
    import ipywidgets as w

    lay = ex.layout
    batch = ex.cfg.trainer.train_batch_size
    mesh = w.Text(_flow(lay.mesh_shape), description="mesh", continuous_update=False)
    compute = w.Text(_flow(lay.compute_mapping), description="compute", continuous_update=False)
    param = w.Text(_flow(lay.param_mapping), description="parameters", continuous_update=False)
    remats = list(dict.fromkeys([lay.remat, "none", "full", "save_dots"]))
    remat = w.Dropdown(options=remats, value=lay.remat, description="remat")
    micro = w.Dropdown(
        options=[m for m in range(1, batch + 1) if batch % m == 0], value=lay.microbatches, description="microbatches"
    )
    blocks = w.Text(
        "" if lay.loss_block_size is None else str(lay.loss_block_size),
        description="loss blocks",
        continuous_update=False,
    )
    mode = w.ToggleButtons(options=["auto", "explicit"], value=lay.mode, description="mode")
    base = ex.view()
    paths = [r.path for r in base.plan.params.rows] if base.plan is not None else []
    largest = max(base.plan.params.rows, key=lambda r: r.size).path if paths else None
    array = w.Dropdown(options=paths, value=largest, description="grid of")
    compile_ = w.Checkbox(False, description="compile the step")
    rank = w.Button(description="rank among --search", tooltip="compiles every layout --search tries, once")
    out = w.HTML()

    def layout() -> Layout:
        text = blocks.value.strip()
        if text and not text.isdigit():
            raise ConfigError(f"trainer.loss_block_size: {text!r} is not a whole number (empty: none)")
        return lay.replace(
            mesh_shape=parse_flow(mesh.value, "mesh.shape"),
            compute_mapping=parse_flow(compute.value, "mesh.compute_mapping"),
            param_mapping=parse_flow(param.value, "mesh.param_mapping"),
            remat=remat.value,
            microbatches=micro.value,
            loss_block_size=int(text) if text else None,
            mode=mode.value,
        )

    def redraw(*_):
        try:
            v = ex.view(layout(), compile=compile_.value)
            out.value = v.html(array.value)
        except (ConfigError, nm.NamedError) as e:
            out.value = f"<p style='color:#c92a2a'>{html.escape(str(e))}</p>"

    def ranked(_):
        out.value = "<p>compiling every layout --search tries...</p>"
        try:
            ex.search()
        except ConfigError as e:
            out.value = f"<p style='color:#c92a2a'>{html.escape(str(e))}</p>"
            return
        redraw()

    for c in (mesh, compute, param, remat, micro, blocks, mode, array, compile_):
        c.observe(redraw, names="value")
    rank.on_click(ranked)
    redraw()
    return w.VBox(
        [
            w.HBox([mesh, compute, param]),
            w.HBox([remat, micro, blocks]),
            w.HBox([mode, array]),
            w.HBox([compile_, rank]),
            out,
        ]
    )
