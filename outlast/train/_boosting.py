"""What `outlast.train.xgboost` and `outlast.train.lightgbm` share: Ray's report callback (metrics after
each round, the model every `frequency` rounds and at the end) and outlast's drain callback, both over a
booster with `save_model(path)`. Each framework's module adapts them to its callback protocol."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from outlast import train
from outlast.train.checkpoint import Checkpoint


def flatten(results: dict, prefix: str = "") -> dict[str, Any]:
    """{"train": {"rmse": [...]}} -> {"train-rmse": [...]}, as Ray's `flatten_dict(delimiter="-")`."""
    flat: dict[str, Any] = {}
    for key, value in results.items():
        name = f"{prefix}-{key}" if prefix else str(key)
        if isinstance(value, dict):
            flat.update(flatten(value, name))
        else:
            flat[name] = value
    return flat


class ReportCallbackBase:
    """Ray's `RayReportCallback` arguments and what they do: `metrics` picks (list) or renames ({reported:
    the framework's}) what is reported, `results_postprocessing_fn` gets the dict last, `filename` is the
    model's file in the checkpoint (rank 0 saves it), `frequency` rounds between checkpoints (0: none
    during training), `checkpoint_at_end` one after the last round."""

    CHECKPOINT_NAME = "model"

    def __init__(self, metrics: str | list[str] | dict[str, str] | None = None, filename: str | None = None,
                 frequency: int = 0, checkpoint_at_end: bool = True,
                 results_postprocessing_fn: Callable[[dict], dict] | None = None) -> None:
        if isinstance(frequency, bool) or not isinstance(frequency, int) or frequency < 0:
            raise ValueError(f"RayTrainReportCallback(frequency=...) must be a whole number of rounds >= 0, "
                             f"got {frequency!r}")
        self._metrics = [metrics] if isinstance(metrics, str) else metrics
        self._filename = filename or self.CHECKPOINT_NAME
        self._frequency = frequency
        self._checkpoint_at_end = checkpoint_at_end
        self._results_postprocessing_fn = results_postprocessing_fn

    def _report_dict(self, results: dict) -> dict[str, Any]:
        """`results`: the framework's evaluation results, nested by data set; the last value of each."""
        last = {k: (v[-1] if isinstance(v, list) else v) for k, v in flatten(results).items()}
        if not self._metrics:
            report = last
        elif isinstance(self._metrics, dict):
            report = {key: last[metric] for key, metric in self._metrics.items()}
        else:
            report = {key: last[key] for key in self._metrics}
        return self._results_postprocessing_fn(report) if self._results_postprocessing_fn else report

    def _checkpoints_after(self, iteration: int) -> bool:
        """Whether round `iteration` (from 0) is one of the every-`frequency` checkpoints."""
        return bool(self._frequency) and (iteration + 1) % self._frequency == 0

    @contextmanager
    def _checkpoint(self, model) -> Iterator[Checkpoint | None]:
        if train.get_context().get_world_rank() != 0:
            yield None
            return
        with tempfile.TemporaryDirectory() as d:
            model.save_model(Path(d, self._filename).as_posix())
            yield Checkpoint(d)

    def _save_and_report(self, report: dict, model) -> None:
        with self._checkpoint(model) as checkpoint:
            train.report(report, checkpoint=checkpoint)


class PreemptionWatch:
    """The drain callbacks' core: ask `get_preemption_info()` each round (the same round on every rank) and
    say once per notice that this round's model is to be saved."""

    def __init__(self) -> None:
        self._saved_for: object = None

    def new_notice(self):
        info = train.get_preemption_info()
        if info is None or info == self._saved_for:
            return None
        self._saved_for = info
        return info
