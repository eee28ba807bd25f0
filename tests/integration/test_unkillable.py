"""A worker that SIGKILL cannot end: the run does not wait for it forever.

The worker is made unkillable for real: the test moves it into a cgroup v1 freezer and freezes
it. A frozen task sleeps in the kernel (state D, in `refrigerator`) and a SIGKILL stays pending
until it is thawed, as a task blocked on a dead NFS server or a faulted GPU does; the fork
server cannot reap it. After its grace and `OUTLAST_UNKILLABLE_TIMEOUT_S`, its agent reports
it by pid and gives its node up; the run goes on on the other node.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import pytest

from outlast.testing import LocalCluster
from outlast.train import FailureConfig, RunConfig, ScalingConfig, Trainer
from tests.integration.procs import alive, wait_until

FREEZER = Path("/sys/fs/cgroup/freezer")
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not (FREEZER / "cgroup.procs").exists(),
                                reason="making a process unkillable for real needs root and the cgroup v1 freezer")


def stuck_then_fine(config):
    from outlast.train import get_context

    ctx = get_context()
    rank, attempt = ctx.get_world_rank(), ctx.get_attempt()
    out = Path(config["dir"])
    (out / f"a{attempt}-r{rank}.json").write_text(json.dumps({"pid": os.getpid(),
                                                              "node": os.environ["OUTLAST_NODE_ID"]}))
    if attempt > 1:
        return
    if rank == 0:
        time.sleep(1000)  # frozen by the test meanwhile
    while not (out / "go").exists():
        time.sleep(0.05)
    raise ValueError("rank 1 fails, so that the attempt is stopped")


def test_a_worker_sigkill_cannot_end_is_reported_by_pid_and_the_run_goes_on_elsewhere(tmp_path, storage_path,
                                                                                        monkeypatch):
    monkeypatch.setenv("OUTLAST_UNKILLABLE_TIMEOUT_S", "3")
    out = tmp_path / "out"
    out.mkdir()
    freezer = FREEZER / f"outlast-test-{uuid.uuid4().hex[:8]}"
    freezer.mkdir()
    pid = None
    try:
        with LocalCluster(num_nodes=2, cpus_per_node=2, workdir=tmp_path / "nodes") as cluster:
            import threading

            box = {}

            def fit():
                box["result"] = Trainer(
                    stuck_then_fine, train_loop_config={"dir": str(out)},
                    scaling_config=ScalingConfig(num_workers=2, placement_strategy="SPREAD"),
                    run_config=RunConfig(name="unkillable", storage_path=storage_path,
                                         failure_config=FailureConfig(max_failures=2))).fit()

            t = threading.Thread(target=fit, daemon=True)
            t.start()
            wait_until(lambda: (out / "a1-r0.json").exists() and (out / "a1-r1.json").exists(), 120, "attempt 1")
            first = json.loads((out / "a1-r0.json").read_text())
            assert json.loads((out / "a1-r1.json").read_text())["node"] != first["node"]  # spread
            pid = first["pid"]
            (freezer / "cgroup.procs").write_text(str(pid))  # the test, not outlast, moves it
            (freezer / "freezer.state").write_text("FROZEN")
            wait_until(lambda: Path(f"/proc/{pid}/stat").read_text().split()[2] == "D", 10, "rank 0 to be frozen")
            (out / "go").touch()
            t.join(timeout=180)
            assert not t.is_alive(), "the run waits for a worker that cannot die"
            result = box["result"]
            assert result.error is None
            second = [json.loads((out / f"a2-r{r}.json").read_text()) for r in (0, 1)]
            assert {s["node"] for s in second} == {n for n in cluster.node_ids if n != first["node"]}
            assert alive(pid)  # still stuck: outlast reported it, it did not pretend it died
            log = cluster.nodes[first["node"]].log_path.read_text()
            assert f"pid {pid}" in log and "did not die" in log
            table = {n.node_id: n.state for n in cluster.node_table()}
            assert table[first["node"]] == "draining"
            history = json.loads(Path(storage_path, "unkillable", "run_state.json").read_text())
            assert f"pid {pid}" in json.dumps(history)
    finally:
        (freezer / "freezer.state").write_text("THAWED")  # its pending SIGKILL ends it now
        if pid is not None:
            wait_until(lambda: not alive(pid), 30, "the thawed worker to die")
        wait_until(lambda: not (freezer / "cgroup.procs").read_text().strip(), 30, "the freezer to empty")
        freezer.rmdir()
