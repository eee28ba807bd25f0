"""Small promises of storage: orphan manifests keep their place in the run's order, and a URL's absolute
path keeps its leading slash."""

from __future__ import annotations

from outlast.controller.retention import checkpoints_to_delete
from outlast.controller.runstate import RunBook
from outlast.protocol.messages import FileEntry
from outlast.storage import open_storage
from outlast.storage.local import LocalStorage
from outlast.storage.records import Manifest
from outlast.storage.remote import RemoteStorage
from outlast.storage.run_store import RunStore

ENTRY = FileEntry("model.pt", 1, "0" * 64)


def commit(book: RunBook, name: str, attempt: int, index: int, metrics: dict, now: float) -> None:
    """A commit as the controller makes it: the manifest written, then the run state naming it."""
    seq = max((c.seq for c in book.state.checkpoints), default=0) + 1
    manifest = Manifest(checkpoint_dir=name, seq=seq, attempt=attempt, report_index=index, committed_at=now,
                        ranks=[0], files=[ENTRY], metrics=metrics)
    book.store.write_manifest(manifest)
    book.record_commit(manifest)
    book.flush()


def test_an_orphan_manifest_older_than_the_named_checkpoints_keeps_its_place(tmp_path):
    """A fenced driver's last commit (attempt 1) wrote its manifest but never the run state, which the driver
    after it filled with attempt 2's checkpoints; a third launch adopts it."""
    store = RunStore(LocalStorage(str(tmp_path)), "run")
    book = RunBook.open(store, "exp", now=1.0)
    book.begin_attempt(1.0)
    commit(book, "checkpoint_001_000004", 1, 4, {"step": 4}, now=2.0)
    book.begin_attempt(3.0)
    commit(book, "checkpoint_002_000002", 2, 2, {"step": 12}, now=4.0)
    commit(book, "checkpoint_002_000004", 2, 4, {"step": 14}, now=5.0)
    store.write_manifest(Manifest(checkpoint_dir="checkpoint_001_000009", seq=2, attempt=1, report_index=9,
                                  committed_at=2.5, ranks=[0], files=[ENTRY], metrics={"step": 9}))

    reopened = RunBook.open(store, "exp", now=6.0).state
    by_seq = [c.checkpoint_dir for c in sorted(reopened.checkpoints, key=lambda c: c.seq)]
    assert by_seq == ["checkpoint_001_000004", "checkpoint_001_000009", "checkpoint_002_000002",
                      "checkpoint_002_000004"]
    assert len({c.seq for c in reopened.checkpoints}) == 4
    assert reopened.latest_checkpoint == "checkpoint_002_000004"
    # Retention keeps the newest checkpoint, not the adopted one.
    gone = checkpoints_to_delete(reopened.checkpoints, 1, None, "max")
    assert "checkpoint_002_000004" not in {c.checkpoint_dir for c in gone}
    assert RunStore(LocalStorage(str(tmp_path)), "run").load_state().checkpoints == reopened.checkpoints


def test_orphans_newer_than_every_named_checkpoint_come_last_in_their_order(tmp_path):
    store = RunStore(LocalStorage(str(tmp_path)), "run")
    book = RunBook.open(store, "exp", now=1.0)
    book.begin_attempt(1.0)
    commit(book, "checkpoint_001_000004", 1, 4, {}, now=2.0)
    for index in (14, 9):
        store.write_manifest(Manifest(checkpoint_dir=f"checkpoint_001_{index:06d}", seq=index, attempt=1,
                                      report_index=index, committed_at=3.0, ranks=[0], files=[ENTRY]))
    state = RunBook.open(store, "exp", now=6.0).state
    assert [c.checkpoint_dir for c in sorted(state.checkpoints, key=lambda c: c.seq)] == [
        "checkpoint_001_000004", "checkpoint_001_000009", "checkpoint_001_000014"]
    assert state.latest_checkpoint == "checkpoint_001_000014"


def test_an_absolute_path_after_a_scheme_keeps_its_leading_slash(tmp_path):
    storage = open_storage(f"local://{tmp_path}/store")
    assert isinstance(storage, LocalStorage)
    storage.write_atomic("run/x", b"1")
    assert (tmp_path / "store" / "run" / "x").read_bytes() == b"1"
    assert RemoteStorage(f"local://{tmp_path}/y/").root == f"{tmp_path}/y"
    assert RemoteStorage("s3://bucket/runs/").root == "bucket/runs"
