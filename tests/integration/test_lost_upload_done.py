"""The run's last checkpoint, uploaded in the background, is committed even when its upload thread's done
message never reaches the driver: the driver finds the files the upload began with in storage itself."""

from __future__ import annotations

import json
from pathlib import Path

from outlast.storage import open_storage
from outlast.storage.run_store import RunStore
from outlast.train import RunConfig, ScalingConfig, Trainer
from tests.integration.jobs import counting_loop


def test_the_last_asynchronous_checkpoint_is_committed_when_every_upload_done_message_is_lost(tmp_path, monkeypatch):
    monkeypatch.setenv("OUTLAST_FAULT_POINTS", "upload.done_message=drop")
    storage_path = str(tmp_path / "storage")
    config = {"events": str(tmp_path / "events.jsonl"), "steps": 4, "every": 2, "sharded": True,
              "pad_bytes": 1 << 20, "upload_mode": "ASYNC"}
    result = Trainer(counting_loop, train_loop_config=config, scaling_config=ScalingConfig(num_workers=2),
                     run_config=RunConfig(name="run", storage_path=storage_path)).fit()
    assert result.checkpoint is not None and result.checkpoint.path.endswith("checkpoint_001_000003")
    store = RunStore(open_storage(storage_path), "run")
    assert store.load_state().latest_checkpoint == "checkpoint_001_000003"
    manifest = store.read_manifest("checkpoint_001_000003")
    assert sorted(f.path for f in manifest.files) == ["pad.bin", "state.json", "state_rank0.json", "state_rank1.json"]
    stored = Path(storage_path) / "run" / "checkpoint_001_000003"
    assert json.loads((stored / "state_rank1.json").read_text()) == {"step": 3}
    # ... and a restore checks the files against the checksums the driver took of them.
    with result.checkpoint.as_directory() as d:
        assert json.loads((Path(d) / "state.json").read_text()) == {"step": 3}
