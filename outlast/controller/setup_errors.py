"""Failures that no retry can mend: a worker that cannot be set up the same way every time.

An import error while the worker loads the train function (a module missing on the nodes,
or one that raises as it is imported) and a `WorkerSetupError` (use_gpu=True where no CUDA
device is visible) happen before the train function runs, depend on nothing that changes
between attempts, and would fail every retry the same way: the run fails at once with that
error, and max_failures is not spent on identical tries. The same exception raised by the
train function itself is not judged here: it may depend on what the attempt restores.
"""

from __future__ import annotations

from outlast.storage.records import FailureRecord

DETERMINISTIC = frozenset({"ModuleNotFoundError", "ImportError", "WorkerSetupError"})


def no_retry_can_mend(f: FailureRecord) -> str | None:
    """Why retrying `f` is pointless, or None."""
    if f.phase != "setup" or f.exc_type not in DETERMINISTIC:
        return None
    return (f"{f.describe()}\nThis happened while setting up the worker, before the train function ran, and every "
            "retry would fail the same way, so the run fails now (max_failures is not spent). Fix it and launch the "
            "run again: it resumes from its latest checkpoint")
