"""A node cut off the network (not killed) is declared dead, and the run restarts without it.

The nodes run in network namespaces (see `tests/integration/netns.py`): the head and the
driver in the root namespace, three members each in its own. Cutting a member's link leaves
its agent and workers running but unreachable, as a machine whose network failed.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.integration.jobs import read_events
from tests.integration.netns import NetnsCluster, located_counting_loop, unavailable_reason
from tests.integration.procs import alive

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")

NODE_TIMEOUT_S = 2.0


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    c = NetnsCluster(num_members=3, node_timeout_s=NODE_TIMEOUT_S, workdir=tmp_path / "cluster")
    try:
        c.wait_joined()
        for k, v in c.env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("OUTLAST_NODE_TIMEOUT_S", str(NODE_TIMEOUT_S))  # the controller's view
        monkeypatch.setenv("OUTLAST_DRIVER_TIMEOUT_S", "2")  # the cut agent kills its workers after this
        monkeypatch.setenv("OUTLAST_CAPACITY_TIMEOUT_S", "20")  # fail rather than hang on a bug
        yield c
    finally:
        c.shutdown()


class Cutter(threading.Thread):
    """Waits for attempt 1 to be past its first checkpoint, cuts a member that holds a rank,
    then watches the head's node table and the cut node's workers."""

    def __init__(self, cluster: NetnsCluster, events: str, after_step: int) -> None:
        super().__init__(daemon=True)
        self.cluster, self.events, self.after_step = cluster, events, after_step
        self.victim: str | None = None
        self.victim_pids: list[int] = []
        self.cut_at = self.dead_after_s = self.workers_gone_after_s = None
        self.agent_alive_after_cut = self.agent_alive_after_workers = None
        self.error: BaseException | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            self._run()
        except BaseException as e:  # re-raised by the test after fit()
            self.error = e

    def _run(self) -> None:
        where = self.cluster.node_of_netns()
        deadline = time.monotonic() + 40
        while not self.stop.is_set():
            events = [e for e in read_events(self.events) if e["attempt"] == 1]
            placed = {e["rank"]: where.get(e["netns"], "?") for e in events if e["event"] == "where"}
            steps = [e["step"] for e in events if e["event"] == "step"]
            members = sorted(n for n in placed.values() if n != "head")
            if members and steps and max(steps) >= self.after_step:
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"attempt 1 never reached step {self.after_step}: {events}")
            time.sleep(0.02)
        else:
            return
        self.victim = members[-1]
        ranks = {r for r, n in placed.items() if n == self.victim}
        self.victim_pids = sorted({e["pid"] for e in events if e["rank"] in ranks})
        self.cluster.cut(self.victim)
        self.cut_at = time.monotonic()
        self.agent_alive_after_cut = self.cluster.nodes[self.victim].proc.poll() is None

        # The head declares it dead after its node timeout.
        while self.dead_after_s is None and time.monotonic() - self.cut_at < NODE_TIMEOUT_S + 15:
            states = {n.node_id: n.state for n in self.cluster.node_table()}
            if states.get(self.victim) == "dead":
                self.dead_after_s = time.monotonic() - self.cut_at
            time.sleep(0.1)
        # Its agent, no longer hearing the driver, kills that run's workers; the agent itself lives on.
        while time.monotonic() - self.cut_at < 15:
            if not any(alive(p) for p in self.victim_pids):
                self.workers_gone_after_s = time.monotonic() - self.cut_at
                break
            time.sleep(0.1)
        self.agent_alive_after_workers = self.cluster.nodes[self.victim].proc.poll() is None


def test_a_node_cut_off_the_network_is_declared_dead_and_the_run_restarts_on_the_others(cluster, storage_path,
                                                                                        tmp_path):
    from outlast.train import FailureConfig, RunConfig, ScalingConfig, Trainer

    events = str(tmp_path / "events.jsonl")
    steps = 30
    cutter = Cutter(cluster, events, after_step=7)  # past the checkpoint of step 4
    cutter.start()
    try:
        result = Trainer(
            located_counting_loop,
            train_loop_config={"events": events, "steps": steps, "every": 5, "step_sleep": 0.1},
            scaling_config=ScalingConfig(num_workers=2, placement_strategy="SPREAD"),
            run_config=RunConfig(name="netns", storage_path=storage_path,
                                 failure_config=FailureConfig(max_failures=1)),
        ).fit()
    finally:
        cutter.stop.set()
        cutter.join(timeout=30)
    if cutter.error is not None:
        raise cutter.error
    victim = cutter.victim
    assert victim is not None, "no member node held a rank"
    print(f"cut {victim}: declared dead after {cutter.dead_after_s} s, its workers gone after "
          f"{cutter.workers_gone_after_s} s")
    logs = "\n".join(f"--- {n}\n{cluster.log_tail(n)}" for n in ("head", victim))

    assert cutter.agent_alive_after_cut, "the cut node's agent died: the test must cut the network, not kill it"
    assert cutter.dead_after_s is not None, f"the head never declared {victim} dead\n{logs}"
    assert cutter.dead_after_s < NODE_TIMEOUT_S + 6, f"{victim} declared dead only after {cutter.dead_after_s:.1f} s"
    assert cutter.workers_gone_after_s is not None, \
        f"the cut node's workers {cutter.victim_pids} still run 15 s after the cut\n{logs}"
    assert cutter.agent_alive_after_workers, "the cut node's agent exited instead of just killing its workers"

    assert result.last_metrics["step"] == steps - 1
    evs = read_events(events)
    where = cluster.node_of_netns()
    second = {e["rank"]: where.get(e["netns"], "?") for e in evs if e["event"] == "where" and e["attempt"] == 2}
    assert sorted(second) == [0, 1], f"attempt 2 did not start both ranks: {second}"
    assert victim not in second.values(), f"attempt 2 placed a rank on the cut node {victim}: {second}"
    assert len(set(second.values())) == 2, f"SPREAD put attempt 2's ranks on one node: {second}"
    restored = {e["restored_step"] for e in evs if e["event"] == "start" and e["attempt"] == 2}
    assert restored and min(restored) >= 4, f"attempt 2 did not resume from a checkpoint: {restored}"
    assert max(e["attempt"] for e in evs) == 2
    assert any(e["event"] == "end" and e["attempt"] == 2 for e in evs)
    attempts = json.loads((Path(storage_path) / "netns" / "run_state.json").read_text())["attempts"]
    lost = [f for f in attempts[0]["failures"] if f["kind"] == "NodeLost"]
    assert [f["node_id"] for f in lost] == [victim], f"attempt 1 did not end with {victim} lost: {attempts[0]}"
    assert attempts[1]["outcome"] == "finished" and attempts[1]["restored_from"], attempts[1]

    # No orphans: every worker of either attempt is gone, and once the agents stop, nothing is
    # left in the members' namespaces (fork servers included).
    for pid in {e["pid"] for e in evs}:
        assert not alive(pid), f"worker {pid} outlived the run"
    cluster.stop_agents()
    deadline = time.monotonic() + 10
    while cluster.leftover_pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not cluster.leftover_pids(), f"processes left in the namespaces: {cluster.leftover_pids()}"


def test_a_node_cut_off_for_less_than_the_node_timeout_keeps_its_ranks_and_the_attempt_goes_on(
        cluster, storage_path, tmp_path):
    from outlast.train import FailureConfig, RunConfig, ScalingConfig, Trainer

    events = str(tmp_path / "events.jsonl")
    where = cluster.node_of_netns()
    cut: dict = {}

    def cut_briefly() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            evs = read_events(events)
            placed = {where.get(e["netns"]) for e in evs if e["event"] == "where"}
            members = sorted(n for n in placed if n and n != "head")
            if members and any(e["event"] == "step" and e["step"] >= 5 for e in evs):
                # The silence a cut leaves is longer than the cut (heartbeats every 0.5 s, and TCP
                # doubles its wait between retransmissions): 0.2 of the timeouts, healed on a timer so
                # that a slow answer to the table's request does not lengthen it.
                cut["node"] = members[0]
                healer = threading.Timer(NODE_TIMEOUT_S * 0.2, cluster.heal, args=(members[0],))
                cluster.cut(members[0])
                healer.start()
                time.sleep(NODE_TIMEOUT_S * 0.15)
                cut["states"] = {n.node_id: n.state for n in cluster.node_table()}
                healer.join()
                return
            time.sleep(0.02)

    t = threading.Thread(target=cut_briefly, daemon=True)
    t.start()
    result = Trainer(
        located_counting_loop,
        train_loop_config={"events": events, "steps": 30, "every": 5, "step_sleep": 0.1},
        scaling_config=ScalingConfig(num_workers=2, placement_strategy="SPREAD"),
        run_config=RunConfig(name="short-cut", storage_path=storage_path,
                             failure_config=FailureConfig(max_failures=0)),
    ).fit()
    t.join(timeout=30)
    assert "node" in cut, "no member node held a rank to cut"
    assert cut["states"][cut["node"]] == "alive", f"a cut shorter than the node timeout lost the node: {cut}"
    assert result.last_metrics["step"] == 29
    assert {e["attempt"] for e in read_events(events)} == {1}, "the short cut ended the attempt"
    state = json.loads((Path(storage_path) / "short-cut" / "run_state.json").read_text())
    assert len(state["attempts"]) == 1 and not state["attempts"][0]["failures"], state["attempts"]


@pytest.mark.torch
def test_live_groups_form_across_namespace_nodes_and_a_killed_rank_is_replaced_while_the_others_go_on(
        cluster, storage_path, tmp_path):
    # Each node has its own network, and its hostname resolves to 127.0.0.1 there: a live group's ranks must
    # advertise their node's address on the bridge, or the ranks on other nodes cannot connect to them.
    from outlast.procutil import pid_alive
    from outlast.train import FailureConfig, RunConfig, ScalingConfig
    from outlast.train.torch import TorchTrainer
    from tests.integration.live_jobs import live_loop

    events = tmp_path / "events.jsonl"
    steps, workers = 30, 3
    killed: dict = {}

    def kill_a_member_s_rank() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            evs = read_events(events) if events.exists() else []
            placed = {e["rank"]: (e["node"], e["pid"]) for e in evs if e["event"] == "start"}
            if len(placed) == workers and any(e["event"] == "step" and e["step"] >= 3 for e in evs):
                rank = max(r for r, (node, _) in placed.items() if node != "head")
                killed.update(rank=rank, node=placed[rank][0], pid=placed[rank][1])
                os.kill(killed["pid"], signal.SIGKILL)
                return
            time.sleep(0.02)

    killer = threading.Thread(target=kill_a_member_s_rank, daemon=True)
    killer.start()
    result = TorchTrainer(
        live_loop, train_loop_config={"events": str(events), "steps": steps, "report": True, "sleep": 0.05},
        scaling_config=ScalingConfig(num_workers=workers, placement_strategy="SPREAD"),
        run_config=RunConfig(name="live-netns", storage_path=storage_path,
                             failure_config=FailureConfig(max_failures=1, live_recovery=True)),
    ).fit()
    killer.join(timeout=30)
    evs = read_events(events)
    starts = [e for e in evs if e["event"] == "start"]
    first = {e["rank"]: e for e in starts if e["incarnation"] == 0}
    assert len({e["node"] for e in first.values()} - {"head"}) >= 2, f"fewer than 2 member nodes held a rank: {first}"
    assert killed, f"no rank on a member node reached step 3: {starts}"
    assert result.error is None and result.last_metrics == {"step": steps - 1}
    assert not pid_alive(killed["pid"])
    # The others never stopped: each logged from its first pid only, up to its end, in the first attempt.
    for rank in set(range(workers)) - {killed["rank"]}:
        mine = [e for e in evs if e["rank"] == rank]
        assert {e["pid"] for e in mine} == {first[rank]["pid"]} and mine[-1]["event"] == "end", mine[-1]
    assert [e["rank"] for e in starts if e["incarnation"] == 1] == [killed["rank"]]
    assert {e["attempt"] for e in evs} == {1}
    ends = [e["exact"] for e in evs if e["event"] == "end"]
    assert len(ends) == workers and all(w == ends[0] for w in ends)
    state = json.loads((Path(storage_path) / "live-netns" / "run_state.json").read_text())
    assert len(state["attempts"]) == 1 and state["status"] == "finished"
    [recovery] = state["live_recoveries"]
    assert recovery["path"] == "live" and recovery["ranks"] == [killed["rank"]], recovery
    assert "SIGKILL" in recovery["cause"]
