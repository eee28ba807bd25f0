"""Many nodes on one machine (`LocalCluster`): placement, a lost node, and preemptions that
drain some ranks, all ranks, rank 0 with relaxed collectives, a shard holder, or two nodes
in a row."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from outlast.testing import LocalCluster
from outlast.train import FailureConfig, RunConfig, ScalingConfig, Trainer, TrainingFailedError
from tests.integration.jobs import counting_loop, node_logging_loop, read_events, relaxed_loop
from tests.integration.procs import wait_until


@pytest.fixture
def cluster(request, monkeypatch, tmp_path):
    monkeypatch.setenv("OUTLAST_NODE_TIMEOUT_S", "2")
    monkeypatch.setenv("OUTLAST_CAPACITY_TIMEOUT_S", "3")
    params = getattr(request, "param", {})
    with LocalCluster(num_nodes=params.get("num_nodes", 3), node_timeout_s=2,
                      failure_domains=params.get("failure_domains"), workdir=tmp_path / "cl") as c:
        yield c


def _state(storage_path) -> dict:
    return json.loads((Path(storage_path) / "run" / "run_state.json").read_text())


def _checkpointed_step(storage_path) -> int:
    state = _state(storage_path)
    return json.loads((Path(storage_path) / "run" / state["latest_checkpoint"] / "state.json").read_text())["step"]


def _when(events, predicate, action, what: str) -> threading.Thread:
    def run():
        wait_until(lambda: predicate(read_events(events)), 60, what)
        action()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _at_step(step: int):
    return lambda evs: any(e["event"] == "step" and e["step"] >= step and e["attempt"] == 1 for e in evs)


def _placed(events, attempt: int) -> dict[int, str]:
    return {e["rank"]: e["node_id"] for e in read_events(events) if e["event"] == "placed" and e["attempt"] == attempt}


def _fit(fn, storage_path, events, num_workers=2, strategy="PACK", steps=60, **failure):
    return Trainer(fn, train_loop_config={"events": str(events), "steps": steps, "step_sleep": 0.02},
                   scaling_config=ScalingConfig(num_workers=num_workers, placement_strategy=strategy),
                   run_config=RunConfig(name="run", storage_path=storage_path,
                                        failure_config=FailureConfig(**failure))).fit()


def test_spread_places_one_rank_per_node_with_torch_style_ranks(cluster, storage_path, tmp_path):
    events = tmp_path / "events.jsonl"
    _fit(node_logging_loop, storage_path, events, num_workers=3, strategy="SPREAD", steps=3)
    placed = [e for e in read_events(events) if e["event"] == "placed"]
    assert sorted(e["node_id"] for e in placed) == cluster.node_ids
    assert {(e["rank"], e["node_rank"], e["local_rank"]) for e in placed} == {(0, 0, 0), (1, 1, 0), (2, 2, 0)}


def test_pack_places_ranks_by_resources_consecutively(storage_path, tmp_path, monkeypatch):
    with LocalCluster(num_nodes=2, cpus_per_node=2):
        events = tmp_path / "events.jsonl"
        Trainer(node_logging_loop, train_loop_config={"events": str(events), "steps": 2},
                scaling_config=ScalingConfig(num_workers=3, resources_per_worker={"CPU": 1}),
                run_config=RunConfig(name="run", storage_path=storage_path)).fit()
        placed = {e["rank"]: (e["node_id"], e["node_rank"], e["local_rank"]) for e in read_events(events)
                  if e["event"] == "placed"}
        assert placed == {0: ("node-0", 0, 0), 1: ("node-0", 0, 1), 2: ("node-1", 1, 0)}


def test_a_run_that_fits_no_node_says_so_and_fails_after_the_capacity_timeout(cluster, storage_path, tmp_path):
    with pytest.raises(TrainingFailedError, match="no capacity") as info:
        Trainer(counting_loop, train_loop_config={"events": str(tmp_path / "e"), "steps": 2},
                scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"GPU": 1}),
                run_config=RunConfig(name="run", storage_path=storage_path)).fit()
    assert "GPU" in str(info.value) and "3 usable node(s)" in str(info.value)
    assert _state(storage_path)["status"] == "errored"


def test_a_killed_node_restarts_the_run_on_the_remaining_nodes(cluster, storage_path, tmp_path):
    events = tmp_path / "events.jsonl"
    killer = _when(events, _at_step(12), lambda: cluster.kill_node(_placed(events, 1)[1]), "step 12")
    result = _fit(node_logging_loop, storage_path, events, strategy="SPREAD", steps=30, max_failures=1)
    killer.join()
    assert result.last_metrics == {"step": 29}
    lost = _placed(events, 1)[1]
    assert lost not in _placed(events, 2).values()
    failure = _state(storage_path)["attempts"][0]["failures"][0]
    assert failure["kind"] == "NodeLost" and lost in failure["message"]
    assert any(n.node_id == lost and n.state == "dead" for n in cluster.node_table())


def test_a_drain_of_the_node_of_some_ranks_tells_every_rank_and_moves_them(cluster, storage_path, tmp_path):
    events = tmp_path / "events.jsonl"
    drained = {}

    def drain():
        drained["node"] = _placed(events, 1)[1]
        cluster.drain_node(drained["node"], deadline_s=20, message="spot reclaimed")

    drainer = _when(events, _at_step(10), drain, "step 10")
    result = _fit(node_logging_loop, storage_path, events, strategy="SPREAD", steps=40)
    drainer.join()
    assert result.last_metrics == {"step": 39}
    notices = [e for e in read_events(events) if e["event"] == "notice"]
    assert sorted(e["rank"] for e in notices) == [0, 1] and len({e["step"] for e in notices}) == 1
    assert notices[0]["node_ids"] == [drained["node"]] and notices[0]["ranks"] == [1]
    assert drained["node"] not in _placed(events, 2).values()
    starts = [e for e in read_events(events) if e["event"] == "start" and e["attempt"] == 2]
    assert {e["restored_step"] for e in starts} == {notices[0]["step"]}  # no step lost
    assert _state(storage_path)["failure_counts"] == {"preemption": 1}


def test_a_drain_of_every_rank_moves_the_run_to_the_spare_node(cluster, storage_path, tmp_path):
    events = tmp_path / "events.jsonl"
    drainer = _when(events, _at_step(10), lambda: cluster.drain_node("node-0", deadline_s=20), "step 10")
    result = _fit(node_logging_loop, storage_path, events, steps=40)
    drainer.join()
    assert result.last_metrics == {"step": 39}
    assert set(_placed(events, 1).values()) == {"node-0"} and set(_placed(events, 2).values()) == {"node-1"}
    notices = [e for e in read_events(events) if e["event"] == "notice"]
    assert notices[0]["ranks"] == [0, 1]
    assert {e["restored_step"] for e in read_events(events) if e["event"] == "start" and e["attempt"] == 2} \
        == {notices[0]["step"]}


def test_two_drains_in_a_row_with_staggered_deadlines_lose_no_step(cluster, storage_path, tmp_path):
    events = tmp_path / "events.jsonl"
    first = _when(events, _at_step(8), lambda: cluster.drain_node("node-0", deadline_s=20), "step 8")
    in_attempt_2 = lambda evs: any(e["event"] == "step" and e["attempt"] == 2 and e["step"] >= 20 for e in evs)  # noqa: E731
    second = _when(events, in_attempt_2, lambda: cluster.drain_node("node-1", deadline_s=10), "attempt 2")
    result = _fit(node_logging_loop, storage_path, events, steps=40)
    first.join()
    second.join()
    assert result.last_metrics == {"step": 39}
    assert [set(_placed(events, a).values()) for a in (1, 2, 3)] == [{"node-0"}, {"node-1"}, {"node-2"}]
    notices = {e["attempt"]: e["step"] for e in read_events(events) if e["event"] == "notice"}
    restored = {e["attempt"]: e["restored_step"] for e in read_events(events) if e["event"] == "start"}
    assert restored[2] == notices[1] and restored[3] == notices[2]
    assert _state(storage_path)["failure_counts"] == {"preemption": 2}


def test_a_drain_without_a_deadline_still_moves_the_run(cluster, storage_path, tmp_path):
    events = tmp_path / "events.jsonl"
    drainer = _when(events, _at_step(5), lambda: cluster.drain_node("node-0", reason="maintenance"), "step 5")
    result = _fit(node_logging_loop, storage_path, events, steps=20)
    drainer.join()
    assert result.last_metrics == {"step": 19}
    notices = [e for e in read_events(events) if e["event"] == "notice"]
    assert notices and all(e["deadline_ms"] is None and e["reason"] == "maintenance" for e in notices)
    assert set(_placed(events, 2).values()) == {"node-1"}


@pytest.mark.parametrize("cluster", [{"num_nodes": 3, "failure_domains": ["", "slice-a", "slice-a"]}],
                         indirect=True)
def test_a_drain_on_one_node_of_a_failure_domain_drains_the_domain(cluster, storage_path, tmp_path):
    events = tmp_path / "events.jsonl"
    ack = {}
    drainer = _when(events, _at_step(5), lambda: ack.update(a=cluster.drain_node("node-1", deadline_s=20)),
                    "step 5")
    result = _fit(node_logging_loop, storage_path, events, num_workers=3, strategy="SPREAD", steps=20)
    drainer.join()
    assert result.last_metrics == {"step": 19}
    assert ack["a"].node_ids == ["node-1", "node-2"]
    notices = [e for e in read_events(events) if e["event"] == "notice"]
    assert notices[0]["node_ids"] == ["node-1", "node-2"]
    assert sorted(notices[0]["ranks"]) == sorted(r for r, n in _placed(events, 1).items() if n != "node-0")
    assert set(_placed(events, 2).values()) == {"node-0"}
    states = {n.node_id: n.state for n in cluster.node_table()}
    assert states == {"node-0": "alive", "node-1": "draining", "node-2": "draining"}


def _relaxed_fit(storage_path, events, sharded=False):
    # No periodic checkpoint: the one saved after the notice is what the restart restores. Sharded,
    # two survivors save a shard each, so the lost rank is known to have held one too.
    return Trainer(relaxed_loop, train_loop_config={"events": str(events), "steps": 40, "step_sleep": 0.02,
                                                    "sharded": sharded},
                   scaling_config=ScalingConfig(num_workers=3 if sharded else 2, placement_strategy="SPREAD"),
                   run_config=RunConfig(name="run", storage_path=storage_path, failure_config=FailureConfig(
                       relax_collectives_on_preemption=True, max_failures=1))).fit()


def _kill_preempted_node(cluster, events, workers=2):
    """Once every rank has seen the notice, the node of rank 0 vanishes, as a spot machine does."""
    def run():
        wait_until(lambda: len([e for e in read_events(events) if e["event"] == "notice"]) >= workers, 60, "notices")
        starts = [e for e in read_events(events) if e["event"] == "start" and e["attempt"] == 1]
        cluster.kill_node(next(e["node_id"] for e in starts if e["rank"] == 0))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_rank_0_preempted_with_relaxed_collectives_the_survivor_commits_the_checkpoint(
        cluster, storage_path, tmp_path):
    events = tmp_path / "events.jsonl"
    rank0_node = {}

    def drain():
        starts = [e for e in read_events(events) if e["event"] == "start" and e["attempt"] == 1]
        rank0_node["id"] = next(e["node_id"] for e in starts if e["rank"] == 0)
        cluster.drain_node(rank0_node["id"], deadline_s=30)

    drainer = _when(events, _at_step(12), drain, "step 12")
    killer = _kill_preempted_node(cluster, events)
    result = _relaxed_fit(storage_path, events)
    drainer.join()
    killer.join()
    assert result.last_metrics["step"] == 39
    notice = next(e for e in read_events(events) if e["event"] == "notice" and e["rank"] == 1)
    assert notice["ranks"] == [0]
    # Rank 1 alone saved the just-in-time checkpoint, committed without rank 0's report.
    from outlast.storage.records import MANIFEST_NAME

    latest = Path(storage_path) / "run" / _state(storage_path)["latest_checkpoint"]
    assert json.loads((latest / MANIFEST_NAME).read_text())["ranks"] == [1]
    assert _checkpointed_step(storage_path) == notice["step"]
    restored = {e["restored_step"] for e in read_events(events) if e["event"] == "start" and e["attempt"] == 2}
    assert restored == {notice["step"]}
    assert _state(storage_path)["failure_counts"] == {"preemption": 1}


def test_a_sharded_checkpoint_missing_the_shard_of_a_preempted_rank_is_not_committed(
        cluster, storage_path, tmp_path):
    events = tmp_path / "events.jsonl"
    drainer = _when(events, _at_step(12), lambda: cluster.drain_node(
        next(e["node_id"] for e in read_events(events) if e["event"] == "start" and e["rank"] == 0),
        deadline_s=30), "step 12")
    killer = _kill_preempted_node(cluster, events, workers=3)
    result = _relaxed_fit(storage_path, events, sharded=True)
    drainer.join()
    killer.join()
    assert result.last_metrics["step"] == 39
    skipped = _state(storage_path)["skipped_checkpoints"]
    assert len(skipped) == 1 and "missing the shards of ranks [0] (lost with node" in skipped[0]["reason"]
    # The survivors waiting in report() were told why (the teardown may take them before they log it).
    failed = [e for e in read_events(events) if e["event"] == "commit_failed"]
    assert all(skipped[0]["reason"] in e["error"] for e in failed)
    restored = {e["restored_step"] for e in read_events(events) if e["event"] == "start" and e["attempt"] == 2}
    assert restored == {None}  # nothing whole was ever saved: from scratch
    assert _state(storage_path)["latest_checkpoint"] is None


@pytest.mark.parametrize("cluster", [{"num_nodes": 2}], indirect=True)
def test_a_run_waits_visibly_for_a_replacement_node_and_goes_on_when_one_joins(
        cluster, storage_path, tmp_path, monkeypatch):
    monkeypatch.setenv("OUTLAST_CAPACITY_TIMEOUT_S", "120")
    events = tmp_path / "events.jsonl"
    seen = {}

    def lose_a_node_then_replace_it():
        cluster.kill_node("node-1")
        state_file = Path(storage_path) / "run" / "run_state.json"
        wait_until(lambda: json.loads(state_file.read_text())["status"] == "waiting_for_capacity", 60,
                   "the run to say it waits for capacity")
        seen.update(json.loads(state_file.read_text()))
        cluster.add_node("node-2")

    replacer = _when(events, _at_step(8), lose_a_node_then_replace_it, "step 8")
    result = _fit(node_logging_loop, storage_path, events, strategy="STRICT_SPREAD", steps=20, max_failures=1)
    replacer.join()
    assert result.last_metrics == {"step": 19}
    assert "do not fit" in seen["waiting_for"] and "STRICT_SPREAD" in seen["waiting_for"]
    assert set(_placed(events, 2).values()) == {"node-0", "node-2"}
    assert _state(storage_path)["status"] == "finished" and _state(storage_path)["waiting_for"] is None


def test_sigterm_to_a_member_agent_drains_it_and_the_run_moves_before_it_stops(storage_path, tmp_path, monkeypatch):
    monkeypatch.setenv("OUTLAST_NODE_TIMEOUT_S", "2")
    monkeypatch.setenv("OUTLAST_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "30")  # inherited by the nodes
    with LocalCluster(num_nodes=3, node_timeout_s=2) as cluster:
        events = tmp_path / "events.jsonl"
        term = _when(events, _at_step(8), lambda: cluster.stop_node(_placed(events, 1)[1]), "step 8")
        result = _fit(node_logging_loop, storage_path, events, strategy="SPREAD", steps=30)
        term.join()
        stopped = _placed(events, 1)[1]
        assert result.last_metrics == {"step": 29}
        notices = [e for e in read_events(events) if e["event"] == "notice"]
        assert {e["rank"] for e in notices} == {0, 1} and notices[0]["reason"] == "shutdown"
        assert notices[0]["node_ids"] == [stopped] and stopped not in _placed(events, 2).values()
        assert {e["restored_step"] for e in read_events(events) if e["event"] == "start" and e["attempt"] == 2} \
            == {notices[0]["step"]}
        # Its workers gone, the node left long before its 30 s drain deadline.
        assert cluster.nodes[stopped].proc.wait(timeout=15) == 0


@pytest.mark.torch
@pytest.mark.parametrize("cluster", [{"num_nodes": 2}], indirect=True)
def test_ddp_spans_nodes_and_a_killed_node_resumes_it_on_the_other(cluster, storage_path, tmp_path):
    from outlast.train.torch import TorchTrainer
    from tests.integration.jobs import ddp_loop

    events = tmp_path / "events.jsonl"
    killer = _when(events, lambda evs: any(e["event"] == "step" and e["step"] >= 12 for e in evs),
                   lambda: cluster.kill_node("node-1"), "step 12")
    result = TorchTrainer(ddp_loop, train_loop_config={"events": str(events), "steps": 25, "every": 5},
                          scaling_config=ScalingConfig(num_workers=2, placement_strategy="SPREAD"),
                          run_config=RunConfig(name="run", storage_path=storage_path,
                                               failure_config=FailureConfig(max_failures=1))).fit()
    killer.join()
    assert result.last_metrics["step"] == 24
    starts = [e for e in read_events(events) if e["event"] == "start"]
    # From the run's history, not the ranks' events: the kill can land after a commit and before the
    # rank logs the step it committed.
    committed = [c["metrics"]["step"] for c in _state(storage_path)["checkpoints"] if c["attempt"] == 1]
    assert {e["restored_step"] for e in starts if e["attempt"] == 2} == {max(committed)}  # the last before the kill
    assert _state(storage_path)["attempts"][0]["failures"][0]["kind"] == "NodeLost"
