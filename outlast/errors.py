"""Public errors of `outlast.train`. Each says what happened and what to change."""

from __future__ import annotations

from outlast.storage.records import FailureRecord


class TrainingFailedError(RuntimeError):
    """The run could not finish: every failure is in `failures`, the root cause first."""

    def __init__(self, message: str, failures: list[FailureRecord] | None = None) -> None:
        super().__init__(message)
        self.failures: list[FailureRecord] = list(failures or [])

    @property
    def root_cause(self) -> FailureRecord | None:
        return self.failures[0] if self.failures else None

    def __reduce__(self):
        return (type(self), (self.args[0], self.failures))


class CollectiveTimeoutError(RuntimeError):
    """A barrier or broadcast waited longer than its timeout; names the ranks that never came."""

    def __init__(self, message: str, missing_ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.missing_ranks = list(missing_ranks or [])

    def __reduce__(self):
        return (type(self), (self.args[0], self.missing_ranks))


class CheckpointCommitError(RuntimeError):
    """A reported checkpoint could not be committed; the previous committed one stays the latest."""


class NotInWorkerError(RuntimeError):
    """A worker-only function was called outside a training worker."""


class RunInUseError(RuntimeError):
    """Another live driver holds the run's lease; the message names it."""


class PreemptionError(TrainingFailedError):
    """The run was preempted more often than `FailureConfig.max_preemption_failures` allows."""
