"""A failure's kind is outlast's enum, apart from the name of the exception a rank raised; histories written
when the kind was kept in `exc_type` read the same."""

from __future__ import annotations

import json
import signal

import msgspec
import pytest

from outlast.controller.policy import is_symptom, is_users_error, pick_root_cause
from outlast.protocol import messages as m
from outlast.protocol.kinds import Budget, FailureKind
from outlast.protocol.transport import AGENT_EVENTS, encode
from outlast.storage import records as r


def _failure(**kw) -> r.FailureRecord:
    base = dict(attempt=2, rank=1, node_id="n2", pid=7, exit_code=None, signal=None, time=5.0)
    return r.FailureRecord(**{**base, **kw})


def _run_state_of_version_1(*failures: dict) -> bytes:
    """A run state as outlast wrote it before `kind`: outlast's kinds in `exc_type`."""
    return json.dumps({"version": 1, "name": "run", "status": "errored", "created_at": 0.0, "updated_at": 6.0,
                       "attempts": [{"attempt": 2, "started_at": 1.0, "failures": list(failures)}],
                       "failure_counts": {"worker": 1}}).encode()


def _old(exc_type: str, **kw) -> dict:
    return {"attempt": 2, "rank": 1, "node_id": "n2", "pid": 7, "exit_code": None, "signal": None, "time": 5.0,
            "exc_type": exc_type, "message": "the agent of n2 died", **kw}


def test_a_kind_is_written_apart_from_the_exception_name_and_read_back_as_the_enum():
    now = _failure(kind=FailureKind.NODE_LOST, message="the agent of n2 died")
    stored = json.loads(r.encode(now))
    assert stored["kind"] == "NodeLost" and stored["exc_type"] is None
    assert r.decode(r.encode(now), r.FailureRecord, "x").kind is FailureKind.NODE_LOST
    assert now.describe() == "rank 1 (pid 7, node n2, attempt 2) was lost with its node: the agent of n2 died"
    assert not is_users_error(now)


def test_a_run_state_of_version_1_reads_its_kinds_out_of_exc_type():
    data = _run_state_of_version_1(_old("NodeLost"), _old("ValueError", rank=0, message="bad batch"),
                                   _old("CorruptCheckpointError", rank=1, message="checkpoint c does not verify"))
    state = r.decode(data, r.RunState, "old")
    lost, users, corrupt = state.attempts[0].failures
    assert (lost.kind, lost.exc_type) == (FailureKind.NODE_LOST, None)
    assert (users.kind, users.exc_type) == (None, "ValueError")
    # The rank raised it, and outlast knows what it means: both.
    assert (corrupt.kind, corrupt.exc_type) == (FailureKind.CORRUPT_CHECKPOINT, "CorruptCheckpointError")
    assert lost == _failure(kind=FailureKind.NODE_LOST, message="the agent of n2 died")
    assert state.version == r.RUN_STATE_VERSION, "written back as the version it now is"
    assert json.loads(r.encode(state))["attempts"][0]["failures"][0]["kind"] == "NodeLost"


def test_a_users_exception_named_like_a_kind_stays_the_users_in_a_run_state_of_version_2():
    state = r.RunState(name="run", status="errored", created_at=0.0, updated_at=1.0,
                       attempts=[r.AttemptRecord(attempt=1, started_at=0.0,
                                                 failures=[_failure(exc_type="Hang", message="the user's own")])])
    (f,) = r.decode(r.encode(state), r.RunState, "new").attempts[0].failures
    assert f.exc_type == "Hang" and f.kind is None


def test_a_kind_outlast_does_not_know_is_a_corrupt_document_naming_the_field():
    doc = json.loads(r.encode(r.RunState(name="run", status="errored", created_at=0.0, updated_at=1.0,
                                         attempts=[r.AttemptRecord(attempt=1, started_at=0.0,
                                                                   failures=[_failure(kind=FailureKind.HANG)])])))
    doc["attempts"][0]["failures"][0]["kind"] = "Hung"
    with pytest.raises(r.CorruptDocument, match=r"/run_state\.json is not a valid RunState document .*kind"):
        r.decode(json.dumps(doc).encode(), r.RunState, "/run_state.json")


def test_a_kind_on_the_wire_that_outlast_does_not_know_is_refused():
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"kind": "Hung", "message": "m", "traceback": "", "phase": "node"}, m.WorkerError)


def test_budgets_keep_their_names_in_the_run_state():
    state = r.RunState(name="x", status="running", created_at=0.0, updated_at=0.0,
                       failure_counts={Budget.WORKER: 2, Budget.PREEMPTION: 1})
    assert json.loads(r.encode(state))["failure_counts"] == {"worker": 2, "preemption": 1}
    loaded = r.decode(r.encode(state), r.RunState, "x")
    assert loaded.failure_counts.get(Budget.WORKER) == 2 and loaded.failure_counts.get(Budget.DRIVER) is None


def test_a_kind_crosses_the_wire_as_the_enum_with_no_exception_name():
    ev = m.WorkerExited(run_id="r", attempt=1, rank=0, pid=1, exit_code=None, signal=int(signal.SIGKILL),
                        node_id="n", error=m.WorkerError(kind=FailureKind.FORK_SERVER_DIED, message="gone",
                                                         traceback="", phase="node"))
    got = AGENT_EVENTS.decode(encode(ev))
    assert got.error.kind is FailureKind.FORK_SERVER_DIED and got.error.exc_type is None


def test_a_kind_of_outlast_ranks_as_a_named_cause_as_an_exception_does():
    hang = _failure(rank=0, kind=FailureKind.HANG, message="no progress", time=2.0)
    peer = _failure(rank=1, exc_type="RuntimeError", message="[/gloo/...] Connection closed by peer", time=1.0)
    assert pick_root_cause([peer, hang]) is hang
    assert hang.describe() == "rank 0 (pid 7, node n2, attempt 2) raised Hang: no progress"
    assert is_users_error(hang) and not is_users_error(_failure(kind=FailureKind.SPAWN_REFUSED, message="draining"))


def test_our_own_sigterm_is_a_symptom_and_a_sigkill_a_cause():
    def died(sig):
        return r.FailureRecord(attempt=1, rank=0, node_id="n", pid=1, exit_code=None, signal=int(sig), time=1.0)

    assert is_symptom(died(signal.SIGTERM)) and not is_symptom(died(signal.SIGKILL))
    assert pick_root_cause([died(signal.SIGTERM), died(signal.SIGKILL)]).signal == signal.SIGKILL
