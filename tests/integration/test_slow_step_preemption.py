"""Preemption of loops whose steps are long (2 s and 10 s), as large models train: on a 3-node
LocalCluster, two DDP ranks SPREAD, rank 0's node drained with `outlast drain-node`. Every rank
sees the notice at the same call, at most one call after the drain, the just-in-time checkpoint
is saved, and the run moves to the spare node without losing a step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from outlast.testing import LocalCluster
from outlast.train import FailureConfig, RunConfig, ScalingConfig
from outlast.train.torch import TorchTrainer
from tests.integration.jobs import ddp_slow_preemptible_loop, read_events
from tests.integration.procs import wait_until

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.torch


def _drain_after_step(cluster, events, step: int, deadline_s: float, drained: dict) -> threading.Thread:
    def run():
        wait_until(lambda: any(e["event"] == "step" and e["step"] >= step and e["attempt"] == 1
                               for e in read_events(events)), 240, f"step {step}")
        node = next(e["node_id"] for e in read_events(events) if e["event"] == "placed" and e["rank"] == 0)
        done = subprocess.run(
            [sys.executable, "-m", "outlast.cli.main", "drain-node", "--node-id", node, "--reason", "preemption",
             "--reason-message", "spot instance reclaimed", "--deadline-remaining-seconds", str(deadline_s)],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
            env={**os.environ, "OUTLAST_ADDRESS": cluster.head_address,
                 "OUTLAST_CLUSTER_KEY": str(cluster.key_file)})
        drained.update(node=node, returned_at=time.time(), rc=done.returncode, err=done.stderr)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize(("step_s", "steps", "drain_after", "deadline_s"), [(2.0, 5, 1, 20.0), (10.0, 3, 0, 60.0)],
                         ids=["2s-steps-20s-deadline", "10s-steps-60s-deadline"])
def test_a_slow_loop_sees_the_notice_at_its_next_call_and_moves_with_its_jit_checkpoint(
        step_s, steps, drain_after, deadline_s, storage_path, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("OUTLAST_NODE_TIMEOUT_S", "5")
    events = tmp_path / "events.jsonl"
    drained: dict = {}
    with LocalCluster(num_nodes=3, preload=["torch", "torch.distributed"]) as cluster:
        cluster.wait_ready()
        drainer = _drain_after_step(cluster, events, drain_after, deadline_s, drained)
        result = TorchTrainer(
            ddp_slow_preemptible_loop, train_loop_config={"events": str(events), "steps": steps, "step_s": step_s},
            scaling_config=ScalingConfig(num_workers=2, placement_strategy="SPREAD"),
            run_config=RunConfig(name="run", storage_path=storage_path,
                                 failure_config=FailureConfig(max_failures=0))).fit()
        drainer.join()
    assert drained["rc"] == 0, drained["err"]
    evs = read_events(events)
    assert result.last_metrics == {"step": steps - 1}
    notices = [e for e in evs if e["event"] == "notice"]
    assert sorted(e["rank"] for e in notices) == [0, 1]
    assert len({e["step"] for e in notices}) == 1  # the same call on every rank
    assert notices[0]["node_ids"] == [drained["node"]] and notices[0]["ranks"] == [0]
    # From the moment the controller hears of the drain (not when the command returns: on a loaded
    # machine the command may take longer than a step to start and to end).
    heard = min(r.created for r in caplog.records if "is draining" in r.getMessage())
    for rank in (0, 1):
        after = [e for e in evs if e["event"] == "call" and e["rank"] == rank and e["attempt"] == 1
                 and e["t"] > heard]
        # The call in progress when the drain was heard may answer None; the next one is the notice.
        assert [e["notice"] for e in after][:2] in ([True], [True, True], [False, True]), after
    state = json.loads((Path(storage_path) / "run" / "run_state.json").read_text())
    jit = state["attempts"][1]["restored_from"]
    assert jit == [c for c in state["checkpoints"] if c["attempt"] == 1][-1]["checkpoint_dir"]
    placed_2 = {e["rank"]: e["node_id"] for e in evs if e["event"] == "placed" and e["attempt"] == 2}
    assert drained["node"] not in placed_2.values() and len(set(placed_2.values())) == 2
    restarts = {e["restored_step"] for e in evs if e["event"] == "start" and e["attempt"] == 2}
    assert restarts == {notices[0]["step"]}  # no step lost
    assert state["failure_counts"] == {"preemption": 1}
