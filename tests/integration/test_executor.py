"""`outlast.Executor` with real worker processes, without isolation (as on any machine)."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal

import pytest

import outlast


def square(x):
    return x * x


def fail(msg):
    raise ValueError(msg)


def die_first_times(marker_dir, times):
    """SIGKILLs itself on its first `times` runs (counted by files), then answers."""
    runs = len(os.listdir(marker_dir))
    open(os.path.join(marker_dir, str(runs)), "w").close()
    if runs < times:
        os.kill(os.getpid(), signal.SIGKILL)
    return runs


def whoami():
    return os.getpid(), os.environ.get("OUTLAST_TASK_ID")


@pytest.fixture(scope="module")
def ex(tmp_path_factory):
    # Module-scoped, so before the per-test OUTLAST_HOME: a home of its own, never the user's.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OUTLAST_HOME", str(tmp_path_factory.mktemp("executor_home")))
        mp.delenv("OUTLAST_ADDRESS", raising=False)
        with outlast.Executor(max_workers=2, max_retries=2) as executor:
            yield executor


def test_map_and_submit_run_in_worker_processes(ex):
    assert list(ex.map(square, range(8))) == [x * x for x in range(8)]
    pid, task_id = ex.submit(whoami).result(timeout=60)
    assert pid != os.getpid() and task_id


def test_an_exception_of_the_function_is_the_futures_answer(ex):
    with pytest.raises(ValueError, match="bad input"):
        ex.submit(fail, "bad input").result(timeout=60)


def test_a_task_whose_process_dies_is_retried_on_max_retries(ex, tmp_path):
    assert ex.submit(die_first_times, str(tmp_path), 2).result(timeout=60) == 2


def test_when_max_retries_is_spent_the_future_says_how_the_process_died(ex, tmp_path):
    with pytest.raises(outlast.TaskFailedError, match="SIGKILL") as e:
        ex.submit(die_first_times, str(tmp_path), 10).result(timeout=60)
    assert e.value.signal == signal.SIGKILL and "max_retries=2" in str(e.value)


def test_shutdown_cancels_queued_tasks_on_request_and_refuses_new_ones(tmp_path):
    executor = outlast.Executor(max_workers=1)
    import time

    futures = [executor.submit(time.sleep, 0.5) for _ in range(4)]
    executor.shutdown(wait=True, cancel_futures=True)
    assert any(f.cancelled() for f in futures) and futures[0].done()
    with pytest.raises(RuntimeError, match="after shutdown"):
        executor.submit(square, 2)


def test_it_is_a_concurrent_futures_executor():
    assert issubclass(outlast.Executor, cf.Executor)


def chatty(n):
    import sys

    for i in range(n):
        print(f"out {i}")
    print("last words on stderr", file=sys.stderr)
    return os.environ["OUTLAST_TASK_ID"]


def test_what_a_task_prints_reaches_the_callers_stdout_prefixed_with_the_task_and_node(ex, capfd):
    import re
    import time

    task_id = ex.submit(chatty, 500).result(timeout=60)
    out, deadline = "", time.monotonic() + 60
    while "last words on stderr" not in out:  # the lines come through the node, the result directly
        assert time.monotonic() < deadline, f"the task's last line never came; got:\n{out[-2000:]}"
        time.sleep(0.05)
        out += capfd.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith(f"[task {task_id} ")]
    assert len(lines) == 501 and lines[-1].endswith("] last words on stderr")
    assert all(re.match(rf"\[task {task_id} \S+\] ", line) for line in lines)
    assert [line.split()[-1] for line in lines[:-1]] == [str(i) for i in range(500)]
