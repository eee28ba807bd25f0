"""Failure kinds and budgets are enums whose spelling on disk and on the wire is the one histories have."""

from __future__ import annotations

import json
import signal

from outlast.controller.policy import is_symptom, is_users_error, pick_root_cause
from outlast.protocol import messages as m
from outlast.protocol.kinds import Budget, FailureKind
from outlast.protocol.transport import AGENT_EVENTS, encode
from outlast.storage import records as r

# A failure of a history written before the kinds were an enum.
OLD = b'''{"attempt": 2, "rank": 1, "node_id": "n2", "pid": 7, "exit_code": null, "signal": null, "time": 5.0,
           "exc_type": "NodeLost", "message": "the agent of n2 died"}'''


def test_a_kind_written_now_reads_as_the_string_histories_hold_and_back():
    now = r.FailureRecord(attempt=2, rank=1, node_id="n2", pid=7, exit_code=None, signal=None, time=5.0,
                          exc_type=FailureKind.NODE_LOST, message="the agent of n2 died")
    assert json.loads(r.encode(now))["exc_type"] == "NodeLost"
    old = r.decode(OLD, r.FailureRecord, "old")
    assert old == now and old.exc_type == FailureKind.NODE_LOST
    assert old.describe() == now.describe() == "rank 1 (pid 7, node n2, attempt 2) was lost with its node: " \
                                               "the agent of n2 died"
    assert not is_users_error(old)


def test_budgets_keep_their_names_in_the_run_state():
    state = r.RunState(name="x", status="running", created_at=0.0, updated_at=0.0,
                       failure_counts={Budget.WORKER: 2, Budget.PREEMPTION: 1})
    assert json.loads(r.encode(state))["failure_counts"] == {"worker": 2, "preemption": 1}
    loaded = r.decode(r.encode(state), r.RunState, "x")
    assert loaded.failure_counts.get(Budget.WORKER) == 2 and loaded.failure_counts.get(Budget.DRIVER) is None


def test_a_kind_on_the_wire_is_the_string_an_older_peer_sends():
    ev = m.WorkerExited(run_id="r", attempt=1, rank=0, pid=1, exit_code=None, signal=int(signal.SIGKILL),
                        node_id="n", error=m.WorkerError(exc_type=FailureKind.FORK_SERVER_DIED, message="gone",
                                                         traceback="", phase="node"))
    got = AGENT_EVENTS.decode(encode(ev))
    assert got.error.exc_type == "ForkServerDied" == FailureKind.FORK_SERVER_DIED


def test_our_own_sigterm_is_a_symptom_and_a_sigkill_a_cause():
    def died(sig):
        return r.FailureRecord(attempt=1, rank=0, node_id="n", pid=1, exit_code=None, signal=int(sig), time=1.0)

    assert is_symptom(died(signal.SIGTERM)) and not is_symptom(died(signal.SIGKILL))
    assert pick_root_cause([died(signal.SIGTERM), died(signal.SIGKILL)]).signal == signal.SIGKILL
