"""outlast's training API, with the names and shapes of Ray Train (V2).

A Ray Train script ports by changing `ray.train` to `outlast.train` in its imports.
"""

from __future__ import annotations

from typing import Any

from outlast.train import collective
from outlast.train._session import get_session
from outlast.train.checkpoint import Checkpoint, CheckpointUploadMode
from outlast.train.config import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from outlast.train.context import TrainContext
from outlast.errors import (
    CheckpointCommitError, CollectiveTimeoutError, PreemptionError, RunInUseError, TrainingFailedError,
)
from outlast.train.preemption import PreemptionInfo
from outlast.train.result import Result
from outlast.train.trainer import DataParallelTrainer, Trainer


def report(
    metrics: dict[str, Any],
    checkpoint: Checkpoint | None = None,
    checkpoint_upload_mode: CheckpointUploadMode = CheckpointUploadMode.SYNC,
    delete_local_checkpoint_after_upload: bool | None = None,
) -> None:
    """Report metrics, and optionally a checkpoint, from every rank.

    Every rank must call `report()` the same number of times. Without a checkpoint it
    returns at once. With one (SYNC), it returns once the checkpoint is committed: from
    then on a failure restores it. With ASYNC it returns at once and the files upload in
    the background; keep the directory until then (it is deleted after the upload
    unless `delete_local_checkpoint_after_upload=False`).
    """
    get_session("report").report(metrics, checkpoint, checkpoint_upload_mode, delete_local_checkpoint_after_upload)


def get_checkpoint() -> Checkpoint | None:
    """The checkpoint this attempt restores from (the latest committed one), or None."""
    return get_session("get_checkpoint").get_checkpoint()


def get_preemption_info() -> PreemptionInfo | None:
    """None, or the notice that some ranks' nodes are going away: the same on every rank, from
    the same call on, with no waiting for other ranks. Costs well under a microsecond while
    nothing is pending; a notice reaches the loop within about half a second."""
    return get_session("get_preemption_info").get_preemption_info()


def get_context() -> TrainContext:
    return get_session("get_context").context


__all__ = [
    "Checkpoint", "CheckpointCommitError", "CheckpointUploadMode", "collective", "CheckpointConfig", "CollectiveTimeoutError", "DataParallelTrainer",
    "FailureConfig", "PreemptionError", "PreemptionInfo", "Result", "RunInUseError", "RunConfig", "ScalingConfig",
    "TrainContext", "Trainer", "TrainingFailedError",
    "get_checkpoint", "get_context", "get_preemption_info", "report",
]
