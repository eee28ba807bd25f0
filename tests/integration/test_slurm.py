"""outlast on a real Slurm: the guide's just-in-time example as an sbatch job on 2 of 3 local nodes.

A local Slurm 22.05 cluster (scripts/slurm-cluster: three slurmd on this host, partitions low
and high) runs for the whole session. Each test submits examples/slurm/preemption_jit_checkpoint.sbatch,
acts on the job as Slurm or an administrator would, and reads the run's history from storage.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from outlast.protocol.kinds import FailureKind
from outlast.slurm.allocation import expand_hostlist
from outlast.slurm.local_cluster import PROGRAMS, Layout, LocalSlurm, free_port_block
from outlast.slurm.scontrol import job_info
from outlast.storage import open_storage
from outlast.storage.records import RunState
from outlast.storage.run_store import RunStore

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "examples" / "slurm" / "preemption_jit_checkpoint.sbatch"
STEPS = 100

pytestmark = pytest.mark.torch


def _installed() -> bool:
    return all(shutil.which(p) for p in PROGRAMS)


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    if not _installed():
        subprocess.run([str(ROOT / "scripts" / "setup-slurm")], check=False)
    if not _installed():
        pytest.skip("Slurm 22.05 (slurmctld slurmd slurm-client munge) could not be installed here "
                    "(needs root and apt-get): run ./scripts/setup-slurm as root")
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster runs its daemons as root")
    # Ports of its own, so that other clusters (scripts/slurm-cluster, another session's) can run beside it.
    base = free_port_block(4)
    cluster = LocalSlurm(Layout(root=tmp_path_factory.mktemp("slurm"), ctld_port=base, first_node_port=base + 1),
                         die_with_caller=True)
    cluster.start()
    yield cluster
    cluster.stop()


def wait_until(predicate, timeout_s: float, what) -> None:
    """`what`: a description, or a function giving one (called only on a timeout)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what() if callable(what) else what}")
        time.sleep(0.3)


@pytest.fixture(autouse=True)
def _no_job_left(slurm):
    """A test that fails midway must not leave its job holding the nodes the next test needs."""
    yield
    left = slurm.jobs()
    if left:
        slurm._slurm(["scancel", *left], check=False)
        wait_until(lambda: not slurm.jobs(), 60, "the jobs left by the test to end")


class Job:
    def __init__(self, slurm: LocalSlurm, job_id: str, storage: Path, out: Path) -> None:
        self.slurm, self.id, self.storage, self.out = slurm, job_id, storage, out

    def info(self):
        return job_info(self.slurm._slurm(["scontrol", "show", "job", "-o", self.id]))

    def state(self) -> RunState | None:
        return RunStore(open_storage(str(self.storage)), f"jit-{self.id}").load_state()

    def checkpoints(self) -> int:
        s = self.state()
        return len(s.checkpoints) if s else 0

    def wait_done(self, restarts: int, timeout_s: float = 150.0) -> None:
        def done():
            i = self.info()
            return i.state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") and i.restarts == restarts
        wait_until(done, timeout_s,
                   lambda: f"job {self.id} to end after {restarts} requeue(s); its output:\n{self.output()}")

    def output(self) -> str:
        return self.out.read_text() if self.out.exists() else "(none)"


def _env(slurm: LocalSlurm) -> dict[str, str]:
    return {**os.environ, **slurm.layout.env, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
            "OUTLAST_EXAMPLES": str(ROOT / "examples")}


def _submit(slurm: LocalSlurm, tmp_path: Path, *sbatch_args: str, steps: int = STEPS) -> Job:
    storage = tmp_path / "storage"
    out = tmp_path / "job.out"
    done = subprocess.run(["sbatch", "--parsable", "-o", str(out), "--chdir", str(ROOT), *sbatch_args, str(SBATCH),
                           str(storage), "--steps", str(steps), "--step_s", "0.05", "--checkpoint_every", "10"],
                          env=_env(slurm), capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return Job(slurm, done.stdout.strip().split(";")[0], storage, out)


def _resumed_after_jit(state: RunState) -> bool:
    """A just-in-time checkpoint was saved, and a later attempt restored the newest checkpoint of the
    preempted attempt (that one, or one the loop committed after it while it trained on): no step lost."""
    jit = [c for c in state.checkpoints if c.metrics.get("preempted")]
    if not jit:
        return False
    newest = max((c for c in state.checkpoints if c.attempt == jit[0].attempt), key=lambda c: c.metrics["step"])
    return any(a.restored_from == newest.checkpoint_dir for a in state.attempts)


def _resumed_with_no_step_lost(state: RunState, steps: int = STEPS) -> None:
    assert state.status == "finished"
    assert _last_step(state) == steps - 1
    assert _resumed_after_jit(state), (state.attempts, [(c.checkpoint_dir, c.metrics) for c in state.checkpoints])


def _last_step(state: RunState) -> int:
    """The example checkpoints every 10 steps and at its last step."""
    return max(c.metrics["step"] for c in state.checkpoints)


def _preemptions(state: RunState) -> list[str]:
    return [f.message or "" for a in state.attempts for f in a.failures if f.kind is FailureKind.PREEMPTION]


def _job_processes(slurm: LocalSlurm, job_id: str) -> list[psutil.Process]:
    """Processes of the job's own (its driver, agents, workers): they carry its id and its cluster's
    configuration in their environment (another Slurm on this machine may have a job of the same id)."""
    out = []
    for p in psutil.process_iter(["name"]):
        try:
            env = p.environ()
            if p.info["name"] != "slurmstepd" and env.get("SLURM_JOB_ID") == job_id and \
                    env.get("SLURM_CONF") == slurm.layout.env["SLURM_CONF"]:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


def test_preempted_by_a_high_partition_job_it_saves_a_jit_checkpoint_is_requeued_and_resumes(slurm, tmp_path):
    steps = STEPS * 3  # still training when the preemption comes, on a loaded machine too
    job = _submit(slurm, tmp_path, steps=steps)
    wait_until(lambda: job.checkpoints() >= 1, 90, lambda: f"the first checkpoint; output:\n{job.output()}")
    high = subprocess.run(["sbatch", "--parsable", "-p", "high", "-N", "2", "-o", str(tmp_path / "high.out"),
                           "--wrap", "echo high ran"], env=_env(slurm), capture_output=True, text=True, timeout=30)
    assert high.returncode == 0, high.stderr
    job.wait_done(restarts=1)
    assert (tmp_path / "high.out").read_text().strip() == "high ran"
    state = job.state()
    _resumed_with_no_step_lost(state, steps)
    assert any(f"Slurm job {job.id} (restart 0) got SIGUSR1: preempted" in m for m in _preemptions(state)), \
        _preemptions(state)
    assert job.info().state == "COMPLETED"


def test_at_its_time_limit_it_checkpoints_on_the_signal_and_resumes_after_the_requeue(slurm, tmp_path):
    job = _submit(slurm, tmp_path, "--time=10", "--signal=B:USR1@40", steps=STEPS * 100)
    wait_until(lambda: job.checkpoints() >= 1, 90, lambda: f"the first checkpoint; output:\n{job.output()}")
    # A limit that ends 80-140 s from now, while it trains: USR1 when 40 s are left. slurmctld checks time
    # limits every 30 s or so, and a signal whose time has already passed goes out at the next check (seen:
    # a one-minute limit set 30 s into the job got its signal 1.6 s before the end, too late to save).
    elapsed = time.time() - (job.info().end_time - 600)
    slurm._slurm(["scontrol", "update", f"jobid={job.id}", f"timelimit={math.ceil((elapsed + 80) / 60)}"])
    wait_until(lambda: job.info().restarts == 1, 180, lambda: f"the requeue at the time limit; output:\n{job.output()}")
    slurm._slurm(["scontrol", "update", f"jobid={job.id}", "timelimit=10"])  # no second signal while we look

    def resumed_and_trained():
        s = job.state()
        jit = [c for c in s.checkpoints if c.metrics.get("preempted")]
        return _resumed_after_jit(s) and any(c.attempt > jit[0].attempt for c in s.checkpoints)
    wait_until(resumed_and_trained, 90, lambda: f"a checkpoint after the resume; output:\n{job.output()}")
    state = job.state()
    jit = [c for c in state.checkpoints if c.metrics.get("preempted")][0]
    saved = max(c.metrics["step"] for c in state.checkpoints if c.attempt == jit.attempt)
    assert min(c.metrics["step"] for c in state.checkpoints if c.attempt > jit.attempt) > saved
    assert any("got SIGUSR1: its time limit is near" in m for m in _preemptions(state)), _preemptions(state)
    slurm._slurm(["scancel", job.id])
    job.wait_done(restarts=1, timeout_s=60)


def test_a_node_drained_by_an_administrator_is_drained_for_maintenance_and_the_run_moves_off_it(slurm, tmp_path):
    job = _submit(slurm, tmp_path)
    wait_until(lambda: job.checkpoints() >= 1, 90, lambda: f"the first checkpoint; output:\n{job.output()}")
    # The example's two ranks share the first node (PACK); the job's other node can take them both.
    node = slurm._slurm(["scontrol", "show", "job", "-o", job.id]).split("BatchHost=")[1].split()[0]
    slurm._slurm(["scontrol", "update", f"nodename={node}", "state=drain", "reason=disk swap"])
    try:
        job.wait_done(restarts=0)
        assert job.info().state == "COMPLETED", job.output()
        state = job.state()
        _resumed_with_no_step_lost(state)
        drained = f"Slurm job {job.id} (restart 0): node {node} drained by an administrator (disk swap)"
        assert any(drained in m and "maintenance" in m for m in _preemptions(state)), _preemptions(state)
        assert "no requeue" in job.output()
    finally:
        slurm._slurm(["scontrol", "update", f"nodename={node}", "state=resume"])


def test_scancel_ends_the_job_without_a_requeue_and_leaves_no_process(slurm, tmp_path):
    job = _submit(slurm, tmp_path, steps=STEPS * 20)
    wait_until(lambda: job.checkpoints() >= 1, 90, lambda: f"the first checkpoint; output:\n{job.output()}")
    assert _job_processes(slurm, job.id)
    slurm._slurm(["scancel", job.id])
    job.wait_done(restarts=0, timeout_s=60)
    assert job.info().state == "CANCELLED"
    wait_until(lambda: not _job_processes(slurm, job.id), 30, "the job's processes to end")
    time.sleep(3)  # a requeue would show by now
    assert job.info().restarts == 0 and job.info().state == "CANCELLED"


def test_killed_with_scancel_signal_kill_and_requeued_by_hand_it_resumes_from_the_last_commit(slurm, tmp_path):
    job = _submit(slurm, tmp_path, steps=STEPS * 2)
    wait_until(lambda: job.checkpoints() >= 3, 90, lambda: f"three checkpoints; output:\n{job.output()}")
    slurm._slurm(["scancel", "--signal=KILL", "--full", job.id])
    wait_until(lambda: job.info().state not in ("RUNNING", "COMPLETING"), 60, "the killed job to end")
    latest = job.state().latest_checkpoint
    slurm._slurm(["scontrol", "requeue", job.id])
    job.wait_done(restarts=1)
    state = job.state()
    assert state.status == "finished" and _last_step(state) == STEPS * 2 - 1
    resumed = [a for a in state.attempts if a.restored_from is not None]
    assert resumed and resumed[0].restored_from == latest
    assert not _preemptions(state)  # a kill is not a preemption


def test_with_etcd_every_node_joins_the_store_and_a_preemption_still_saves_requeues_and_resumes(slurm, tmp_path):
    from tests.integration.etcd_cluster import EtcdCluster, etcd_missing

    if etcd_missing():
        pytest.skip(etcd_missing())
    etcd = EtcdCluster(tmp_path / "etcd").start()
    try:
        storage, out = tmp_path / "storage", tmp_path / "job.out"
        # Long enough that the preemption finds it training, however slow the etcd query and the
        # second sbatch are on a loaded machine (100 steps could end first: no notice, no checkpoint).
        steps = STEPS * 4
        example = ROOT / "examples" / "preemption_jit_checkpoint.py"
        wrap = (f"exec outlast slurm --etcd {etcd.urls} -- python {example} --storage_path {storage} "
                f"--run_name jit-$SLURM_JOB_ID --steps {steps} --step_s 0.05 --checkpoint_every 10")
        done = subprocess.run(["sbatch", "--parsable", "-N", "2", "--ntasks-per-node=1", "--requeue", "-o", str(out), "--open-mode=append",
                               "--signal=B:USR1@30", "--chdir", str(ROOT), "--wrap", wrap],
                              env=_env(slurm), capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        job = Job(slurm, done.stdout.strip().split(";")[0], storage, out)
        wait_until(lambda: job.checkpoints() >= 1, 90, lambda: f"the first checkpoint; output:\n{job.output()}")
        keys = subprocess.run(["etcdctl", "--endpoints", etcd.urls, "get", "--prefix", "/outlast/", "--keys-only"],
                              capture_output=True, text=True, timeout=30, env={**os.environ, "ETCDCTL_API": "3"})
        nodes = {k.rsplit("/", 1)[1] for k in keys.stdout.split() if "/nodes/" in k}
        assert len(nodes) == 2 and "/head" in keys.stdout, keys.stdout  # both agents in etcd, one holding the role
        high = subprocess.run(["sbatch", "--parsable", "-p", "high", "-N", "2", "-o", str(tmp_path / "high.out"),
                               "--wrap", "echo high ran"], env=_env(slurm), capture_output=True, text=True, timeout=30)
        assert high.returncode == 0, high.stderr
        job.wait_done(restarts=1, timeout_s=300)
        state = job.state()
        assert state.status == "finished" and _last_step(state) == steps - 1, job.output()
        jit = [c for c in state.checkpoints if c.metrics.get("preempted")]
        assert jit, ([(c.attempt, c.metrics) for c in state.checkpoints], job.output()[-4000:])
        # The run may train a few steps past the just-in-time checkpoint before the requeue: the
        # next start restores the newest commit of the preempted attempt, the checkpoint or later.
        newest = max((c for c in state.checkpoints if c.attempt == jit[0].attempt), key=lambda c: c.metrics["step"])
        assert state.attempts[-1].restored_from == newest.checkpoint_dir, state.attempts
    finally:
        etcd.stop()


def test_the_nodes_of_the_job_join_as_slurm_names_them_with_what_slurm_gave_the_job(slurm, tmp_path):
    script = tmp_path / "status.sbatch"
    script.write_text("#!/bin/bash\nexec outlast slurm --failure-domain-switch --preload '' -- outlast status\n")
    out = tmp_path / "status.out"
    done = subprocess.run(["sbatch", "--parsable", "-N", "2", "-o", str(out), str(script)], env=_env(slurm),
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    job = Job(slurm, done.stdout.strip(), tmp_path, out)
    job.wait_done(restarts=0, timeout_s=90)
    assert job.info().state == "COMPLETED", job.output()
    nodes = expand_hostlist(slurm._slurm(["scontrol", "show", "job", "-o", job.id]).split(" NodeList=")[1].split()[0])
    rows = {ln.split()[0]: ln for ln in job.output().splitlines() if ln.split() and ln.split()[0] in nodes}
    assert set(rows) == set(nodes), job.output()
    for node in nodes:
        # One CPU per node in the local cluster; leaf switches s1 (n1, n2) and s2 (n3).
        assert "alive" in rows[node] and "CPU 1," in rows[node] and f"slurm_job={job.id}" in rows[node]
        assert f" {'s1' if node in ('n1', 'n2') else 's2'} " in rows[node], rows[node]
    assert not _job_processes(slurm, job.id)


def test_a_whole_job_preempted_is_one_notice_naming_every_node_and_rank_and_loses_no_step(slurm, tmp_path):
    """Two ranks on the job's two nodes: USR1 drains both, so every rank's PreemptionInfo names both nodes and
    both ranks, from the first call that sees it; the ranks are held once the just-in-time checkpoint is
    committed, since the job is requeued then, so the requeued run trains no step a second time."""
    from tests.integration.jobs import read_events

    storage, out, events = tmp_path / "storage", tmp_path / "job.out", tmp_path / "events.jsonl"
    script = tmp_path / "steps.sbatch"
    script.write_text(f"#!/bin/bash\nexec outlast slurm -- python {ROOT / 'tests' / 'integration' / 'slurm_steps.py'} "
                      f"--storage {storage} --name run --events {events} --steps 80\n")
    done = subprocess.run(["sbatch", "--parsable", "-N", "2", "--ntasks-per-node=1", "--requeue", "-o", str(out),
                           "--open-mode=append", "--signal=B:USR1@30", "--chdir", str(ROOT), str(script)],
                          env=_env(slurm), capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    job = Job(slurm, done.stdout.strip().split(";")[0], storage, out)
    wait_until(lambda: any(e["ev"] == "step" and e["step"] >= 12 for e in read_events(events)), 120,
               lambda: f"the run to train 12 steps; output:\n{job.output()}")
    high = subprocess.run(["sbatch", "--parsable", "-p", "high", "-N", "2", "-o", "/dev/null", "--wrap", "sleep 1"],
                          env=_env(slurm), capture_output=True, text=True, timeout=30)
    assert high.returncode == 0, high.stderr
    job.wait_done(restarts=1, timeout_s=300)
    evs = read_events(events)
    placed = {e["rank"] for e in evs if e["ev"] == "start" and e["attempt"] == 1}
    assert placed == {0, 1}, job.output()
    notices = [e for e in evs if e["ev"] == "notice"]
    nodes = expand_hostlist(slurm._slurm(["scontrol", "show", "job", "-o", job.id]).split(" NodeList=")[1].split()[0])
    assert sorted(e["rank"] for e in notices) == [0, 1], notices
    assert all(sorted(e["node_ids"]) == sorted(nodes) and e["ranks"] == [0, 1] for e in notices), notices
    assert all(sorted(r for rs in e["node_to_ranks"].values() for r in rs) == [0, 1] for e in notices), notices
    preempted = notices[0]["attempt"]
    trained = max(e["step"] for e in evs if e["ev"] == "step" and e["attempt"] == preempted)
    restored = [e["restored"] for e in evs if e["ev"] == "start" and e["attempt"] > preempted]
    assert restored and restored[0] == trained, (f"the requeued run restored step {restored[0]}, but the preempted "
                                                 f"attempt trained up to step {trained}: steps lost")
    state = RunStore(open_storage(str(storage)), "run").load_state()
    assert state.status == "finished" and state.failure_counts.get("worker", 0) == 0
    assert any(f"Slurm job {job.id} (restart 0) got SIGUSR1" in m for m in _preemptions(state)), _preemptions(state)


_STARTS_A_CLUSTER = """
import sys
from pathlib import Path
from outlast.slurm.local_cluster import Layout, LocalSlurm, free_port_block
base = free_port_block(4)
c = LocalSlurm(Layout(root=Path(sys.argv[1]), ctld_port=base, first_node_port=base + 1), die_with_caller=True)
c.start()
print(" ".join(str(c._pid(n)) for n in c.running()), flush=True)
sys.stdin.read()
"""


def test_a_cluster_tied_to_its_caller_stops_when_the_caller_is_killed_before_any_teardown(slurm, tmp_path):
    caller = subprocess.Popen([sys.executable, "-c", _STARTS_A_CLUSTER, str(tmp_path / "slurm")], cwd=ROOT,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in caller.stdout.readline().split()]
        assert len(pids) == 5  # munged, slurmctld and three slurmd
        caller.kill()  # SIGKILL: nothing of the caller's runs after this
        caller.wait()
        wait_until(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                                   for p in pids), 30, "the daemons to stop")
    finally:
        caller.kill()
        LocalSlurm(Layout(root=tmp_path / "slurm")).stop(timeout_s=5)  # whatever is left, if the test failed
