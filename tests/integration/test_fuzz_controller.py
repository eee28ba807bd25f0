"""The controller's socket, fuzzed by what reaches it: a worker of the run, holding the run's credential
(tests/fuzz/controller_job.py), sends the driver generated messages with hostile fields (ranks and attempts
that are not its own, paths, sizes and counts) and checks after each batch that the driver answers a valid
request. The run ends without an error, and nothing appears outside its storage."""

from __future__ import annotations

import json

from outlast.testing import LocalCluster
from outlast.train import RunConfig, ScalingConfig, Trainer
from tests.fuzz.controller_job import fuzz_the_driver
from tests.fuzz.doors import outside_writes, plant_canary


def test_the_driver_survives_hostile_messages_from_its_own_worker_and_answers_it_after_each_batch(
        tmp_path, storage_path):
    canary = plant_canary(tmp_path / "canary")
    out = tmp_path / "fuzz.json"
    with LocalCluster(num_nodes=1, preload=[]):
        result = Trainer(fuzz_the_driver,
                         train_loop_config={"seed": 7, "count": 400, "batch": 50, "canary": str(canary),
                                            "out": str(out)},
                         scaling_config=ScalingConfig(num_workers=1),
                         run_config=RunConfig(name="fuzzed", storage_path=storage_path)).fit()
    seen = json.loads(out.read_text())
    assert seen["cases"] == 400, seen
    assert seen["answers"]["CheckpointsList (to rank 0)"] == 8  # after each batch of 50
    # The run ends: its own rank's forged reports may change its results (they are its own), never the driver.
    assert result.error is None
    assert outside_writes(canary) == []
