"""An Executor's embedded node whose agent is SIGKILLed mid-task is started again: retriable
tasks run again on the new node, the others fail saying that the node died and how."""

from __future__ import annotations

import os
import signal
import time

import pytest

import outlast


def count_runs_and_hang_on_the_first(marker_dir):
    """Records each run; the first waits (for its node to be killed), later ones answer."""
    runs = len(os.listdir(marker_dir))
    open(os.path.join(marker_dir, str(runs)), "w").close()
    if runs == 0:
        time.sleep(600)
    return runs


def _wait_for(condition, what, timeout_s=120.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _kill_agent_once_the_task_runs(ex, marker_dir):
    _wait_for(lambda: os.listdir(marker_dir), "the task's first run")
    pid = ex._embedded.proc.pid
    os.kill(pid, signal.SIGKILL)
    return pid


def test_a_retriable_task_runs_again_on_the_restarted_node(tmp_path):
    with outlast.Executor(max_workers=1, max_retries=1, preload=[]) as ex:
        future = ex.submit(count_runs_and_hang_on_the_first, str(tmp_path))
        killed = _kill_agent_once_the_task_runs(ex, tmp_path)
        assert future.result(timeout=120) == 1
        assert ex._embedded.proc.pid != killed
        assert ex.submit(pow, 2, 5).result(timeout=60) == 32  # the new node takes new tasks too


def test_a_task_without_retries_fails_saying_the_node_died_and_how(tmp_path):
    with outlast.Executor(max_workers=1, max_retries=0, preload=[]) as ex:
        future = ex.submit(count_runs_and_hang_on_the_first, str(tmp_path))
        _kill_agent_once_the_task_runs(ex, tmp_path)
        with pytest.raises(outlast.TaskFailedError, match=r"embedded node agent died \(killed by SIGKILL\)"):
            future.result(timeout=120)
        assert ex.submit(pow, 3, 2).result(timeout=60) == 9


def test_a_node_that_does_not_come_back_fails_every_task_and_refuses_new_ones(tmp_path):
    # As the node's watcher says it when the agent keeps dying (RestartPolicy gives up) or cannot start.
    why = "the embedded node agent died (killed by SIGKILL); it died 4 times in a row; giving up"
    with outlast.Executor(max_workers=1, max_retries=3, preload=[]) as ex:
        running = ex.submit(count_runs_and_hang_on_the_first, str(tmp_path))
        queued = ex.submit(pow, 2, 2)
        _wait_for(lambda: os.listdir(tmp_path), "the task's first run")
        ex._on_node_change("gone", why)
        for future in (running, queued):
            with pytest.raises(outlast.TaskFailedError, match="giving up"):
                future.result(timeout=60)
        with pytest.raises(RuntimeError, match="no node to run tasks on: the embedded node agent died"):
            ex.submit(pow, 2, 3)
