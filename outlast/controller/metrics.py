"""The driver's Prometheus metrics, per run (`$OUTLAST_DRIVER_METRICS_PORT`).

The core decides and knows nothing of metrics: the loop (`runtime.py`) shows every step's
event, the effects that came out and the state after it to a `RunMetrics`, which counts what
went by: reports, commits (with their bytes and how long they took), attempts, restores,
failures by kind, preemptions and the time from a notice to the checkpoint that answered it; and the run's
goodput (`outlast/storage/goodput.py`) over the attempts this driver ran, from its history and the reports it saw.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import msgspec

from outlast.controller import group as g
from outlast.controller.states import State
from outlast.metrics import Endpoint, prometheus, serve
from outlast.protocol import messages as m
from outlast.storage import goodput
from outlast.storage.records import ReportEntry

if TYPE_CHECKING:
    from outlast.controller.core import ControllerCore
    from outlast.controller.effects import StorageEffect, TierAsk

# Seconds: a report's wait spans a fast local commit to a slow upload of a large checkpoint.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# Each split of the goodput reads every report this driver saw: it is made again once this many times its own
# cost has gone by (every step on a small run; rarer as the reports pile up).
GOODPUT_SHARE = 10


class DriverMetrics:
    """One registry per driver process, served once; each run's series carry `run=NAME`."""

    _shared: "DriverMetrics | None" = None

    def __init__(self, where: Endpoint) -> None:
        c = prometheus()
        self.registry = r = c.CollectorRegistry()
        run = ["run"]
        self.steps = c.Counter("outlast_run_steps_reported_total", "Steps reported (rank 0's reports)", run,
                               registry=r)
        self.report_latency = c.Histogram(
            "outlast_run_report_latency_seconds",
            "From a checkpoint's first report by any rank to its commit: what report(checkpoint=...) waits",
            run, buckets=LATENCY_BUCKETS, registry=r)
        self.commit_latency = c.Histogram(
            "outlast_run_commit_latency_seconds",
            "The commit itself, once every rank has reported: the manifest and the run state written",
            run, buckets=LATENCY_BUCKETS, registry=r)
        self.commits = c.Counter("outlast_run_checkpoints_committed_total", "Checkpoints committed", run, registry=r)
        self.checkpoint_bytes = c.Counter("outlast_run_checkpoint_bytes_total", "Bytes of committed checkpoints",
                                          run, registry=r)
        self.upload_rate = c.Gauge("outlast_run_checkpoint_upload_bytes_per_second",
                                   "The latest checkpoint's bytes over its first report to its commit", run,
                                   registry=r)
        self.attempts = c.Counter("outlast_run_attempts_total", "Attempts started (each a whole group of workers)",
                                  run, registry=r)
        self.restores = c.Counter("outlast_run_restores_total", "Attempts that started from a checkpoint", run,
                                  registry=r)
        self.failures = c.Counter("outlast_run_failures_total",
                                  "Attempts ended by a failure, by kind (the root cause's)", run + ["kind"],
                                  registry=r)
        self.preemptions = c.Counter("outlast_run_preemptions_total", "Preemption notices that reached the run",
                                     run, registry=r)
        self.notice_to_commit = c.Histogram(
            "outlast_run_preemption_notice_to_commit_seconds",
            "From a preemption notice to the commit of the checkpoint saved for it", run,
            buckets=LATENCY_BUCKETS, registry=r)
        self.goodput: dict[str, goodput.Goodput] = {}  # run -> its newest split, replaced whole (never torn)
        r.register(_GoodputCollector(self.goodput))
        self.server, self.url = serve(r, where)

    @classmethod
    def shared(cls, where: Endpoint) -> "DriverMetrics":
        """The process's endpoint: the first run asks for it, later runs share it."""
        if cls._shared is None:
            cls._shared = cls(where)
        return cls._shared

    @classmethod
    def serving(cls) -> str | None:
        """The URL of this process's endpoint, None before a run asked for one."""
        return cls._shared.url if cls._shared is not None else None

    def for_run(self, name: str) -> "RunMetrics":
        return RunMetrics(self, name)


class RunMetrics:
    """Watches one run's loop: `observe` after each step of the core."""

    def __init__(self, d: DriverMetrics, name: str) -> None:
        self.d, self.name = d, name
        self._pending: dict[tuple[int, int], list[float]] = {}  # (attempt, index) -> [first report at, bytes]
        self._attempts_seen: set[int] = set()
        self._failures_seen: dict[str, int] | None = None
        self._kind: State | None = None
        self._notice_at: float | None = None
        self._seq = -1  # the newest commit counted
        # Goodput over this driver's attempts (those begun after it started): an earlier driver's reports are on
        # storage, not here.
        self._born = time.time()
        self._reports: dict[int, list[ReportEntry]] = {}
        self._split_at = self._split_cost = 0.0
        self._ended = 0
        for series in (d.steps, d.report_latency, d.commit_latency, d.commits, d.checkpoint_bytes, d.attempts,
                       d.restores, d.preemptions, d.notice_to_commit):
            series.labels(name)  # shown at zero from the start

    def observe(self, event: Any, effects: list[g.Effect | StorageEffect | TierAsk], core: "ControllerCore",
                start: float, end: float) -> None:
        history = core.book.state
        if self._failures_seen is None:  # a resumed run's earlier failures and commits are history, not news
            self._failures_seen = dict(history.failure_counts)
            self._seq = max((c.seq for c in history.checkpoints), default=-1)
        if isinstance(event, g.FromWorker):
            self._on_worker(event.msg, start, core.wall())
        for effect in effects:
            if isinstance(effect, g.Spawn):
                self._on_spawn(effect.msg)
        for c in history.checkpoints:  # the history, not the ranks' answers: a restart may cut those short
            if c.seq > self._seq:
                self._seq = c.seq
                self._on_committed(c.attempt, c.report_index, start, end)
        for failure_kind, count in core.book.state.failure_counts.items():
            new = count - self._failures_seen.get(failure_kind, 0)
            if new > 0:
                self.d.failures.labels(self.name, failure_kind).inc(new)
                self._failures_seen[failure_kind] = count
        kind = core.state.kind
        if kind != self._kind and kind == State.PREEMPTING:
            self.d.preemptions.labels(self.name).inc()
            self._notice_at = start
        self._kind = kind
        ended = sum(a.ended_at is not None for a in history.attempts)
        # At each attempt's end, and otherwise as often as the split costs at most a tenth of the loop's time.
        if ended != self._ended or end - self._split_at >= GOODPUT_SHARE * self._split_cost:
            began = time.perf_counter()
            mine = msgspec.structs.replace(history, attempts=[a for a in history.attempts if a.started_at >= self._born])
            self.d.goodput[self.name] = goodput.split(mine, self._reports, core.wall())
            self._split_at, self._ended, self._split_cost = end, ended, time.perf_counter() - began

    def _on_worker(self, msg: m.WorkerMessage, now: float, wall: float) -> None:
        if isinstance(msg, m.Report):
            if msg.rank == 0:
                self.d.steps.labels(self.name).inc()
                self._reports.setdefault(msg.attempt, []).append(
                    ReportEntry(index=msg.index, time=wall, metrics={}, stalled_s=msg.stalled_s))
            if msg.checkpoint_dir or msg.files or msg.upload_pending:
                pending = self._pending.setdefault((msg.attempt, msg.index), [now, 0])
                pending[1] += sum(f.size for f in msg.files)
        elif isinstance(msg, m.UploadDone) and (msg.attempt, msg.index) in self._pending:
            self._pending[(msg.attempt, msg.index)][1] += sum(f.size for f in msg.files)

    def _on_spawn(self, msg: m.SpawnWorkers) -> None:
        if msg.attempt in self._attempts_seen:
            return  # the same attempt's spawn on its other nodes
        self._attempts_seen.add(msg.attempt)
        self.d.attempts.labels(self.name).inc()
        if msg.restore_checkpoint:
            self.d.restores.labels(self.name).inc()
        self._pending = {k: v for k, v in self._pending.items() if k[0] >= msg.attempt}

    def _on_committed(self, attempt: int, index: int, start: float, end: float) -> None:
        self.d.commits.labels(self.name).inc()
        self.d.commit_latency.labels(self.name).observe(max(end - start, 0.0))
        pending = self._pending.pop((attempt, index), None)
        if pending is not None:  # its reports were seen (not so for one reported before a relaunch)
            first, size = pending
            waited = max(end - first, 0.0)
            self.d.report_latency.labels(self.name).observe(waited)
            self.d.checkpoint_bytes.labels(self.name).inc(size)
            if waited > 0:
                self.d.upload_rate.labels(self.name).set(size / waited)
        if self._notice_at is not None:
            self.d.notice_to_commit.labels(self.name).observe(max(end - self._notice_at, 0.0))
            self._notice_at = None


class _GoodputCollector:
    """The runs' goodput, read at each scrape from the newest split of each: every part of one scrape comes from
    the same split, so the parts add up to the held time in what a scraper sees."""

    def __init__(self, splits: dict[str, goodput.Goodput]) -> None:
        self.splits = splits

    def describe(self) -> list[Any]:
        return []  # read at scrape time only: nothing to check when registering

    def collect(self) -> Any:
        GaugeMetricFamily = prometheus().metrics_core.GaugeMetricFamily  # the registry that calls this has it
        held = GaugeMetricFamily("outlast_run_held_seconds",
                                 "Wall time this driver's attempts of the run held their workers", labels=["run"])
        parts = GaugeMetricFamily("outlast_run_goodput_seconds",
                                  "The held time by part (docs/guide/watching.md); the parts add up to "
                                  "outlast_run_held_seconds", labels=["run", "part"])
        ratio = GaugeMetricFamily("outlast_run_goodput_ratio", "Productive steps over the held time",
                                  labels=["run"])
        for run, split in list(self.splits.items()):
            held.add_metric([run], split.held_s)
            ratio.add_metric([run], split.fraction)
            for part, seconds in split.parts().items():
                parts.add_metric([run, part], seconds)
        return [held, parts, ratio]
