"""outlast: distributed training and memory-hungry work that outlasts failures.

`outlast.train` is the training API; `outlast.Executor` runs tasks on the node with memory
safety. Names load on first use, so `import outlast.train` stays as light as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what a type checker reads for the names below; at run time they load on first use
    from outlast.executor import Executor as Executor
    from outlast.executor import OutOfMemoryError as OutOfMemoryError
    from outlast.executor import TaskFailedError as TaskFailedError
    from outlast.isolation.config import IsolationConfig as IsolationConfig

_LAZY = {
    "Executor": "outlast.executor",
    "OutOfMemoryError": "outlast.executor",
    "TaskFailedError": "outlast.executor",
    "IsolationConfig": "outlast.isolation.config",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'outlast' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = sorted(_LAZY)
