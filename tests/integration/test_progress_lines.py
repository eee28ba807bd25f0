"""The driver says what a run waits on, in plain log lines when stderr is not a terminal: a
preemption with its deadline (and the driver's metrics count it, with its notice-to-commit time),
capacity that is missing."""

from __future__ import annotations

import logging

import pytest

from outlast.controller.metrics import DriverMetrics
from outlast.testing import LocalCluster
from outlast.train import FailureConfig, RunConfig, ScalingConfig, Trainer, TrainingFailedError
from tests.integration.jobs import counting_loop, node_logging_loop
from tests.integration.test_metrics import scrape, value
from tests.integration.test_multinode import _at_step, _fit, _placed, _when


def _progress(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "outlast.progress"]


def test_a_preemption_is_shown_with_its_deadline_and_counted(tmp_path, caplog, monkeypatch):
    monkeypatch.setenv("OUTLAST_DRIVER_METRICS_PORT", "0")
    events, storage = tmp_path / "events.jsonl", str(tmp_path / "storage")
    with LocalCluster(num_nodes=3, node_timeout_s=2) as cluster, caplog.at_level(logging.INFO):
        drainer = _when(events, _at_step(10),
                        lambda: cluster.drain_node(_placed(events, 1)[1], deadline_s=20, message="spot reclaimed"),
                        "step 10")
        result = _fit(node_logging_loop, storage, events, strategy="SPREAD", steps=150)
        drainer.join()
    assert result.last_metrics == {"step": 149}
    lines = _progress(caplog)
    assert any(line.startswith("preemption of node(s) node-") and "restart in at most" in line for line in lines)
    after = scrape(DriverMetrics.serving())
    assert value(after, "outlast_run_preemptions_total", run="run") == 1
    assert value(after, "outlast_run_preemption_notice_to_commit_seconds_count", run="run") == 1


def test_missing_capacity_is_shown_with_what_is_missing(tmp_path, caplog, monkeypatch):
    monkeypatch.setenv("OUTLAST_CAPACITY_TIMEOUT_S", "2")
    with LocalCluster(num_nodes=1, cpus_per_node=1) as _cluster, caplog.at_level(logging.INFO):
        with pytest.raises(TrainingFailedError):
            Trainer(node_logging_loop, train_loop_config={"events": str(tmp_path / "e"), "steps": 1},
                    scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 4}),
                    run_config=RunConfig(name="too-big", storage_path=str(tmp_path / "storage"))).fit()
    lines = _progress(caplog)
    assert lines and lines[0].startswith("waiting for capacity: ") and "CPU" in lines[0]
    assert "gives up in" in lines[0]


def test_a_restore_fetched_from_object_storage_shows_its_bytes(s3, tmp_path, caplog):
    """The first report of a fetch comes before its last: every fetch from object storage is shown."""
    events = tmp_path / "events.jsonl"
    with caplog.at_level(logging.INFO):
        result = Trainer(counting_loop,
                         train_loop_config={"events": str(events), "steps": 8, "every": 5, "pad_bytes": 8 << 20,
                                            "fault": {"rank": 1, "step": 6, "when": "before_report", "kind": "kill"}},
                         scaling_config=ScalingConfig(num_workers=2),
                         run_config=RunConfig(name="fetched", storage_path="s3://runs/progress",
                                              failure_config=FailureConfig(max_failures=1))).fit()
    assert result.last_metrics == {"step": 7}
    lines = [line for line in _progress(caplog) if line.startswith("restoring checkpoint_001_000004: ")]
    assert lines and all(" of 8.0 MiB fetched (" in line for line in lines)
    assert "no longer waiting for restore" in _progress(caplog)
