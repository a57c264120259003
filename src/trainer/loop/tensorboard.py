"""TensorBoard event files, written with the ``tensorboard`` package alone (no TensorFlow).

``tracker.tensorboard: true`` writes ``<run_dir>/tensorboard/events.out.tfevents.*``: every
numeric metric as a scalar (tags ``train/loss``, ``eval/loss``, ...), the run's config.yaml and
each sample as text. ``tensorboard --logdir <run_dir>/tensorboard`` shows them. The package is
optional (``pip install 'named-jax[tensorboard]'``) and imported only when a run asks for it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ..checkpoint.run_places import EVENTS_DIR  # under the run directory


class EventWriter:
    """One event file in ``<run_dir>/tensorboard``, opened with TensorBoard's restart marker at
    the first step this run logs (``start_step + 1``: a resume's checkpoint is at ``start_step``).
    Its readers then drop what an earlier run of the directory logged from that step on, the
    steps a killed run logged after its last checkpoint, which this run logs again (as
    ``drop_rows_after`` does for metrics.jsonl)."""

    def __init__(self, run_dir: Path, start_step: int = 0):
        from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
        from tensorboard.plugins.text.metadata import create_summary_metadata
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = event_pb2, summary_pb2
        self._tensor, self._shape, self._types = tensor_pb2, tensor_shape_pb2, types_pb2
        self._text_metadata = create_summary_metadata
        self._writer = EventFileWriter(str(run_dir / EVENTS_DIR))
        self._add(start_step + 1, session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START))

    def _add(self, step: int, **fields) -> None:
        self._writer.add_event(self._event.Event(wall_time=time.time(), step=step, **fields))

    def scalars(self, step: int, values: dict[str, Any]) -> None:
        """The numbers of ``values`` (tag -> value) as scalars; other values are left out."""
        Value = self._summary.Summary.Value
        kept = [
            Value(tag=tag, simple_value=float(v))
            for tag, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        ]
        if kept:
            self._add(step, summary=self._summary.Summary(value=kept))
        self._writer.flush()

    def text(self, step: int, tag: str, text: str) -> None:
        """``text`` under ``tag``, shown as written (a code block: the text plugin reads Markdown)."""
        fence = "````" if "```" in text else "```"
        tensor = self._tensor.TensorProto(
            dtype=self._types.DT_STRING,
            tensor_shape=self._shape.TensorShapeProto(dim=[self._shape.TensorShapeProto.Dim(size=1)]),
            string_val=[f"{fence}\n{text}\n{fence}".encode()],
        )
        value = self._summary.Summary.Value(tag=tag, tensor=tensor, metadata=self._text_metadata(tag, ""))
        self._add(step, summary=self._summary.Summary(value=[value]))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
