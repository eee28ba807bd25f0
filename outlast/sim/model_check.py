"""The fleet model checked against a real run: the same interruptions, at the same instants, through the same model.

`python -m outlast.sim check-model RUN_DIR [--json]` reads a run's history and rank 0's reports, measures from them
the parameters the fleet model takes (`measure`), turns each attempt's end into the interruption that caused it
(`interruptions`), replays those through `outlast.sim.fleet.simulate` (the code path of `python -m outlast.sim
fleet`, at the run's size: one simulated node per real node) and compares the model's goodput, part by part, with
`outlast.storage.goodput.split` of the real run. Both are split by the same function, so a difference is the model's
placing of steps, checkpoints and restarts, not its accounting.

What is measured, each from this run alone:
- the step: the mean time from one report to the next, its checkpoint stall taken out, at the run's first size;
- the stall: the stalls `split` counts, per checkpoint committed; the interval: the steps between checkpoints;
- a checkpoint's copy: the mean time from its report to its commit;
- start-up: the first attempt's start to its first report (the first step's compute is in it, as in the model);
- a restart: from the instant the attempt was lost (a failure's record, a hang's detection, a drained attempt's
  just-in-time checkpoint committed or its deadline) to the next attempt's first report, the model's restore
  taken out (the real restore is inside that time, and the history does not time it apart), and apart from it
  the time more a restart onto a node that took a lost one's place took (a new node agent started);
- a hang's limit: from the hung attempt's last report to the hang's detection, and a lost node's detection likewise
  (the history keeps when a node was found lost, not when it went); a drain's notice: its deadline;
- spares: the nodes that took a lost one's place at once (the next attempt as large, without waiting).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from outlast.controller.types import Timeouts
from outlast.protocol.kinds import FailureKind
from outlast.sim.fleet import FleetConfig, Mechanisms, simulate
from outlast.sim.interruptions import SECONDS_PER_DAY, Effect, Interruption
from outlast.sim.run import quiet
from outlast.storage.goodput import PARTS, Goodput, split
from outlast.storage.records import AttemptRecord, ReportEntry, RunState

CHECK_VERSION = 1
GB = 1.0  # the checkpoint's size per rank in the replay: any size, its times come from the bandwidths set below


class CannotReplay(ValueError):
    """The run's history has something the model cannot replay (said in the message)."""


@dataclass(frozen=True)
class Measured:
    nodes: int
    ranks_per_node: int
    wall_s: float  # the first attempt's start to the last one's end
    step_s: float
    stall_s: float
    checkpoint_steps: int
    commit_s: float
    startup_s: float
    restart_s: float  # to the first report, restore included
    new_node_s: float  # more, onto a node that took a lost one's place
    hang_limit_s: float | None
    node_lost_s: float  # from a lost node's attempt's last report to the node found lost
    spares: int  # nodes the run was given at once after losing one: free nodes in the real cluster
    memory_tier: bool
    elastic: bool
    jit_drain: bool


@dataclass(frozen=True)
class Replay:
    measured: Measured
    config: FleetConfig
    mechanisms: Mechanisms
    events: list[Interruption]


def measure(state: RunState, reports: dict[int, list[ReportEntry]]) -> Measured:
    attempts = state.attempts
    if not attempts or any(a.ended_at is None for a in attempts):
        raise CannotReplay("the run has not ended: check a finished or failed run")
    if not reports.get(attempts[0].attempt):
        raise CannotReplay("the run's first attempt made no report: nothing to measure a step from")
    t0 = attempts[0].started_at
    nodes = sorted({o.node_id for o in attempts[0].outputs} | {f.node_id for f in attempts[0].failures}) or ["node"]
    workers = attempts[0].workers or len({o.rank for o in attempts[0].outputs}) or 1
    steps, stalls = [], []
    for a in attempts:
        got = sorted(reports.get(a.attempt, []), key=lambda r: r.time)
        # At the run's full size: the model's steps on fewer nodes take longer by the nodes missing.
        size = (a.workers or workers) / workers
        for p, r in zip(got, got[1:]):
            # As `split` counts a stall: never more than its step, and none on an attempt's first report.
            stall = min(max(r.stalled_s, 0.0), r.time - p.time) if math.isfinite(r.stalled_s) else 0.0
            steps.append((r.time - p.time - stall) * size)
            stalls.append(stall)
    if not steps:
        raise CannotReplay("the run made fewer than two reports in any attempt: no step to measure")
    when = {(r_a, r.index): r.time for r_a, got in reports.items() for r in got}
    commits = [c.committed_at - when[(c.attempt, c.report_index)] for c in state.checkpoints
               if (c.attempt, c.report_index) in when]
    indexes = sorted({c.report_index + 1 for c in state.checkpoints if c.attempt == attempts[0].attempt})
    # The first attempt's first checkpoint (retention keeps the newest, so under num_to_keep this can be a multiple).
    every = indexes[0] if indexes else 10**9  # no checkpoint: none in the model either
    # The loop's stall in report() is carried by the report after the checkpoint's, so it is averaged per checkpoint
    # rather than read off the checkpoint's own report.
    stall = sum(stalls) / len(state.checkpoints) if state.checkpoints else 0.0
    commit = max(statistics.fmean(commits), 1e-6) if commits else 1e-6
    memory = any(c.memory for c in state.checkpoints)
    first = _first_report(reports, attempts[0])
    if first is None:
        raise CannotReplay("the run's first attempt has no report within its span: its history and reports disagree")
    startup = first.time - t0 - first.stalled_s
    m = Measured(nodes=len(nodes), ranks_per_node=max(1, workers // len(nodes)),
                 wall_s=attempts[-1].ended_at - t0,  # type: ignore[operator]
                 step_s=statistics.fmean(steps), stall_s=stall, checkpoint_steps=every, commit_s=commit,
                 startup_s=startup, restart_s=0.0, new_node_s=0.0, hang_limit_s=_hang_limit(state, reports),
                 node_lost_s=_node_lost_s(state, reports), spares=_spares(state), memory_tier=memory,
                 elastic=bool(state.resizes) or len({a.workers for a in attempts}) > 1,
                 jit_drain=any(_jit_commit(state, a) is not None for a in attempts))
    restarts: list[float] = []
    onto_new: list[float] = []  # restarts onto a node that took a lost one's place
    for before, a in zip(attempts, attempts[1:]):
        took = _restart_took(state, reports, m, before, a)
        if took is not None:
            (onto_new if _replaced(state, before, a) else restarts).append(took)
    restart = statistics.fmean(restarts) if restarts else statistics.fmean(onto_new) if onto_new else 1.0
    new_node = statistics.fmean(onto_new) - restart if onto_new else 0.0
    return _replace(m, restart_s=max(restart, 1e-6), new_node_s=max(new_node, 0.0))


def interruptions(state: RunState, m: Measured, node_of: dict[str, int],
                  each_restart: dict[int, float] | None = None) -> list[Interruption]:
    """Each attempt that did not finish, as the interruption that ended it, at the instant it struck; with
    `each_restart`, each carrying the time its own restart took (by the attempt it ended)."""
    each = each_restart or {}
    t0 = state.attempts[0].started_at
    out = []
    hangs = {h.attempt: h for h in state.hangs}
    drains = {d.attempt: d for d in state.drains}
    for a in state.attempts[:-1]:
        if a.attempt in drains:
            d = drains[a.attempt]
            out.append(Interruption(d.time - t0, d.message or "drain", Effect.DRAIN, node_of.get(d.node_ids[0], 0),
                                    each.get(a.attempt)))
            continue
        if a.attempt in hangs or any(f.kind is FailureKind.HANG for f in a.failures):
            hang = hangs.get(a.attempt)
            at = (hang.time if hang else a.ended_at) - (m.hang_limit_s or 0.0)  # type: ignore[operator]
            node = node_of.get(a.failures[0].node_id, 0) if a.failures else 0
            out.append(Interruption(at - t0, "hang", Effect.HANG, node, each.get(a.attempt)))
            continue
        if not a.failures:
            raise CannotReplay(f"attempt {a.attempt} ended ({a.outcome}) without a failure, a hang or a drain: "
                               "the model has no interruption for it (a grow is the model's own decision)")
        f = min(a.failures, key=lambda f: f.time)
        if f.kind is FailureKind.NODE_LOST:
            # The history keeps when the node was found lost, not when it went: it went after the attempt's last
            # report, and was found `node_lost_s` later.
            out.append(Interruption(f.time - t0 - m.node_lost_s, "node lost", Effect.NODE_LOST,
                                    node_of.get(f.node_id, 0), each.get(a.attempt)))
        else:
            out.append(Interruption(f.time - t0, f"rank {f.rank} failed", Effect.RANK_DIES,
                                    node_of.get(f.node_id, 0), each.get(a.attempt)))
    return out


def replay(state: RunState, reports: dict[int, list[ReportEntry]], each_restart: bool = False) -> Replay:
    """The run in the model: with the measured restart times (their means), or with `each_restart` each restart's
    own."""
    m = measure(state, reports)
    first = state.attempts[0]
    node_ids = sorted({o.node_id for o in first.outputs} | {f.node_id for f in first.failures})
    waits = [a.capacity_at - a.waiting_since for a in state.attempts
             if a.waiting_since is not None and a.capacity_at is not None]
    every_s = m.checkpoint_steps * m.step_s
    gb_node = GB * m.ranks_per_node
    config = FleetConfig(
        nodes=m.nodes, ranks_per_node=m.ranks_per_node, days=m.wall_s / SECONDS_PER_DAY, step_s=m.step_s,
        checkpoint_gb_per_rank=GB,
        # Both copies (to storage, to a peer) take the measured commit: the storage's share is the node's own.
        storage_gb_s=gb_node * m.nodes / m.commit_s, network_gb_s=gb_node / m.commit_s,
        host_copy_gb_s=GB / m.stall_s if m.stall_s > 0 else 1e12,
        checkpoint_every_s=every_s, memory_every_s=every_s, startup_s=m.startup_s, restart_s=m.restart_s,
        new_node_s=m.new_node_s,
        # No node came back to the run unless it waited for one: a lost node is never repaired within the run.
        notice_s=_notice_s(state), replace_s=max(waits) if waits else 10 * m.wall_s, repair_s=10 * m.wall_s,
        spares=m.spares, hang_timeout_s=m.hang_limit_s, timeouts=Timeouts(node_lost_after_s=m.node_lost_s))
    # Live recovery off: each interruption replayed is an attempt that ended, a restart; a real run's live
    # recoveries, which end no attempt, are not replayed.
    mech = Mechanisms(memory_tier=m.memory_tier, jit_drain=m.jit_drain, spares=m.spares > 0, elastic=m.elastic,
                      live_recovery=False)
    each = None
    if each_restart:
        by = {b.attempt: b for b in state.attempts}
        took = {a.attempt: _restart_took(state, reports, m, a, by[a.attempt + 1]) for a in state.attempts[:-1]
                if a.attempt + 1 in by}
        each = {k: max(v, 1e-6) for k, v in took.items() if v is not None}
    return Replay(m, config, mech, interruptions(state, m, {n: i for i, n in enumerate(node_ids)}, each))


def check(state: RunState, reports: dict[int, list[ReportEntry]]) -> dict[str, Any]:
    """The real run's goodput and the model's, part by part, as shares of the time held, and their differences."""
    real = split(state, reports, now=state.attempts[-1].ended_at or time.time())
    r = replay(state, reports)
    model = simulate(r.config, r.mechanisms, r.events).goodput
    each = replay(state, reports, each_restart=True)
    own = simulate(each.config, each.mechanisms, each.events).goodput
    shares = {"real": _shares(real), "model": _shares(model)}
    return {"version": CHECK_VERSION, "run": state.name,
            "measured": {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(r.measured).items()},
            "mechanisms": r.mechanisms.label(),
            "interruptions": [{"at_s": round(e.at_s, 3), "effect": e.effect.value, "cause": e.cause}
                              for e in r.events],
            "real": _doc(real), "model": _doc(model),
            "goodput_difference": round(model.fraction - real.fraction, 4),
            "parts_difference": {p: round(shares["model"][p] - shares["real"][p], 4) for p in PARTS},
            "largest_part_difference": max(PARTS, key=lambda p: abs(shares["model"][p] - shares["real"][p])),
            # The same replay with each restart's own measured time rather than their mean: what is left is the
            # model's placing of steps, checkpoints and restores.
            "restarts_s_each": [round(e.restart_s, 3) for e in each.events if e.restart_s is not None],
            "model_each_restart": _doc(own), "goodput_difference_each_restart": round(own.fraction - real.fraction, 4)}


def describe(out: dict[str, Any]) -> list[str]:
    real, model = out["real"], out["model"]
    m = out["measured"]
    lines = [f"run {out['run']}: {m['nodes']} node(s) x {m['ranks_per_node']} ranks, {m['wall_s']:.1f} s, "
             f"{len(out['interruptions'])} interruption(s) replayed ({out['mechanisms']})",
             f"  measured: step {m['step_s']:.3f} s, stall {m['stall_s']:.3f} s, checkpoint every "
             f"{m['checkpoint_steps']} steps, commit {m['commit_s']:.3f} s, start-up {m['startup_s']:.2f} s, "
             f"restart {m['restart_s']:.2f} s",
             f"  goodput: real {100 * real['fraction']:.2f}%, model {100 * model['fraction']:.2f}% "
             f"(difference {100 * out['goodput_difference']:+.2f} points); with each restart's own time, model "
             f"{100 * out['model_each_restart']['fraction']:.2f}% "
             f"({100 * out['goodput_difference_each_restart']:+.2f})",
             f"  {'part':22} {'real %':>8} {'model %':>8} {'diff':>7}"]
    for p in PARTS:
        rs, ms = real["shares"][p], model["shares"][p]
        if rs or ms:
            lines.append(f"  {p:22} {100 * rs:8.2f} {100 * ms:8.2f} {100 * (ms - rs):+7.2f}")
    return lines


def main(argv: list[str]) -> int:
    from outlast.storage import open_storage
    from outlast.storage.run_store import RunStore

    p = argparse.ArgumentParser(prog="python -m outlast.sim check-model", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's directory: STORAGE_PATH/NAME")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    storage_path, _, name = args.run_dir.rstrip("/").rpartition("/")
    if not name:
        p.error(f"RUN_DIR must be STORAGE_PATH/NAME, got {args.run_dir!r}")
    store = RunStore(open_storage(storage_path or "."), name)
    state = store.load_state()
    if state is None:
        p.error(f"no run history at {args.run_dir} (expected {args.run_dir}/run_state.json)")
    quiet()
    try:
        out = check(state, {a.attempt: store.read_reports(a.attempt) for a in state.attempts})
    except CannotReplay as e:
        p.error(f"cannot replay {args.run_dir}: {e}")
    print(json.dumps(out) if args.json else "\n".join(describe(out)))
    return 0


def _first_report(reports: dict[int, list[ReportEntry]], a: AttemptRecord) -> ReportEntry | None:
    got = [r for r in reports.get(a.attempt, []) if r.time >= a.started_at]
    return min(got, key=lambda r: r.time) if got else None


def _hang_limit(state: RunState, reports: dict[int, list[ReportEntry]]) -> float | None:
    limits = []
    for h in state.hangs:
        got = [r.time for r in reports.get(h.attempt, []) if r.time <= h.time]
        start = next(a.started_at for a in state.attempts if a.attempt == h.attempt)
        limits.append(h.time - max(got, default=start))
    return statistics.fmean(limits) if limits else None


def _node_lost_s(state: RunState, reports: dict[int, list[ReportEntry]]) -> float:
    waits = []
    for a in state.attempts:
        for f in a.failures:
            if f.kind is FailureKind.NODE_LOST:
                got = [r.time for r in reports.get(a.attempt, []) if r.time <= f.time]
                waits.append(f.time - max(got, default=a.started_at))
                break
    return statistics.fmean(waits) if waits else 0.0


def _jit_commit(state: RunState, a: AttemptRecord) -> float | None:
    """A drained attempt's checkpoint committed after the notice: the just-in-time one."""
    notice = next((d.time for d in state.drains if d.attempt == a.attempt), None)
    if notice is None:
        return None
    after = [c.committed_at for c in state.checkpoints if c.attempt == a.attempt and c.committed_at >= notice]
    return min(after, default=None)


def _lost_at(state: RunState, a: AttemptRecord, m: Measured) -> float | None:
    """The instant the model ends an attempt at, read from the real history."""
    for d in state.drains:
        if d.attempt == a.attempt:
            jit = _jit_commit(state, a)
            return jit if jit is not None else d.deadline if d.deadline is not None else a.ended_at
    for h in state.hangs:
        if h.attempt == a.attempt:
            return h.time
    return min((f.time for f in a.failures), default=None)


def _spares(state: RunState) -> int:
    """Node-losing interruptions (a drain, a lost node) after which the next attempt ran at the same size without
    waiting: a free node took the lost one's place."""
    return sum(_replaced(state, a, b) and b.waiting_since is None for a, b in zip(state.attempts, state.attempts[1:]))


def _restart_took(state: RunState, reports: dict[int, list[ReportEntry]], m: Measured, before: AttemptRecord,
                  a: AttemptRecord) -> float | None:
    """From the instant `before` was lost to `a`'s first report, its wait for capacity and the model's restore out."""
    r = _first_report(reports, a)
    lost = _lost_at(state, before, m)
    if r is None or lost is None:
        return None
    waited = (a.capacity_at - a.waiting_since) if a.capacity_at and a.waiting_since else 0.0
    return r.time - r.stalled_s - lost - waited - _restore_s(m, _replaced(state, before, a))


def _replaced(state: RunState, a: AttemptRecord, b: AttemptRecord) -> bool:
    lost = any(d.attempt == a.attempt for d in state.drains) or any(f.kind is FailureKind.NODE_LOST
                                                                     for f in a.failures)
    return lost and b.workers == a.workers


def _restore_s(m: Measured, replaced: bool) -> float:
    # As the model restores: from memory, a node's own shards at the host copy and a replaced node's from a peer;
    # else from storage. Both copies go at the commit's pace (set from this run in `replay`).
    if not m.memory_tier:
        return m.commit_s
    return max(m.stall_s, m.commit_s) if replaced else m.stall_s


def _notice_s(state: RunState) -> float:
    notices = [d.deadline - d.time for d in state.drains if d.deadline is not None]
    return statistics.fmean(notices) if notices else FleetConfig.notice_s


def _replace(m: Measured, **changes: Any) -> Measured:
    return Measured(**{**asdict(m), **changes})


def _shares(g: Goodput) -> dict[str, float]:
    return {p: (s / g.held_s if g.held_s > 0 else 0.0) for p, s in g.parts().items()}


def _doc(g: Goodput) -> dict[str, Any]:
    return {"fraction": round(g.fraction, 4), "held_s": round(g.held_s, 3), "steps": g.steps,
            "replayed_steps": g.replayed_steps, "parts_s": {p: round(s, 3) for p, s in g.parts().items()},
            "shares": {p: round(s, 4) for p, s in _shares(g).items()}}
