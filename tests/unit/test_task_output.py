"""How an Executor prints its tasks' output lines: prefixed, and a gap said in a line."""

from __future__ import annotations

from outlast.executor.tasks import format_task_output
from outlast.protocol import messages as m


def _ev(seq, lines):
    return m.WorkerOutput(run_id="exec-1", attempt=0, rank=-1, node_id="node-2", seq=seq, lines=lines, task_id="t1")


def test_each_line_is_prefixed_with_the_task_and_its_node():
    assert format_task_output(_ev(0, ["a", "", "b c"]), 0) == (
        "[task t1 node-2] a\n[task t1 node-2] \n[task t1 node-2] b c\n")


def test_lines_the_node_skipped_are_counted_and_said_before_the_next_ones():
    assert format_task_output(_ev(105, ["x"]), 5) == (
        "[task t1 node-2] (100 lines not shown: the task wrote faster than they were read)\n[task t1 node-2] x\n")


def test_a_message_with_only_a_gap_says_the_gap():
    assert format_task_output(_ev(7, []), 2).count("5 lines not shown") == 1


def test_nothing_new_prints_nothing():
    assert format_task_output(_ev(3, []), 3) == ""
