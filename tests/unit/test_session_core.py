"""The worker session's protocol core: what each call sends, what it waits for, and what it returns."""

from __future__ import annotations

import pytest

from outlast.errors import CheckpointCommitError, CollectiveTimeoutError
from outlast.protocol import messages as m
from outlast.train.session_core import SessionCore


def notice(index: int, decision: int) -> m.PreemptionNotice:
    return m.PreemptionNotice(index=index, decision_index=decision, node_ids=["n1"], ranks=[0], deadline_unix_ms=None,
                              reason="spot", message="going away")


def test_a_call_outside_any_grant_asks_and_waits_and_the_grant_answers_none_locally_until_it_expires():
    core = SessionCore(attempt=2, rank=1)
    step = core.preemption_call(now=0.0)
    assert step.send == (m.PreemptionQuery(attempt=2, rank=1, index=0),) and step.waiting
    assert core.receive(m.PreemptionGrant(index=0, horizon=3, valid_s=10.0), now=1.0).result() is None
    assert core.preemption_call(now=2.0).send == ()  # call 1: below the horizon, before the expiry
    assert core.preemption_call(now=2.0).send == ()  # call 2
    assert core.preemption_call(now=2.0).send[0].index == 3  # call 3: at the horizon, it asks again
    assert core.receive(m.PreemptionGrant(index=3, horizon=100, valid_s=10.0), now=2.0) is not None
    assert core.preemption_call(now=12.1).send[0].index == 4  # the grant ran out at 12.0


def test_a_notice_is_returned_from_its_decision_index_on_and_never_before():
    core = SessionCore(attempt=0, rank=0)
    core.preemption_call(now=0.0)
    assert core.receive(notice(0, decision=2), now=0.0).result() is None  # call 0 < 2
    assert core.preemption_call(now=0.0).result() is None  # call 1
    assert not core.saw_preemption
    seen = core.preemption_call(now=99.0)  # call 2: no message, the notice
    assert seen.send == () and seen.result().decision_index == 2
    assert core.saw_preemption and core.preemption_call(now=0.0).result() is seen.result()


def test_a_reply_that_arrived_before_its_call_is_kept_and_completes_the_call_at_once():
    core = SessionCore(attempt=0, rank=0)
    assert core.receive(m.CollectiveReply(seq=0, payload=b"x"), now=0.0) is None
    step = core.collective("broadcast", None)
    assert step.waiting is None and step.result() == b"x" and step.send[0].seq == 0


def test_a_reply_to_another_call_does_not_complete_the_waiting_one():
    core = SessionCore(attempt=0, rank=0)
    core.collective("barrier", None)  # seq 0, waiting
    assert core.receive(m.CollectiveReply(seq=1), now=0.0) is None
    assert core.receive(m.Committed(index=0, checkpoint_dir="c"), now=0.0) is None
    assert core.waiting_for == "barrier #0"
    assert core.receive(m.CollectiveReply(seq=0), now=0.0).result() is None
    assert core.collective("barrier", None).result() is None  # seq 1's reply was kept


def test_a_collective_timeout_raises_naming_the_missing_ranks():
    core = SessionCore(attempt=0, rank=3)
    core.collective("barrier", None)
    step = core.receive(m.CollectiveTimeout(seq=0, op="barrier", missing_ranks=[1, 2], waited_s=30.0), now=0.0)
    with pytest.raises(CollectiveTimeoutError, match=r"barrier #0 on rank 3 timed out after 30 s: ranks \[1, 2\]"):
        step.result()


def test_a_report_without_a_checkpoint_only_sends():
    core = SessionCore(attempt=1, rank=0)
    slot = core.begin_report()
    step = core.report(slot, {"loss": 1.0})
    assert step.waiting is None and step.send == (m.Report(attempt=1, rank=0, index=0, metrics={"loss": 1.0}),)
    assert core.begin_report().index == 1 and core.progress() == 2


def test_a_report_with_its_files_waits_for_the_commit_and_a_refusal_raises():
    core = SessionCore(attempt=1, rank=0)
    slot = core.begin_report()
    files = [m.FileEntry(path="a", size=1, sha256="0")]
    step = core.report(slot, {}, checkpoint=True, files=files)
    assert step.send[0].checkpoint_dir == slot.name == "checkpoint_001_000000" and step.send[0].files == files
    assert core.receive(m.Committed(index=1, checkpoint_dir="c"), now=0.0) is None  # another report's
    failed = core.receive(m.CommitFailed(index=0, reason="storage refused"), now=0.0)
    with pytest.raises(CheckpointCommitError, match="checkpoint_001_000000 was not committed: storage refused"):
        failed.result()


def test_an_asynchronous_report_is_pending_and_the_notice_checkpoint_skips_the_upload_queue():
    core = SessionCore(attempt=0, rank=0)
    slot = core.begin_report()
    assert slot.waits_for_uploads and not slot.saw_preemption
    step = core.report(slot, {}, checkpoint=True, upload_bytes=10, bandwidth_bps=5.0)
    assert step.waiting is None and step.send[0].upload_pending and step.send[0].upload_bytes == 10
    core.preemption_call(now=0.0)
    core.receive(notice(0, decision=0), now=0.0)
    answer = core.begin_report()
    assert answer.saw_preemption and not answer.waits_for_uploads
    assert core.report(answer, {}, checkpoint=True).send[0].saw_preemption


def test_every_message_in_every_state_is_taken_without_raising():
    messages = [m.Committed(index=0, checkpoint_dir="c"), m.CommitFailed(index=0, reason="x"), m.CollectiveReply(seq=0),
                m.CollectiveTimeout(seq=0, op="barrier", missing_ranks=[], waited_s=0.0),
                m.PreemptionGrant(index=0, horizon=1, valid_s=1.0), notice(0, 0), m.DumpStacks(attempt=0)]
    for start in ("idle", "preemption", "collective", "commit"):
        for msg in messages:
            core = SessionCore(attempt=0, rank=0)
            if start == "preemption":
                core.preemption_call(now=0.0)
            elif start == "collective":
                core.collective("barrier", None)
            elif start == "commit":
                core.report(core.begin_report(), {}, checkpoint=True, files=[])
            step = core.receive(msg, now=0.0)
            assert step is None or step.send == ()


def test_the_set_up_waits_for_the_controllers_welcome_which_may_have_come_first():
    core = SessionCore(attempt=1, rank=0)
    step = core.welcome()
    assert step.send == () and step.waiting == "the controller's welcome"
    assert core.receive(m.Welcome(attempt=1, rank=0), now=0.0) is not None
    early = SessionCore(attempt=1, rank=0)
    assert early.receive(m.Welcome(attempt=1, rank=0), now=0.0) is None  # kept for the call
    assert early.welcome().waiting is None


def test_the_train_function_waits_until_the_controller_has_heard_the_set_up():
    core = SessionCore(attempt=1, rank=0)
    step = core.set_up()
    assert step.send == (m.SetUp(attempt=1, rank=0),) and step.waiting == "the controller to hear the set-up"
    assert core.receive(m.Welcome(attempt=1, rank=0), now=0.0) is None  # not its reply
    assert core.receive(m.SetUpHeard(attempt=1, rank=0), now=0.0) is not None


def test_a_reports_message_carries_the_previous_calls_checkpoint_stall_once():
    core = SessionCore(attempt=1, rank=0)
    core.stalled_s = 1.25  # what the previous report() with a checkpoint took, set once it returned
    assert core.report(core.begin_report(), {"step": 1}).send[0].stalled_s == 1.25
    assert core.report(core.begin_report(), {"step": 2}).send[0].stalled_s == 0.0
