"""The controller's socket, fuzzed by what reaches it: a worker of the run, holding the run's credential
(tests/fuzz/controller_job.py), sends the driver generated messages with hostile fields (ranks and attempts
that are not its own, paths, sizes and counts) and checks after each batch that the driver answers a valid
request. The run ends without an error, and nothing appears outside its storage. bench/fuzz_doors.py runs the
same door 100,000 times."""

from __future__ import annotations

from tests.fuzz.controller_job import fuzz_a_run
from tests.fuzz.doors import outside_writes, plant_canary


def test_the_driver_survives_hostile_messages_from_its_own_worker_and_answers_it_after_each_batch(
        tmp_path, storage_path):
    canary = plant_canary(tmp_path / "canary")
    result, seen = fuzz_a_run(storage_path, canary, tmp_path / "fuzz.json", seed=7, count=400, batch=50)
    assert seen["cases"] == 400, seen
    assert seen["answers"]["CheckpointsList (to rank 0)"] == 8  # after each batch of 50
    # The run ends: its own rank's forged reports may change its results (they are its own), never the driver.
    assert result.error is None
    assert outside_writes(canary) == []
