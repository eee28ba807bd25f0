"""What the dashboard's pages say, worked out from a run's history and rank 0's reports."""

from __future__ import annotations

import math

from outlast.cli.dashboard import views
from outlast.protocol import messages as m
from outlast.storage.records import (
    AttemptRecord, CheckpointRecord, DrainRecord, FailureRecord, ReportEntry, ResizeRecord, RunState,
)


def _reports(n: int, t0: float, **extra) -> list[ReportEntry]:
    return [ReportEntry(index=i, time=t0 + i, metrics={"loss": 1.0 / (i + 1), **extra}) for i in range(n)]


def _story() -> tuple[RunState, dict[int, list[ReportEntry]]]:
    kill = FailureRecord(attempt=1, rank=1, node_id="node-1", pid=7, exit_code=None, signal=9, time=112.0)
    state = RunState(
        name="r", status="finished", created_at=100.0, updated_at=200.0,
        attempts=[AttemptRecord(attempt=1, started_at=100.0, ended_at=112.0, outcome="failed", failures=[kill],
                                workers=3),
                  AttemptRecord(attempt=2, started_at=113.0, ended_at=150.0, outcome="resized",
                                restored_from="checkpoint_001_000004", workers=3),
                  AttemptRecord(attempt=3, started_at=151.0, ended_at=190.0, outcome="finished",
                                restored_from="checkpoint_002_000009", workers=2)],
        checkpoints=[CheckpointRecord(checkpoint_dir="checkpoint_001_000004", seq=1, attempt=1, report_index=4,
                                      committed_at=105.0),
                     CheckpointRecord(checkpoint_dir="checkpoint_002_000009", seq=2, attempt=2, report_index=9,
                                      committed_at=123.0)],
        drains=[DrainRecord(attempt=2, node_ids=["node-2"], reason="preemption", message="spot", time=140.0,
                            deadline=170.0, ranks=[2])],
        resizes=[ResizeRecord(attempt=3, from_workers=3, to_workers=2, reason="node node-2 drained", steps_lost=2,
                              time=151.0)],
        failure_counts={"worker": 1})
    return state, {1: _reports(8, 100.0), 2: _reports(12, 113.0), 3: _reports(5, 151.0, note="text")}


def test_steps_go_on_from_the_restored_checkpoint_and_every_report_is_a_point():
    state, reports = _story()
    s = views.series(state, reports)
    assert len(s["time"]) == 8 + 12 + 5
    # attempt 2 restored report 4 of attempt 1: its first report is step 5; attempt 3 restored report 9 of
    # attempt 2 (step 14): its first is step 15.
    assert s["step"][:8] == list(range(8)) and s["step"][8] == 5 and s["step"][20] == 15
    assert s["attempt"] == [1] * 8 + [2] * 12 + [3] * 5
    assert s["names"] == ["loss"]  # a text metric is not charted
    assert len(s["values"]["loss"]) == 25 and None not in s["values"]["loss"]


def test_a_reported_step_metric_is_the_step_and_a_metric_first_seen_later_is_padded():
    state = RunState(name="r", status="running", created_at=0.0, updated_at=0.0,
                     attempts=[AttemptRecord(attempt=1, started_at=0.0)])
    reports = {1: [ReportEntry(index=0, time=1.0, metrics={"step": 100}),
                   ReportEntry(index=1, time=2.0, metrics={"step": 200, "acc": 0.5}),
                   ReportEntry(index=2, time=3.0, metrics={"step": 300, "acc": float("nan")})]}
    s = views.series(state, reports)
    assert s["step"] == [100, 200, 300]
    acc = s["values"]["acc"]  # NaN is drawn as what it is (a diverging metric must show), not as a gap
    assert acc[:2] == [None, 0.5] and math.isnan(acc[2])
    assert s["values"]["step"] == [100, 200, 300]


def test_steps_lost_count_the_reports_after_the_restored_checkpoint_and_a_resize_says_its_own():
    state, reports = _story()
    lost = views.steps_lost(state, reports)
    assert lost[2] == 8 - 5  # attempt 1 made reports 0..7; checkpoint 4 kept 0..4
    assert lost[3] == 2  # the resize's own count


def test_the_run_view_names_the_failure_the_drain_window_and_draws_a_running_attempt_to_now():
    state, reports = _story()
    v = views.run_view(state, "/s/r", reports, now=300.0)
    assert [a["workers"] for a in v["attempts"]] == [3, 3, 2]
    (f,) = v["attempts"][0]["failures"]
    assert (f["rank"], f["signal"], f["cause"]) == (1, "SIGKILL", "killed by SIGKILL")
    assert v["drains"] == [{"attempt": 2, "start": 140.0, "deadline": 170.0, "node_ids": ["node-2"],
                            "reason": "preemption", "message": "spot", "ranks": [2]}]
    assert [r["attempt"] for r in v["restores"]] == [2, 3]
    assert v["checkpoints"][-1]["latest"] is False and v["resizes"][0]["steps_lost"] == 2
    state.attempts.append(AttemptRecord(attempt=4, started_at=250.0))
    v = views.run_view(state, "/s/r", reports, now=300.0)
    assert v["attempts"][-1]["outcome"] == "running" and v["attempts"][-1]["drawn_to"] == 300.0


def test_a_cause_says_what_ended_the_rank():
    base = dict(attempt=1, rank=0, node_id="n", pid=1, time=0.0)
    assert views.failure_view(FailureRecord(**base, exit_code=3, signal=None))["cause"] == "exit code 3"
    assert views.failure_view(FailureRecord(**base, exit_code=1, signal=None, exc_type="ValueError",
                                            message="bad"))["cause"] == "ValueError: bad"
    assert views.failure_view(FailureRecord(**base, exit_code=None, signal=9,
                                            oom_report="chose it"))["cause"] == "killed for memory"


def test_the_cluster_view_counts_down_a_drain_and_says_why_a_node_was_not_asked():
    drain = m.NodeDraining(node_id="b", reason="maintenance", message="kernel", deadline_unix_s=1030.0)
    nodes = [m.NodeInfo(node_id="a", address="tcp://a", host="a", resources={"CPU": 2}, is_head=True,
                        used={"run1": {"CPU": 1}}, last_seen_unix=999.0),
             m.NodeInfo(node_id="b", address="tcp://b", host="b", resources={"CPU": 2}, state="draining",
                        draining=drain, last_seen_unix=1000.0),
             m.NodeInfo(node_id="c", address="tcp://c", host="c", resources={}, state="dead", last_seen_unix=900.0)]
    v = views.cluster_view(nodes, {"b": "no answer within 2 s"}, now=1000.0, reached_through="tcp://a")
    a, b, c = v["nodes"]
    assert b["draining"]["left_s"] == 30.0 and b["draining"]["reason"] == "maintenance"
    assert b["status_error"] == "no answer within 2 s"
    assert c["state"] == "dead" and c["silent_s"] == 100.0
    assert a["used"] == {"run1": {"CPU": 1}}
    assert v["counts"] == {"alive": 1, "draining": 1, "dead": 1}


def test_a_nodes_own_status_gives_its_workers_memory_against_reservations_and_its_kill_reports():
    node = m.NodeInfo(node_id="a", address="tcp://a", host="a", resources={"CPU": 2})
    worker = m.WorkerInfo(run_id="run1", attempt=2, rank=0, pid=11, rss_bytes=5 << 20, memory_bytes=3 << 30,
                          resources=m.Resources(num_cpus=1.0, memory_bytes=2 << 30))
    kill = m.KillReport(node_id="a", time=990.0, trigger="memory.high", usage_bytes=9, limit_bytes=8,
                        node_total_bytes=16, target_bytes=7, policy="least work lost", considered=[],
                        selected=["run1-r0"], reason="the least work since its last checkpoint")
    status = m.StatusReply(node_id="a", pid=1, address="tcp://a", started_at=0.0, runs=["run1"], workers=[worker],
                           preload=[], zygote_ready=True, recent_kills=[kill],
                           isolation=m.IsolationInfo(cgroup_version=2, root="/x", total_memory=16, system_reserved_memory=2,
                                                     user_limit=8, total_cpus=2, system_reserved_cpus=0.5,
                                                     system_memory=1, user_memory=6, counted_memory=6, monitors=[],
                                                     kills=1))
    (row,) = views.cluster_view([node], {"a": status}, now=1000.0, reached_through="tcp://a")["nodes"]
    assert row["workers"] == [{"run_id": "run1", "attempt": 2, "rank": 0, "pid": 11, "rss_bytes": 5 << 20,
                               "memory_bytes": 3 << 30, "reserved_memory": 2 << 30}]
    assert row["isolation"]["counted_memory"] == 6 and row["isolation"]["user_limit"] == 8
    assert row["kills"][0]["selected"] == ["run1-r0"] and row["kills"][0]["reason"].startswith("the least work")
