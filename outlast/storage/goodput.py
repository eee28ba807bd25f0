"""Goodput: of the wall time a run held its workers, how much went into steps that stayed, and where the rest went.

Pure: `split(state, reports, now)` takes the run's history (`RunState`) and rank 0's reports by attempt
(`ReportEntry`, as `RunStore.read_reports` gives them) and returns a `Goodput`. It reads no clock and no storage,
so `outlast runs`, the dashboard and the driver's Prometheus metrics compute the same figures from the same data.

The whole is the sum of the attempts' spans, from each attempt's start (`AttemptRecord.started_at`: its placing
began) to its end (or `now`, for one still going). A gap between two attempts is counted only when one driver
ran both (it ends one and begins the next in the same step); the time between a driver that died and the
driver relaunched after it held no workers, and is left out.

Each attempt's span is cut at its reports' arrival times (`ReportEntry.time`, the driver's wall clock, the clock
of every other time in the history), and each piece gets exactly one part, so the parts add up to the whole by
construction (docs/guide/watching.md says how each is measured):

- before the attempt's first report: start-up for the run's first attempt; for a later one, what ended the attempt
  before it (a restart, a drain); the window it waited for capacity (`waiting_since` to `capacity_at`) is waiting.
  The first step's own compute is in this piece: a report marks the end of a step, and nothing says where
  the set-up before the first one ended;
- from one report to the next: a step. It was trained again (`replayed`) when its report's progress (the reports
  made since the run began, counted through the checkpoint each attempt restored) was reached before, by an
  attempt that went further than the checkpoint restored; else it is productive. Either way, the time the rank
  spent in `report()` with a checkpoint (`ReportEntry.stalled_s`) is taken out as a checkpoint stall;
- after the attempt's last report: what ended it. A hang, from the last report to its detection
  (`HangRecord.time`), then a restart (a hang before the first report stays in the piece before it: nothing marks
  where it began); a failure or a resize, a restart (the step in flight at a failure is lost
  with it, so the restart begins where the last step that finished ended); a drain notice that reached the
  attempt, a drain; a finished or stopped run, its ending (the last checkpoint's commit, the workers' exit); an
  attempt still going, the step in flight.

A live recovery (`LiveRecoveryRecord`, path "live") keeps its attempt going, so its reports run on through it. The
interval from the last report before the death (the step in flight, thrown away on every rank) to the state
received (`time + seconds`) is taken out of whatever pieces it falls in and charged to live recoveries: without
it, the recovery would read as one long step.
"""

from __future__ import annotations

import math

import msgspec

from outlast.protocol.kinds import FailureKind
from outlast.storage.naming import is_default_name
from outlast.storage.records import AttemptRecord, ReportEntry, RunState

# 2: live recoveries, a part of their own (under 1 they were in productive steps, or steps trained again).
GOODPUT_VERSION = 2

# The parts, in the order they are shown.
PARTS = ("productive", "startup", "waiting", "restarts", "live_recoveries", "replayed", "checkpoint_stalls", "drains",
         "hangs", "ending", "in_flight")


class Goodput(msgspec.Struct, frozen=True, kw_only=True):
    """Seconds of the run's held wall time, part by part; `held_s` is their sum."""

    version: int = GOODPUT_VERSION
    held_s: float
    fraction: float = 0.0  # productive over held: the run's goodput (0 for a run that held nothing yet)
    productive_s: float = 0.0  # steps that stayed
    startup_s: float = 0.0  # the first attempt, to its first report
    waiting_s: float = 0.0  # waiting for capacity, in any attempt
    restarts_s: float = 0.0  # from the end of the last step before a failure (or resize) to the next first report
    live_recoveries_s: float = 0.0  # from the last report before a death that live recovery answered to the state received
    replayed_s: float = 0.0  # steps trained again after a restore
    checkpoint_stalls_s: float = 0.0  # rank 0 in report() with a checkpoint
    drains_s: float = 0.0  # from a drain notice's last step to the next attempt's first report
    hangs_s: float = 0.0  # from the last report before a hang to its detection
    ending_s: float = 0.0  # from a finished or stopped run's last report to its end
    in_flight_s: float = 0.0  # a live run: since its newest report, not judged yet
    steps: int = 0  # reports that closed a productive step
    replayed_steps: int = 0
    complete: bool = True  # False: an attempt restored a checkpoint the history no longer names (replays unknown)

    def parts(self) -> dict[str, float]:
        return {p: getattr(self, f"{p}_s") for p in PARTS}


def split(state: RunState, reports: dict[int, list[ReportEntry]], now: float) -> Goodput:
    acc = dict.fromkeys(PARTS, 0.0)
    steps = replayed_steps = 0
    progress = _Progress(state)
    hangs = {h.attempt: h.time for h in state.hangs}
    drained = {d.attempt: d.time for d in state.drains}
    deaths: dict[int, list[tuple[float, float]]] = {}
    for rec in state.live_recoveries:
        if rec.path == "live" and rec.seconds is not None and math.isfinite(rec.time) and math.isfinite(rec.seconds):
            deaths.setdefault(rec.attempt, []).append((rec.time, rec.time + max(rec.seconds, 0.0)))
    before = "startup"  # what the piece before an attempt's first report is charged to
    for a in state.attempts:
        start = a.started_at
        end = a.ended_at if a.ended_at is not None else max(now, start)
        if not (math.isfinite(start) and math.isfinite(end)):
            continue  # a history that says no time (a number too large for a float) held none that can be told
        got = sorted((r for r in reports.get(a.attempt, []) if start <= r.time <= end), key=lambda r: r.time)
        waits = _waiting(a, end)
        lives = _live_windows(deaths.get(a.attempt, []), [r.time for r in got])
        first = got[0].time if got else end
        _add(acc, before, start, first, waits, lives)
        base, reached = progress.enter(a)
        for prev, r in zip(got, got[1:]):
            length = r.time - prev.time
            stall = min(max(r.stalled_s, 0.0), length) if math.isfinite(r.stalled_s) else 0.0
            live = min(_overlap(prev.time, r.time, lives), length - stall)
            acc["checkpoint_stalls"] += stall
            acc["live_recoveries"] += live
            if base + r.index + 1 <= reached:
                acc["replayed"] += length - stall - live
                replayed_steps += 1
            else:
                acc["productive"] += length - stall - live
                steps += 1
        progress.leave(a, base + (got[-1].index + 1 if got else 0))
        tail, before = _tail(a, hangs.get(a.attempt), drained.get(a.attempt))
        last = got[-1].time if got else first
        if tail == "hang":
            detected = min(max(hangs[a.attempt], last), end)
            _add(acc, "hangs", last, detected, waits, lives)
            _add(acc, "restarts", detected, end, waits, lives)
        else:
            _add(acc, tail, last, end, waits, lives)
    held = sum(acc.values())
    return Goodput(held_s=held, fraction=acc["productive"] / held if held > 0 else 0.0, steps=steps,
                   replayed_steps=replayed_steps, complete=progress.complete, productive_s=acc["productive"],
                   startup_s=acc["startup"], waiting_s=acc["waiting"], restarts_s=acc["restarts"],
                   live_recoveries_s=acc["live_recoveries"], replayed_s=acc["replayed"], checkpoint_stalls_s=acc["checkpoint_stalls"], drains_s=acc["drains"],
                   hangs_s=acc["hangs"], ending_s=acc["ending"], in_flight_s=acc["in_flight"])


def _waiting(a: AttemptRecord, end: float) -> tuple[float, float] | None:
    if a.waiting_since is None:
        return None
    return a.waiting_since, min(a.capacity_at if a.capacity_at is not None else end, end)


def _live_windows(deaths: list[tuple[float, float]], times: list[float]) -> list[tuple[float, float]]:
    """The attempt's live recoveries as disjoint windows, each from the last report at or before its death (or
    the death, before the first report) to the state received."""
    windows = sorted((max((t for t in times if t <= died), default=died), received) for died, received in deaths)
    merged: list[tuple[float, float]] = []
    for lo, hi in windows:
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def _overlap(lo: float, hi: float, windows: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(hi, w_hi) - max(lo, w_lo)) for w_lo, w_hi in windows)


def _add(acc: dict[str, float], part: str, lo: float, hi: float, waits: tuple[float, float] | None,
         lives: list[tuple[float, float]]) -> None:
    """[lo, hi] to `part`, but for the window the attempt waited for capacity, which is always waiting, and its
    live recoveries' (a live recovery never waits for capacity: its attempt holds its workers)."""
    if hi <= lo:
        return
    overlap = 0.0
    if waits is not None:
        overlap = max(0.0, min(hi, waits[1]) - max(lo, waits[0]))
    live = min(_overlap(lo, hi, lives), hi - lo - overlap)
    acc["waiting"] += overlap
    acc["live_recoveries"] += live
    acc[part] += hi - lo - overlap - live


def _tail(a: AttemptRecord, hang_at: float | None, drain_at: float | None) -> tuple[str, str]:
    """What the time after the attempt's last report is, and what the next attempt's start-up is charged to."""
    if a.ended_at is None:
        # Live: the step in flight. A run whose driver died without ending it reads the same until a driver
        # is launched again and closes the attempt (`driver_lost`).
        return ("hang" if hang_at is not None else "in_flight"), "restarts"
    if drain_at is not None and drain_at <= a.ended_at:
        return "drains", "drains"
    if hang_at is not None or any(f.kind is FailureKind.HANG for f in a.failures):
        return ("hang" if hang_at is not None else "restarts"), "restarts"
    if a.outcome in ("failed", "resized", "driver_lost") or a.failures and a.outcome != "finished":
        return "restarts", "restarts"
    return "ending", "restarts"


class _Progress:
    """Reports made since the run began, counted through restores: an attempt that restored the checkpoint of
    report i of attempt b starts where b's report i left the run."""

    def __init__(self, state: RunState) -> None:
        self.by_dir = {c.checkpoint_dir: (c.attempt, c.report_index) for c in state.checkpoints}
        self.bases: dict[int, int] = {}
        self.reached = 0
        self.complete = True

    def enter(self, a: AttemptRecord) -> tuple[int, int]:
        """The attempt's base (the progress it restored) and the furthest progress reached before it."""
        base = 0
        if a.restored_from:
            where = self.by_dir.get(a.restored_from) or _from_default_name(a.restored_from)
            if where is None or where[0] not in self.bases:
                # Deleted by retention under a name of the user's: what it restored is unknown, so nothing
                # of this attempt counts as trained again.
                self.complete = False
                base = self.reached
            else:
                base = self.bases[where[0]] + where[1] + 1
        self.bases[a.attempt] = base
        return base, self.reached

    def leave(self, a: AttemptRecord, made: int) -> None:
        self.reached = max(self.reached, made)


def _from_default_name(name: str) -> tuple[int, int] | None:
    if not is_default_name(name):
        return None
    _, attempt, index = name.split("_")
    return int(attempt), int(index)


def describe(g: Goodput) -> list[str]:
    """Lines for a terminal: the fraction, then each part that is not zero, largest first."""
    if g.held_s <= 0:
        return ["goodput: nothing held yet"]
    lines = [f"goodput: {100 * g.fraction:.1f}% of {g.held_s:.1f} s held went into steps that stayed "
             f"({g.steps} steps{f', {g.replayed_steps} trained again' if g.replayed_steps else ''})"]
    for part, s in sorted(g.parts().items(), key=lambda kv: -kv[1]):
        if s > 0:
            lines.append(f"  {LABELS[part]:28} {s:10.1f} s  {100 * s / g.held_s:5.1f}%")
    if not g.complete:
        lines.append("  (a restored checkpoint is no longer in the history: its attempt's replayed steps are "
                     "counted as productive)")
    return lines


LABELS = {"productive": "productive steps", "startup": "start-up", "waiting": "waiting for capacity",
          "restarts": "restarts", "live_recoveries": "live recoveries", "replayed": "steps trained again", "checkpoint_stalls": "checkpoint stalls",
          "drains": "drains", "hangs": "hangs until detected", "ending": "ending",
          "in_flight": "step in flight"}
