import pytest

from outlast.storage import records as r
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
