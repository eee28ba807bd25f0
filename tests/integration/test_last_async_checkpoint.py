"""The run's last checkpoint, uploaded in the background as the loop's last act, is committed: the
upload thread's done message gets out before its worker exits."""

from __future__ import annotations

import json
from pathlib import Path

from outlast.storage import open_storage
from outlast.storage.run_store import RunStore
from outlast.train import RunConfig, ScalingConfig, Trainer
from tests.integration.jobs import counting_loop


def test_an_asynchronous_upload_as_the_loops_last_act_is_committed_every_time(tmp_path):
    storage_path = str(tmp_path / "storage")
    for run in range(3):
        config = {"events": str(tmp_path / f"events{run}.jsonl"), "steps": 4, "every": 2, "sharded": True,
                  "pad_bytes": 4 << 20, "upload_mode": "ASYNC"}
        result = Trainer(counting_loop, train_loop_config=config, scaling_config=ScalingConfig(num_workers=2),
                         run_config=RunConfig(name=f"run{run}", storage_path=storage_path)).fit()
        assert result.checkpoint is not None, f"run {run} lost its last checkpoint"
        assert result.checkpoint.path.endswith("checkpoint_001_000003")
        state = RunStore(open_storage(storage_path), f"run{run}").load_state()
        assert state.latest_checkpoint == "checkpoint_001_000003"
        stored = Path(storage_path) / f"run{run}" / "checkpoint_001_000003"
        assert json.loads((stored / "state_rank1.json").read_text()) == {"step": 3}
        assert (stored / "pad.bin").stat().st_size == 4 << 20
