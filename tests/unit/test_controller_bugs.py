"""The three controller bugs of issue 8, driven in-process: no processes, no agents."""

from __future__ import annotations

from outlast.controller.horizons import HorizonBook, NoticeAt
from outlast.controller.states import State
from outlast.protocol import messages as m
from tests.fakes.controller import make, start
from tests.fakes.storage import MemoryStorage


def decisions(answers):
    return {a.rank: a.reply for a in answers if isinstance(a.reply, NoticeAt)}


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
    answers = {}
    for rank in (0, 1):
        answers.update(decisions(book.on_query(rank, 5, now=t)))
    assert answers == {0: NoticeAt(5), 1: NoticeAt(5)}


def test_a_notice_mid_step_of_a_10_s_loop_in_the_running_controller_reaches_both_ranks_at_the_next_call():
    h = make()
    placement = start(h)
    for call in range(3):
        for rank in (0, 1):
            h.worker(m.PreemptionQuery(attempt=1, rank=rank, index=call))
        h.step(dt=10.0)
    h.agent(placement[0], m.NodeDraining(node_id=placement[0], reason="spot", message="reclaimed",
                                         deadline_unix_s=h.wall() + 60.0))
    for _ in range(20):
        h.step(dt=0.1)  # two seconds of ticks: no rank asks
    for rank in (0, 1):
        h.worker(m.PreemptionQuery(attempt=1, rank=rank, index=3))
    notices = {r: [x for x in h.to_rank(r) if isinstance(x, m.PreemptionNotice)] for r in (0, 1)}
    assert {r: [(x.index, x.decision_index) for x in n] for r, n in notices.items()} == {0: [(3, 3)], 1: [(3, 3)]}


def test_ranks_that_return_during_a_preemption_finish_the_run_even_after_the_deadline():
    h = make()
    placement = start(h)
    h.agent(placement[0], m.NodeDraining(node_id=placement[0], reason="test", message="drain", deadline_unix_s=None))
    assert h.state is State.PREEMPTING
    h.worker(m.WorkerDone(attempt=1, rank=0, reports=0))
    h.agent(placement[0], h.exited(0, placement[0]))
    h.agent(placement[1], h.exited(1, placement[1]))  # rank 1's WorkerDone is still in flight
    h.step(dt=10_000.0)  # past the preemption deadline and the wait for last messages
    h.step(dt=0.1)
    assert h.state is State.FINISHED and h.core.closed
    assert h.core.book.state.attempts[-1].outcome == "finished"


class RefusingDeletes(MemoryStorage):
    def delete(self, path: str) -> None:
        raise PermissionError(f"AccessDenied: s3:DeleteObject on {path}")


def test_a_delete_refused_during_retention_still_commits_and_answers_the_ranks():
    h = make(RefusingDeletes(), num_to_keep=1)
    start(h)
    entry = m.FileEntry("model.pt", 1, "0" * 64)
    for index in (0, 1):
        for rank in (0, 1):
            h.worker(m.Report(attempt=1, rank=rank, index=index, metrics={},
                              checkpoint_dir=f"checkpoint_001_{index:06d}", files=[entry]))
    committed = {r: [x.index for x in h.to_rank(r) if isinstance(x, m.Committed)] for r in (0, 1)}
    assert committed == {0: [0, 1], 1: [0, 1]}
    assert h.core.book.state.latest_checkpoint == "checkpoint_001_000001"
    assert [c.checkpoint_dir for c in h.core.book.state.checkpoints] == ["checkpoint_001_000001"]
