"""The driver lease on a real S3-protocol server: conditional PUTs decide who drives a run."""

from __future__ import annotations

import pytest

import outlast.train  # noqa: F401  (first: the training API and the controller import each other)
from outlast.controller.driver_lease import LeaseKeeper
from outlast.storage import open_storage
from outlast.storage import records as r
from outlast.storage.conditional import conditional
from outlast.storage.run_store import RunStore
from tests.unit.test_driver_lease import race_for_the_lease


def test_s3_creates_only_what_is_absent_and_replaces_only_the_version_read(s3):  # noqa: F811
    cas = conditional(open_storage("s3://runs/cas"))
    assert cas.read_versioned("doc") is None
    first = cas.write_if("doc", b"one", None)
    assert first is not None
    assert cas.write_if("doc", b"two", None) is None
    assert cas.read_versioned("doc") == ("one".encode(), first)
    second = cas.write_if("doc", b"three", first)
    assert second is not None and cas.write_if("doc", b"four", first) is None
    assert cas.read_versioned("doc").data == b"three"


def test_of_drivers_racing_for_a_run_on_s3_exactly_one_wins(s3):  # noqa: F811
    assert sorted(race_for_the_lease("s3://runs/race", 4)) == ["refused"] * 3 + ["won"]


def test_a_driver_whose_lease_was_taken_on_s3_finds_out_and_writes_nothing(s3):  # noqa: F811
    t = [0.0]
    clock = lambda: t[0]  # noqa: E731

    def sleep(s):
        t[0] += s

    old = LeaseKeeper(RunStore(open_storage("s3://runs/takeover"), "run"), ttl_s=5.0, clock=clock, sleep=sleep,
                      host="machine-a/boot/ns")
    old.acquire()
    new = LeaseKeeper(RunStore(open_storage("s3://runs/takeover"), "run"), ttl_s=5.0, clock=clock, sleep=sleep,
                      host="machine-b/boot/ns")
    new.acquire()  # watched 5 s of its own clock without a renewal
    assert old.renew_if_due(t[0] + 100) is not None
    assert old.store.fenced is not None
    assert new.renew_if_due(t[0] + 100) is None


def test_an_oversized_lease_on_s3_counts_as_none_and_a_driver_takes_the_run_from_its_version(s3):  # noqa: F811
    storage = open_storage("s3://runs/oversized")
    storage.write_atomic("run/driver_lease.json", b"{" + b" " * (2 * r.MAX_SMALL_DOCUMENT_BYTES) + b"}")
    store = RunStore(storage, "run")
    lease, version = store.read_lease()
    assert lease is None and version is not None
    keeper = LeaseKeeper(store, ttl_s=5.0, host="machine-a/boot/ns")
    keeper.acquire()  # an unreadable lease locks no run
    assert store.read_lease()[0] is not None


def test_an_oversized_run_state_on_s3_is_refused_after_one_bounded_read(s3, monkeypatch):  # noqa: F811
    monkeypatch.setattr(r, "MAX_DOCUMENT_BYTES", 4096)
    storage = open_storage("s3://runs/oversized-state")
    storage.write_atomic("run/run_state.json", b"{" + b" " * (1 << 20) + b"}")
    with pytest.raises(r.DocumentTooLarge, match="run_state.json is larger than outlast writes"):
        RunStore(storage, "run").load_state()
