"""Retrying a storage call that failed for a while (an outage, throttling), with backoff.

What is retried: any `OSError` (every storage error is one: `StorageError` wraps the object
stores' own), except those that waiting cannot mend: a path that is not there, a permission
refused. The budget is the time spent waiting between tries, `OUTLAST_STORAGE_RETRY_S`
(default 60 s); past it, the error is raised. `sleep` is injected, so the simulator waits on
its own clock.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, TypeVar

import tenacity

from outlast.protocol.messages import FileEntry
from outlast.storage.base import Storage, StorageError, StorageFenced

log = logging.getLogger("outlast.storage")

T = TypeVar("T")

RETRY_S_VAR = "OUTLAST_STORAGE_RETRY_S"
DEFAULT_RETRY_S = 60.0


def retry_budget_s(env: Mapping[str, str] = os.environ) -> float:
    text = env.get(RETRY_S_VAR)
    if text is None:
        return DEFAULT_RETRY_S
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{RETRY_S_VAR}={text!r} is not a number of seconds; set it to e.g. 60") from None
    if value < 0:
        raise ValueError(f"{RETRY_S_VAR}={text!r} is negative; set it to 0 (no retries) or more")
    return value


def transient(e: BaseException) -> bool:
    return isinstance(e, OSError) and not isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError,
                                                         NotADirectoryError, StorageFenced))


class Retrying:
    """Tries until the call succeeds, fails for good, or `budget_s` of waiting is spent; then re-raises.

    Almost every storage call succeeds at its first try: that try is made directly, and tenacity's
    machinery (a `tenacity.Retrying` and its state, a few dozen calls) is built only once it fails,
    from that failure on, so the tries, waits and `on_retry` calls are those tenacity makes alone.
    The controller makes a storage call for every run state it writes."""

    def __init__(self, budget_s: float, sleep: Callable[[float], None] = time.sleep,
                 on_retry: Callable[[tenacity.RetryCallState], None] | None = None) -> None:
        self.budget_s, self.sleep, self.on_retry = budget_s, sleep, on_retry

    def __call__(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        try:
            return fn(*args, **kwargs)
        except OSError as e:
            if not transient(e):
                raise
            first: OSError | None = e

        def again(*args: Any, **kwargs: Any) -> T:  # tenacity's first try is the one that failed above
            nonlocal first
            if first is not None:
                failed, first = first, None
                raise failed
            return fn(*args, **kwargs)

        return tenacity.Retrying(
            retry=tenacity.retry_if_exception(transient),
            wait=tenacity.wait_exponential(multiplier=0.25, min=0.25, max=5.0),
            stop=lambda state: state.idle_for >= self.budget_s,
            sleep=self.sleep, reraise=True, before_sleep=self.on_retry,
        )(again, *args, **kwargs)


_UPLOAD_TRIES = int(os.environ.get("OUTLAST_UPLOAD_TRIES", "4"))


def upload_with_retries(storage: Storage, local_dir: str, dest: str, move: bool = False,
                        replace: bool = True) -> list[FileEntry]:
    """A storage hiccup costs a retry with backoff, not the checkpoint."""
    retry = tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(StorageError), stop=tenacity.stop_after_attempt(_UPLOAD_TRIES),
        wait=tenacity.wait_exponential(multiplier=0.2, max=5), reraise=True,
        before_sleep=lambda state: log.warning("upload to %s failed (%s); retrying", dest,
                                               state.outcome.exception() if state.outcome is not None else None),
    )
    # `move`: the caller deletes the local files after the upload anyway, so storage on the
    # same file system may link them into place instead of copying.
    return retry(storage.upload_dir, Path(local_dir), dest, move=move, replace=replace)
