"""One schedule, run from its seed to the end of the run, with its faults injected on time."""

from __future__ import annotations

import json
import logging
import random
import signal
from dataclasses import dataclass

from outlast.controller import group as g
from outlast.controller.runstate import RunBook
from outlast.protocol import messages as m
from outlast.sim.agent_node import AgentNode
from outlast.sim.cluster import NodeModel
from outlast.sim.driver import SimDriver
from outlast.sim.invariants import Observer
from outlast.sim.live import POINTS, Group, LiveWatch
from outlast.sim.schedule import FAIL_KINDS, GROW_POINTS, MESH_POINTS, NEWER_DOCUMENTS, SHARD_POINTS, Fault, Schedule, draw, draw_live
from outlast.sim.storage import SimStorage
from outlast.sim.tier import SimTier
from outlast.sim.workers import SimRank
from outlast.sim.world import World
from outlast.storage.lease import LEASE_VERSION
from outlast.storage.records import MANIFEST_NAME, MANIFEST_VERSION, RUN_STATE_VERSION, NewerVersionError
from outlast.storage.run_store import RunStore

WALL0 = 1_800_000_000.0
RELAUNCH_AFTER_S = 12.0  # a new driver takes the run once the dead one's lease (10 s) has expired


@dataclass(frozen=True)
class Outcome:
    seed: int
    violations: list[str]
    status: str
    virtual_s: float
    trace: list[str]
    facts: dict[str, int]


class Sim:
    def __init__(self, schedule: Schedule, trace: bool = False, edges: bool = False) -> None:
        """`edges`: the invariants of the edge schedules too: every state the controller enters is also
        asked, in a copy, what it makes of each message a worker or an agent may send, and each failure
        must be charged to its cause's budget (`invariants.py`)."""
        self.schedule = schedule
        self.edges = edges
        self.world = World(random.Random(schedule.seed ^ 0x5EED), trace=trace)
        self.storage = SimStorage(lambda: self.world.now)
        self.storage.latency_s = schedule.storage_latency_s
        self.storage.refuse_deletes = schedule.refuse_deletes
        self.storage_faults = any(f.kind == "storage_fail" for f in schedule.faults)
        self._pids = 1000
        self.nodes: list[NodeModel] = [self._new_node(f"n{i}") for i in range(schedule.nodes)]
        self._by_id: dict[str, NodeModel] = {n.node_id: n for n in self.nodes}  # each message to a node
        self.observer = Observer(self)
        self.drained_at: dict[str, float] = {}
        self.driver: SimDriver | None = None
        self.generations = 0
        self.closed = False
        self.own_faults = {"fork_server_deaths": 0, "agent_deaths": 0, "agent_restarts": 0}  # those that struck
        self.armed_in_grow: Fault | None = None  # struck by the observer once a grow's notice is out
        self.facts = dict.fromkeys(["interrupts", "lease_losses", "unkillable_ranks", "children_started",
                                    "uploads_lost_at_exit", "failures_in_drains", "failures_in_grows",
                                    "states_probed", "newer_documents", "refused_as_newer",
                                    "copies_corrupted", "holders_lost", "restores_from_memory", "evictions"], 0)
        self.newer: dict[str, str] = {}  # path -> which document a newer outlast rewrote
        # Live recovery (`schedule.live`): the faults armed for a point of a rank's step, each live group by
        # (attempt, generation), and the invariants.
        self.live_armed: list[tuple[int | None, str]] = []
        self.live_drains: list[tuple[int, str, float | None]] = []  # (rank, point, deadline): its node drained there
        self.live_grows: list[tuple[int, str]] = []  # (rank, point): a node joins as the rank reaches it
        self.live_groups: dict[tuple[int, int, str], Group] = {}  # (attempt, generation, "" or a mesh group's name)
        # Every live-recovery process by (run, attempt, rank, incarnation): a drained rank and its replacement both
        # live while a move is under way.
        self.live_processes: dict[tuple[str, int, int, int], SimRank] = {}
        self.live_watch = LiveWatch(self)
        if schedule.live:
            self.facts.update({f"live_kill_{p}": 0 for p in POINTS + SHARD_POINTS + MESH_POINTS},
                              live_orphaned_replacements=0, live_mesh_steps_lost=0, live_mesh_widened_lost=0, live_mesh_lost_unsaid=0,
                              live_several_senders=0, live_left_cleanly=0,
                              **{f"live_drain_{p}": 0 for p in POINTS + SHARD_POINTS},
                              **{f"live_grow_{p}": 0 for p in GROW_POINTS})
        self.refused: str | None = None  # why a driver refused to open the run
        loop = schedule.loop
        self.notice_bound_s = max(0.5, loop.step_s * 1.1) + 0.5 + 6 * schedule.max_delay_s \
            + 12 * schedule.storage_latency_s

    def _new_node(self, node_id: str, same_host: bool = False) -> NodeModel:
        return AgentNode(self, node_id, self.schedule.cpus_per_node, same_host)

    def new_pid(self) -> int:
        self._pids += 1
        return self._pids

    def wall(self) -> float:
        return WALL0 + self.world.now

    def node(self, node_id: str) -> NodeModel | None:
        return self._by_id.get(node_id)

    def tier_at(self, address: str) -> SimTier | None:
        """The tier server at `address`: of a live agent, the one that bound it (a new agent binds another)."""
        node = next((n for n in self.nodes if isinstance(n, AgentNode) and n.tier is not None
                     and n.tier.address == address), None)
        return node.tier if node is not None and node.alive else None

    def rank_of(self, driver: SimDriver, attempt: int, rank: int, incarnation: int | None = None) -> SimRank | None:
        """The rank's live process (of `incarnation`, when given: a drained rank lives beside its replacement)."""
        assert driver.core is not None
        w = self.observer.live.get((driver.core.run_id, attempt, rank))
        if incarnation is not None and w is not None and w.incarnation != incarnation:
            return self.live_processes.get((driver.core.run_id, attempt, rank, incarnation))
        if incarnation is not None and w is None:
            # A drained process lives on when its replacement died (the observer forgot the rank): the answer to its
            # report goes over its socket. Dropped, it waited for ever, and the group with it.
            drained = self.live_processes.get((driver.core.run_id, attempt, rank, incarnation))
            return drained if drained is not None and drained.alive else None
        return w

    # ---- the run ---------------------------------------------------------------------------

    def run(self) -> Outcome:
        s = self.schedule
        for node in self.nodes:
            node.start()
        self._launch(None)
        for fault in s.faults:
            self.world.at(fault.at, self._inject, fault)
        limit = 300.0 + 3 * s.nominal_s * (1 + len(s.faults)) + 200.0 * len(s.faults)
        self.world.run_until(limit)
        if not self.observer.violations:
            self.observer.at_end(self.closed, limit)
        book = self.final_book()
        if s.live and book is not None and not self.observer.violations:
            self.live_watch.at_end(book)
        ob = self.observer
        facts = {"preempted_attempts": len(ob.noticed), "ranks_told": sum(len(v) for v in ob.first_notice.values()),
                 "durable_checkpoints": len(ob.durable), "driver_launches": self.generations,
                 "attempts": len(book.state.attempts) if book else 0,
                 "resizes": len(book.state.resizes) if book else 0,
                 "grows": sum(r.to_workers > r.from_workers for r in book.state.resizes) if book else 0, **self.own_faults,
                 **self.facts}
        if s.live and book is not None:
            recs = book.state.live_recoveries
            sharded = s.loop.shards > 1
            unheld_shard = sum("every rank holding shard(s)" in r.reason for r in recs)
            drains = [r for r in recs if r.cause.startswith("drain")]
            left = sum(r.reason.startswith("shrink, live: drain") for r in book.state.resizes)
            facts.update(live_drains_moved=sum(r.path == "live" for r in drains) - left, live_drains_left=left,
                         live_drains_fell_back=sum(r.path == "restart" for r in drains),
                         live_grows=sum(r.path == "live" and r.cause.startswith("grow") for r in recs),
                         live_recovered=sum(r.path == "live" for r in recs),
                         live_sharded=int(sharded), live_sharded_recovered=sharded * sum(r.path == "live" for r in recs),
                         live_mesh=int(s.loop.mesh), live_mesh_recovered=s.loop.mesh * sum(r.path == "live" for r in recs),
                         live_mesh_fell_back=s.loop.mesh * sum(r.path == "restart" for r in recs),
                         live_fallback_unheld_shard=unheld_shard,
                         live_widened=sum(r.path == "live" and r.generation > 0 and len(r.ranks) > 1 for r in recs),
                         live_shrunk=sum(r.path == "live" and r.cause.startswith("shrink") for r in recs),
                         live_fallback_no_holder=sum("no rank that holds the state" in r.reason for r in recs),
                         live_fallback_transfer_bound=sum("took the state (more than" in r.reason for r in recs),
                         live_fallback_other=sum(r.path == "restart" and "no rank that holds the state" not in r.reason
                                                 and "took the state (more than" not in r.reason
                                                 for r in recs) - unheld_shard)
        status = "refused" if self.refused is not None else book.state.status if book else "?"
        return Outcome(s.seed, list(ob.violations), status, self.world.now, self.world.trace, facts)

    def _launch(self, last_seen: float | None) -> None:
        self.generations += 1
        self.driver = SimDriver(self, self.generations)
        self.world.note(f"driver{self.generations} launched")
        before = dict(self.storage.files)
        try:
            launched = self.driver.launch(last_seen)
        except NewerVersionError as e:  # fit() refuses the run: the user upgrades outlast, or starts another run
            self.world.note(f"driver{self.generations} refused the run: {e}")
            self.driver.die()
            self.observer.refused(e, before)
            self.refused = str(e)
            self._close()
            return
        except OSError as e:  # fit() raises before its run starts; the user launches it again
            self.world.note(f"driver{self.generations} could not open the run: {e}")
            self.driver.die()
            self.world.after(RELAUNCH_AFTER_S, self._launch, last_seen)
            return
        if not launched:
            self._close()
        elif self.newer:
            self.observer.violation(f"driver{self.generations} opened the run although a newer outlast wrote its "
                                    f"{', '.join(sorted(self.newer.values()))}")

    def driver_closed(self, driver: SimDriver) -> None:
        if driver is self.driver:
            self._close()

    def _close(self) -> None:
        self.closed = self.world.stopped = True

    def final_book(self) -> RunBook | None:
        self.storage.failing.clear()
        try:
            return RunBook.open(RunStore(self.storage, "run"), "exp", self.wall())
        except (OSError, NewerVersionError):
            return None

    # ---- faults ----------------------------------------------------------------------------

    def _inject(self, f: Fault) -> None:
        if self.closed:
            return
        self.world.note(f"FAULT {f}")
        live_nodes = [n for n in self.nodes if n.alive]
        rank = f.target % self.schedule.loop.world_size
        if f.kind == "kill_at":  # the rank dies when it next reaches the point (any rank's, target < 0)
            self.live_armed.append((f.target if f.target >= 0 else None, f.point))
        elif f.kind == "drain_at":  # the rank's node is drained when the rank next reaches the point
            self.live_drains.append((f.target, f.point, f.deadline_s))
        elif f.kind == "grow_at":  # a node joins when the rank next reaches the point
            self.live_grows.append((f.target, f.point))
        elif f.kind == "kill_worker":
            if hit := next((w for n in live_nodes if (w := n.kill_worker(rank)) is not None), None):
                self.observer.struck(hit)
        elif f.kind == "unkillable":
            until = self.world.now + f.duration_s
            if hit := next((w for n in live_nodes if (w := n.wedge_worker(rank, until)) is not None), None):
                self.observer.struck(hit)
                self.facts["unkillable_ranks"] += 1
                if until != float("inf"):  # out of the kernel, the kill it was sent (or the error it met) ends it
                    self.world.at(until, self._unstuck, hit)
        elif f.kind == "arm_in_grow":
            self.armed_in_grow = f
        elif f.kind in ("interrupt", "lease_lost"):
            if self.driver is not None and self.driver.alive:
                self.facts["interrupts" if f.kind == "interrupt" else "lease_losses"] += 1
                self.driver.deliver(g.Interrupted() if f.kind == "interrupt"
                                    else g.LeaseLost("simulated: another driver took the run's lease"))
        elif f.kind == "lose_node":
            node = self.nodes[f.target % len(self.nodes)]
            if node.alive:  # with workers, or placed on before the head declares it dead
                self.observer.harm += 1
                self.live_watch.node_lost(sum(w.alive for w in node.workers.values()))
            node.die()
        elif f.kind in ("drain", "drain_empty"):
            candidates = [n for n in live_nodes if not n.workers] if f.kind == "drain_empty" else live_nodes
            if candidates:
                self._drain(candidates[f.target % len(candidates)], f.deadline_s)
        elif f.kind == "driver_death":
            if self.driver is not None and self.driver.alive:
                self.driver.die()
                died = self.wall()
                self.world.after(RELAUNCH_AFTER_S, self._launch, died)
        elif f.kind == "hang":
            if hit := next((w for n in live_nodes if (w := n.wedge_worker(rank)) is not None), None):
                self.observer.struck(hit)
        elif f.kind == "add_node":
            self._add_node()
        elif f.kind == "storage_fail":
            self.storage.failing.append((self.world.now, self.world.now + f.duration_s))
        elif f.kind == "storage_slow":
            self.storage.slow.append((self.world.now, self.world.now + f.duration_s, f.latency_s))
        elif f.kind in ("fork_server_death", "agent_death", "agent_restart"):
            self._agent_fault(f, live_nodes)
        elif f.kind == "newer_document" and not (self.driver is not None and self.driver.alive):
            self._write_newer(NEWER_DOCUMENTS[f.target % len(NEWER_DOCUMENTS)])
        elif f.kind == "corrupt_copy":
            self._corrupt(f.target)
        elif f.kind == "lose_holders":
            self._lose_holders(f.target)

    # ---- live recovery ------------------------------------------------------------------------

    def live_armed_for(self, w: SimRank, point: str) -> bool:
        """Whether a fault armed for `point` strikes `w` there (it is spent)."""
        for i, (rank, at) in enumerate(self.live_armed):
            if at == point and rank in (None, w.rank):
                del self.live_armed[i]
                return True
        return False

    def live_planned_at(self, w: SimRank, point: str) -> None:
        """A drain armed for `point` strikes `w`'s node as the rank reaches it (the rank goes on); a node armed for
        it joins."""
        if (w.rank, point) in self.live_grows:
            self.live_grows.remove((w.rank, point))
            self.facts[f"live_grow_{point}"] += 1
            self._add_node()
        for i, (rank, at, deadline) in enumerate(self.live_drains):
            if at == point and rank == w.rank and w.node.alive and w.node.core.draining is None:
                del self.live_drains[i]
                self.facts[f"live_drain_{point}"] += 1
                self.world.note(f"node {w.node.node_id} of rank {w.rank} drained at {point}")
                self._drain(w.node, deadline)
                return

    def live_kill(self, w: SimRank, point: str) -> None:
        if w.alive and w.node.alive:
            self.facts[f"live_kill_{point}"] += 1
            self.world.note(f"rank {w.rank} of attempt {w.attempt} killed at {point}")
            self.observer.struck(w)
            w.kill()
            w.node.worker_exited(w, None, signal.SIGKILL, None)

    def live_group(self, attempt: int, membership, name: str = "", ranks: tuple[int, ...] | None = None) -> Group:
        """A generation's group: its whole group (the live group's), or one of an FSDP2 mesh's (`name`, of `ranks`)."""
        key = (attempt, membership.generation, name)
        if key not in self.live_groups:
            self.live_groups[key] = Group(self, membership, ranks)
        return self.live_groups[key]

    def live_died(self, w: SimRank) -> None:
        """`w`'s process is gone: each group of its attempt that names it loses it."""
        assert w.live is not None
        member = w.live.rank.member
        for (attempt, _, _), group in self.live_groups.items():
            if attempt == w.attempt and group.names(member):
                group.lost(w)

    def _corrupt(self, target: int) -> None:
        tiers = [n.tier for n in self.nodes if isinstance(n, AgentNode) and n.alive and n.tier is not None
                 and n.tier.records]
        if not tiers:
            return
        tier = tiers[target % len(tiers)]
        newest = max(tier.records, key=lambda k: (tier.records[k].seq, k))
        hits = [(t, newest) for t in tiers if newest in t.data] if target % 2 else [(tier, newest)]
        for t, key in hits:
            t.corrupt(key)
            if self.observer.tier is not None:
                self.observer.tier.corrupted(t.node.node_id, key)
            self.facts["copies_corrupted"] += 1
            if self.world.tracing:
                self.world.note(f"node {t.node.node_id}: copy {key} corrupted in RAM")

    def _lose_holders(self, target: int) -> None:
        """The machines that hold the newest committed checkpoint go: one of them, or all."""
        core = self.driver.core if self.driver is not None else None
        book = core.book if core is not None else self.final_book()
        record = max(book.state.checkpoints, key=lambda r: r.seq, default=None) if book is not None else None
        holders = [n for n in self.nodes if record is not None and n.node_id in record.memory and n.alive]
        for node in holders if target % 2 else holders[:1]:
            self.observer.harm += 1
            self.facts["holders_lost"] += 1
            node.die()

    def _write_newer(self, which: str) -> None:
        """A newer outlast drove the run meanwhile: one of its documents is of a newer version, with fields of
        its own. The latest manifest is the one the run state names (none yet: the run state instead)."""
        files = self.storage.files
        state = json.loads(files["run/run_state.json"]) if "run/run_state.json" in files else {}
        latest = state.get("latest_checkpoint")
        if which == "latest manifest" and latest is None:
            which = "run state"
        path, newest = {"run state": ("run/run_state.json", RUN_STATE_VERSION), "lease": ("run/driver_lease.json",
                        LEASE_VERSION), "latest manifest": (f"run/{latest}/{MANIFEST_NAME}", MANIFEST_VERSION)}[which]
        doc = json.loads(files[path]) if path in files else {}
        doc.update(version=newest + 1, recorded_by_the_newer_version={"kept": True})
        files[path] = json.dumps(doc).encode()
        self.newer[path] = which
        self.facts["newer_documents"] += 1

    def _agent_fault(self, f: Fault, live_nodes: list[NodeModel]) -> None:
        """The node's own processes die: a node with workers if there is one, else any."""
        agents = [n for n in live_nodes if isinstance(n, AgentNode)]
        busy = [n for n in agents if n.workers] or agents
        if not busy:
            return
        node = busy[f.target % len(busy)]
        self.observer.harm += 1
        self.own_faults[{"fork_server_death": "fork_server_deaths", "agent_death": "agent_deaths",
                         "agent_restart": "agent_restarts"}[f.kind]] += 1
        if f.kind == "fork_server_death":
            node.fork_server_dies()
        elif f.kind == "agent_death":  # the embedded node: its driver starts a new one, a new node id
            node.same_host = True
            node.agent_dies()
            self.world.after(f.duration_s, self._add_node, True)
        else:  # a persistent node, started again by its supervisor (systemd) with the same id
            node.same_host = f.same_host
            node.agent_dies()
            self.world.after(f.duration_s, self._restart_agent, node)

    def grow_noticed(self) -> None:
        """A grow's notice went out: an armed failure strikes within its window."""
        f, self.armed_in_grow = self.armed_in_grow, None
        if f is not None:
            kind = FAIL_KINDS[int(f.deadline_s or 0)]
            self.world.after(f.duration_s, self._inject, Fault(self.world.now + f.duration_s, kind, f.target))

    def _unstuck(self, w: SimRank) -> None:
        if w.alive and w.node.alive:
            w.kill()
            w.node.worker_exited(w, None, signal.SIGKILL, None)

    def _restart_agent(self, node: AgentNode) -> None:
        if not node.alive:
            node.start()
            self.world.note(f"node {node.node_id} agent started again (pid {node.agent_pid})")

    def drain_node(self, node: NodeModel, why: str) -> None:
        """A node drains itself (it gave up a workload that SIGKILL did not end): no deadline."""
        if node.alive and node.core.draining is None:
            self.drained_at.setdefault(node.node_id, self.world.now)
            node.drain(m.NodeDraining(node_id=node.node_id, reason="other", message=why, deadline_unix_s=None,
                                      node_ids=[node.node_id]))

    def _drain(self, node: NodeModel, deadline_s: float | None) -> None:
        self.drained_at.setdefault(node.node_id, self.world.now)
        self.live_watch.drained |= {(w.attempt, w.rank) for w in node.workers.values() if w.alive}
        deadline = self.wall() + deadline_s if deadline_s is not None else None
        node.drain(m.NodeDraining(node_id=node.node_id, reason="spot", message="simulated preemption",
                                  deadline_unix_s=deadline, node_ids=[node.node_id]))
        if deadline_s is not None:
            self.world.after(deadline_s, node.die)
            if self.world.rng.random() < 0.5:  # the cloud replaces the preempted node, some time later
                self.world.after(deadline_s + self.world.rng.uniform(5.0, 40.0), self._add_node)

    def _add_node(self, same_host: bool = False) -> None:
        node = self._new_node(f"n{len(self.nodes)}", same_host)
        self.nodes.append(node)
        self._by_id[node.node_id] = node
        node.start()
        self.world.note(f"node {node.node_id} joined")


def run_seed(seed: int, trace: bool = False, elastic: bool = False, edges: bool = False,
             tier: bool = False, live: bool = False) -> Outcome:
    if live:
        return Sim(draw_live(seed), trace=trace).run()
    return Sim(draw(seed, elastic, edges, tier), trace=trace, edges=edges).run()


def quiet() -> None:
    """The controller logs what a run does; thousands of simulated runs would drown the result."""
    logging.getLogger("outlast").setLevel(logging.CRITICAL + 1)
