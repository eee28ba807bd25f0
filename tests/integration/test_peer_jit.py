"""A drain's just-in-time checkpoint through a peer, on real nodes and a real S3 server slowed down: the
checkpoint the loop saves for the notice is committed in memory on a node that is not draining before the
deadline, though storage could not take it in time, the run restarts from it at once with no step lost,
and the checkpoint becomes durable afterwards, uploaded from the peer's memory after the drained node is
gone."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from outlast.storage.records import MANIFEST_NAME
from outlast.testing import LocalCluster
from outlast.train import FailureConfig, RunConfig, ScalingConfig, Trainer
from tests.integration.jobs import preemptible_loop, read_events
from tests.integration.procs import wait_until
from tests.integration.throttle import Throttle

ROOT = Path(__file__).resolve().parents[2]
PAD = 12 << 20
RATE_BPS = 1e6  # the store's uplink once the drain comes: the pad needs over 12 s, the manifest a few ms
DEADLINE_S = 5.0


class SlowS3:
    """The tests' moto server behind a proxy whose uploads go at `rate_bps`; reads here go around it."""

    def __init__(self, endpoint: str) -> None:
        import boto3

        host, port = endpoint.rsplit("//", 1)[1].split(":")
        self.proxy = Throttle((host, int(port)))
        self.endpoint = f"http://127.0.0.1:{self.proxy.port}"
        self._client = boto3.client("s3", endpoint_url=endpoint)

    def read(self, key: str) -> bytes:
        return self._client.get_object(Bucket="runs", Key=key)["Body"].read()

    def keys(self, prefix: str) -> list[str]:
        pages = self._client.get_paginator("list_objects_v2").paginate(Bucket="runs", Prefix=prefix)
        return [o["Key"] for page in pages for o in page.get("Contents", [])]


@pytest.fixture
def slow_s3(s3, monkeypatch):
    store = SlowS3(os.environ["AWS_ENDPOINT_URL"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", store.endpoint)
    yield store
    store.proxy.close()


def test_a_drains_checkpoint_commits_in_a_peers_memory_before_the_deadline_and_is_durable_later(
        slow_s3, monkeypatch, tmp_path, capfd, caplog):
    caplog.set_level(logging.INFO, logger="outlast")
    monkeypatch.setenv("OUTLAST_NODE_TIMEOUT_S", "2")
    events = tmp_path / "events.jsonl"
    seen: dict = {}
    with LocalCluster(num_nodes=3, node_timeout_s=2, cpus_per_node=1, workdir=tmp_path / "cl") as cluster:
        def drain_then_kill():
            wait_until(lambda: any(e["event"] == "step" and e["step"] >= 5 for e in read_events(events)), 90,
                       "step 5")
            node = next(e["node_id"] for e in read_events(events) if e["event"] == "start" and e["rank"] == 0)
            seen["drained"] = node
            slow_s3.proxy.rate_bps = RATE_BPS
            cluster.drain_node(node, deadline_s=DEADLINE_S)
            wait_until(lambda: any(e["event"] == "start" and e["attempt"] == 2 for e in read_events(events)), 60,
                       "attempt 2")
            manifests = [k for k in slow_s3.keys("x/run/") if k.endswith(MANIFEST_NAME)]
            seen["manifest_then"] = json.loads(slow_s3.read(manifests[-1]))
            cluster.kill_node(node)  # gone: its peer's memory is what storage gets the checkpoint from

        thread = threading.Thread(target=drain_then_kill, daemon=True)
        thread.start()
        result = Trainer(preemptible_loop,
                         train_loop_config={"events": str(events), "steps": 40, "step_sleep": 0.05, "pad_bytes": PAD},
                         scaling_config=ScalingConfig(num_workers=2, placement_strategy="SPREAD"),
                         run_config=RunConfig(name="run", storage_path="s3://runs/x",
                                              failure_config=FailureConfig(max_failures=0))).fit()
        thread.join()
    said = "".join(capfd.readouterr()) + caplog.text
    assert result.last_metrics == {"step": 39}
    notice = next(e for e in read_events(events) if e["event"] == "notice" and e["rank"] == 0)
    starts = [e for e in read_events(events) if e["event"] == "start" and e["attempt"] == 2]
    # No step lost: attempt 2 goes on from the step the notice's checkpoint was saved at.
    assert [e["restored_step"] for e in starts] == [notice["step"], notice["step"]], said[-4000:]
    assert "saved after the notice, is committed and the run has room elsewhere; restarting now" in said
    assert "the preemption deadline has passed" not in said
    # Committed in memory while storage had the manifest alone; the restore read memory.
    then = seen["manifest_then"]
    assert then["durable"] is False and seen["drained"] in then["memory"] and len(then["memory"]) == 2
    assert "from storage" not in said
    state = json.loads(slow_s3.read("x/run/run_state.json"))
    record = next(r for r in state["checkpoints"] if r["checkpoint_dir"] == then["checkpoint_dir"])
    assert record["durable"] is True and record["memory_at"]
    manifest = json.loads(slow_s3.read(f"x/run/{then['checkpoint_dir']}/{MANIFEST_NAME}"))
    assert manifest["durable"] is True
    assert len(slow_s3.read(f"x/run/{then['checkpoint_dir']}/pad.bin")) == PAD
    peer = next(n for n in then["memory"] if n != seen["drained"])
    assert f"uploaded from the memory of {peer}" in said
    assert any("committed in memory for the drain, is durable" in n["text"] for n in state["notes"])
    # A driver started after that reads the run as its history has it: durable.
    shown = subprocess.run([sys.executable, "-m", "outlast.cli.main", "runs", "s3://runs/x", "run"], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    line = next(x for x in shown.stdout.splitlines() if x.strip().startswith(then["checkpoint_dir"]))
    assert "durable" in line, shown.stdout + shown.stderr


def test_a_drains_checkpoint_whose_both_holders_die_before_its_upload_falls_back_to_the_newest_durable_one(
        slow_s3, monkeypatch, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="outlast")
    monkeypatch.setenv("OUTLAST_NODE_TIMEOUT_S", "2")
    events = tmp_path / "events.jsonl"
    seen: dict = {}
    with LocalCluster(num_nodes=4, node_timeout_s=2, cpus_per_node=1, workdir=tmp_path / "cl") as cluster:
        def drain_then_kill_both_holders():
            wait_until(lambda: any(e["event"] == "step" and e["step"] >= 7 for e in read_events(events)), 90,
                       "step 7")
            node = next(e["node_id"] for e in read_events(events) if e["event"] == "start" and e["rank"] == 0)
            slow_s3.proxy.rate_bps = RATE_BPS / 4  # the notice's checkpoint needs 50 s to reach storage
            cluster.drain_node(node, deadline_s=DEADLINE_S)
            wait_until(lambda: any(e["event"] == "start" and e["attempt"] == 2 for e in read_events(events)), 60,
                       "attempt 2")
            state = json.loads(slow_s3.read("x/run/run_state.json"))
            jit = state["checkpoints"][-1]
            seen["jit"] = jit
            for holder in jit["memory"]:
                cluster.kill_node(holder)
            # Attempt 2 fails with the holder it ran on, or at the next kill of one of its ranks.
            starts = [e for e in read_events(events) if e["event"] == "start" and e["attempt"] == 2]
            survivor = [e for e in starts if e["node_id"] not in jit["memory"]]
            if len(survivor) == len(starts):
                os.kill(survivor[0]["pid"], signal.SIGKILL)

        thread = threading.Thread(target=drain_then_kill_both_holders, daemon=True)
        thread.start()
        result = Trainer(preemptible_loop,
                         train_loop_config={"events": str(events), "steps": 30, "step_sleep": 0.3, "every": 6,
                                            "pad_bytes": PAD},
                         scaling_config=ScalingConfig(num_workers=2, placement_strategy="SPREAD"),
                         run_config=RunConfig(name="run", storage_path="s3://runs/x",
                                              failure_config=FailureConfig(max_failures=1))).fit()
        thread.join()
    assert result.last_metrics == {"step": 29}
    jit = seen["jit"]
    # Its two holders, and any node that pulled a copy for a restore since (it holds one too).
    assert jit["durable"] is False and len(jit["memory"]) >= 2
    notice = next(e for e in read_events(events) if e["event"] == "notice" and e["rank"] == 0)
    assert jit["metrics"] == {"step": notice["step"]}
    starts = [e for e in read_events(events) if e["event"] == "start" and e["attempt"] == 3]
    # The newest durable checkpoint is step 5's: the steps after it are done again.
    assert [e["restored_step"] for e in starts] == [5, 5]
    state = json.loads(slow_s3.read("x/run/run_state.json"))
    (skipped,) = [s for s in state["skipped_checkpoints"] if s["checkpoint_dir"] == jit["checkpoint_dir"]]
    assert "whose upload from memory was not in yet" in skipped["reason"]
    assert f"the {jit['report_index'] - 5} reports between them" in skipped["reason"], skipped["reason"]
    assert any(f"checkpoint {jit['checkpoint_dir']} stays committed in memory only" in n["text"]
               for n in state["notes"])
