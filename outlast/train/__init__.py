"""outlast's training API, with the names and shapes of Ray Train (V2).

docs/ray-parity.md says, name by name, what is the same as in Ray Train, what differs and
what is not supported; `outlast run script.py` runs a Ray Train script unchanged.
"""

from __future__ import annotations

from typing import Any

from outlast.train import collective
from outlast.train import unsupported as _unsupported
from outlast.train._session import get_session
from outlast.train.checkpoint import (
    Checkpoint, CheckpointConsistencyMode, CheckpointUploadMode, ReportedCheckpoint, ReportedCheckpointStatus,
)
from outlast.train.config import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from outlast.train.context import TrainContext
from outlast.train.data import TRAIN_DATASET_KEY, DataConfig, get_dataset_shard
from outlast.errors import (
    CheckpointCommitError, CollectiveTimeoutError, ControllerError, NewerVersionError, PreemptionError, RunInUseError,
    TrainingFailedError, WorkerGroupError,
)
from outlast.train.preemption import PreemptionInfo
from outlast.train.result import Result
from outlast.train.trainer import DataParallelTrainer, Trainer


def report(
    metrics: dict[str, Any],
    checkpoint: Checkpoint | None = None,
    checkpoint_dir_name: str | None = None,
    checkpoint_upload_mode: CheckpointUploadMode = CheckpointUploadMode.SYNC,
    delete_local_checkpoint_after_upload: bool | None = None,
    checkpoint_upload_fn: Any = None,
    validation: Any = False,
) -> None:
    """Report metrics, and optionally a checkpoint, from every rank.

    Every rank must call `report()` the same number of times. Without a checkpoint it
    returns at once. With one (SYNC), it returns once the checkpoint is committed: from
    then on a failure restores it. With ASYNC it returns at once and the files upload in
    the background; keep the directory until then (it is deleted after the upload
    unless `delete_local_checkpoint_after_upload=False`).

    The checkpoint is stored under `{storage_path}/{name}/{checkpoint_dir_name}`, as on Ray, or under
    checkpoint_AAA_IIIIII without one. A name must be unique to its report across the run's
    attempts; a name already taken, or not a valid directory name, raises `CheckpointNameError`
    before anything is written. Ranks with files for the same report must pass the same name.
    """
    if checkpoint_upload_fn is not None:
        raise ValueError("report(checkpoint_upload_fn=...) is not supported: outlast uploads the checkpoint's files "
                         "to RunConfig(storage_path=...) itself, with retries, and verifies them on restore")
    if validation:
        raise ValueError("report(validation=...) is not supported: validate in the train function and report the "
                         "validation metrics with the checkpoint")
    get_session("report").report(metrics, checkpoint, checkpoint_upload_mode, delete_local_checkpoint_after_upload,
                                 checkpoint_dir_name)


def get_all_reported_checkpoints(
    consistency_mode: CheckpointConsistencyMode = CheckpointConsistencyMode.VALIDATED,
    timeout_s: float | None = None,
) -> list[ReportedCheckpoint]:
    """The run's committed checkpoints that are still kept (CheckpointConfig.num_to_keep), with their
    metrics, ordered by checkpoint_score_attribute with the best last (report order without one), as
    Ray orders them. It waits until every checkpoint this rank reported (ASYNC ones too) is committed or
    refused, and asks the controller, whose history is ahead of the run state in storage."""
    CheckpointConsistencyMode(consistency_mode)
    return get_session("get_all_reported_checkpoints").get_all_reported_checkpoints()


def get_checkpoint() -> Checkpoint | None:
    """The checkpoint this attempt restores from (the latest committed one), or None."""
    return get_session("get_checkpoint").get_checkpoint()


def get_preemption_info() -> PreemptionInfo | None:
    """None, or the notice that some ranks' nodes are going away: the same on every rank, from
    the same call on, with no waiting for other ranks. Costs well under a microsecond while
    nothing is pending; a notice reaches the loop within about half a second."""
    return get_session("get_preemption_info").get_preemption_info()


def heartbeat() -> None:
    """Tell outlast this rank is making progress, for a loop whose steps call neither report() nor
    get_preemption_info() for longer than FailureConfig.hang_timeout_s (a long evaluation, say)."""
    get_session("heartbeat").heartbeat()


def get_context() -> TrainContext:
    return get_session("get_context").context


def __getattr__(name: str):
    # Ray Train names outlast does not offer fail with what to do instead (an ImportError, which
    # `from ... import` passes on as it is); any other name is an ordinary missing attribute.
    raise _unsupported.refuse(__name__, _unsupported.TRAIN, name)


__all__ = [
    "Checkpoint", "CheckpointCommitError", "CheckpointConsistencyMode", "CheckpointUploadMode", "collective",
    "CheckpointConfig", "CollectiveTimeoutError", "ControllerError", "DataConfig", "DataParallelTrainer",
    "FailureConfig", "NewerVersionError", "PreemptionError", "PreemptionInfo", "ReportedCheckpoint",
    "ReportedCheckpointStatus", "Result",
    "RunInUseError", "RunConfig", "ScalingConfig", "TRAIN_DATASET_KEY", "TrainContext", "Trainer",
    "TrainingFailedError", "WorkerGroupError",
    "get_all_reported_checkpoints", "get_checkpoint", "get_context", "get_dataset_shard", "get_preemption_info",
    "heartbeat", "report",
]
