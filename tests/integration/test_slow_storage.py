"""Storage slower than the agent's patience with a silent driver: the controller's loop never
waits on storage, so its heartbeats go on and no worker is killed for its silence."""

from __future__ import annotations

from outlast.storage import open_storage
from outlast.storage.run_store import RunStore
from outlast.train import FailureConfig, RunConfig, ScalingConfig, Trainer, CheckpointConfig
from tests.integration.jobs import read_events
from tests.integration.slow_fs import DELETE_S_VAR, counting_loop_on_slow_storage


def test_deletes_slower_than_the_driver_timeout_kill_no_worker(tmp_path, monkeypatch):
    monkeypatch.setenv("OUTLAST_DRIVER_TIMEOUT_S", "2")
    monkeypatch.setenv(DELETE_S_VAR, "8")
    events = tmp_path / "events.jsonl"
    storage_path = f"slowrm://{tmp_path}/storage"
    result = Trainer(
        counting_loop_on_slow_storage,
        train_loop_config={"events": str(events), "steps": 6, "every": 2, "step_sleep": 0.5},
        scaling_config=ScalingConfig(num_workers=1),
        run_config=RunConfig(name="run", storage_path=storage_path, failure_config=FailureConfig(max_failures=0),
                             checkpoint_config=CheckpointConfig(num_to_keep=1)),
    ).fit()
    assert result.checkpoint is not None and result.checkpoint.path.endswith("checkpoint_001_000005")
    state = RunStore(open_storage(storage_path), "run").load_state()
    assert state.status == "finished"
    assert [a.outcome for a in state.attempts] == ["finished"] and state.failure_counts == {}
    assert [c.checkpoint_dir for c in state.checkpoints] == ["checkpoint_001_000005"]
    assert {e["event"] for e in read_events(events)} >= {"start", "end"}
    # Retention's deletes were carried out, each after its 8 s, before fit() returned.
    assert sorted(p.name for p in (tmp_path / "storage" / "run").iterdir() if p.name.startswith("checkpoint_")) \
        == ["checkpoint_001_000005"]
