"""Errors a task's future raises. Each carries what happened, as data."""

from __future__ import annotations

from outlast.protocol.messages import KillReport


class OutOfMemoryError(RuntimeError):
    """outlast killed the task for memory more often than `max_oom_retries` allows.

    `kill_report` is the last kill's report (node memory, trigger, every worker considered);
    `reports` holds the report of every kill of this task, oldest first.
    """

    def __init__(self, message: str, reports: list[KillReport] | None = None) -> None:
        super().__init__(message)
        self.reports: list[KillReport] = list(reports or [])

    @property
    def kill_report(self) -> KillReport | None:
        return self.reports[-1] if self.reports else None

    def __reduce__(self) -> tuple[type[OutOfMemoryError], tuple[str, list[KillReport]]]:
        return (type(self), (self.args[0], self.reports))


class TaskFailedError(RuntimeError):
    """The task's process died (not for memory) more often than `max_retries` allows, or its result
    could not be unpickled in the process that submitted it."""

    def __init__(self, message: str, exit_code: int | None = None, signal: int | None = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.signal = signal

    def __reduce__(self) -> tuple[type[TaskFailedError], tuple[str, int | None, int | None]]:
        return (type(self), (self.args[0], self.exit_code, self.signal))
