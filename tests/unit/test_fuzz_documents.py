"""Every document outlast reads from storage, its state directory or etcd, generated hostile
(tests/fuzz/documents.py: hostile fields, wrong types, cut short, from the future, no document at all).

A reader returns what it read, or a clear error naming the file (`CorruptDocument`, `NewerVersionError`),
or treats the document as no checkpoint; it never raises anything else, and never opens a path that a
document names outside the run's directory. bench/fuzz_doors.py runs the same readers 100,000 times each.
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from outlast.client import discovery
from outlast.cluster.sealed import Sealer
from outlast.cluster.store_view import ClusterView, StoreEvent
from outlast.controller.runstate import RunBook
from outlast.storage import records as r
from outlast.storage.run_store import RunStore
from tests.fuzz.documents import (RUN, WatchedStorage, apply_records, hostile, plant_decoy, plant_run, read_node_file,
                                  read_run)
from tests.fuzz.doors import outside_writes, plant_canary
from tests.fuzz.hostile import Hostile, Targets

FUZZ = settings(max_examples=25, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def canary(tmp_path_factory):
    canary = plant_canary(tmp_path_factory.mktemp("documents") / "canary")
    plant_decoy(canary)
    return canary


@FUZZ
@given(seed=st.integers(0, 2**32))
def test_a_hostile_run_directory_is_read_as_data_and_never_as_paths_to_open(canary, seed):
    with tempfile.TemporaryDirectory() as tmp:
        _outcome, outside = read_run(Path(tmp), canary, seed)
    assert outside == []
    assert outside_writes(canary) == ["%s/ckpt" % canary, f"{canary}/ckpt/{r.MANIFEST_NAME}"]


def test_a_run_state_naming_a_checkpoint_outside_the_run_is_not_read_from_there(tmp_path, canary):
    plant_run(Hostile(random.Random(0), Targets(str(canary))), tmp_path)
    state = r.RunState(name=RUN, status="running", created_at=1.0, updated_at=1.0,
                       latest_checkpoint="../" * 12 + str(canary).lstrip("/") + "/ckpt")
    (tmp_path / RUN / r.RUN_STATE_NAME).write_bytes(r.encode(state))
    storage = WatchedStorage(tmp_path, RUN)
    store = RunStore(storage, RUN)
    RunBook.open(store, RUN, 1000.0)
    with pytest.raises(r.CorruptDocument, match="not the name of a checkpoint"):
        store.read_manifest(state.latest_checkpoint)
    assert storage.outside == []


@FUZZ
@given(seed=st.integers(0, 2**32))
def test_a_hostile_node_file_is_no_node_and_never_an_error(tmp_path, monkeypatch, canary, seed):
    monkeypatch.setenv("OUTLAST_HOME", str(tmp_path))
    assert read_node_file(hostile(seed, canary)) in ("no node", "a node")


@FUZZ
@given(seed=st.integers(0, 2**32), sealed=st.booleans())
def test_hostile_etcd_records_are_refused_or_kept_out_of_the_table_never_an_error(canary, seed, sealed):
    assert apply_records(hostile(seed, canary), Sealer(b"k" * 40), sealed, 20) in (
        "refused", "malformed", "taken", "ignored")


def test_a_node_file_with_a_pid_no_process_can_have_is_no_node(tmp_path, monkeypatch):
    monkeypatch.setenv("OUTLAST_HOME", str(tmp_path))
    for pid in (-1, 0, 2**63 - 1):
        discovery.node_file_path().write_bytes(msgspec.json.encode(
            {"address": "tcp://127.0.0.1:1", "pid": pid, "node_id": "n",
             "process": {"pid": pid, "started_at": 1.0, "cmdline": ["outlast"]}}))
        assert discovery.published_node() is None


def test_a_sealed_head_record_that_is_not_text_is_malformed_not_an_error():
    sealer = Sealer(b"k" * 40)
    view = ClusterView(sealer)
    assert not view.apply(StoreEvent("head", sealer.seal("head", b"\xfd\xff")))
    assert view.malformed == ["head"] and view.head is None
