"""What `fit()` returns, read back from the run's history on storage.

As in Ray Train V2, `metrics` are those reported with the latest committed checkpoint
(None without one), and `best_checkpoints` lists the kept checkpoints ordered by score,
the best last, cut to `CheckpointConfig.num_to_keep`.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from outlast.storage.records import CheckpointRecord, RunState
from outlast.train import return_value
from outlast.train.checkpoint import Checkpoint

if TYPE_CHECKING:
    from outlast.storage.base import Storage
    from outlast.storage.run_store import RunStore

log = logging.getLogger("outlast.train")



@dataclass
class Result:
    metrics: dict[str, Any] | None
    checkpoint: Checkpoint | None
    path: str
    error: BaseException | None = None
    best_checkpoints: list[tuple[Checkpoint, dict[str, Any]]] = field(default_factory=list)
    return_value: Any = None
    # outlast's own: rank 0's last report, with a checkpoint or without (Ray's V1 `metrics`).
    last_metrics: dict[str, Any] | None = None

    @property
    def metrics_dataframe(self):
        """One row per checkpoint of `best_checkpoints`, as a pandas DataFrame (None without any)."""
        if not self.best_checkpoints:
            return None
        try:
            import pandas as pd
        except ImportError:
            raise ImportError("Result.metrics_dataframe needs pandas: `pip install pandas`, or read "
                              "Result.best_checkpoints, a list of (checkpoint, metrics)") from None
        return pd.DataFrame([metrics for _, metrics in self.best_checkpoints])

    @property
    def filesystem(self):
        """A `pyarrow.fs.FileSystem` that reaches `path`, as Ray gives: pyarrow's own for a local path, the
        fsspec file system of the URL wrapped for pyarrow otherwise. Without pyarrow, the fsspec one."""
        import fsspec.core

        fs = fsspec.core.url_to_fs(self.path)[0]
        try:
            import pyarrow.fs
        except ImportError:
            return fs
        if "://" not in self.path or self.path.startswith("file://"):
            return pyarrow.fs.LocalFileSystem()
        return pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(fs))

    def get_best_checkpoint(self, metric: str, mode: str) -> Checkpoint | None:
        """The checkpoint of `best_checkpoints` with the highest (mode "max") or lowest ("min") `metric`."""
        if mode not in ("max", "min"):
            raise ValueError(f"get_best_checkpoint: mode must be 'max' or 'min', got {mode!r}")
        if not self.best_checkpoints:
            raise RuntimeError(f"the run at {self.path} has no committed checkpoint: report one with "
                               "report(metrics, checkpoint=Checkpoint.from_directory(d))")
        scored = [(c, v) for c, mt in self.best_checkpoints if _is_number(v := _lookup(mt, metric))]
        if not scored:
            seen = sorted({k for _, mt in self.best_checkpoints for k in mt})
            raise RuntimeError(f"no checkpoint of the run at {self.path} has a number for metric {metric!r}; "
                               f"their metrics are {seen}")
        pick = max if mode == "max" else min
        return pick(scored, key=lambda cv: cv[1])[0]

    @classmethod
    def from_path(cls, path: str | os.PathLike[str], storage_filesystem: Any = None) -> "Result":
        """The result of the run whose directory is `path` ({storage_path}/{name}), finished or not."""
        from outlast.storage import open_storage
        from outlast.storage.run_store import RunStore

        if storage_filesystem is not None:
            raise ValueError("Result.from_path(storage_filesystem=...) is not supported: give the path as a URL "
                             "(s3://bucket/prefix/name, gs://...), with credentials the usual way for that store")
        text = os.fspath(path).rstrip("/")
        parent, _, name = text.rpartition("/")
        if not name:
            raise ValueError(f"Result.from_path: {path!r} names no run directory")
        storage = open_storage(parent or ".")
        store = RunStore(storage, name)
        state = store.load_state()
        if state is None:
            raise RuntimeError(f"{storage.uri(name)} has no run_state.json: is it a run directory "
                               "({storage_path}/{name}) written by outlast?")
        return build_result(state, storage, store)


def build_result(state: RunState, storage: "Storage", store: "RunStore", num_to_keep: int | None = None,
                 score_attribute: str | None = None, score_order: str = "max",
                 error: BaseException | None = None, return_key: bytes | None = None) -> Result:
    """The run's result; its return value only with the key of the driver whose workers sealed it
    (train/return_value.py): from storage alone, `return_value` is None."""
    def checkpoint(record: CheckpointRecord) -> Checkpoint:
        local = storage.local_path(store.path(record.checkpoint_dir))
        return Checkpoint(local if local is not None else storage.uri(store.path(record.checkpoint_dir)))

    latest = next((c for c in state.checkpoints if c.checkpoint_dir == state.latest_checkpoint), None)
    best = rank_checkpoints(state.checkpoints, num_to_keep, score_attribute, score_order)
    return Result(
        metrics=dict(latest.metrics) if latest else None,
        checkpoint=checkpoint(latest) if latest else None,
        path=storage.uri(store.run_dir),
        error=error,
        best_checkpoints=[(checkpoint(c), dict(c.metrics)) for c in best],
        return_value=return_value.read(storage, store, return_key) if state.status == "finished" else None,
        last_metrics=state.last_metrics,
    )


def rank_checkpoints(records: list[CheckpointRecord], num_to_keep: int | None, score_attribute: str | None,
                     score_order: str) -> list[CheckpointRecord]:
    """Kept checkpoints worst first, best last (report order without a score), at most `num_to_keep`.

    A checkpoint without a number for the score ranks below every scored one; ties go to the later report.
    """
    if score_attribute is None:
        ranked = sorted(records, key=lambda r: r.seq)
    else:
        sign = 1.0 if score_order == "max" else -1.0

        def score(r: CheckpointRecord) -> tuple[int, float, int]:
            value = _lookup(r.metrics, score_attribute)
            return (1, sign * float(value), r.seq) if _is_number(value) else (0, 0.0, r.seq)

        ranked = sorted(records, key=score)
    return ranked[-num_to_keep:] if num_to_keep else ranked


def _lookup(metrics: dict[str, Any], key: str) -> Any:
    """`key` in `metrics`, or in nested dicts along its '/'-separated parts, as Ray looks up flattened keys."""
    if key in metrics:
        return metrics[key]
    value: Any = metrics
    for part in key.split("/"):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
