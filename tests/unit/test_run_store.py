import pytest

from outlast.controller.runstate import RunBook
from outlast.storage import naming, records as r
from outlast.storage.lease import this_process
from outlast.storage.local import LocalStorage
from outlast.storage.run_store import RunStore
from tests.fakes.storage import MemoryStorage

MANIFEST = r.MANIFEST_NAME


def manifest(name: str) -> r.Manifest:
    return r.Manifest(checkpoint_dir=name, seq=1, attempt=1, report_index=0, committed_at=0.0,
                      ranks=[0], files=[])


@pytest.fixture
def store(tmp_path):
    return RunStore(LocalStorage(tmp_path), "runs/exp")


def test_load_state_of_a_new_run_is_none(store):
    assert store.load_state() is None


def test_a_saved_state_loads_back_equal(store):
    state = r.RunState(name="exp", status="running", created_at=1.0, updated_at=2.0, latest_checkpoint="c")
    store.save_state(state)
    assert store.load_state() == state
    assert store.storage.exists("runs/exp/run_state.json")


def test_a_corrupt_run_state_raises_naming_its_full_path(store):
    store.storage.write_atomic("runs/exp/run_state.json", b"{garbage")
    with pytest.raises(r.CorruptDocument, match=r"runs/exp/run_state\.json is not a valid RunState"):
        store.load_state()


def test_a_manifest_is_written_inside_its_checkpoint_dir_and_reads_back(store):
    store.write_manifest(manifest("checkpoint_001_000000"))
    assert store.storage.exists(f"runs/exp/checkpoint_001_000000/{MANIFEST}")
    assert store.read_manifest("checkpoint_001_000000") == manifest("checkpoint_001_000000")


def test_a_missing_manifest_reads_as_none(store):
    assert store.read_manifest("checkpoint_001_000000") is None


def test_a_corrupt_manifest_raises_naming_its_path(store):
    store.storage.write_atomic(f"runs/exp/c/{MANIFEST}", b"[1]")
    with pytest.raises(r.CorruptDocument, match=f"runs/exp/c/{MANIFEST}"):
        store.read_manifest("c")


def test_remove_uncommitted_deletes_only_checkpoint_dirs_without_a_manifest(store):
    s = store.storage
    s.write_atomic("runs/exp/checkpoint_001_000000/model.pt", b"half")    # crashed mid-upload
    store.write_manifest(manifest("checkpoint_001_000001"))                # manifest, not in state yet
    s.write_atomic("runs/exp/checkpoint_001_000002/model.pt", b"named")   # named by the run state
    s.write_atomic("runs/exp/user_stuff/file", b"mine")                  # not a checkpoint name
    removed = store.remove_uncommitted(committed={"checkpoint_001_000002"})
    assert removed == ["checkpoint_001_000000"]
    assert s.list_dirs("runs/exp") == ["checkpoint_001_000001", "checkpoint_001_000002", "user_stuff"]


def test_remove_uncommitted_on_a_run_without_a_directory_removes_nothing(store):
    assert store.remove_uncommitted(set()) == []


def test_delete_checkpoint_deletes_the_manifest_before_the_directory():
    mem = MemoryStorage()
    store = RunStore(mem, "run")
    store.write_manifest(manifest("c"))
    mem.write_atomic("run/c/model.pt", b"w")
    mem.ops.clear()
    store.delete_checkpoint("c")
    assert mem.ops == [("delete", f"run/c/{MANIFEST}"), ("delete", "run/c")]
    assert mem.files == {}


def test_remove_uncommitted_from_an_attempt_on_keeps_that_attempts_directories_and_later_ones(store):
    s = store.storage
    for name in ("checkpoint_001_000004", "checkpoint_002_000000", "checkpoint_003_000001"):
        s.write_atomic(f"runs/exp/{name}/model.pt", b"no manifest yet")
    assert store.remove_uncommitted(set(), from_attempt=2) == ["checkpoint_001_000004"]
    assert s.list_dirs("runs/exp") == ["checkpoint_002_000000", "checkpoint_003_000001"]


# Whoever can write the storage path writes what the driver reads: a document larger than outlast writes of its
# kind is refused without being read past its limit, so that writer never gets the driver's memory.
class CountingStorage(LocalStorage):
    """Counts the bytes its readers took."""

    taken = 0

    def read_bytes(self, path):
        data = super().read_bytes(path)
        self.taken += len(data)
        return data

    def read_head(self, path, n):
        data = super().read_head(path, n)
        self.taken += len(data)
        return data


def oversized(limit: int) -> bytes:
    return b"{" + b" " * limit + b"}"  # valid JSON of any length: only its size refuses it


@pytest.mark.parametrize("where, read", [
    ("run_state.json", lambda s: s.load_state()),
    (f"c1/{MANIFEST}", lambda s: s.read_manifest("c1")),
    (r.report_segment_name(0, 0), lambda s: s.read_reports(0)),
])
def test_a_document_larger_than_outlast_writes_is_refused_unread(tmp_path, monkeypatch, where, read):
    monkeypatch.setattr(r, "MAX_DOCUMENT_BYTES", 4096)
    storage = CountingStorage(tmp_path)
    store = RunStore(storage, "runs/exp")
    storage.write_atomic(f"runs/exp/{where}", oversized(1 << 20))
    with pytest.raises(r.DocumentTooLarge, match="larger than outlast writes") as e:
        read(store)
    assert f"runs/exp/{where}" in str(e.value)
    assert storage.taken <= 4097


def test_an_oversized_run_state_is_neither_set_aside_nor_rebuilt_but_named(tmp_path, monkeypatch):
    monkeypatch.setattr(r, "MAX_DOCUMENT_BYTES", 4096)
    storage = CountingStorage(tmp_path)
    storage.write_atomic("runs/exp/run_state.json", oversized(1 << 20))
    with pytest.raises(r.DocumentTooLarge, match="move it out of the run's directory"):
        RunBook.open(RunStore(storage, "runs/exp"), "exp", now=1.0)
    assert len(storage.read_bytes("runs/exp/run_state.json")) == (1 << 20) + 2  # left as it was
    assert not [p for p in (tmp_path / "runs/exp").iterdir() if "corrupt" in p.name]


def test_an_oversized_marker_marks_its_directory_unreadable_and_is_not_read_whole(tmp_path):
    storage = CountingStorage(tmp_path)
    storage.write_atomic(f"runs/exp/mine/{naming.MARKER_NAME}", oversized(r.MAX_SMALL_DOCUMENT_BYTES))
    store = RunStore(storage, "runs/exp")
    assert store.checkpoint_dirs() == {"mine": None}
    assert storage.taken <= r.MAX_SMALL_DOCUMENT_BYTES + 1


def test_an_oversized_lease_counts_as_none_and_is_not_read_whole(tmp_path, caplog):
    storage = CountingStorage(tmp_path)
    (tmp_path / "runs/exp").mkdir(parents=True)
    (tmp_path / "runs/exp/driver_lease.json").write_bytes(oversized(8 * r.MAX_SMALL_DOCUMENT_BYTES))
    store = RunStore(storage, "runs/exp")
    lease, version = store.read_lease()
    assert lease is None and version is not None
    assert "larger than any lease" in caplog.text
    # Taken over as an unreadable lease is: a compare-and-swap against the version read.
    assert store.write_lease_if(this_process("d", 1.0, 10.0), version) is not None
    assert store.read_lease()[0] is not None
