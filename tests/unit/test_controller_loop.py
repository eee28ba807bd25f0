"""The controller loop (`runtime.py`) over a worker group in memory: it starts, steps, tears down
through the same events, and raises what the run ended with."""

from __future__ import annotations

import pytest

from outlast.controller import group as g
from outlast.controller.runtime import Controller
from outlast.protocol import messages as m
from outlast.train import TrainingFailedError
from tests.fakes.controller import WALL_OFFSET, make_plan, node
from tests.fakes.worker_group import FakeWorkerGroup


def controller(group: FakeWorkerGroup, **plan_kw) -> Controller:
    return Controller(make_plan(**plan_kw), group, clock=group.clock, wall=lambda: WALL_OFFSET + group.now)


def test_a_run_goes_from_the_first_table_to_finished_and_ends_on_every_node():
    group = FakeWorkerGroup([node("n1"), node("n2")], reports=3)
    c = controller(group)
    c.run()
    assert c.core.closed and c.core.book.state.status == "finished"
    assert c.core.last_metrics == {"step": 2}
    ends = {e.node_id for e in group.performed if isinstance(e, g.ToNode) and isinstance(e.msg, m.EndRun)}
    assert ends == {"n1", "n2"}


def test_a_head_that_does_not_answer_fails_the_run_saying_so():
    with pytest.raises(TrainingFailedError, match="did not answer"):
        controller(FakeWorkerGroup([])).run()


def test_a_worker_that_raises_with_no_retries_left_raises_training_failed_error():
    def fail(group, spawn, node_id):
        group.inbox.append(g.FromAgent(node_id, m.WorkerExited(
            run_id=spawn.run_id, attempt=spawn.attempt, rank=spawn.workers[0].rank, pid=1, exit_code=1, signal=None,
            node_id=node_id, error=m.WorkerError(exc_type="ValueError", message="bad batch", traceback="",
                                                 phase="train"))))
        FakeWorkerGroup.stay_running(group, spawn, node_id)

    group = FakeWorkerGroup([node("n1"), node("n2")], on_spawn=fail)
    with pytest.raises(TrainingFailedError, match="bad batch"):
        controller(group, max_failures=0).run()


def test_ctrl_c_tears_down_through_the_loop_then_raises_keyboard_interrupt():
    group = FakeWorkerGroup([node("n1"), node("n2")], on_spawn=FakeWorkerGroup.stay_running)
    group.interrupt_at_poll = 5
    c = controller(group)
    with pytest.raises(KeyboardInterrupt):
        c.run()
    assert any(isinstance(e, g.StopRun) for e in group.performed)
    assert c.core.closed and c.core.book.state.status == "aborted"  # the workers' exits came back first
