"""What to do when a task's process ends: a pure function of the task's history and its budgets."""

from __future__ import annotations

import enum
from dataclasses import dataclass


@dataclass(frozen=True)
class RetryConfig:
    max_retries: int = 3  # deaths other than outlast's memory kills (a crash, a signal)
    max_oom_retries: int = -1  # memory kills; -1: no limit (the policy lets the oldest task finish)
    retry_exceptions: bool = False  # an exception the function raised is the task's answer by default
    oom_backoff_s: float = 0.5
    oom_backoff_max_s: float = 10.0


class RetryVerdict(enum.Enum):
    RETRY = "retry"
    FAIL = "fail"


@dataclass(frozen=True)
class RetryOutcome:
    verdict: RetryVerdict
    delay_s: float
    reason: str


def on_oom_kill(kills_so_far: int, cfg: RetryConfig) -> RetryOutcome:
    """`kills_so_far` counts this kill too."""
    if 0 <= cfg.max_oom_retries < kills_so_far:
        return RetryOutcome(RetryVerdict.FAIL, 0.0, f"killed for memory {kills_so_far} time(s); max_oom_retries="
                                                    f"{cfg.max_oom_retries} is spent")
    # Backoff: memory that is tight now is usually free again once older tasks finish.
    delay = min(cfg.oom_backoff_s * 2 ** (kills_so_far - 1), cfg.oom_backoff_max_s)
    budget = "no limit" if cfg.max_oom_retries < 0 else f"{kills_so_far} of {cfg.max_oom_retries}"
    return RetryOutcome(RetryVerdict.RETRY, delay, f"killed for memory; retrying in {delay:.1f} s ({budget})")


def on_failure(failures_so_far: int, cfg: RetryConfig, raised: bool) -> RetryOutcome:
    """A death or (with retry_exceptions) an exception; `failures_so_far` counts this one."""
    if raised and not cfg.retry_exceptions:
        return RetryOutcome(RetryVerdict.FAIL, 0.0, "the task raised; retry_exceptions is off")
    if failures_so_far > cfg.max_retries:
        return RetryOutcome(RetryVerdict.FAIL, 0.0,
                            f"failed {failures_so_far} time(s); max_retries={cfg.max_retries} is spent")
    return RetryOutcome(RetryVerdict.RETRY, 0.0, f"failed; retry {failures_so_far} of {cfg.max_retries}")


def window_after_oom_kill(window: float, still_running: int) -> float:
    """Admission after a memory kill: no more at once than survived it (at least one).

    Oversubscribed tasks would otherwise start again only to be killed again; the window
    learns how many fit, as TCP learns a path's capacity.
    """
    return float(max(1, min(window, still_running)))


def window_after_success(window: float, max_workers: int) -> float:
    """Probe for room again: about one more task per window's worth of completions."""
    return min(window + 1.0 / max(window, 1.0), float(max_workers))
