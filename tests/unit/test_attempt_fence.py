"""A rank of an old attempt (a partitioned node's, back on the network) neither joins nor disturbs
the new attempt: the controller drops whatever it says."""

from __future__ import annotations

from outlast.controller import group as g
from outlast.controller.states import State
from outlast.protocol import messages as m
from tests.fakes.controller import make, node, start

ENTRY = m.FileEntry("model.pt", 1, "0" * 64)


def test_reports_uploads_hellos_and_exits_of_an_old_attempt_change_nothing_in_the_new_one():
    h = make(max_failures=1)
    placement = start(h)
    h.agent(placement[0], h.exited(0, placement[0], code=1))
    h.agent(placement[1], h.exited(1, placement[1], code=None))
    assert h.core.attempt.number == 2
    h.step(g.NodeTable([node(n) for n in ("n1", "n2", "n3")]))
    new = start(h)
    assert h.state is State.RUNNING

    def snapshot():
        book = h.core.book.state
        return (h.state, h.core.attempt.number, sorted(h.core.attempt.exited), list(book.checkpoints),
                dict(book.failure_counts), len(book.attempts))

    before = snapshot()
    old_dir = "checkpoint_001_000007"
    for rank, node_id in placement.items():
        h.worker(m.WorkerHello(attempt=1, rank=rank, pid=100 + rank))
        h.worker(m.Report(attempt=1, rank=rank, index=7, metrics={"step": 7}, checkpoint_dir=old_dir, files=[ENTRY]))
        h.worker(m.UploadDone(attempt=1, rank=rank, index=7, checkpoint_dir=old_dir, files=[ENTRY], error=None))
        h.worker(m.WorkerDone(attempt=1, rank=rank, reports=8))
        h.agent(node_id, h.exited(rank, node_id, code=1, attempt=1))
    assert snapshot() == before, "an old attempt's messages changed the new attempt"
    assert not any(isinstance(x, m.Committed) for r in new for x in h.to_rank(r) if x is not None
                   and getattr(x, "checkpoint_dir", None) == old_dir)
