"""Which runs' output files under `$OUTLAST_HOME/logs/` a node removes, so that a long-lived node
does not fill its disk with them.

A run's files (one directory per run, a file per rank and attempt: outlast/agent/output.py) are
kept while the run is among the node's `keep_runs` most recently written, or was written within
`keep_hours`, or is still being written; `outlast runs --logs` reads a dead rank's last lines
from them, so they outlive the run for a while. The decision is pure; `prune` applies it. The
agent prunes at its start and at each run's end.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import msgspec

KEEP_RUNS_ENV = "OUTLAST_LOG_KEEP_RUNS"
KEEP_HOURS_ENV = "OUTLAST_LOG_KEEP_HOURS"

log = logging.getLogger("outlast.agent")


class Retention(msgspec.Struct, frozen=True):
    keep_runs: int = 20
    keep_hours: float = 24.0


class RunLogs(msgspec.Struct, frozen=True):
    name: str  # the run's directory under the log directory
    mtime: float  # when any of its files was last written (wall clock)


class Removal(msgspec.Struct, frozen=True):
    name: str
    reason: str


def retention_from_env(env: Mapping[str, str] = os.environ) -> Retention:
    """The settings, or `ValueError` saying which variable is wrong and what it takes."""
    runs, hours = env.get(KEEP_RUNS_ENV, "").strip(), env.get(KEEP_HOURS_ENV, "").strip()
    default = Retention()
    try:
        keep_runs = int(runs) if runs else default.keep_runs
    except ValueError:
        keep_runs = -1
    if keep_runs < 0:
        raise ValueError(f"{KEEP_RUNS_ENV}={runs!r}: give a whole number of runs, 0 or more "
                         f"(default {default.keep_runs})")
    try:
        keep_hours = float(hours) if hours else default.keep_hours
    except ValueError:
        keep_hours = -1.0
    if not 0 <= keep_hours < float("inf"):
        raise ValueError(f"{KEEP_HOURS_ENV}={hours!r}: give a number of hours, 0 or more "
                         f"(default {default.keep_hours:g})")
    return Retention(keep_runs, keep_hours)


def to_remove(runs: list[RunLogs], now: float, policy: Retention, active: set[str]) -> list[Removal]:
    """The runs whose files go, each with why; `active` names the runs still being written."""
    newest_first = sorted(runs, key=lambda r: (r.mtime, r.name), reverse=True)
    out = []
    for rank, run in enumerate(newest_first):
        age_h = (now - run.mtime) / 3600
        if run.name in active or rank < policy.keep_runs or age_h < policy.keep_hours:
            continue
        out.append(Removal(run.name, f"last written {age_h:.1f} h ago, older than {KEEP_HOURS_ENV}="
                                     f"{policy.keep_hours:g} and not among the {policy.keep_runs} most recent "
                                     f"runs ({KEEP_RUNS_ENV})"))
    return out


def scan(log_dir: Path) -> list[RunLogs]:
    """Each run directory with the newest mtime of it and its files."""
    runs = []
    try:
        entries = list(os.scandir(log_dir))
    except FileNotFoundError:
        return []
    for entry in entries:
        if not entry.is_dir(follow_symlinks=False):
            continue
        try:
            mtime = entry.stat(follow_symlinks=False).st_mtime
            for f in os.scandir(entry.path):
                mtime = max(mtime, f.stat(follow_symlinks=False).st_mtime)
        except OSError:
            continue  # removed meanwhile, or unreadable: left alone
        runs.append(RunLogs(entry.name, mtime))
    return runs


def prune(log_dir: Path, now: float, active: set[str], env: Mapping[str, str] = os.environ) -> list[Removal]:
    """Remove the run directories `to_remove` names; a bad setting removes nothing and says why."""
    try:
        policy = retention_from_env(env)
    except ValueError as e:
        log.error("keeping every run's output files under %s: %s", log_dir, e)
        return []
    done = []
    for removal in to_remove(scan(log_dir), now, policy, active):
        try:
            shutil.rmtree(log_dir / removal.name)
        except OSError as e:
            log.warning("could not remove the output files of %s under %s: %s", removal.name, log_dir, e)
            continue
        log.info("removed the output files of %s: %s", removal.name, removal.reason)
        done.append(removal)
    return done
