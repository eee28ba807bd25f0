"""`outlast.Executor`: memory-safe task execution on an outlast node."""

from outlast.executor.errors import OutOfMemoryError, TaskFailedError
from outlast.executor.runtime import Executor

__all__ = ["Executor", "OutOfMemoryError", "TaskFailedError"]
