"""A cluster kept in a real 3-member etcd, with real agents and real runs: the agent holding the
head role dies while a run trains, a drain issued during the hand-over reaches the run, etcd
loses one member and then its majority, and comes back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from outlast import train
from outlast.testing import LocalCluster
from outlast.train import Checkpoint, RunConfig, ScalingConfig, Trainer
from tests.integration.etcd_cluster import EtcdCluster, etcd_missing
from tests.integration.jobs import log_event, read_events
from tests.integration.procs import wait_until

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(etcd_missing() is not None, reason=etcd_missing() or "")

SLOT = ["--resources", "slot=1"]  # the nodes a run may use: the head's node has none


def stepping_loop(config: dict) -> None:
    """Steps in lock step, saves one checkpoint on a preemption notice, and stops when told to
    (a file appears) or, after a restore, `after_restore` steps later."""
    import tempfile

    ckpt = train.get_checkpoint()
    start = 0
    if ckpt is not None:
        with ckpt.as_directory() as d:
            start = json.loads(Path(d, "state.json").read_text())["step"] + 1
    log_event(config, event="start", node_id=os.environ.get("OUTLAST_NODE_ID"), restored=start - 1 if ckpt else None)
    saved = False
    step = start
    while not (ckpt is not None and step >= start + config["after_restore"]):
        # Rank 0 reads the stop file for all, in lock step: a rank that saw it alone and ended would leave
        # the others waiting at the next step's collective.
        if train.collective.broadcast_from_rank_zero(os.path.exists(config["stop"])):
            break
        info = train.get_preemption_info()
        checkpoint = None
        if info is not None and not saved:
            saved = True
            log_event(config, event="notice", step=step, node_ids=info.node_ids)
            if train.get_context().get_world_rank() == 0:
                d = tempfile.mkdtemp()
                Path(d, "state.json").write_text(json.dumps({"step": step}))
                checkpoint = Checkpoint.from_directory(d)
        train.report({"step": step}, checkpoint=checkpoint)
        log_event(config, event="step", step=step)
        step += 1
        time.sleep(0.05)


@pytest.fixture
def etcd(tmp_path):
    cluster = EtcdCluster(tmp_path / "etcd").start()
    yield cluster
    cluster.stop()


def _fit_in_thread(storage_path, name, events, stop, workers=2, after_restore=10):
    box: dict = {}

    def run():
        try:
            box["result"] = Trainer(
                stepping_loop, train_loop_config={"events": str(events), "stop": str(stop),
                                                  "after_restore": after_restore},
                scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"slot": 1},
                                             placement_strategy="SPREAD"),
                run_config=RunConfig(name=name, storage_path=storage_path)).fit()
        except BaseException as e:  # noqa: BLE001 - the test asserts on it
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def _steps(events) -> list[int]:
    return [e["step"] for e in read_events(events) if e["event"] == "step"]


def _outlast(address: str, home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUTLAST_ADDRESS": address, "OUTLAST_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "outlast.cli.main", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


def _holder(cluster: LocalCluster) -> str | None:
    return next((n.node_id for n in cluster.node_table() if n.is_head and n.state != "dead"), None)


def _state(storage_path, name) -> dict:
    return json.loads((Path(storage_path) / name / "run_state.json").read_text())


def test_the_head_role_passes_on_and_a_drain_issued_during_the_hand_over_reaches_the_run(
        etcd, storage_path, tmp_path):
    with LocalCluster(num_nodes=1, etcd=etcd.urls, workdir=tmp_path / "nodes") as cluster:
        for node_id in ("node-1", "node-2"):
            cluster.add_node(node_id, extra_args=SLOT)
        cluster.add_node("node-3")
        wait_until(lambda: _holder(cluster) == "node-0", 30, "node-0 to hold the head role")
        events, stop = tmp_path / "events.jsonl", tmp_path / "stop"
        fit, box = _fit_in_thread(storage_path, "run", events, stop)
        wait_until(lambda: len(_steps(events)) >= 10, 120, "the run to train")
        placed = {e["node_id"] for e in read_events(events) if e["event"] == "start"}
        assert placed == {"node-1", "node-2"}

        cluster.kill_node("node-0")
        # During the hand-over (no live holder yet), from a tool on node-3's machine.
        drained = _outlast(cluster.nodes["node-3"].address, tmp_path, "drain-node", "--node-id", "node-2",
                           "--reason", "preemption", "--deadline-remaining-seconds", "60")
        assert drained.returncode == 0, drained.stderr
        assert "node node-2 is draining in 60 s" in drained.stdout

        wait_until(lambda: _holder(cluster) in ("node-1", "node-2", "node-3"), 30, "another agent to hold the role")
        assert {n.node_id: n.state for n in cluster.node_table()}["node-0"] == "dead"
        cluster.add_node("node-4", extra_args=SLOT)
        wait_until(lambda: {n.node_id: n.state for n in cluster.node_table()}.get("node-4") == "alive", 30,
                   "node-4 to join")

        fit.join(timeout=120)
        assert not fit.is_alive() and "error" not in box, box.get("error")
        notices = [e for e in read_events(events) if e["event"] == "notice"]
        assert {e["rank"] for e in notices} == {0, 1} and notices[0]["node_ids"] == ["node-2"]
        restarts = [e for e in read_events(events) if e["event"] == "start" and e["attempt"] == 2]
        assert {e["node_id"] for e in restarts} == {"node-1", "node-4"}
        assert {e["restored"] for e in restarts} == {notices[0]["step"]}  # the just-in-time checkpoint
        # The head's death was nothing to the run: its only failure is the preemption.
        state = _state(storage_path, "run")
        assert state["failure_counts"] == {"preemption": 1} and len(state["attempts"]) == 2


def test_one_lost_etcd_member_changes_nothing_and_a_lost_majority_stops_placement_not_training(
        etcd, storage_path, tmp_path):
    home = tmp_path / "tools"
    with LocalCluster(num_nodes=1, etcd=etcd.urls, workdir=tmp_path / "nodes") as cluster:
        for node_id in ("node-1", "node-2", "node-3"):  # run a takes two, run b one
            cluster.add_node(node_id, extra_args=SLOT)
        wait_until(lambda: _holder(cluster) is not None, 30, "an agent to hold the head role")
        holder = _holder(cluster)
        address = cluster.nodes["node-0"].address
        events, stop = tmp_path / "a.jsonl", tmp_path / "stop-a"
        run_a, box_a = _fit_in_thread(storage_path, "a", events, stop)
        wait_until(lambda: len(_steps(events)) >= 5, 120, "run a to train")

        etcd.kill_member("m0")
        seen = len(_steps(events))
        wait_until(lambda: len(_steps(events)) >= seen + 20, 60, "run a to go on training")
        # If m0 led etcd, its calls fail for the second etcd takes to elect another leader.
        wait_until(lambda: "cluster store: etcd, available" in _outlast(address, home, "status").stdout, 30,
                   "the store to answer with two members")
        assert f"held by {holder}" in _outlast(address, home, "status").stdout  # the same agent: its lease held

        etcd.kill_member("m1")
        wait_until(lambda: "UNAVAILABLE since" in _outlast(address, home, "status").stdout, 60,
                   "status to say the store is unavailable")
        status = _outlast(address, home, "status").stdout
        assert "nothing new is placed" in status
        events_b, stop_b = tmp_path / "b.jsonl", tmp_path / "stop-b"
        run_b, box_b = _fit_in_thread(storage_path, "b", events_b, stop_b, workers=1)
        seen_b = {"status": "no run_state.json yet"}

        def b_waits() -> bool:
            if (Path(storage_path) / "b" / "run_state.json").exists():
                seen_b["status"] = _state(storage_path, "b")["status"]
            return seen_b["status"] == "waiting_for_capacity"
        try:  # a ceiling, not a timing: once failed at a load of 5 after 60 s
            wait_until(b_waits, 120, "run b to wait")
        except AssertionError as e:
            raise AssertionError(f"{e}; run b's status: {seen_b['status']}") from None
        seen = len(_steps(events))
        wait_until(lambda: len(_steps(events)) >= seen + 20, 60, "run a to train on without a majority")
        assert not read_events(events_b), "run b was placed while etcd had no majority"

        etcd.start_member("m0")
        etcd.start_member("m1")
        wait_until(lambda: len(_steps(events_b)) >= 5, 120, "run b to be placed once etcd is back")
        wait_until(lambda: "cluster store: etcd, available" in _outlast(address, home, "status").stdout, 60,
                   "status to say the store is back")
        stop.touch()
        stop_b.touch()
        for fit, box in ((run_a, box_a), (run_b, box_b)):
            fit.join(timeout=60)
            assert not fit.is_alive() and "error" not in box, box.get("error")
        assert _state(storage_path, "a")["failure_counts"] == {}
        assert len(_state(storage_path, "a")["attempts"]) == 1


def _cli(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OUTLAST_ADDRESS"}
    return subprocess.run([sys.executable, "-m", "outlast.cli.main", *args], cwd=ROOT, env={**env, "OUTLAST_HOME": str(home)},
                          capture_output=True, text=True, timeout=90)


def test_outlast_start_with_etcd_joins_it_and_status_says_so(etcd, tmp_path):
    home = tmp_path / "home"
    started = _cli(home, "start", "--preload", "", "--etcd", etcd.urls)
    try:
        assert started.returncode == 0, started.stderr
        assert f"joined the cluster kept in etcd at {etcd.urls}" in started.stdout
        wait_until(lambda: "held by" in _cli(home, "status").stdout, 30, "the node to hold the head role")
        status = _cli(home, "status").stdout
        assert "cluster store: etcd, available" in status and "1 node(s): 1 alive" in status, status
    finally:
        _cli(home, "stop")


def test_outlast_start_with_no_etcd_there_says_what_to_check(tmp_path):
    refused = _cli(tmp_path / "home", "start", "--preload", "", "--etcd", "http://127.0.0.1:9")
    assert refused.returncode == 1
    assert "could not join the cluster in etcd at http://127.0.0.1:9" in refused.stderr, refused.stderr
    assert "majority" in refused.stderr
    bad = _cli(tmp_path / "home", "start", "--preload", "", "--etcd", "ftp://x")
    assert bad.returncode == 1 and "http(s)://HOST:PORT" in bad.stderr, bad.stderr


def test_an_etcd_with_auth_on_is_used_with_its_user_and_a_wrong_password_is_refused_clearly(
        etcd, tmp_path, monkeypatch):
    def ctl(*args: str) -> None:
        done = subprocess.run(["etcdctl", "--endpoints", etcd.urls, *args], capture_output=True, text=True,
                              timeout=30, env={**os.environ, "ETCDCTL_API": "3"})
        assert done.returncode == 0, done.stderr

    ctl("user", "add", "root:rootpw")
    ctl("user", "add", "trainer:s3cret")
    ctl("role", "add", "outlast")
    ctl("role", "grant-permission", "outlast", "--prefix=true", "readwrite", "/outlast/")
    ctl("user", "grant-role", "trainer", "outlast")
    ctl("auth", "enable")
    home = tmp_path / "home"
    monkeypatch.setenv("OUTLAST_ETCD_PASSWORD", "wrong")
    refused = _cli(home, "start", "--preload", "", "--etcd", etcd.urls, "--etcd-user", "trainer")
    assert refused.returncode == 1 and "etcd refused" in refused.stderr, refused.stderr
    monkeypatch.setenv("OUTLAST_ETCD_PASSWORD", "s3cret")
    started = _cli(home, "start", "--preload", "", "--etcd", etcd.urls, "--etcd-user", "trainer")
    try:
        assert started.returncode == 0, started.stderr
        wait_until(lambda: "held by" in _cli(home, "status").stdout, 30, "the node to hold the head role")
        assert "cluster store: etcd, available" in _cli(home, "status").stdout
    finally:
        _cli(home, "stop")


def test_an_etcd_that_wants_client_certificates_is_used_with_them(tmp_path):
    from tests.integration.etcd_cluster import Tls

    tls = Tls.make(tmp_path / "tls")
    etcd = EtcdCluster(tmp_path / "etcd", tls=tls).start()
    home = tmp_path / "home"
    try:
        no_cert = _cli(home, "start", "--preload", "", "--etcd", etcd.urls, "--etcd-cacert", str(tls.ca))
        assert no_cert.returncode == 1 and "could not join the cluster in etcd" in no_cert.stderr, no_cert.stderr
        assert "TLS" in no_cert.stderr, no_cert.stderr  # the reason, not just that it failed
        started = _cli(home, "start", "--preload", "", "--etcd", etcd.urls, "--etcd-cacert", str(tls.ca),
                       "--etcd-cert", str(tls.client_cert), "--etcd-key", str(tls.client_key))
        assert started.returncode == 0, started.stderr
        wait_until(lambda: "held by" in _cli(home, "status").stdout, 30, "the node to hold the head role")
        assert "cluster store: etcd, available" in _cli(home, "status").stdout
    finally:
        _cli(home, "stop")
        etcd.stop()


def test_the_head_fans_a_drain_out_to_the_failure_domain(etcd, tmp_path):
    from outlast.protocol import messages as m

    with LocalCluster(num_nodes=4, etcd=etcd.urls, workdir=tmp_path / "nodes",
                      failure_domains=["", "rack-a", "rack-a", "rack-b"]) as cluster:
        wait_until(lambda: _holder(cluster) == "node-0", 30, "node-0 to hold the head role")
        ack = cluster.drain_node("node-1", deadline_s=60, reason="maintenance")
        assert ack.node_ids == ["node-1", "node-2"]

        def draining_here(node_id: str) -> bool:
            reply = cluster._request(cluster.nodes[node_id].address, m.StatusRequest())
            return isinstance(reply, m.StatusReply) and reply.draining is not None

        wait_until(lambda: draining_here("node-2"), 30, "node-2 to drain with its failure domain")
        assert draining_here("node-1") and not draining_here("node-3")
        states = {n.node_id: n.state for n in cluster.node_table()}
        assert states == {"node-0": "alive", "node-1": "draining", "node-2": "draining", "node-3": "alive"}


def _draining_here(cluster: LocalCluster, node_id: str) -> bool:
    from outlast.protocol import messages as m

    reply = cluster._request(cluster.nodes[node_id].address, m.StatusRequest())
    return isinstance(reply, m.StatusReply) and reply.draining is not None


def test_a_dead_nodes_drain_does_not_drain_its_peer_again_when_the_peer_rejoins(etcd, tmp_path):
    with LocalCluster(num_nodes=4, etcd=etcd.urls, workdir=tmp_path / "nodes",
                      failure_domains=["rack-b", "rack-a", "rack-a", "rack-b"]) as cluster:
        wait_until(lambda: _holder(cluster) == "node-0", 30, "node-0 to hold the head role")
        cluster.drain_node("node-1", deadline_s=600, reason="maintenance")
        wait_until(lambda: _draining_here(cluster, "node-2"), 30, "node-2 to drain with its failure domain")
        cluster.kill_node("node-1")  # the drained node is gone; its drain key stays in etcd
        wait_until(lambda: {n.node_id: n.state for n in cluster.node_table()}.get("node-1") == "dead", 30,
                   "node-1 to be dead")
        cluster.kill_node("node-2")
        cluster.restart_node("node-2")  # a new start: it deletes its own drain and rejoins
        wait_until(lambda: {n.node_id: n.state for n in cluster.node_table()}.get("node-2") == "alive", 30,
                   "node-2 to rejoin")
        # The head's next pass over the drains: node-3's fans out to node-0 in the same pass that
        # would have drained node-2 again for node-1's.
        cluster.drain_node("node-3", deadline_s=600, reason="maintenance")
        wait_until(lambda: _draining_here(cluster, "node-0"), 30, "node-0 to drain with node-3's failure domain")
        assert not _draining_here(cluster, "node-2")
        assert {n.node_id: n.state for n in cluster.node_table()}["node-2"] == "alive"


def test_records_written_to_etcd_without_the_cluster_key_are_refused_and_said(etcd, tmp_path):
    from outlast.cluster.etcd_store import EtcdConfig, EtcdStore, namespace_of
    from outlast.cluster.store_view import drain_value, node_value
    from outlast.protocol import messages as m
    from outlast.protocol.auth import ClusterKey

    with LocalCluster(num_nodes=2, etcd=etcd.urls, workdir=tmp_path / "nodes") as cluster:
        wait_until(lambda: _holder(cluster) == "node-0", 30, "node-0 to hold the head role")
        # Someone who can write to etcd but has no cluster key: it knows the prefix (from the keys
        # it can list) and the record formats (outlast is open source).
        key = ClusterKey.load(cluster.key_file)
        intruder = EtcdStore(EtcdConfig.parse(etcd.urls), namespace_of(key.public))
        fake = m.NodeInfo(node_id="intruder", address="tcp://10.9.9.9:1", host="10.9.9.9", resources={"CPU": 64.0})
        intruder.put("members/intruder", node_value(fake))
        intruder.put("nodes/intruder", node_value(fake))
        intruder.put("drains/node-1", drain_value(m.NodeDraining(node_id="node-1", reason="preemption", message="",
                                                                 deadline_unix_s=None, node_ids=["node-1"])))
        logs = [cluster.nodes[n].log_path for n in ("node-0", "node-1")]
        for path in logs:
            wait_until(lambda: "refused the cluster store's record drains/node-1" in path.read_text(), 30,  # noqa: B023 - called before the loop goes on
                       f"the refusal in {path.name}")
            assert "refused the cluster store's record nodes/intruder" in path.read_text()
        assert sorted(n.node_id for n in cluster.node_table()) == ["node-0", "node-1"]
        assert not _draining_here(cluster, "node-1")
        # The cluster's own records still pass: a drain asked of an agent is written sealed.
        cluster.drain_node("node-1", deadline_s=600, reason="maintenance")
        wait_until(lambda: _draining_here(cluster, "node-1"), 30, "node-1 to drain")
