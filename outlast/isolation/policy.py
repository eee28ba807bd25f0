"""The memory policy: whether to kill (`judge`) and whom (`rank_for_killing`, `select_victims`).

Pure functions: they get the memory sample, the workers and `now`, and return a decision
with its reason and the full kill report. The agent carries the decision out.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from outlast.isolation.units import format_bytes
from outlast.protocol.kinds import WorkloadKind
from outlast.protocol.messages import ConsideredWorker, KillReport, Resources

POLICY = ("idle workers first; then the least work lost (a task: time since it started; a training worker: "
          "time since its run's last committed checkpoint x the run's worker count); non-retriable last; "
          "newest first on ties")


@dataclass(frozen=True)
class KillCandidate:
    """A live worker as the policy sees it (times are wall-clock seconds)."""

    name: str
    kind: WorkloadKind
    owner: str
    rank: int | None
    pid: int
    memory_bytes: int
    started_at: float
    resources: Resources = Resources()
    idle: bool = False  # being torn down already: killing it loses nothing
    retriable: bool = True
    run_world_size: int = 1
    last_commit_at: float | None = None


@dataclass(frozen=True)
class PolicyConfig:
    kill_at: float = 0.95  # judge a kill once counted memory reaches this fraction of the limit
    target: float = 0.90  # kill until counted memory would be below this fraction: the margin
    reclaim_wait_s: float = 2.0  # after victims are reaped, wait at most this long for memory to come back


@dataclass(frozen=True)
class MemorySample:
    counted_bytes: int  # workloads' anon + all shared memory: what must stay under the limit
    limit_bytes: int  # re-read at every sample
    node_total_bytes: int
    stalled: bool = False  # v1: the user cgroup is at its limit with the OOM killer off


@dataclass(frozen=True)
class Cooldown:
    """Victims of the last kill, and what memory looked like then."""

    victims: frozenset[int]  # pids
    counted_at_kill: int
    expected_freed: int
    reaped_at: float | None = None


class Action(enum.Enum):
    NONE = "none"
    WAIT = "wait"
    KILL = "kill"


@dataclass(frozen=True)
class KillDecision:
    action: Action
    reason: str
    victims: list[KillCandidate] = field(default_factory=list)
    report: KillReport | None = None


def _run_starts(candidates: list[KillCandidate]) -> dict[str, float]:
    """When each training run's current workers started: its first worker's start."""
    starts: dict[str, float] = {}
    for c in candidates:
        if c.kind is WorkloadKind.TRAINING:
            starts[c.owner] = min(starts.get(c.owner, c.started_at), c.started_at)
    return starts


def work_at_risk(c: KillCandidate, now: float, run_started: float | None = None) -> float:
    """Seconds of work that killing `c` throws away."""
    if c.idle:
        return 0.0
    if c.kind is WorkloadKind.TRAINING:
        # One death restarts the whole run from its last commit (or from its start).
        start = c.started_at if run_started is None else run_started
        since = max(start, c.last_commit_at) if c.last_commit_at is not None else start
        return max(now - since, 0.0) * max(c.run_world_size, 1)
    return max(now - c.started_at, 0.0)


def rank_for_killing(candidates: list[KillCandidate], now: float) -> list[KillCandidate]:
    """Best victim first. Workers of one run tie (they lose the same work): the biggest goes first."""
    runs = _run_starts(candidates)

    def key(c: KillCandidate) -> tuple[bool, bool, float, float, int, float, int]:
        group_start = runs.get(c.owner, c.started_at) if c.kind is WorkloadKind.TRAINING else c.started_at
        return (not c.idle, not c.retriable, work_at_risk(c, now, runs.get(c.owner)), -group_start,
                -c.memory_bytes, -c.started_at, -c.pid)

    return sorted(candidates, key=key)


def cooldown_over(cool: Cooldown, alive_pids: set[int], sample: MemorySample, now: float,
                  cfg: PolicyConfig) -> tuple[bool, str]:
    """Judge again only once the victims are gone and their memory is back: no kill storms."""
    left = cool.victims & alive_pids
    if left:
        return False, f"waiting for {len(left)} killed worker(s) to be reaped (pids {sorted(left)})"
    if sample.counted_bytes < cfg.kill_at * sample.limit_bytes:
        return True, "memory is back below the kill threshold"
    if sample.counted_bytes <= cool.counted_at_kill - cool.expected_freed // 2:
        return True, "the victims' memory came back"
    if cool.reaped_at is not None and now - cool.reaped_at >= cfg.reclaim_wait_s:
        return True, f"memory did not come back within {cfg.reclaim_wait_s:g} s of the reap; judging again"
    return False, "victims reaped; waiting for their memory to come back"


def judge(sample: MemorySample, candidates: list[KillCandidate], now: float, cfg: PolicyConfig, trigger: str,
          node_id: str) -> KillDecision:
    threshold = int(cfg.kill_at * sample.limit_bytes)
    if sample.counted_bytes < threshold and not sample.stalled:
        return KillDecision(Action.NONE, f"{format_bytes(sample.counted_bytes)} counted, below the kill threshold "
                                         f"{format_bytes(threshold)}")
    target = int(cfg.target * sample.limit_bytes)
    victims = select_victims(candidates, sample.counted_bytes - target, now)
    report = build_report(sample, candidates, victims, now, cfg, trigger, node_id, target)
    if not victims:
        return KillDecision(Action.WAIT, report.reason, [], report)
    return KillDecision(Action.KILL, report.reason, victims, report)


def select_victims(candidates: list[KillCandidate], must_free: int, now: float) -> list[KillCandidate]:
    """Enough of the best victims to free `must_free` bytes at once, not one at a time.

    Killing one worker of a training run restarts the whole run, so its other workers' memory
    comes back too (the controller stops them): they are counted, not killed.
    """
    chosen: list[KillCandidate] = []
    freed, runs_hit = 0, set()
    for c in rank_for_killing(candidates, now):
        if freed >= must_free and chosen:
            break
        if c.kind is WorkloadKind.TRAINING and c.owner in runs_hit:
            continue
        chosen.append(c)
        if c.kind is WorkloadKind.TRAINING:
            runs_hit.add(c.owner)
            freed += sum(o.memory_bytes for o in candidates
                         if o.kind is WorkloadKind.TRAINING and o.owner == c.owner)
        else:
            freed += c.memory_bytes
    return chosen


def expected_freed(victims: list[KillCandidate], candidates: list[KillCandidate]) -> int:
    runs_hit = {v.owner for v in victims if v.kind is WorkloadKind.TRAINING}
    picked = {v.pid for v in victims}
    return sum(c.memory_bytes for c in candidates
               if c.pid in picked or (c.kind is WorkloadKind.TRAINING and c.owner in runs_hit))


def build_report(sample: MemorySample, candidates: list[KillCandidate], victims: list[KillCandidate], now: float,
                 cfg: PolicyConfig, trigger: str, node_id: str, target: int) -> KillReport:
    picked = {c.pid for c in victims}
    runs = _run_starts(candidates)
    considered = [
        ConsideredWorker(name=c.name, kind=c.kind, owner=c.owner, rank=c.rank, pid=c.pid,
                         memory_bytes=c.memory_bytes, resources=c.resources, age_s=round(max(now - c.started_at, 0), 3),
                         work_at_risk_s=round(work_at_risk(c, now, runs.get(c.owner)), 3), idle=c.idle, retriable=c.retriable,
                         selected=c.pid in picked)
        for c in rank_for_killing(candidates, now)
    ]
    over = f"{format_bytes(sample.counted_bytes)} of the workloads' limit {format_bytes(sample.limit_bytes)}"
    if victims:
        runs_hit = {v.owner for v in victims if v.kind is WorkloadKind.TRAINING}
        freed = expected_freed(victims, candidates)
        restarts = f"; run(s) {', '.join(sorted(runs_hit))} restart from their last checkpoint" if runs_hit else ""
        reason = (f"{over} ({'stalled at the limit' if sample.stalled else f'threshold {cfg.kill_at:.0%}'}); "
                  f"killing {', '.join(v.name for v in victims)} to free about {format_bytes(freed)} "
                  f"and get below {format_bytes(target)}{restarts}")
    else:
        reason = f"{over}, but no worker of outlast holds memory to free; other processes use it"
    return KillReport(node_id=node_id, time=now, trigger=trigger, usage_bytes=sample.counted_bytes,
                      limit_bytes=sample.limit_bytes, node_total_bytes=sample.node_total_bytes, target_bytes=target,
                      policy=POLICY, considered=considered, selected=[v.name for v in victims], reason=reason)


def render_report(r: KillReport) -> str:
    """The report as the user reads it in an error and in the node's log."""
    lines = [
        f"outlast killed {', '.join(r.selected) or 'nothing'} on node {r.node_id} for memory",
        f"  why: {r.reason}",
        f"  trigger: {r.trigger}",
        f"  node memory {format_bytes(r.node_total_bytes)}, workloads' limit {format_bytes(r.limit_bytes)}, "
        f"counted {format_bytes(r.usage_bytes)}, target {format_bytes(r.target_bytes)}",
        f"  policy: {r.policy}",
        "  considered (best victim first):",
    ]
    for w in r.considered:
        who = f"run {w.owner} rank {w.rank}" if w.kind is WorkloadKind.TRAINING else f"task {w.owner}"
        flags = "".join([" idle" if w.idle else "", "" if w.retriable else " non-retriable"])
        lines.append(
            f"    {'KILLED ' if w.selected else 'kept   '}{w.name}: {who}, pid {w.pid}, "
            f"memory {format_bytes(w.memory_bytes)}, requested {w.resources.num_cpus:g} CPU"
            f"{', ' + format_bytes(w.resources.memory_bytes) if w.resources.memory_bytes else ''}, "
            f"age {w.age_s:.1f} s, work at risk {w.work_at_risk_s:.1f} s{flags}"
        )
    return "\n".join(lines)
