"""`outlast.Executor` at its edges: a result the driver cannot read, and a driver on a machine
that is not the cluster's head (in its own network namespace)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import outlast
from tests.integration.netns import NetnsCluster, unavailable_reason

ROOT = Path(__file__).resolve().parents[2]


def _refuse_to_load():
    raise ImportError("this class only exists where the task ran")


class OnlyThere:
    def __reduce__(self):
        return (_refuse_to_load, ())


def unreadable_result():
    return OnlyThere()


def square(x):
    return x * x


def test_a_result_that_cannot_be_unpickled_fails_its_own_future_and_the_others_go_on():
    with outlast.Executor(max_workers=2, max_retries=0) as ex:
        bad = ex.submit(unreadable_result)
        with pytest.raises(outlast.TaskFailedError, match=r"its result cannot be unpickled here: ImportError"):
            bad.result(timeout=120)
        assert [f.result(timeout=120) for f in [ex.submit(square, i) for i in range(4)]] == [0, 1, 4, 9]


@pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")
def test_an_executor_on_a_machine_that_is_not_the_head_gets_its_results(tmp_path):
    cluster = NetnsCluster(num_members=1, workdir=tmp_path / "cluster")
    try:
        cluster.wait_joined()
        member_ns = cluster.nodes["n1"].netns
        script = textwrap.dedent("""
            import outlast
            from tests.integration.test_executor_edges import square
            with outlast.Executor(max_workers=2, max_retries=0) as ex:
                print(sorted(ex.map(square, range(5), timeout=60)))
        """)
        home = tmp_path / "driver-home"
        env = {**os.environ, **cluster.env, "OUTLAST_HOME": str(home), "PYTHONPATH": str(ROOT)}
        # The driver runs on the member's "machine": its tasks go to the head, their results come back.
        done = subprocess.run(["ip", "netns", "exec", member_ns, sys.executable, "-c", script], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.strip().splitlines()[-1] == "[0, 1, 4, 9, 16]"
    finally:
        cluster.shutdown()


def test_an_executor_that_starts_its_own_node_without_isolation_says_so(caplog):
    with caplog.at_level("WARNING", logger="outlast.executor"):
        with outlast.Executor(max_workers=1) as ex:
            assert ex.submit(square, 3).result(timeout=120) == 9
    assert any("started one for this executor, without resource isolation" in r.message for r in caplog.records)
