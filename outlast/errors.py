"""Public errors of `outlast.train`. Each says what happened and what to change."""

from __future__ import annotations

from outlast.protocol.kinds import NODE_KINDS
from outlast.storage.naming import CheckpointNameError as CheckpointNameError  # report(checkpoint_dir_name=...)
from outlast.storage.records import FailureRecord
from outlast.storage.records import NewerVersionError as NewerVersionError  # a run written by a newer outlast


class TrainingFailedError(RuntimeError):
    """The run could not finish: every failure is in `failures`, the root cause first."""

    def __init__(self, message: str, failures: list[FailureRecord] | None = None) -> None:
        super().__init__(message)
        self.failures: list[FailureRecord] = list(failures or [])

    @property
    def root_cause(self) -> FailureRecord | None:
        return self.failures[0] if self.failures else None

    def __reduce__(self) -> tuple[type[RuntimeError], tuple[object, ...]]:
        return (type(self), (self.args[0], self.failures))


class WorkerFailure(RuntimeError):
    """One rank's failure as an exception (`WorkerGroupError.worker_failures`); `record` has every detail."""

    def __init__(self, record: FailureRecord) -> None:
        super().__init__(record.describe())
        self.record = record

    def __reduce__(self) -> tuple[type[RuntimeError], tuple[object, ...]]:
        return (type(self), (self.record,))


class WorkerGroupError(TrainingFailedError):
    """Training workers failed more often than `FailureConfig.max_failures` allows.

    `worker_failures` maps each rank that failed in the last attempt to its failure.
    """

    def __init__(self, message: str, failures: list[FailureRecord] | None = None) -> None:
        super().__init__(message, failures)
        last = max((f.attempt for f in self.failures), default=None)
        self.worker_failures: dict[int, Exception] = {
            f.rank: WorkerFailure(f) for f in self.failures if f.attempt == last}


class ControllerError(TrainingFailedError):
    """The run stopped for a reason outside the training workers (no node answered, the run's lease
    was lost, workers never started); `controller_failure` is that reason as an exception."""

    def __init__(self, message: str, failures: list[FailureRecord] | None = None) -> None:
        super().__init__(message, failures)
        self.controller_failure: Exception = RuntimeError(message)


def classify(error: TrainingFailedError) -> TrainingFailedError:
    """The error `fit()` raises, with Ray's classes: a run whose last attempt ended with failed workers
    raises `WorkerGroupError`, any other stop `ControllerError`. Subclasses pass through."""
    if type(error) is not TrainingFailedError:
        return error
    last = max((f.attempt for f in error.failures), default=None)
    in_last = [f for f in error.failures if f.attempt == last and f.kind not in NODE_KINDS]
    cls = WorkerGroupError if in_last else ControllerError
    new = cls(error.args[0], error.failures)
    new.__cause__ = error.__cause__
    return new


class WorkerSetupError(RuntimeError):
    """A worker cannot be set up on its node, and trying again would fail the same way (use_gpu=True where
    no CUDA device is visible): the run fails at once instead of spending max_failures on identical tries."""


class RendezvousError(RuntimeError):
    """The ranks of an attempt could not meet in the process group outlast sets up for them (its store, gloo's
    or NCCL's connections): a failure of outlast's own set-up, before the train function ran. It is retried on
    a budget of its own and not charged to FailureConfig.max_failures (outlast/controller/setup_failures.py)."""


class CollectiveTimeoutError(RuntimeError):
    """A barrier or broadcast waited longer than its timeout; names the ranks that never came."""

    def __init__(self, message: str, missing_ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.missing_ranks = list(missing_ranks or [])

    def __reduce__(self) -> tuple[type[RuntimeError], tuple[object, ...]]:
        return (type(self), (self.args[0], self.missing_ranks))


class CheckpointCommitError(RuntimeError):
    """A reported checkpoint could not be committed; the previous committed one stays the latest."""


class NotInWorkerError(RuntimeError):
    """A worker-only function was called outside a training worker."""


class RunInUseError(RuntimeError):
    """Another live driver holds the run's lease; the message names it."""


class PreemptionError(TrainingFailedError):
    """The run was preempted more often than `FailureConfig.max_preemption_failures` allows."""
