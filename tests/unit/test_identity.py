"""A process is told by its pid, its start and its command line; its start, read by two processes, may have moved
by whole seconds (the boot time under it follows the wall clock), and is still the same start."""

import os

from outlast.identity import ProcessIdentity, identify, same_process, same_start, this_process


def test_a_start_moved_by_whole_seconds_is_the_same_start_and_a_fraction_apart_is_another():
    assert same_start(1000.37, 1000.37)
    assert same_start(1001.37, 1000.37) and same_start(999.37, 1000.37)  # a clock step of one second, either way
    assert same_start(1000.38, 1000.37)  # a clock tick's rounding
    assert not same_start(1000.77, 1000.37)  # another process's start
    assert not same_start(1004.37, 1000.37)  # more than a clock step: not taken for one


def test_this_process_is_still_itself_when_its_start_reads_a_second_later():
    me = this_process()
    moved = ProcessIdentity(pid=me.pid, started_at=me.started_at + 1.0, cmdline=me.cmdline)
    assert same_process(moved, identify(os.getpid()))[0]
    other = ProcessIdentity(pid=me.pid, started_at=me.started_at + 0.5, cmdline=me.cmdline)
    assert not same_process(other, identify(os.getpid()))[0]
