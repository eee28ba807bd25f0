"""The node's resource isolation at run time: set-up, worker leaves, monitors, kills, undo.

The agent owns one `NodeIsolation`. It polls `sources` with its sockets, calls `check()` on
an event (and on its timer, the threshold monitor), and carries out the victims it returns.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable

import psutil

from outlast.isolation.config import IsolationConfig, cpu_count
from outlast.isolation.detect import detect
from outlast.isolation.driver import CgroupDriver, HandsBackToKernel, MemoryReading
from outlast.isolation.errors import IsolationError
from outlast.isolation.monitor import EventSource
from outlast.isolation.policy import (
    Action, Cooldown, KillCandidate, KillDecision, MemorySample, PolicyConfig, cooldown_over, expected_freed, judge,
    render_report,
)
from outlast.isolation.reservations import Reservations, compute_reservations
from outlast.protocol.messages import IsolationInfo, KillReport, Resources

log = logging.getLogger("outlast.isolation")

RECENT_KILLS = 20


class NodeIsolation:
    def __init__(self, driver: CgroupDriver, reservations: Reservations, node_id: str, policy: PolicyConfig,
                 clock: Callable[[], float] = time.time) -> None:
        self.driver = driver
        self.reservations = reservations
        self.node_id = node_id
        self.policy = policy
        self.clock = clock
        self.sources: list[EventSource] = []
        self.cooldown: Cooldown | None = None
        self.recent: deque[KillReport] = deque(maxlen=RECENT_KILLS)
        self.kills = 0
        self._armed_limit: int | None = None
        self._doomed_leaves: set[str] = set()
        self._last_reason = ""
        self._last_unreadable: str | None = None
        self._released_to_kernel = False

    @classmethod
    def start(cls, config: IsolationConfig, node_id: str, driver: CgroupDriver | None = None) -> NodeIsolation:
        """Validate, set up the layout, clean what a crashed agent left, arm the monitors."""
        driver = driver or detect(node_id, config.cgroup_path)
        driver.validate()  # raises with every problem before the first write
        res = compute_reservations(psutil.virtual_memory().total, driver.starting_limit(), cpu_count(),
                                   config.reserved_memory_bytes, config.reserved_cpus,
                                   checkpoint_memory=config.checkpoint_memory)
        node = cls(driver, res, node_id, PolicyConfig(kill_at=config.kill_at, target=config.target))
        try:
            driver.setup(res)
            for line in driver.cleanup_stale():
                log.warning("%s", line)
            node._arm()
        except BaseException as e:
            left = driver.teardown()
            for s in node.sources:
                s.close()
            node.sources = []
            if isinstance(e, (KeyboardInterrupt, SystemExit, IsolationError)) and not left:
                raise
            raise IsolationError(setup_failed(driver.root, e, left)) from e
        log.info("resource isolation on (cgroup v%d, %s): %s", driver.version, driver.root, res.reason)
        return node

    def _arm(self) -> None:
        reading = self.driver.sample()
        limit = None if "unreadable" in reading else reading["limit"]
        if limit == self._armed_limit and self.sources:
            return
        for s in self.sources:
            s.close()
        try:
            self.sources = self.driver.monitors(limit, self.policy.kill_at)
        except OSError as e:
            raise IsolationError(f"cannot arm the memory monitors on {self.driver.root}: {e}") from e
        self._armed_limit = limit

    # ---- leaves --------------------------------------------------------------------

    def create_leaf(self, name: str, resources: Resources) -> list[str]:
        try:
            return self.driver.create_leaf(name, resources)
        except FileExistsError:
            self.driver.kill_leaf(name)  # a leftover of a reused name: never share a leaf
            self.driver.remove_leaf(name)
            return self.driver.create_leaf(name, resources)

    def remove_leaf(self, name: str) -> None:
        if not self.driver.remove_leaf(name):
            self._doomed_leaves.add(name)  # a grandchild still exiting; try again on the timer

    def kill_leaf(self, name: str) -> None:
        self.driver.kill_leaf(name)

    def leaf_pids(self, name: str) -> list[int]:
        return self.driver.leaf_pids(name)

    def leaf_memory(self, name: str) -> int:
        return self.driver.leaf_memory(name)

    def tidy(self) -> None:
        for name in list(self._doomed_leaves):
            if self.driver.remove_leaf(name):
                self._doomed_leaves.discard(name)

    # ---- judging -------------------------------------------------------------------------

    def sample(self) -> tuple[MemorySample, MemoryReading]:
        raw = self.driver.sample()
        if "unreadable" in raw:
            # Fail closed: memory that cannot be read counts as a full node, never as an empty one.
            if raw["unreadable"] != self._last_unreadable:
                log.error("memory monitor: %s; counting the node as full until it can be read", raw["unreadable"])
            self._last_unreadable = raw["unreadable"]
            limit = self._armed_limit or self.reservations.user_memory
            raw = {"limit": self._armed_limit, "counted": limit, "user": 0, "system": 0, "stalled": False,
                   "unreadable": raw["unreadable"]}
        else:
            self._last_unreadable = None
        limit = raw["limit"] if raw["limit"] is not None else self.reservations.user_memory
        return MemorySample(counted_bytes=int(raw["counted"]), limit_bytes=int(limit),
                            node_total_bytes=self.reservations.total_memory, stalled=bool(raw["stalled"])), raw

    def check(self, candidates: list[KillCandidate], alive_pids: set[int], trigger: str) -> KillDecision:
        """Decide whether and whom to kill now. Limits are re-read at every call."""
        now = self.clock()
        sample, raw = self.sample()
        if raw["limit"] != self._armed_limit:
            self._arm()  # someone changed the limit: the v1 threshold follows it
        if self.cooldown is not None:
            over, why = cooldown_over(self.cooldown, alive_pids, sample, now, self.policy)
            if not over:
                return KillDecision(Action.WAIT, why)
            self.cooldown = None
        decision = judge(sample, candidates, now, self.policy, trigger, self.node_id)
        if decision.action is Action.KILL:
            assert decision.report is not None
            self.cooldown = Cooldown(victims=frozenset(v.pid for v in decision.victims),
                                     counted_at_kill=sample.counted_bytes,
                                     expected_freed=expected_freed(decision.victims, candidates))
            self.recent.append(decision.report)
            self.kills += len(decision.victims)
            log.warning("%s", render_report(decision.report))
        elif decision.action is Action.WAIT and decision.reason != self._last_reason:
            log.warning("memory: %s", decision.reason)
        self._last_reason = decision.reason
        self._kernel_way_out(sample, candidates)
        return decision

    def _kernel_way_out(self, sample: MemorySample, candidates: list[KillCandidate]) -> None:
        """v1 stalls user/ at its limit for outlast to choose; with no outlast worker there, nobody
        would ever choose, and the other processes would stall forever: the kernel decides then."""
        if not isinstance(self.driver, HandsBackToKernel):
            return
        if sample.stalled and not candidates and not self._released_to_kernel:
            said = self.driver.release_to_kernel()
            self._released_to_kernel = True
            if said:
                log.warning("memory: %s", said)
        elif candidates and self._released_to_kernel:
            self.driver.hold_from_kernel()
            self._released_to_kernel = False

    def note_reaped(self, pid: int) -> None:
        c = self.cooldown
        if c is not None and pid in c.victims and c.reaped_at is None:
            self.cooldown = Cooldown(c.victims, c.counted_at_kill, c.expected_freed, reaped_at=self.clock())

    def take_event(self, source: EventSource) -> str:
        source.consume()
        return f"kernel event: {source.name}"

    # ---- status and stop ----------------------------------------------------------------------

    def info(self) -> IsolationInfo:
        sample, raw = self.sample()
        r = self.reservations
        return IsolationInfo(
            cgroup_version=self.driver.version, root=self.driver.root, total_memory=r.total_memory,
            system_reserved_memory=r.system_memory, user_limit=sample.limit_bytes, total_cpus=r.total_cpus,
            system_reserved_cpus=r.system_cpus, system_memory=int(raw["system"] or 0),
            user_memory=int(raw["user"] or 0), counted_memory=sample.counted_bytes,
            monitors=[s.name for s in self.sources] + ["threshold (anon + shared memory)"], kills=self.kills,
        )

    def capacity(self) -> Resources:
        r = self.reservations
        return Resources(num_cpus=r.user_cpus, memory_bytes=r.user_memory)

    def close(self) -> None:
        for s in self.sources:
            s.close()
        self.sources = []
        for line in self.driver.teardown():
            log.warning("undoing resource isolation: %s", line)


def setup_failed(root: str, error: BaseException, left: list[str]) -> str:
    """One paragraph: what failed, what was undone, what to do."""
    undone = ("everything it had changed was undone" if not left else
              "undoing it left: " + "; ".join(left) + f" (remove {root} by hand once it is empty)")
    return (f"resource isolation could not be set up in {root}: {type(error).__name__}: {error}. The node did "
            f"not start; {undone}. Pass --cgroup-path naming a cgroup delegated to this user (or run as root), "
            "or start without --enable-resource-isolation.")
