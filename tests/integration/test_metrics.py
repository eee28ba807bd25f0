"""Prometheus metrics, scraped for real: every node's endpoint and the driver's, over HTTP, parsed
with the client library's own parser; the counters move as a run trains, fails and restores."""

from __future__ import annotations

import json
import math
import os
import signal
import tempfile
import threading
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from outlast.controller.metrics import DriverMetrics
from outlast.protocol import messages as m
from outlast.testing import LocalCluster
from outlast.train import FailureConfig, RunConfig, ScalingConfig, Trainer
from tests.integration.jobs import _restored_start, log_event, read_events
from tests.integration.procs import wait_until


def gated_loop(config: dict) -> None:
    """Checkpoints every 5 steps; in attempt 1, rank 1 dies at `kill_step` once the file `go` exists, so
    the test has read the metrics of a run that has not failed yet."""
    from outlast import train
    from outlast.train import Checkpoint

    ctx = train.get_context()
    start, _ = _restored_start()
    for step in range(start, config["steps"]):
        train.collective.barrier()
        if step == config["kill_step"] and ctx.get_world_rank() == 1 and ctx.get_attempt() == 1:
            while not os.path.exists(config["go"]):
                time.sleep(0.02)
            os.kill(os.getpid(), signal.SIGKILL)
        checkpoint = None
        if (step + 1) % 5 == 0 and ctx.get_world_rank() == 0:
            d = tempfile.mkdtemp()
            with open(os.path.join(d, "state.json"), "w") as f:
                json.dump({"step": step}, f)
            with open(os.path.join(d, "pad.bin"), "wb") as f:
                f.write(b"\0" * 4096)
            checkpoint = Checkpoint.from_directory(d)
        train.report({"step": step}, checkpoint=checkpoint)
        log_event(config, event="step", step=step)


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, from a real GET of the endpoint."""
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples, name: str, **labels) -> float:
    """The sum of the samples named `name` whose labels include `labels`."""
    return sum(v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items())


def node_urls(cluster: LocalCluster) -> list[str]:
    urls = []
    for node in cluster.nodes.values():
        reply = cluster._request(node.address, m.StatusRequest())
        assert reply.metrics_url.startswith("http://127.0.0.1:")  # loopback unless told otherwise
        urls.append(reply.metrics_url)
    return urls


@pytest.fixture
def cluster(monkeypatch):
    monkeypatch.setenv("OUTLAST_METRICS_PORT", "0")  # any free port: one per node
    monkeypatch.setenv("OUTLAST_DRIVER_METRICS_PORT", "0")
    with LocalCluster(num_nodes=2, node_timeout_s=3) as c:
        c.wait_ready(60)
        yield c


def test_both_endpoints_count_a_run_that_trains_fails_and_restores(cluster, tmp_path):
    nodes = node_urls(cluster)
    for url in nodes:
        wait_until(lambda: value(scrape(url), "outlast_node_fork_server_ready") == 1, 30, "fork server ready")  # noqa: B023 - called before the loop goes on
    events = tmp_path / "events.jsonl"
    mid_run: dict[str, dict] = {}
    go = tmp_path / "go"

    def watch() -> None:  # while attempt 1 trains, before its rank 1 is killed
        try:
            wait_until(lambda: any(e["event"] == "step" and e["step"] >= 4 and e["attempt"] == 1
                                   for e in read_events(events)), 120, "attempt 1 at step 4")
            # attempt 1 cannot fail before `go` exists: what is read here is a run that has not failed. The
            # driver splits the goodput again only once ten times the split's own cost has passed
            # (controller/metrics.py), so a scrape just after a report may show the split of the report before:
            # the one kept is the first that counts a productive step.
            def productive() -> bool:
                mid_run["driver"] = scrape(DriverMetrics.serving())
                return value(mid_run["driver"], "outlast_run_goodput_seconds", part="productive", run="scraped") > 0
            wait_until(productive, 60, "a scrape whose goodput counts a productive step")
            # the nodes read their workloads once a second: wait for a reading with both ranks in it
            wait_until(lambda: sum(value(scrape(url), "outlast_node_workers", kind="worker") for url in nodes) == 2,
                       60, "both ranks' workers counted by their nodes")
            mid_run["nodes_saw_both"] = True
        finally:
            go.touch()  # whatever happened here, the run goes on (and the asserts below say what was missed)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    Trainer(gated_loop, train_loop_config={"events": str(events), "steps": 30, "kill_step": 12, "go": str(go)},
            scaling_config=ScalingConfig(num_workers=2, placement_strategy="SPREAD"),
            run_config=RunConfig(name="scraped", storage_path=str(tmp_path / "storage"),
                                 failure_config=FailureConfig(max_failures=1))).fit()
    watcher.join(10)
    run = {"run": "scraped"}

    assert "driver" in mid_run, "the driver's endpoint was not read while attempt 1 trained"
    before = mid_run["driver"]
    assert value(before, "outlast_run_steps_reported_total", **run) >= 4
    assert value(before, "outlast_run_attempts_total", **run) == 1
    assert value(before, "outlast_run_failures_total", **run) == 0
    assert value(before, "outlast_run_restores_total", **run) == 0
    assert mid_run.get("nodes_saw_both")
    # goodput while the run lives: its parts add up to the held time in one scrape, the step in flight included
    assert value(before, "outlast_run_held_seconds", **run) > 0
    assert value(before, "outlast_run_goodput_seconds", part="productive", **run) > 0
    assert math.isclose(value(before, "outlast_run_goodput_seconds", **run),
                        value(before, "outlast_run_held_seconds", **run), rel_tol=1e-9)

    after = scrape(DriverMetrics.serving())
    assert value(after, "outlast_run_steps_reported_total", **run) > value(before, "outlast_run_steps_reported_total",
                                                                           **run)
    assert value(after, "outlast_run_attempts_total", **run) == 2
    assert value(after, "outlast_run_failures_total", **run) == 1
    assert value(after, "outlast_run_restores_total", **run) == 1
    commits = value(after, "outlast_run_checkpoints_committed_total", **run)
    assert commits >= 6  # steps 4, 9 in attempt 1; then 14 .. 29 after the restore from 9
    assert value(after, "outlast_run_report_latency_seconds_count", **run) == commits
    assert value(after, "outlast_run_commit_latency_seconds_count", **run) == commits
    assert value(after, "outlast_run_checkpoint_bytes_total", **run) >= commits * 4096
    assert value(after, "outlast_run_checkpoint_upload_bytes_per_second", **run) > 0
    assert math.isclose(value(after, "outlast_run_goodput_seconds", **run),
                        value(after, "outlast_run_held_seconds", **run), rel_tol=1e-9)
    assert value(after, "outlast_run_goodput_seconds", part="restarts", **run) > 0  # the kill's
    assert value(after, "outlast_run_goodput_seconds", part="in_flight", **run) == 0  # every attempt has ended
    assert 0 < value(after, "outlast_run_goodput_ratio", **run) < 1
    for url in nodes:  # the workers are gone once the run is over
        wait_until(lambda: value(scrape(url), "outlast_node_workers", kind="worker") == 0, 30, "workers gone")  # noqa: B023 - called before the loop goes on


def test_metrics_are_off_unless_asked_for(monkeypatch):
    monkeypatch.delenv("OUTLAST_METRICS_PORT", raising=False)
    with LocalCluster(num_nodes=1) as cluster:
        assert cluster._request(cluster.head_address, m.StatusRequest()).metrics_url == ""
