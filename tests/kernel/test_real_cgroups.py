"""Resource isolation on a real kernel: cgroup v1 on the host, cgroup v2 in a guest kernel.

Each test makes its own cgroup under this process's cgroup, limits it to a small node,
starts an agent with isolation inside it, and removes it all at the end. In every memory
test the kernel's OOM killer must stay idle: outlast kills, by its policy, and says so.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import zmq

import outlast
from outlast.agent.agent import NodeSpec
from outlast.client.discovery import request
from outlast.protocol import messages as m
from tests.kernel import jobs
from tests.kernel.cgroups import ScratchCgroup, kernel_oom_kills, start_agent

MiB = 1024**2
NODE_MEMORY = 1536 * MiB
RESERVED = "512MiB"
TIER = 192 * MiB  # the memory tier's default budget here: an eighth of the node, reserved beside the system's
LIMIT = NODE_MEMORY - 512 * MiB - TIER  # the workloads' limit: 832 MiB
SLOW = float(os.environ.get("OUTLAST_TEST_SLOWDOWN", "1"))  # the emulated guest runs Python slower
NODE_TIMEOUT_S = NodeSpec(resources={}).node_timeout_s * SLOW  # a driver takes a node silent this long for lost

pytestmark = [pytest.mark.usefixtures("real_cgroups"), pytest.mark.timeout(int(300 * SLOW))]


@pytest.fixture
def node(tmp_path, monkeypatch):
    """A node of 1.5 GiB with isolation on, in its own test cgroup; yields (agent, address, cgroup, log)."""
    cg = ScratchCgroup(NODE_MEMORY)
    agents = []

    def start(node_id="k1", extra=()):
        log = str(tmp_path / f"agent-{node_id}-{len(agents)}.log")
        proc, address = start_agent(cg, node_id, ["--enable-resource-isolation", "--system-reserved-memory",
                                                  RESERVED, *extra], log)
        agents.append(proc)
        monkeypatch.setenv("OUTLAST_ADDRESS", address)
        return proc, address, log

    try:
        yield cg, start
    finally:
        for proc in agents:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=20 * SLOW)
                except Exception:
                    proc.kill()
        cg.remove()


class PingWatch:
    """Pings the agent all along. A ping unanswered within the node timeout fails: a driver that heard nothing from
    the node for that long would take it for lost. The worst answer time goes in the message, and is not asserted."""

    def __init__(self, address: str) -> None:
        self.address, self.worst, self.failures = address, 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        ctx = zmq.Context()
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                request(ctx, self.address, m.Ping(), timeout_s=NODE_TIMEOUT_S)
            except Exception:
                self.failures += 1
            self.worst = max(self.worst, time.monotonic() - t0)
            time.sleep(0.05)
        ctx.term()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _status(address: str, log: str | None = None) -> m.StatusReply:
    ctx = zmq.Context()
    try:
        reply = request(ctx, address, m.StatusRequest(), timeout_s=10.0 * SLOW)
    except Exception as e:
        raise AssertionError(f"{e}\nagent log:\n{Path(log).read_text()[-4000:] if log else ''}") from None
    finally:
        ctx.term()
    assert isinstance(reply, m.StatusReply)
    return reply


def test_the_layout_is_built_and_stop_leaves_the_cgroup_as_found(node):
    cg, start = node
    proc, address, log = start()
    status = _status(address, log)
    iso = status.isolation
    assert iso is not None and iso.total_memory == NODE_MEMORY
    assert iso.user_limit == LIMIT and iso.system_reserved_memory == 512 * MiB + TIER
    root = Path(iso.root)
    assert proc.pid in [int(p) for p in (root / "system" / "cgroup.procs").read_text().split()]
    assert (root / "user" / "workers").is_dir() and (root / "user" / "non-outlast").is_dir()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30 * SLOW)
    for d in cg.dirs:
        assert not [e for e in os.listdir(d) if e.startswith("outlast_")], f"{d} still has the node's tree"


def test_a_checkpoint_memory_given_that_does_not_fit_the_node_is_refused_saying_so(node):
    cg, start = node
    with pytest.raises(RuntimeError, match="exited with 3") as e:
        start("toobig", extra=("--checkpoint-memory", "1GiB"))  # 512 MiB + 1 GiB: nothing left
    assert "1.00 GiB of it checkpoint memory" in str(e.value) and "lower --checkpoint-memory" in str(e.value)
    for d in cg.dirs:
        assert not [e for e in os.listdir(d) if e.startswith("outlast_")]


def test_a_crashed_agents_tree_is_cleaned_up_by_the_next_agent(node):
    cg, start = node
    proc, address, log1 = start("crash1")
    old_root = _status(address, log1).isolation.root
    proc.kill()
    proc.wait()
    _, address2, log = start("crash2")
    assert not os.path.exists(old_root)
    assert "left by an agent that is gone" in Path(log).read_text()
    assert _status(address2, log).isolation is not None


def test_an_agent_killed_and_started_again_with_its_node_id_takes_its_tree_back(node):
    cg, start = node
    proc, address, log1 = start("again")
    root = _status(address, log1).isolation.root
    proc.kill()
    proc.wait()
    proc2, address2, log = start("again")
    assert _status(address2, log).isolation.root == root
    assert proc2.pid in [int(p) for p in (Path(root) / "system" / "cgroup.procs").read_text().split()]
    proc2.send_signal(signal.SIGTERM)
    proc2.wait(timeout=30 * SLOW)
    assert not os.path.exists(root)


def _touch_after_first_kill(log: str, release: str) -> None:
    deadline = time.monotonic() + 300 * SLOW
    while time.monotonic() < deadline and not os.path.exists(release):
        if "outlast killed task-" in Path(log).read_text():
            Path(release).touch()
            return
        time.sleep(0.1)


def test_a_memory_hog_task_is_killed_by_outlast_not_by_the_kernel(node, tmp_path):
    _, start = node
    release = str(tmp_path / "release")
    _, address, log = start()
    oom_before = kernel_oom_kills()
    watch = PingWatch(address)
    try:
        with outlast.Executor(max_workers=2, num_cpus=0.25, max_oom_retries=1, oom_backoff_s=0.2) as ex:
            # The steady task runs until the first kill, however slow the machine; then it ends, since
            # after a kill the executor runs fewer tasks at once and the hog's retry waits for a slot.
            steady = ex.submit(jobs.steady, 150, 300 * SLOW, release)
            time.sleep(2 * SLOW)  # the steady task is older: it has more work at risk
            hog = ex.submit(jobs.hog, 3000)
            releaser = threading.Thread(target=_touch_after_first_kill, args=(log, release), daemon=True)
            releaser.start()
            try:
                with pytest.raises(outlast.OutOfMemoryError) as e:
                    hog.result(timeout=120 * SLOW)
            finally:
                Path(release).touch()
            assert steady.result(timeout=60 * SLOW).startswith("steady done")
    finally:
        watch.stop()
    assert len(e.value.reports) == 2  # killed, retried once, killed again: max_oom_retries=1
    for report in e.value.reports:
        assert len(report.selected) == 1 and report.selected[0].startswith("task-")
        victim = {w.name: w for w in report.considered}[report.selected[0]]
        assert victim.selected and victim.memory_bytes > 500 * MiB
    first = e.value.reports[0]  # the steady task was still running then
    victim = next(w for w in first.considered if w.selected)
    kept = [w for w in first.considered if not w.selected]
    assert kept and all(w.age_s > victim.age_s for w in kept)  # the older steady task kept its work
    report = e.value.kill_report
    assert report.limit_bytes == LIMIT and report.node_total_bytes == NODE_MEMORY
    assert "KILLED task-" in str(e.value)
    assert kernel_oom_kills() == oom_before, "the kernel's OOM killer acted"
    assert watch.failures == 0, (f"{watch.failures} pings went unanswered for the node timeout "
                                 f"({NODE_TIMEOUT_S:.0f} s; worst answer {watch.worst:.2f} s)")
    assert "outlast killed task-" in Path(log).read_text()
    assert _status(address, log).isolation.kills == 2


def test_a_training_worker_killed_for_memory_restarts_its_run_and_the_history_says_why(node, tmp_path):
    from outlast.train import FailureConfig, RunConfig, ScalingConfig, Trainer

    _, start = node
    _, address, _ = start()
    oom_before = kernel_oom_kills()
    storage = tmp_path / "storage"
    storage.mkdir()
    result = Trainer(
        jobs.train_then_hog, train_loop_config={"hog_mib": 3000}, scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="oomrun", storage_path=str(storage),
                             failure_config=FailureConfig(max_failures=1)),
    ).fit()
    assert result.last_metrics == {"step": 2, "restored": True}
    state = json.loads((storage / "oomrun" / "run_state.json").read_text())
    failures = [f for a in state["attempts"] for f in a["failures"]]
    oom = [f for f in failures if f.get("oom_report")]
    assert oom and oom[0]["rank"] == 0 and oom[0]["attempt"] == 1
    assert "outlast killed" in oom[0]["oom_report"] and "run " in oom[0]["oom_report"]
    assert kernel_oom_kills() == oom_before


def test_outlast_start_with_isolation_and_status_shows_reservations_workers_and_kills(tmp_path, monkeypatch):
    import subprocess
    import sys

    cg = ScratchCgroup(NODE_MEMORY)
    monkeypatch.delenv("OUTLAST_ADDRESS", raising=False)

    def cli(*args, **kw):
        return subprocess.run([sys.executable, "-m", "outlast.cli.main", *args], capture_output=True, text=True,
                              timeout=120 * SLOW, **kw)

    try:
        r = cli("start", "--enable-resource-isolation", "--system-reserved-memory", RESERVED, "--preload", "",
                *cg.agent_args(), preexec_fn=cg.launcher())
        assert r.returncode == 0, r.stderr
        with outlast.Executor(max_workers=2, num_cpus=0.25, max_oom_retries=0) as ex:
            steady = ex.submit(jobs.steady, 100, 8 * SLOW)
            time.sleep(2 * SLOW)
            with pytest.raises(outlast.OutOfMemoryError):
                ex.submit(jobs.hog, 3000).result(timeout=120 * SLOW)
            out = cli("status").stdout
            steady.result(timeout=60 * SLOW)
        assert f"resource isolation: cgroup v{cg.version}" in out
        assert "reserved for the system 704 MiB, workloads' limit 832 MiB" in out
        assert "in use: system" in out and "workers killed for memory: 1" in out
        assert "task " in out and "memory " in out  # the steady task, with its leaf's memory
        assert "recent kills (1)" in out and "KILLED task-" in out
        assert cli("stop").returncode == 0
        for d in cg.dirs:
            assert not [e for e in os.listdir(d) if e.startswith("outlast_")]
    finally:
        cli("stop")
        cg.remove()


def test_with_isolation_on_nothing_a_rank_started_outlives_it(node, tmp_path):
    """The rank's cgroup leaf is killed whole when it is reaped, besides its process group and orphans."""
    from outlast.train import FailureConfig, RunConfig, ScalingConfig, Trainer
    from tests.integration.procs import alive
    from tests.integration.test_rank_children import _kill_left, sleepers_then_die, started

    _, start = node
    start(extra=("--checkpoint-memory", "0"))  # the whole small node to the workloads
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    storage = tmp_path / "storage"
    storage.mkdir()
    try:
        result = Trainer(sleepers_then_die, train_loop_config={"dir": str(pids_dir)},
                         scaling_config=ScalingConfig(num_workers=2),
                         run_config=RunConfig(name="children-isolated", storage_path=str(storage),
                                              failure_config=FailureConfig(max_failures=1))).fit()
        assert result.error is None
        pids = started(pids_dir)
        assert len(pids) == 8 and [p for p in pids if alive(p)] == []
    finally:
        _kill_left(pids_dir)
