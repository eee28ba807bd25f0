"""A rank's message that does not decode (a file outside its checkpoint) fails its attempt, saying why, in
the controller core stepped in-process."""

from __future__ import annotations

from outlast.controller import group as g
from outlast.controller.states import State
from outlast.protocol.kinds import FailureKind
from tests.fakes.controller import make, start

REASON = "the controller refused its Report: file '../../x' is not a relative path inside its directory"


def test_a_refused_report_fails_the_attempt_with_the_rank_and_the_path_in_the_history():
    h = make(max_failures=0)
    placement = start(h)
    a = h.core.attempt.number
    h.step(g.RefusedFromWorker(a - 1, 0, REASON))  # a straggler of an attempt before: nothing to fail
    assert h.state is State.RUNNING and not h.core.book.state.attempts[-1].failures
    h.step(g.RefusedFromWorker(a, 1, REASON))
    assert h.state is State.RESTARTING
    failures = h.core.book.state.attempts[-1].failures
    assert [(f.rank, f.kind, f.exc_type, f.message) for f in failures] == [(1, FailureKind.REFUSED_MESSAGE, None, REASON)]
    assert failures[0].node_id == placement[1]
    assert "rank 1" in failures[0].describe() and "'../../x'" in failures[0].describe()
    assert not h.core.book.state.checkpoints
    for rank in (0, 1):
        h.agent(placement[rank], h.exited(rank, placement[rank], code=None))
    assert h.state is State.ERRORED and "'../../x'" in str(h.core.error)
