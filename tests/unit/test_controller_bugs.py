"""The three controller bugs of issue 8, driven in-process: no processes, no agents."""

from __future__ import annotations

import pytest
import zmq

import outlast.train  # noqa: F401  (the controller imports the training API back: issue 8, layering)

from outlast.controller.placement import NodeView
from outlast.controller.preemption import Decision, HorizonBook
from outlast.controller.runstate import RunBook
from outlast.controller.runtime import Controller
from outlast.controller.states import State
from outlast.controller.types import RunPlan, Timeouts
from outlast.protocol import messages as m
from outlast.storage.run_store import RunStore
from tests.fakes.storage import MemoryStorage


@pytest.mark.xfail(strict=True, reason="issue 8 (a): D is fixed at the stale 2^20 horizon")
def test_a_notice_mid_step_of_a_slow_loop_is_seen_at_the_next_call_of_every_rank():
    """2 s steps, one get_preemption_info() per step: the notice comes 0.3 s into a step, nobody asks
    during the collection window; the next call of each rank must be the decision index."""
    book = HorizonBook()
    t = 0.0
    for call in range(5):
        for rank in (0, 1):
            book.on_query(rank, call, now=t)
        t += 2.0
    book.preempt(now=t - 2.0 + 0.3)  # ranks are at call 5 next, in 1.7 s
    book.tick(now=t - 2.0 + 1.0)
    answers = {rank: book.on_query(rank, 5, now=t) for rank in (0, 1)}
    assert answers == {0: Decision(5), 1: Decision(5)}


class FakeLink:
    def __init__(self, sock) -> None:
        self.sock = sock
        self.sent: list = []
        self.last_reply = 0.0

    def send(self, msg) -> None:
        self.sent.append(msg)


class FakeCluster:
    key = None

    def __init__(self, ctx, nodes) -> None:
        self.nodes = {n: m.NodeInfo(node_id=n, address=f"tcp://{n}", host=n, resources={"CPU": 1.0})
                      for n in nodes}
        self.links: dict[str, FakeLink] = {}
        self._ctx = ctx

    def views(self, run_id):
        return [NodeView(node_id=n, address=i.address, resources=dict(i.resources)) for n, i in self.nodes.items()]

    def link(self, node_id):
        if node_id not in self.links:
            self.links[node_id] = FakeLink(self._ctx.socket(zmq.DEALER))
        return self.links[node_id]

    def refresh(self, timeout_s):
        return True

    def note_tick(self, now):
        pass

    def poll_table(self, now, interval_s=1.0):
        pass

    def lost_nodes(self, now, live):
        return {}

    def note_draining(self, notice):
        pass

    def describe(self):
        return ", ".join(self.nodes)


class RefusingDeletes(MemoryStorage):
    def delete(self, path: str) -> None:
        raise PermissionError(f"AccessDenied: s3:DeleteObject on {path}")


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def controller(ctx, storage, nodes=("n1", "n2"), num_to_keep=None):
    clock = [100.0]
    book = RunBook.open(RunStore(storage, "run"), "exp", now=1.0)
    plan = RunPlan(name="exp", book=book, world_size=2,
                   workers=[m.WorkerSpec(rank=r, local_rank=0, local_world_size=1, node_rank=r, world_size=2)
                            for r in range(2)],
                   payload=b"", max_failures=0, num_to_keep=num_to_keep, score_attribute=None, score_order="max",
                   env={}, cwd="/", sys_path=[], timeouts=Timeouts(), per_worker={"CPU": 1.0}, strategy="SPREAD")
    c = Controller(plan, FakeCluster(ctx, nodes), ctx, clock=lambda: clock[0])
    return c, clock


def start(c):
    from outlast.controller.states import Event
    c._fire(Event.STARTED)
    for rank in (0, 1):
        c._on_worker_message(b"", m.WorkerHello(attempt=1, rank=rank, pid=10 + rank))
    assert c.state is State.RUNNING


def exited(c, rank, node):
    return m.WorkerExited(run_id=c.run_id, attempt=1, rank=rank, pid=10 + rank, exit_code=0, signal=None,
                          error=None, node_id=node)


@pytest.mark.xfail(strict=True, reason="issue 8 (b): ALL_FINISHED fired in RESTARTING")
def test_ranks_that_return_during_a_preemption_finish_the_run_even_after_the_deadline(ctx):
    c, clock = controller(ctx, MemoryStorage())
    start(c)
    c._on_agent_event(None, m.NodeDraining(node_id="n1", reason="test", message="drain", deadline_unix_s=None))
    assert c.state is State.PREEMPTING
    c._on_worker_message(b"", m.WorkerDone(attempt=1, rank=0, reports=0))
    c._on_agent_event(None, exited(c, 0, "n1"))
    c._on_agent_event(None, exited(c, 1, "n2"))  # rank 1's WorkerDone is still in flight
    clock[0] += 10_000.0  # past the preemption deadline and the settle time
    c._tick(clock[0])
    c._tick(clock[0] + 0.1)
    assert c.state is State.FINISHED
    assert c.book.state.attempts[-1].ended_at is not None


@pytest.mark.xfail(strict=True, reason="issue 8 (c): a failing delete in retention escapes")
def test_a_delete_refused_during_retention_still_commits_and_answers_the_ranks(ctx):
    c, clock = controller(ctx, RefusingDeletes(), num_to_keep=1)
    start(c)
    sent: list = []
    c._send_to_rank = lambda rank, msg: sent.append((rank, msg))
    entry = m.FileEntry("model.pt", 1, "0" * 64)
    for index in (0, 1):
        for rank in (0, 1):
            c._on_worker_message(b"", m.Report(attempt=1, rank=rank, index=index, metrics={},
                                               checkpoint_dir=f"checkpoint_001_{index:06d}", files=[entry]))
    committed = [(r, msg.index) for r, msg in sent if isinstance(msg, m.Committed)]
    assert committed == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert c.book.state.latest_checkpoint == "checkpoint_001_000001"
