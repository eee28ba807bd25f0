"""The chaos harness (`bench/chaos.py`) in CI, and the bugs it found, each guarded on its own.

The CI run injects 20 faults, every kind at least twice (node lost, short and long partitions, a
drain with a deadline, the S3 server killed and started again, storage slowed past the driver
timeout, the driver killed with an asynchronous upload in flight, a rank that starts a daemon of
its own), on nodes with resource isolation on. It takes about 3 minutes on two quiet cores (each
fault that ends an attempt costs a restart) and more under load, so `scripts/test` runs it in the
session of the pure tests, which ends first. The 100-fault runs are benchmarks
(`bench/results/chaos-100-seed*.json`, docs/chaos.md).
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from tests.integration.jobs import counting_loop, read_events
from tests.integration.netns import unavailable_reason


@pytest.mark.torch
@pytest.mark.timeout(1500)
@pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")
def test_twenty_faults_of_every_kind_on_a_cluster_and_nothing_lost(tmp_path):
    from bench.chaos import run

    result = run(seed=7, n=20, workdir=tmp_path)
    print(json.dumps({k: result[k] for k in ("mix", "clean_s", "chaos_s", "attempts", "failure_counts",
                                             "promises")}))
    assert len(result["mix"]) == 8 and min(result["mix"].values()) >= 2
    assert result["isolation"] == "on", result["isolation"]  # else the cgroup promise would hold trivially
    assert result["ok"], json.dumps(result["promises"], indent=1) + "\n" + json.dumps(result["history"], indent=1)


@pytest.fixture
def slow_s3(monkeypatch, tmp_path):
    """The chaos harness's S3 server on loopback, which can delay every request."""
    from bench.chaos_store import ObjectStore

    store = ObjectStore("127.0.0.1", bucket="runs", workdir=tmp_path / "s3")
    for k, v in store.env().items():
        monkeypatch.setenv(k, v)
    yield store
    store.close()


def test_storage_slower_than_the_driver_timeout_does_not_silence_the_driver(slow_s3, tmp_path, monkeypatch):
    from outlast.train import FailureConfig, RunConfig, ScalingConfig, Trainer

    monkeypatch.setenv("OUTLAST_DRIVER_TIMEOUT_S", "2")
    events = str(tmp_path / "events.jsonl")

    def slow_down() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(e["event"] == "step" and e["step"] >= 3
                                                      for e in read_events(events)):
            time.sleep(0.02)
        slow_s3.delay_s = 3.0  # each request held past the driver timeout
        time.sleep(8.0)
        slow_s3.delay_s = 0.0

    slower = threading.Thread(target=slow_down, daemon=True)
    slower.start()
    result = Trainer(counting_loop, train_loop_config={"events": events, "steps": 60, "every": 100,
                                                       "step_sleep": 0.2},
                     scaling_config=ScalingConfig(num_workers=2),
                     run_config=RunConfig(name="slow", storage_path="s3://runs/x",
                                          failure_config=FailureConfig(max_failures=0))).fit()
    slower.join(timeout=30)
    assert result.last_metrics == {"step": 59}
    assert {e["attempt"] for e in read_events(events)} == {1}
