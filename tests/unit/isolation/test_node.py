"""NodeIsolation with a fake driver: judging, cooldown after kills, limits re-read, undo on a failed start."""

from __future__ import annotations

import pytest

from outlast.isolation.node import NodeIsolation
from outlast.isolation.policy import Action, KillCandidate, PolicyConfig
from outlast.protocol.kinds import WorkloadKind
from outlast.isolation.reservations import GiB, MiB, compute_reservations

RES = compute_reservations(4 * GiB, None, 2, reserved_memory=1 * GiB)


class FakeDriver:
    version, root = 2, "/fake/outlast_n1"

    def __init__(self) -> None:
        self.counted, self.limit, self.armed, self.torn_down = 0, 3 * GiB, [], False

    def sample(self):
        return {"limit": self.limit, "counted": self.counted, "user": self.counted, "system": 0, "stalled": False,
                "kernel_oom_kills": 0}

    def monitors(self, limit, kill_at):
        self.armed.append(limit)
        return []

    def teardown(self):
        self.torn_down = True
        return []


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def node():
    d, clock = FakeDriver(), Clock()
    n = NodeIsolation(d, RES, "n1", PolicyConfig(kill_at=0.95, target=0.90, reclaim_wait_s=2.0), clock=clock)
    n._arm()
    return n, d, clock


def task(name, pid, age, mem):
    return KillCandidate(name=name, kind=WorkloadKind.TASK, owner=name, rank=None, pid=pid, memory_bytes=mem,
                         started_at=1000.0 - age)


def test_no_kill_below_the_threshold_and_a_kill_with_report_above_it():
    n, d, _ = node()
    d.counted = 2 * GiB
    assert n.check([task("a", 1, 5, 1 * GiB)], {1}, "threshold").action is Action.NONE
    d.counted = int(2.95 * GiB)
    decision = n.check([task("old", 1, 50, 1 * GiB), task("new", 2, 5, 1 * GiB)], {1, 2}, "kernel event")
    assert decision.action is Action.KILL and [v.name for v in decision.victims] == ["new"]
    assert n.kills == 1 and list(n.recent) == [decision.report]


def test_after_a_kill_it_waits_for_the_reap_and_the_memory_then_judges_again():
    n, d, clock = node()
    d.counted = int(2.95 * GiB)
    workers = [task("old", 1, 50, 1 * GiB), task("new", 2, 5, 1 * GiB)]
    assert n.check(workers, {1, 2}, "t").action is Action.KILL
    assert n.check(workers, {1, 2}, "t").action is Action.WAIT  # the victim is not reaped yet
    n.note_reaped(2)
    assert n.check(workers[:1], {1}, "t").action is Action.WAIT  # memory not back yet
    clock.now += 2.5  # the wait for memory to come back is over: judge again, and the old one is all that is left
    decision = n.check(workers[:1], {1}, "t")
    assert decision.action is Action.KILL and [v.name for v in decision.victims] == ["old"]


def test_a_changed_limit_is_picked_up_and_the_monitors_re_armed():
    n, d, _ = node()
    d.limit = 2 * GiB
    d.counted = int(1.97 * GiB)
    decision = n.check([task("a", 1, 5, 500 * MiB)], {1}, "t")
    assert d.armed == [3 * GiB, 2 * GiB]
    assert decision.action is Action.KILL and decision.report.limit_bytes == 2 * GiB


def test_a_failed_start_undoes_what_it_did(monkeypatch):
    from outlast.isolation.config import IsolationConfig

    d = FakeDriver()
    d.validate = lambda: None
    d.starting_limit = lambda: None
    d.setup = lambda res: None
    d.cleanup_stale = lambda: []

    def broken(limit, kill_at):
        raise OSError("no eventfd for you")

    d.monitors = broken
    with pytest.raises(Exception, match="cannot arm the memory monitors"):
        NodeIsolation.start(IsolationConfig(enable_resource_isolation=True, system_reserved_memory="512MiB"), "n1",
                            driver=d)
    assert d.torn_down
