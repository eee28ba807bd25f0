"""The driver lease on storage's own compare-and-swap: one winner, hosts told apart by identity,
expiry judged by the reader's own clock, and a driver that lost the lease writes nothing."""

from __future__ import annotations

import json
import threading

import pytest

import outlast.train  # noqa: F401  (first: the training API and the controller import each other)
from outlast.controller.driver_lease import LeaseKeeper
from outlast.storage import open_storage
from outlast.storage.records import RunState
from outlast.storage.run_store import RunStore
from outlast.errors import RunInUseError


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0
        self.on_sleep = None

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s
        if self.on_sleep:
            self.on_sleep()


def keeper(tmp_path, host: str, clock: Clock, wall=lambda: 1.7e9, alive=lambda lease: True) -> LeaseKeeper:
    return LeaseKeeper(RunStore(open_storage(tmp_path), "run"), ttl_s=10.0, clock=clock, wall=wall,
                       sleep=clock.sleep, alive=alive, host=host)


def race_for_the_lease(storage_url, drivers: int) -> list[str]:
    """`drivers` threads each try to take the free lease of one run at the same instant; their outcomes."""
    outcomes: list[str] = []
    start = threading.Barrier(drivers)

    def race():
        k = LeaseKeeper(RunStore(open_storage(storage_url), "run"), ttl_s=10.0)
        start.wait()
        try:
            k.acquire(wait_s=0)
            outcomes.append("won")
        except RunInUseError:
            outcomes.append("refused")

    threads = [threading.Thread(target=race) for _ in range(drivers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes


def test_of_drivers_racing_for_a_free_run_exactly_one_wins(tmp_path):
    assert sorted(race_for_the_lease(tmp_path, 8)) == ["refused"] * 7 + ["won"]


def test_a_live_driver_on_another_machine_with_the_same_hostname_keeps_its_run(tmp_path):
    clock = Clock()
    holder = keeper(tmp_path, "machine-a/boot-1/pid:[1]", clock, wall=lambda: 0.0)  # its clock is decades off
    holder.acquire()
    newcomer = keeper(tmp_path, "machine-b/boot-7/pid:[1]", clock, alive=lambda lease: False)
    clock.on_sleep = lambda: holder.renew_if_due(clock())
    with pytest.raises(RunInUseError, match="renewed its lease just now"):
        newcomer.acquire()


def test_a_lease_unrenewed_for_a_ttl_of_the_readers_own_clock_is_taken_and_the_old_driver_writes_nothing(tmp_path):
    clock = Clock()
    old = keeper(tmp_path, "machine-a/boot-1/pid:[1]", clock, wall=lambda: 4e9)  # its clock far ahead
    old.acquire()
    old.store.save_state(RunState(name="run", status="running", created_at=1, updated_at=1))
    new = keeper(tmp_path, "machine-b/boot-7/pid:[1]", clock)
    new.acquire()  # the old one is stalled: no renewal while the newcomer watches for 10 s
    assert clock() >= 1010.0
    (tmp_path / "run" / "checkpoint_002_000001").mkdir()  # the new driver's upload in flight
    lost = old.renew_if_due(clock() + 100)
    assert lost is not None and "took over this run's lease" in lost
    old.store.save_state(RunState(name="run", status="errored", created_at=1, updated_at=2))
    assert old.store.remove_uncommitted(set()) == []
    assert json.loads((tmp_path / "run" / "run_state.json").read_text())["status"] == "running"
    assert (tmp_path / "run" / "checkpoint_002_000001").is_dir()
    assert new.renew_if_due(clock() + 100) is None  # the new driver keeps its lease


def test_a_dead_driver_on_this_host_is_taken_over_at_once(tmp_path):
    clock = Clock()
    keeper(tmp_path, "here", clock).acquire()
    keeper(tmp_path, "here", clock, alive=lambda lease: False).acquire()
    assert clock() == 1000.0


def test_a_live_driver_on_this_host_is_refused_at_once_naming_it(tmp_path):
    clock = Clock()
    keeper(tmp_path, "here", clock).acquire()
    with pytest.raises(RunInUseError, match=r"is being driven by pid \d+ on .*, alive"):
        keeper(tmp_path, "here", clock).acquire()


def test_a_released_lease_is_taken_at_once_from_any_host(tmp_path):
    clock = Clock()
    first = keeper(tmp_path, "a", clock)
    first.acquire()
    first.release()
    second = keeper(tmp_path, "b", clock)
    second.acquire()
    assert clock() == 1000.0 and second.previous is None


def test_a_store_without_compare_and_swap_still_gets_one_driver_and_a_warning(caplog):
    from outlast.storage.conditional import conditional
    from tests.fakes.storage import MemoryStorage

    with caplog.at_level("WARNING", logger="outlast.storage"):
        cas = conditional(MemoryStorage())
    assert any("no compare-and-swap" in r.message for r in caplog.records)
    first = cas.write_if("run/lease", b"a", None)
    assert first is not None and cas.write_if("run/lease", b"b", None) is None
    assert cas.write_if("run/lease", b"c", first) is not None and cas.read_versioned("run/lease").data == b"c"


def test_a_renewal_written_whose_answer_was_lost_is_not_taken_for_another_drivers_takeover(tmp_path):
    clock = Clock()
    k = keeper(tmp_path, "machine-a/boot-1/pid:[1]", clock)
    k.acquire()
    write = k.store.write_lease_if

    def applied_then_timed_out(lease, expected):
        write(lease, expected)
        raise TimeoutError("the store applied the write, and its answer never came")

    k.store.write_lease_if = applied_then_timed_out
    assert k.renew_if_due(clock() + 10) is None  # said as trouble with storage, and training goes on
    k.store.write_lease_if = write
    assert k.renew_if_due(clock() + 20) is None and k.lost is None  # its own write, not a takeover
    assert k.renew_if_due(clock() + 30) is None and k.lost is None  # and renewals go on from it
    stored, _ = k.store.read_lease()
    assert stored.driver_id == k.driver_id and stored.renewals == 3


def _newer_lease(tmp_path, **fields) -> bytes:
    """A lease as a newer outlast might write it: its version higher, its fields its own."""
    path = tmp_path / "run" / "driver_lease.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"version": 3, "holder": {"pid": 1, "where": "elsewhere"}, **fields}))
    return path.read_bytes()


@pytest.mark.parametrize("fields", [{}, {"driver_id": "x", "host": "h1", "pid": 1, "pid_started_at": 0.0,
                                         "acquired_at": 0.0, "renewed_at": 0.0, "ttl_s": 10.0, "released": True}])
def test_a_lease_of_a_newer_version_is_refused_and_left_as_it_is(tmp_path, fields):
    """Undecodable as this version's, or decodable and saying it is released: neither counts as no lease."""
    from outlast.storage.records import NewerVersionError

    before = _newer_lease(tmp_path, **fields)
    k = keeper(tmp_path, "h1", Clock(), alive=lambda lease: False)
    with pytest.raises(NewerVersionError, match="driver_lease.json has schema version 3, written by a newer outlast"):
        k.acquire(wait_s=0)
    assert (tmp_path / "run" / "driver_lease.json").read_bytes() == before


def test_a_renewal_that_finds_a_newer_outlasts_lease_stops_the_driver_and_fences_the_run(tmp_path):
    clock = Clock()
    k = keeper(tmp_path, "h1", clock)
    k.acquire()
    _newer_lease(tmp_path)
    clock.t += 10.0
    lost = k.renew_if_due(clock())
    assert lost is not None and "a newer outlast's driver took over this run's lease" in lost
    assert k.store.fenced == lost
