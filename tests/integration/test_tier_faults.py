"""The memory tier's faults on real agents: what a run leaves in the tier at its end."""

from __future__ import annotations

from pathlib import Path

from outlast.testing import LocalCluster
from outlast.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig, Trainer
from tests.integration.jobs import counting_loop

MB = 2**20


def _fit(storage_path, events, storage: str, fault=None, pad_bytes=0):
    config = {"events": str(events), "steps": 10, "every": 3, "sharded": True, "delete_after_report": True,
              "step_sleep": 0.05, "pad_bytes": pad_bytes}
    if fault is not None:
        config["fault"] = fault
    return Trainer(counting_loop, train_loop_config=config,
                   scaling_config=ScalingConfig(num_workers=2, placement_strategy="SPREAD"),
                   run_config=RunConfig(name="run", storage_path=storage_path,
                                        failure_config=FailureConfig(max_failures=1),
                                        checkpoint_config=CheckpointConfig(checkpoint_storage=storage))).fit()


def _left_in(tier_dir: Path) -> list[str]:
    """What is under each node's tier directory but its owner file (and an empty directory of restores)."""
    return sorted(str(p.relative_to(tier_dir)) for p in tier_dir.glob("node-*/**/*")
                  if p.name != "owner.json" and not (p.name == "restores" and not any(p.iterdir())))


# ---- what a run leaves at its end -------------------------------------------------------------------------


def test_a_storage_run_that_restored_from_memory_leaves_nothing_of_itself_under_any_nodes_tier(
        monkeypatch, tmp_path, storage_path, capfd):
    monkeypatch.setenv("OUTLAST_NODE_TIMEOUT_S", "2")
    events = tmp_path / "events.jsonl"
    with LocalCluster(num_nodes=2, node_timeout_s=2, cpus_per_node=2, workdir=tmp_path / "cl") as cluster:
        result = _fit(storage_path, events, "storage", pad_bytes=MB,
                      fault={"rank": 1, "step": 6, "when": "after_report", "kind": "kill"})
        left = _left_in(cluster.tier_dir)
    assert result.last_metrics == {"step": 9}
    said = "".join(capfd.readouterr())
    assert "restored checkpoint_001_000005 from local_memory" in said, said[-3000:]
    # Neither its copies nor the links its restores made: those would keep the checkpoint's bytes in RAM.
    assert left == [], left
