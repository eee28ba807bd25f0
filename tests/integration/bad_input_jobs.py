"""Train functions that report what JSON has no plain word for: NaN and the infinities, a set."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

from outlast.train import Checkpoint, report


def diverging_loop(config: dict) -> None:
    """A loss that diverges: finite, then infinite, then NaN, the last two with a checkpoint."""
    for step, loss in enumerate([1.5, math.inf, math.nan]):
        with tempfile.TemporaryDirectory() as d:
            Path(d, "step").write_text(str(step))
            report({"step": step, "loss": loss, "low": -math.inf, "history": [loss, 0.5]},
                   checkpoint=Checkpoint.from_directory(d) if step else None)


def set_metric_loop(config: dict) -> None:
    report({"step": 0, "classes": {"cat", "dog"}})
