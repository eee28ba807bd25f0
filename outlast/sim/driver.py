"""A simulated driver: the real controller core, stepped on the virtual clock, behind a simulated worker group
and a simulated storage executor.

Every event reaches the core through `deliver`, one at a time, in the order its channel
delivered it. The core's storage effects go to an executor of their own (`SimStorageExecutor`),
carried out one after another on the virtual clock, their answers delivered when done: storage's
latency delays what waits on it (a commit), never the heartbeats or the answers to ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from outlast.controller import group as g
from outlast.controller import live_steps
from outlast.controller.core import ControllerCore
from outlast.controller.driver_lease import LeaseKeeper
from outlast.controller.resize import Elastic
from outlast.controller.runstate import RunBook
from outlast.controller.types import RunPlan, Timeouts
from outlast.protocol import messages as m
from outlast.controller import effects as fx
from outlast.sim.cluster import node_table
from outlast.sim.live import live_store
from outlast.sim.storage import SimStorageExecutor
from outlast.sim.tier import SimTierAsks
from outlast.sim.workers import Gang
from outlast.sim.world import Channel
from outlast.storage.run_store import RunStore
from outlast.train.live.store_host import LiveStore

if TYPE_CHECKING:
    from outlast.sim.run import Sim

TICK_S = 0.5
TIMEOUTS = Timeouts(heartbeat_interval_s=1.0, driver_lost_after_s=5.0, worker_start_s=60.0, teardown_grace_s=1.0,
                    last_messages_s=2.0, capacity_s=60.0, node_lost_after_s=5.0)


class SimDriver:
    def __init__(self, sim: "Sim", generation: int) -> None:
        self.sim = sim
        self.generation = generation
        self.identity = f"driver{generation}".encode()  # its socket's identity at the agents
        self._gone_told: set[tuple[str, int]] = set()  # (node id, agent pid) reported gone
        self.alive = True
        self.storage: SimStorageExecutor | None = None
        self.tiers: SimTierAsks | None = None
        self._gangs: dict[int, Gang] = {}
        self._to_node: dict[str, Channel] = {}
        self._from_node: dict[str, Channel] = {}
        self._to_rank: dict[tuple[int, int], Channel] = {}
        self._from_rank: dict[tuple[int, int, bool], Channel] = {}
        self._head = Channel(sim.world, sim.schedule.max_delay_s)
        self._forgotten: set[str] = set()  # nodes whose link the core closed: what they send is lost
        self.core: ControllerCore | None = None
        self.live: LiveStore | None = live_store() if sim.schedule.live else None  # the store it holds for them
        self._performs: dict[type, Callable[[Any], None]] = {
            **dict.fromkeys(fx.STORAGE_EFFECTS, self._to_storage), fx.TierAsk: self._to_tier,
            g.ToRank: self._send_to_rank, **dict.fromkeys((g.Spawn, g.StopRun, g.ToNode), self._send_to_node),
            g.QueryTable: self._query_table, g.ForgetNode: self._forget_node,
            g.PublishMembership: self._publish}

    def launch(self, last_seen: float | None) -> bool:
        """Open the run as `fit()` does; False if it had already finished."""
        sim, s = self.sim, self.sim.schedule
        store = RunStore(sim.storage, "run")
        # As fit() does: the lease first (every simulated driver runs on one host, and the one before is dead),
        # then the run's history.
        LeaseKeeper(store, ttl_s=10.0, clock=lambda: sim.world.now, wall=sim.wall, sleep=lambda s: None,
                    alive=lambda lease: False, host="sim").acquire(wait_s=0)
        book = RunBook.open(store, "exp", sim.wall())
        if book.state.status == "finished":
            return False
        book.close_dead_drivers_attempt(sim.wall(), last_seen)
        plan = RunPlan(
            name="exp", book=book, world_size=s.loop.world_size,
            workers=[m.WorkerSpec(rank=r, local_rank=r, local_world_size=s.loop.world_size, node_rank=0,
                                  world_size=s.loop.world_size) for r in range(s.loop.world_size)],
            payload=b"", max_failures=s.max_failures, num_to_keep=s.num_to_keep, score_attribute=None,
            score_order="max", env={}, cwd="/", sys_path=[], timeouts=TIMEOUTS, max_preemption_failures=-1,
            per_worker={"CPU": 1.0}, strategy=s.strategy,
            elastic=Elastic(s.min_workers, s.loop.world_size, s.resize_interval_s) if s.min_workers else None,
            hang_timeout_s=s.hang_timeout_s,
            checkpoint_storage=s.tier.checkpoint_storage if s.tier is not None else "storage",
            live_recovery=s.live, live_store=self.live.address if self.live is not None else "")
        self.core = ControllerCore(plan, f"driver{self.generation}", f"sim://driver{self.generation}", sim.wall)
        self.storage = SimStorageExecutor(sim, sim.storage, self.deliver, self._storage_escaped)
        self.tiers = SimTierAsks(self)
        sim.storage.take_spent()
        self.deliver(g.NodeTable(node_table(sim.nodes, sim.world.now)))
        self.deliver(g.Started())
        sim.world.after(TICK_S, self._tick)
        return True

    def _storage_escaped(self, effect: fx.StorageEffect, e: Exception) -> None:
        self.sim.observer.escaped(self, effect, e)
        self.die()

    def die(self) -> None:
        self.alive = False
        if self.storage is not None:
            self.storage.stop()
        for ch in [*self._to_node.values(), *self._from_node.values(), *self._to_rank.values(),
                   *self._from_rank.values(), self._head]:
            ch.open = False

    # ---- events in ------------------------------------------------------------------------

    def _tick(self) -> None:
        if self.alive and self.core is not None and not self.core.closed:
            self._agents_gone()
            self.deliver(g.Tick())
            self._live_joined()
            self._live_ready()
            self.sim.world.after(TICK_S, self._tick)

    def _agents_gone(self) -> None:
        """A node's agent on this machine whose pid is gone is lost at once, as the agent group sees it."""
        for node in self.sim.nodes:
            key = (node.node_id, node.agent_pid)
            if (why := node.agent_gone()) is not None and key not in self._gone_told:
                self._gone_told.add(key)
                self.deliver(g.AgentGone(node.node_id, why))

    def deliver(self, event: g.InEvent) -> None:
        world = self.sim.world
        if not self.alive or self.core is None or self.core.closed:
            return
        if world.tracing:
            world.note(f"driver{self.generation} <- {_describe(event)}")
        try:
            effects = self.core.step(event, world.now)
        except Exception as e:  # noqa: BLE001 - an escape is what the simulator looks for
            self.sim.observer.escaped(self, event, e)
            self.die()
            return
        self.sim.observer.after_step(self, event, effects)
        performs = self._performs
        for effect in effects:
            if world.tracing and not isinstance(effect, (g.ToNode, g.QueryTable, fx.WriteRunState)):
                world.note(f"driver{self.generation} -> {_describe_effect(effect)}")
            performs[type(effect)](effect)  # as `perform` does
        if self.core.closed:
            self.sim.driver_closed(self)

    def from_node(self, node_id: str, event: m.AgentEvent) -> None:
        if node_id in self._forgotten:
            return
        ch = self._from_node.get(node_id)
        if ch is None:
            ch = self._from_node[node_id] = Channel(self.sim.world, self.sim.schedule.max_delay_s)
        ch.send(self.deliver, g.FromAgent(node_id, event))

    def worker_channel(self, attempt: int, rank: int, uploads: bool = False, incarnation: int = 0) -> "Link":
        """A rank's socket to the controller (the upload thread has one of its own: no order between them). Its
        messages carry the process's incarnation, as its socket's identity does."""
        ch = self._from_rank[(attempt, rank, uploads)] = Channel(self.sim.world, self.sim.schedule.max_delay_s)
        return Link(ch, self.deliver, incarnation)

    def gang(self, attempt: int, size: int) -> Gang:
        if attempt not in self._gangs:
            self._gangs[attempt] = Gang(size)
        return self._gangs[attempt]

    # ---- effects out ----------------------------------------------------------------------

    def perform(self, effect: g.Effect | fx.StorageEffect | fx.TierAsk) -> None:
        # By the effect's class (none of them subclasses another): a few effects for every event.
        self._performs[type(effect)](effect)

    def _to_storage(self, effect: fx.StorageEffect) -> None:
        assert self.storage is not None
        self.storage.submit(effect)

    def _to_tier(self, effect: fx.TierAsk) -> None:
        assert self.tiers is not None
        self.tiers.submit(effect)

    def _send_to_rank(self, effect: g.ToRank) -> None:
        sim = self.sim
        key = (effect.attempt, effect.rank)
        ch = self._to_rank.get(key)
        if ch is None:
            ch = self._to_rank[key] = Channel(sim.world, sim.schedule.max_delay_s)
        # To the process of the rank whose message was stepped last: a drained rank and its replacement both live
        # while a move is under way.
        w = sim.rank_of(self, effect.attempt, effect.rank, effect.incarnation)
        if w is not None:
            ch.send(w.on_message, effect.msg)

    def _send_to_node(self, effect: g.Spawn | g.StopRun | g.ToNode) -> None:
        sim = self.sim
        node = sim.node(effect.node_id)
        ch = self._to_node.get(effect.node_id)
        if ch is None:
            ch = self._to_node[effect.node_id] = Channel(sim.world, sim.schedule.max_delay_s)
        self._forgotten.discard(effect.node_id)
        if node is not None:
            ch.send(node.from_driver, self, effect.msg)

    def _publish(self, effect: g.PublishMembership) -> None:
        if self.live is not None:
            self.live.publish(effect.attempt, effect.membership)

    def _live_joined(self) -> None:
        """As the runtime's loop does after each batch of events: a word from the sending rank, read from the store
        (the words of the recovery's earlier generations first)."""
        if self.live is None or not self.alive or self.core is None or self.core.closed:
            return
        for attempt, generation in live_steps.unread(self.core):
            if (earlier := self.live.joined(attempt, generation)) is not None:
                self.deliver(earlier)
        if (awaited := live_steps.awaited(self.core)) is not None \
                and (joined := self.live.joined(*awaited)) is not None:
            self.deliver(joined)

    def _live_ready(self) -> None:
        """As the runtime's loop does: a planned generation's new members that wait for it, read from the store."""
        if self.live is None or not self.alive or self.core is None or self.core.closed:
            return
        for attempt, member in live_steps.starting(self.core):
            if (ready := self.live.ready(attempt, member)) is not None:
                self.deliver(ready)

    def _query_table(self, effect: g.QueryTable) -> None:
        self._head.send(lambda: self._head.send(self._table_answer))

    def _forget_node(self, effect: g.ForgetNode) -> None:
        self._forgotten.add(effect.node_id)
        for chans in (self._to_node, self._from_node):
            ch = chans.pop(effect.node_id, None)
            if ch is not None:
                ch.open = False

    def _table_answer(self) -> None:
        self.deliver(g.NodeTable(node_table(self.sim.nodes, self.sim.world.now)))


class Link:
    """A rank's socket: what it sends arrives in order, unless the process exits first (`lose_pending`:
    `os._exit` throws away what the socket's I/O thread still holds)."""

    def __init__(self, ch: Channel, deliver, incarnation: int = 0) -> None:
        self._ch, self._deliver, self._incarnation = ch, deliver, incarnation

    def __call__(self, msg: m.WorkerMessage) -> None:
        self._ch.send(self._deliver, g.FromWorker(msg, self._incarnation))

    def lose_pending(self) -> int:
        """How many messages were lost."""
        lost = self._ch.in_flight if self._ch.open else 0
        self._ch.open = False
        return lost


def _describe(event: g.InEvent) -> str:
    if isinstance(event, g.FromWorker):
        return f"worker {event.msg!r}"
    if isinstance(event, g.FromAgent):
        return f"agent {event.node_id} {event.event!r}"
    if isinstance(event, g.NodeTable):
        return "table " + ", ".join(f"{n.node_id}:{n.state}" for n in event.nodes)
    return type(event).__name__


def _describe_effect(effect: g.Effect) -> str:
    if isinstance(effect, g.Spawn):
        return (f"spawn attempt {effect.msg.attempt} ranks {[w.rank for w in effect.msg.workers]} on {effect.node_id}"
                f" restoring {effect.msg.restore_checkpoint}")
    if isinstance(effect, g.ToRank):
        return f"rank {effect.rank} of attempt {effect.attempt}: {effect.msg!r}"
    return repr(effect)
