"""A controller core built in-process over fake storage, stepped by hand with a virtual clock.

Storage effects are carried out at once, in order, by the real `storage_io.perform` (without
retries), and their answers stepped in before `step` returns; `hold_storage` keeps them instead,
for a test to answer by hand (`held`, `release`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from outlast.controller import effects as fx
from outlast.controller import group as g
from outlast.controller import storage_io
from outlast.controller.core import ControllerCore
from outlast.controller.runstate import RunBook
from outlast.controller.types import RunPlan, Timeouts
from outlast.protocol import messages as m
from outlast.storage.retry import Retrying
from outlast.storage.run_store import RunStore
from tests.fakes.storage import MemoryStorage

WALL_OFFSET = 1_700_000_000.0


def node(node_id: str, cpus: float = 1.0) -> m.NodeInfo:
    return m.NodeInfo(node_id=node_id, address=f"tcp://{node_id}:1", host=node_id, resources={"CPU": cpus})


@dataclass
class Harness:
    core: ControllerCore
    now: float = 100.0
    effects: list[g.Effect] = field(default_factory=list)
    hold_storage: bool = False
    held: list = field(default_factory=list)  # storage effects not carried out yet (hold_storage)
    storage_log: list = field(default_factory=list)  # every storage effect, in the order handed over

    def step(self, event: g.InEvent | None = None, dt: float = 0.0) -> list[g.Effect]:
        self.now += dt
        out = self._carry_out(self.core.step(event or g.Tick(), self.now))
        self.effects += out
        return out

    def release(self, effect=None) -> list[g.Effect]:
        """Carry out the held storage effects (or just `effect`) and step their answers in."""
        todo = [effect] if effect is not None else list(self.held)
        out: list[g.Effect] = []
        for e in todo:
            self.held.remove(e)
            out += self._answer(e)
        self.effects += out
        return out

    def _carry_out(self, effects: list) -> list[g.Effect]:
        out: list[g.Effect] = []
        for effect in effects:
            if not isinstance(effect, fx.STORAGE_EFFECTS):
                out.append(effect)
                continue
            self.storage_log.append(effect)
            if self.hold_storage:
                self.held.append(effect)
            else:
                out += self._answer(effect)
        return out

    def _answer(self, effect) -> list[g.Effect]:
        answer = storage_io.perform(effect, self.core.book.store, lambda: Retrying(0.0, sleep=lambda s: None))
        return self._carry_out(self.core.step(answer, self.now))

    def wall(self) -> float:
        return WALL_OFFSET + self.now

    def worker(self, msg: m.WorkerMessage) -> list[g.Effect]:
        return self.step(g.FromWorker(msg))

    def agent(self, node_id: str, event: m.AgentEvent) -> list[g.Effect]:
        return self.step(g.FromAgent(node_id, event))

    def to_rank(self, rank: int) -> list[m.Msg]:
        """What the controller said to `rank`, less the `Welcome` every hello gets and the `SetUpHeard` every
        `SetUp` gets."""
        return [e.msg for e in self.effects if isinstance(e, g.ToRank) and e.rank == rank
                and not isinstance(e.msg, m.Welcome | m.SetUpHeard)]

    def spawned(self) -> dict[int, str]:
        """rank -> node of the latest attempt's spawns."""
        spawns = [e for e in self.effects if isinstance(e, g.Spawn)]
        last = max((s.msg.attempt for s in spawns), default=0)
        return {w.rank: s.node_id for s in spawns if s.msg.attempt == last for w in s.msg.workers}

    def exited(self, rank: int, node_id: str, code: int = 0, attempt: int | None = None) -> m.WorkerExited:
        return m.WorkerExited(run_id=self.core.run_id, attempt=attempt or self.core.attempt.number, rank=rank,
                              pid=100 + rank, exit_code=code, signal=None, error=None, node_id=node_id)

    @property
    def state(self):
        return self.core.state.kind


def make_plan(storage=None, world_size: int = 2, strategy: str = "SPREAD",
              timeouts: Timeouts = Timeouts(),  # noqa: B008 - frozen: one shared default is safe
              **plan_kw) -> RunPlan:
    storage = storage if storage is not None else MemoryStorage()
    book = RunBook.open(RunStore(storage, "run"), "exp", now=WALL_OFFSET)
    return RunPlan(name="exp", book=book, world_size=world_size,
                   workers=[m.WorkerSpec(rank=r, local_rank=0, local_world_size=1, node_rank=r,
                                         world_size=world_size) for r in range(world_size)],
                   payload=b"", max_failures=plan_kw.pop("max_failures", 0),
                   num_to_keep=plan_kw.pop("num_to_keep", None), score_attribute=None, score_order="max",
                   env={}, cwd="/", sys_path=[], timeouts=timeouts, per_worker={"CPU": 1.0}, strategy=strategy,
                   **plan_kw)


def make(storage=None, nodes=("n1", "n2", "n3"), **plan_kw) -> Harness:
    """A core over in-memory storage, given the node table and started."""
    h = Harness(core=None)  # type: ignore[arg-type]
    h.core = ControllerCore(make_plan(storage, **plan_kw), "run1", "tcp://controller:1", wall=h.wall)
    h.step(g.NodeTable([node(n) for n in nodes]))
    h.step(g.Started())
    return h


def start(h: Harness) -> dict[int, str]:
    """Every rank of the current attempt says hello and is set up; returns where each runs."""
    placement = h.spawned()
    for rank in placement:
        h.worker(m.WorkerHello(attempt=h.core.attempt.number, rank=rank, pid=100 + rank))
        h.worker(m.SetUp(attempt=h.core.attempt.number, rank=rank))
    return placement


def finish_all(h: Harness, placement: dict[int, str]) -> None:
    """Every rank of the current attempt is done and has exited."""
    for rank, node_id in placement.items():
        h.worker(m.WorkerDone(attempt=h.core.attempt.number, rank=rank, reports=0))
        h.agent(node_id, h.exited(rank, node_id))
