"""A driver whose lease another driver took stops and writes nothing more to the run: not its
status, not the removal of the new driver's uploads in flight."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import pytest

from outlast.storage import open_storage
from outlast.storage.lease import Lease
from outlast.storage.run_store import RunStore
from outlast.train import RunConfig, ScalingConfig, Trainer, TrainingFailedError
from tests.integration.jobs import counting_loop, read_events
from tests.integration.procs import wait_until


def test_a_driver_that_lost_its_lease_stops_without_touching_the_run(storage_path, tmp_path, monkeypatch):
    monkeypatch.setenv("OUTLAST_DRIVER_LEASE_S", "3")  # renewed every second
    events = tmp_path / "events.jsonl"
    run_dir = Path(storage_path) / "run"
    seen: dict[str, bytes] = {}

    def take_over() -> None:
        # What a second driver does once it holds the lease: its own lease, an upload in flight.
        wait_until(lambda: any(e["event"] == "step" and e["step"] >= 3 for e in read_events(events)), 120,
                   "the run to be training")
        store = RunStore(open_storage(storage_path), "run")
        other = Lease(driver_id=uuid.uuid4().hex, host="another-machine/boot/ns", hostname="another", pid=4242,
                      pid_started_at=1.0, acquired_at=1.0, renewed_at=1.0, ttl_s=3.0)

        def taken() -> bool:
            # Compare-and-set against the version just read: the driver renews every second, and a renewal that
            # lands between the read and the write wins (the write then changes nothing); read again and try again,
            # as a second driver does. Asserted once, a lost race ended this thread and the run trained on.
            current, version = store.read_lease()
            assert current is not None
            return store.write_lease_if(other, version) is not None

        wait_until(taken, 30, "the lease to be taken over")
        (run_dir / "checkpoint_009_000001").mkdir()
        seen["state"] = (run_dir / "run_state.json").read_bytes()
        seen["lease"] = (run_dir / "driver_lease.json").read_bytes()

    thief = threading.Thread(target=take_over, daemon=True)
    thief.start()
    with pytest.raises(TrainingFailedError, match=r"another driver \(pid 4242 on another\) took over"):
        Trainer(counting_loop, train_loop_config={"events": str(events), "steps": 100000, "every": 1000000,
                                                  "step_sleep": 0.05},
                scaling_config=ScalingConfig(num_workers=1),
                run_config=RunConfig(name="run", storage_path=storage_path)).fit()
    thief.join(timeout=5)
    assert (run_dir / "run_state.json").read_bytes() == seen["state"]  # not marked errored
    assert (run_dir / "checkpoint_009_000001").is_dir()  # the new driver's upload stays
    assert (run_dir / "driver_lease.json").read_bytes() == seen["lease"]  # nor released
