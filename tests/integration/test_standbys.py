"""The standbys that keep a restart from importing torch again: a ready second fork server, forked
from the first once its imports were done, takes the place of a killed one, and a driver's standby agent (with its fork server already warm) takes
the place of a killed embedded agent; and the fork server's spares, forked ahead, that keep a
restart from waiting for a fork. Each standby ends with what it stands by, and nothing is left."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest

from outlast.protocol import messages as m
from outlast.testing import LocalCluster
from outlast.train import FailureConfig, RunConfig, ScalingConfig, Trainer
from tests.integration.procs import alive, live_descendants_running, wait_until
from tests.integration.standby_jobs import kill_once_loop, spare_loop, traced
from tests.integration.jobs import read_events

pytestmark = pytest.mark.usefixtures("standbys")  # what these tests are about


def _status(cluster: LocalCluster) -> m.StatusReply:
    reply = cluster._request(cluster.head_address, m.StatusRequest())
    assert isinstance(reply, m.StatusReply)
    return reply


def _fit(storage_path, tmp_path, kill: str):
    events = tmp_path / "events.jsonl"
    result = Trainer(kill_once_loop, train_loop_config={"events": str(events), "kill": kill},
                     scaling_config=ScalingConfig(num_workers=1),
                     run_config=RunConfig(name=f"standby-{kill}", storage_path=storage_path,
                                          failure_config=FailureConfig(max_failures=1))).fit()
    assert result.error is None and result.last_metrics == {"attempt": 2}
    return {(e["attempt"], e["event"]): e for e in read_events(events)}


@pytest.mark.torch
def test_a_killed_fork_server_gives_way_to_its_ready_standby_which_forks_the_next_worker(storage_path, tmp_path):
    with LocalCluster(num_nodes=1) as cluster:  # the default preload: torch
        cluster.wait_ready()
        wait_until(lambda: _status(cluster).fork_server_standby_pid != 0, 300, "a ready standby fork server")
        before = _status(cluster)
        server, standby = before.fork_server_pid, before.fork_server_standby_pid
        standby_started = psutil.Process(standby).create_time()
        # Forked from the server once its imports were done: it shares their pages, rather than importing again.
        assert psutil.Process(standby).ppid() == server
        memory = psutil.Process(standby).memory_full_info()
        assert memory.uss < memory.rss / 2, memory
        seen = _fit(storage_path, tmp_path, "forkserver")
        assert seen[(1, "start")]["ppid"] == server and seen[(1, "kill")]["victim"] == server
        # The next worker is the standby's child, and the standby had imported torch before the kill.
        assert seen[(2, "start")]["ppid"] == standby
        assert standby_started < seen[(1, "kill")]["t"]
        assert not alive(server)
        after = _status(cluster)
        assert after.fork_server_pid == standby
        # A new standby comes once no fork is on its way.
        wait_until(lambda: _status(cluster).fork_server_standby_pid not in (0, standby), 300, "a new standby")
        spare = _status(cluster).fork_server_standby_pid
        assert psutil.Process(spare).ppid() == standby  # the server that took over forked the next standby
    # Shut down with its agent: both servers, and every worker, are gone.
    for pid in (standby, spare, seen[(1, "start")]["pid"], seen[(2, "start")]["pid"]):
        wait_until(lambda pid=pid: not alive(pid), 30, f"process {pid} to end with its agent")


def test_a_killed_agent_takes_its_standby_fork_server_with_it(tmp_path):
    with LocalCluster(num_nodes=1, preload=["json"]) as cluster:
        cluster.wait_ready()
        wait_until(lambda: _status(cluster).fork_server_standby_pid != 0, 120, "a ready standby fork server")
        status = _status(cluster)
        cluster.kill_node("node-0")
        for pid in (status.fork_server_pid, status.fork_server_standby_pid):
            wait_until(lambda pid=pid: not alive(pid), 30, f"fork server {pid} to end with its agent")


@pytest.mark.torch
def test_a_killed_embedded_agent_gives_way_to_the_drivers_standby_agent_and_its_warm_fork_server(
        storage_path, tmp_path, monkeypatch):
    monkeypatch.setenv("OUTLAST_TRACE_FILE", str(tmp_path / "trace.jsonl"))  # how the loop sees the standby
    monkeypatch.delenv("OUTLAST_ADDRESS", raising=False)
    driver = psutil.Process()
    seen = _fit(storage_path, tmp_path, "agent")
    standby_agent, standby_server = seen[(1, "standby")]["standby"]
    assert seen[(1, "kill")]["victim"] != standby_agent
    # The next worker was forked by the standby agent's fork server, which was ready before the kill.
    assert (seen[(2, "start")]["ppid"], seen[(2, "start")]["grandparent"]) == (standby_server, standby_agent)
    # fit() stopped the node: no agent of it, standby or not, nor any fork server, is left.
    for pid in (standby_agent, standby_server, seen[(1, "kill")]["victim"], seen[(2, "start")]["pid"]):
        wait_until(lambda pid=pid: not alive(pid), 30, f"process {pid} to end with the run")
    left = live_descendants_running(driver, "outlast.agent")
    assert not left, left


def test_a_restarted_rank_is_a_spare_forked_before_the_kill_and_a_spare_killed_by_anyone_is_replaced_unheard(
        storage_path, tmp_path, monkeypatch):
    monkeypatch.setenv("OUTLAST_TRACE_FILE", str(tmp_path / "trace.jsonl"))  # where the loop sees the spares
    monkeypatch.delenv("OUTLAST_ADDRESS", raising=False)
    events = tmp_path / "events.jsonl"
    result = Trainer(spare_loop, train_loop_config={"events": str(events)}, scaling_config=ScalingConfig(num_workers=2),
                     run_config=RunConfig(name="spares", storage_path=storage_path,
                                          failure_config=FailureConfig(max_failures=1))).fit()
    assert result.error is None and result.last_metrics == {"attempt": 2}
    evs = read_events(events)
    kill = next(e for e in evs if e["event"] == "kill")
    restarted = {e["pid"] for e in evs if e["event"] == "start" and e["attempt"] == 2}
    spares = {e["child"] for e in traced("zygote.spare")}
    # Both ranks of attempt 2 are spares, the killed one not among them, and a spare waiting before the kill
    # took the first (a spare forked after it may take the second, on a machine slow between the requests).
    assert len(restarted) == 2 and restarted <= spares - {kill["spare_killed"]}, (restarted, spares, kill)
    assert restarted & set(kill["spares"]), (restarted, kill)
    # The spare killed from outside cost the run nothing: the one failure is rank 1's own death.
    attempts = json.loads((Path(storage_path) / "spares" / "run_state.json").read_text())["attempts"]
    assert [f["rank"] for f in attempts[0]["failures"]] == [1] and len(attempts) == 2, attempts
    # fit() stopped the node: no spare is left, used or not.
    for pid in spares:
        wait_until(lambda pid=pid: not alive(pid), 30, f"spare {pid} to end with the node")


@pytest.mark.torch
def test_the_standby_fork_server_waits_for_the_forks_asked_while_the_server_imported(storage_path, tmp_path,
                                                                                      monkeypatch):
    """A run asked for its ranks while the node's server was still importing torch: the server forks them once
    ready, and the standby (seconds of imports on the same cores) starts only after they are forked."""
    from outlast.agent.forkserver import STANDBY_AFTER_FORKS_S
    from tests.integration.jobs import sleepy_loop

    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv("OUTLAST_TRACE_FILE", str(trace))
    with LocalCluster(num_nodes=1) as cluster:  # the default preload: torch; fit() asks before it is imported
        result = Trainer(sleepy_loop, train_loop_config={"steps": 2, "events": str(tmp_path / "events.jsonl")},
                         scaling_config=ScalingConfig(num_workers=2),
                         run_config=RunConfig(name="early", storage_path=storage_path)).fit()
        assert result.error is None
        wait_until(lambda: _status(cluster).fork_server_standby_pid != 0, 300, "a ready standby fork server")
    marks = [json.loads(line) for line in trace.read_text().splitlines()]
    ready = min(e["t"] for e in marks if e["phase"] == "zygote.ready")  # the server's own word, before it forks
    forks = [e["t"] for e in marks if e["phase"] == "zygote.fork"]
    (standby,) = [e["t"] for e in marks if e["phase"] == "agent.standby_start"]
    assert len(forks) == 2 and min(forks) >= ready  # asked while it imported, forked once ready
    assert standby >= max(forks) + STANDBY_AFTER_FORKS_S
