"""How a fork server ends. A node stopped while its standby fork server still imports its modules
(the common case for a run of a few seconds) prints nothing but the run's own output; a fork
server whose agent dies while ranks run says so in the node's log, and ends them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from outlast.testing import LocalCluster
from tests.integration.jobs import read_events
from tests.integration.procs import alive, wait_until

pytestmark = pytest.mark.usefixtures("standbys")  # what these tests are about

DRIVER = """
import sys
from outlast.train import RunConfig, ScalingConfig, Trainer
from tests.integration.standby_jobs import until_standby_loop
result = Trainer(until_standby_loop, scaling_config=ScalingConfig(num_workers=1),
                 run_config=RunConfig(name=sys.argv[1], storage_path=sys.argv[2])).fit()
print("metrics", result.last_metrics)
"""
ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}


def test_short_runs_print_no_traceback_to_the_driver_or_the_nodes_logs(tmp_path, storage_path, _isolated_outlast_home):
    env = _env()
    for i in range(4):
        env["OUTLAST_TRACE_FILE"] = str(tmp_path / f"trace-{i}.jsonl")
        done = subprocess.run([sys.executable, "-c", DRIVER, f"short-{i}", storage_path], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert "metrics {'standby': True}" in done.stdout, done.stdout
        for stream in (done.stdout, done.stderr):
            assert "Traceback" not in stream, stream
    logs = [p for p in Path(_isolated_outlast_home).rglob("*") if p.is_file() and p.suffix in (".log", ".out", ".err")]
    for log in logs:
        text = log.read_text(errors="replace")
        assert "Traceback" not in text, (log, text)


def test_a_fork_server_whose_agent_dies_while_a_rank_runs_says_so_in_the_nodes_log_and_ends_it(tmp_path, storage_path):
    events = tmp_path / "events.jsonl"
    with LocalCluster(num_nodes=1, preload=[]) as cluster:
        driver = subprocess.Popen([sys.executable, "-m", "tests.integration.driver", storage_path, str(events),
                                   "--workers", "1", "--name", "orphaned"], cwd=ROOT, env=_env(),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_until(lambda: read_events(events) or driver.poll() is not None, 300, "the rank to start")
            rank = read_events(events)[0]
            cluster.kill_node("node-0")
            wait_until(lambda: not alive(rank["pid"]) and not alive(rank["ppid"]), 60, "the rank and its fork server")
            log = cluster.nodes["node-0"].log_path.read_text(errors="replace")
            assert f"its agent went away while 1 workload(s) ran (pids {rank['pid']}); ending them" in log, log
            assert "Traceback" not in log, log
        finally:
            driver.kill()
            driver.wait()
