"""The controller as it was before each bug the simulator guards against, put back for one test.

Each `reinject_*` patches one piece of the real controller to its old behaviour, so a
regression seed can show that the simulator catches that bug (and that the fix holds).
"""

from __future__ import annotations

from outlast.controller import core, ending, handlers, horizons, lifecycle, memory_restore, nodes, runstate, storage_io
from outlast.controller import effects as fx
from outlast.controller import states as st
from outlast.controller.horizons import Answer, Grant, NoticeAt
from outlast.agent import node_core
from outlast.protocol import messages as m
from outlast.protocol.kinds import FailureKind
from outlast.storage.records import CheckpointRecord, FailureRecord


class LegacyHorizonBook(horizons.HorizonBook):
    """Issue 8 (a): grants 2^20 calls ahead; D fixed collect_s after the notice from the stale horizons."""

    def __init__(self) -> None:
        super().__init__(collect_s=0.6)
        self._asked: dict[int, int] = {}
        self._outstanding: dict[int, int] = {}

    def on_query(self, rank, index, now):
        if self.decision_index is not None:
            return [Answer(rank, index, NoticeAt(self.decision_index))]
        if self.noticed_at is None:
            self._outstanding[rank] = index + self.max_step
            self._granted[rank] = horizons._Granted(index, index + self.max_step, now)
            return [Answer(rank, index, Grant(index + self.max_step, self.valid_s))]
        self._asked[rank] = index
        self._outstanding[rank] = index + 1
        if not set(self._outstanding) - set(self._asked) - self._lost:
            return [Answer(rank, index, NoticeAt(self._old_decide()))]
        return [Answer(rank, index, Grant(index + 1, float("inf")))]

    def preempt(self, now):
        if self.noticed_at is None:
            self.noticed_at = now
        if self.decision_index is None and not set(self._outstanding) - set(self._asked) - self._lost:
            self._old_decide()
        return []

    def tick(self, now):
        if self.decision_index is None and self.noticed_at is not None and now - self.noticed_at >= self.collect_s:
            self._old_decide()
        return []

    def lose_rank(self, rank, now):
        self._lost.add(rank)
        return []

    def _old_decide(self) -> int:
        bounds = [self._asked[r] + 1 if r in self._asked else h for r, h in self._outstanding.items()
                  if r not in self._lost]
        self.decision_index = max(bounds, default=0)
        return self.decision_index


class TrustingHorizonBook(horizons.HorizonBook):
    """The first fix of issue 8 (a): a live grant of n > 1 calls bounds its rank, so D was fixed at the
    notice from it; a loop that slowed down after that grant (a report() waiting on an upload) took
    its old rate's worth of calls, at its new rate, to reach D."""

    def on_query(self, rank, index, now):
        if self.decision_index is not None or self.noticed_at is None:
            return super().on_query(rank, index, now)
        if self._asked_since is None:
            self._asked_since = now
        self._parked[rank] = index
        return self._decide_if_exact_at(now)

    def preempt(self, now):
        if self.noticed_at is None:
            self.noticed_at = now
        return self._decide_if_exact_at(now)

    def tick(self, now):
        if self.decision_index is None and self._asked_since is not None and now - self._asked_since >= 0.5:
            return self._decide()
        return self._decide_if_exact_at(now) if self.noticed_at is not None else []

    def _decide_if_exact_at(self, now):
        expired = [r for r in self._inexact() if now - self._granted[r].at > self.valid_s]
        return [] if self.decision_index is not None or expired else self._decide()


def _old_retention(monkeypatch) -> None:
    """Issue 8 (c): a refused delete escapes (from the storage effect that retention asked for)."""
    real = storage_io.perform

    def perform(effect, store, retry):
        if isinstance(effect, fx.DeleteCheckpoint):
            store.delete_checkpoint(effect.checkpoint_dir)
        return real(effect, store, retry)

    monkeypatch.setattr(storage_io, "perform", perform)


def _old_spawn_refused(c, node_id, refused) -> None:
    """Ranks that had not said hello, on any node, were taken for never started."""
    a = c.attempt
    if a is None or refused.attempt != a.number or c.state.kind is not st.State.SCHEDULING:
        return
    lifecycle.on_failure(c, FailureRecord(
        attempt=a.number, rank=0, node_id="", pid=0, exit_code=None, signal=None, time=c.wall(),
        kind=FailureKind.SPAWN_REFUSED, message=refused.reason))
    for rank in range(c.plan.world_size):
        if rank not in a.hello:
            a.exited.setdefault(rank, m.WorkerExited(run_id=c.run_id, attempt=a.number, rank=rank, pid=0,
                                                     exit_code=None, signal=None, error=None, node_id=""))
    lifecycle.judge_if_all_exited(c)


def _first_fix_spawn_refused(c, node_id, refused) -> None:
    """The first fix of the above: a refusal that arrives after another one ended the attempt was dropped."""
    a = c.attempt
    if a is None or refused.attempt != a.number or c.state.kind is not st.State.SCHEDULING:
        return
    lifecycle.on_failure(c, FailureRecord(
        attempt=a.number, rank=0, node_id="", pid=0, exit_code=None, signal=None, time=c.wall(),
        kind=FailureKind.SPAWN_REFUSED, message=refused.reason))
    for rank in a.ranks_on({node_id}):
        a.exited.setdefault(rank, m.WorkerExited(run_id=c.run_id, attempt=a.number, rank=rank, pid=0,
                                                 exit_code=None, signal=None, error=None, node_id=node_id))
    lifecycle.judge_if_all_exited(c)


def _old_finishing(monkeypatch) -> None:
    """Issue 8 (b): ranks that all returned during a preemption left the run in PREEMPTING, with a timer
    that fired ALL_FINISHED whatever the state had become by then."""
    real_exited, real_timers = handlers.on_worker_exited, core.timers

    def on_worker_exited(c, ev):
        before = c.state
        real_exited(c, ev)
        if isinstance(before, (st.Preempting, st.Saved)) and isinstance(c.state, st.Finishing):
            c.state = before
            c.legacy_exited_ok_at = c.now

    def timers(c, now):
        real_timers(c, now)
        at = getattr(c, "legacy_exited_ok_at", None)
        if at is not None and not c.closing and now - at > c.plan.timeouts.last_messages_s:
            ending.finish(c)

    monkeypatch.setattr(handlers, "on_worker_exited", on_worker_exited)
    monkeypatch.setattr(core, "timers", timers)


def reinject_tier(bug: str, monkeypatch) -> None:
    """Bugs of the memory tier's schedules (`outlast/sim/tier.py`), put back."""
    if bug == "adopted_manifest_loses_level":  # an adopted manifest was taken for durable, held nowhere
        monkeypatch.setattr(runstate, "record_of", lambda mf, seq: CheckpointRecord(
            checkpoint_dir=mf.checkpoint_dir, seq=seq, attempt=mf.attempt, report_index=mf.report_index,
            committed_at=mf.committed_at, metrics=mf.metrics))
    elif bug == "pulled_copies_unrecorded":  # copies a node pulled for a restore were not counted as held
        monkeypatch.setattr(memory_restore, "note_pulled", lambda c, checkpoint_dir, node, rank: None)
    else:
        raise ValueError(bug)


def reinject(bug: str, monkeypatch) -> None:
    if bug == "a":
        monkeypatch.setattr(lifecycle, "HorizonBook", LegacyHorizonBook)
    elif bug == "live_grants_trusted":
        monkeypatch.setattr(lifecycle, "HorizonBook", TrustingHorizonBook)
    elif bug == "b":
        _old_finishing(monkeypatch)
    elif bug == "c":
        _old_retention(monkeypatch)
    elif bug == "drain_deadline_charged":
        monkeypatch.setattr(lifecycle, "preempted_by_drain", lambda c, a: None)
    elif bug == "refusal_takes_other_nodes":
        monkeypatch.setitem(handlers.AGENT_EVENTS, m.SpawnRefused, _old_spawn_refused)
    elif bug == "second_refusal_dropped":
        monkeypatch.setitem(handlers.AGENT_EVENTS, m.SpawnRefused, _first_fix_spawn_refused)
    elif bug == "agent_gone_for_good":  # a node whose agent was gone stayed lost after a restart
        monkeypatch.setattr(nodes.NodeBook, "_forget_gone_agent", lambda self, node_id, agent_pid: None)
    elif bug == "spawn_to_any_agent":  # a spawn placed with a stale table was taken by the agent started since
        real = node_core.spawn_refusal
        monkeypatch.setattr(node_core, "spawn_refusal", lambda node_id, draining, placed_on, pid:
                            real(node_id, draining, 0, pid))
    elif bug == "drain_misses_pending_forks":  # a drain told only the runs whose forks had been reported
        from outlast.agent.supervisor import Supervisor
        monkeypatch.setattr(Supervisor, "runs_with_workloads", lambda self: [
            self.runs[r] for r in sorted({w.run_id for w in self.workloads.values()}) if r in self.runs])
    elif bug == "restarted_agent_unnoticed":  # a new pid in a node's answers meant nothing
        monkeypatch.setattr(nodes.NodeBook, "note_pid", lambda self, node_id, pid: None)
    else:
        raise ValueError(bug)


def reinject_edge(bug: str, monkeypatch) -> None:
    """Bugs of the agent's core that the edge invariants guard against, put back."""
    from outlast.agent import supervisor

    if bug == "heartbeat_ignored":  # a run's heartbeats kept nothing alive: its live driver's workers went
        def heartbeat(self, to, beat, now):
            run = self.runs.get(beat.run_id) or self._touch(to, beat.run_id, now, beat.timeout_s)
            run.timeout_s, run.last_commit_at = beat.timeout_s, beat.last_commit_at
        monkeypatch.setattr(supervisor.Supervisor, "heartbeat", heartbeat)
    elif bug == "unkillable_waited_for":  # a workload SIGKILL did not end was waited for forever
        def give_up(self, w, waited_s):
            w.given_up = True  # nothing reported, nothing drained
            return []
        monkeypatch.setattr(supervisor.Supervisor, "_give_up", give_up)
    elif bug == "lost_groups_left":  # ranks lost with their fork server were reported, their process groups not killed
        real = supervisor.Supervisor.lose_all
        monkeypatch.setattr(supervisor.Supervisor, "lose_all", lambda self, why: [
            e for e in real(self, why) if not isinstance(e, supervisor.Kill)])
    else:
        raise ValueError(bug)
