import pytest

from outlast.controller.file_merge import DuplicateFiles, merge_files, settle
from outlast.protocol import messages as m
from outlast.protocol.messages import FileEntry
from tests.fakes.storage import MemoryStorage

KEEP, FAIL = DuplicateFiles.KEEP_RANK0, DuplicateFiles.FAIL


def f(path, sha):
    return FileEntry(path=path, size=1, sha256=sha * 64)


def test_distinct_files_of_every_rank_are_all_kept_sorted_by_path():
    merged = merge_files({1: [f("b", "1")], 0: [f("a", "0")]}, FAIL)
    assert [e.path for e in merged.files] == ["a", "b"] and merged.conflicts == []


def test_the_same_bytes_from_several_ranks_are_no_conflict():
    merged = merge_files({0: [f("model.pt", "a")], 1: [f("model.pt", "a")]}, FAIL)
    assert merged.files == [f("model.pt", "a")] and merged.conflicts == []


def test_fail_refuses_different_bytes_naming_the_file_ranks_and_the_setting():
    with pytest.raises(ValueError, match=r"ranks 0 and 1 both wrote 'model.pt'.*duplicate_files='keep_rank0'"):
        merge_files({0: [f("model.pt", "a")], 1: [f("model.pt", "b")]}, FAIL)


def test_keep_names_every_rank_with_another_copy_and_keeps_rank_zeros_for_now():
    merged = merge_files({0: [f("model.pt", "a")], 1: [f("model.pt", "a")], 2: [f("model.pt", "c")],
                          3: [f("model.pt", "d")]}, KEEP)
    assert merged.files == [f("model.pt", "a")]
    (c,) = merged.conflicts
    assert (c.path, c.ranks, c.kept) == ("model.pt", (0, 2, 3), 0)


def test_settle_lists_the_copy_storage_holds_and_names_its_rank():
    merged = settle(merge_files({0: [f("m", "a")], 1: [f("m", "b")]}, KEEP), {"m": ("sha256", "b" * 64)})
    assert merged.files == [f("m", "b")] and merged.conflicts[0].kept == 1
    merged = settle(merge_files({0: [f("m", "a")], 1: [f("m", "b")], 2: [f("m", "a")]}, KEEP), {"m": ("sha256", "a" * 64)})
    assert merged.files == [f("m", "a")] and merged.conflicts[0].kept == 0


def test_settle_refuses_stored_bytes_that_match_no_rank():
    with pytest.raises(ValueError, match="matches none of them"):
        settle(merge_files({0: [f("m", "a")], 1: [f("m", "b")]}, KEEP), {"m": ("sha256", "e" * 64)})


def test_keep_one_is_the_former_name_of_keep_rank0():
    assert DuplicateFiles("keep_one") is DuplicateFiles("keep_rank0") is KEEP
    with pytest.raises(ValueError):
        DuplicateFiles("rank0")


def test_the_description_leaves_out_the_checkpoint_so_repeats_read_the_same():
    one = merge_files({0: [f("m", "a")], 1: [f("m", "b")]}, KEEP)
    two = merge_files({0: [f("m", "c")], 1: [f("m", "d")]}, KEEP)
    assert one.describe() == two.describe()
    assert "'m' (ranks 0, 1)" in one.describe() and "duplicate_files='fail'" in one.describe()
    assert "keeps rank 0's copy" in one.describe()


def test_the_core_records_a_conflict_in_the_history_once_reading_back_the_stored_copy(caplog):
    import hashlib

    from tests.fakes.controller import make, start

    mem = MemoryStorage()
    h = make(mem, world_size=2)
    start(h)
    data = b"rank zero"
    sha = hashlib.sha256(data).hexdigest()
    for index in (0, 1):
        ckpt = f"checkpoint_001_{index:06d}"
        mem.write_atomic(f"run/{ckpt}/model.pt", data)
        for rank, digest in ((0, sha), (1, "f" * 64)):
            h.worker(m.Report(attempt=1, rank=rank, index=index, metrics={}, checkpoint_dir=ckpt,
                              files=[FileEntry("model.pt", 9, digest)]))
        manifest = h.core.book.store.read_manifest(ckpt)
        assert manifest is not None and manifest.files == [FileEntry("model.pt", 9, sha)]
    notes = h.core.book.state.notes
    assert len(notes) == 1 and "'model.pt' (ranks 0, 1)" in notes[0].text
    assert sum("model.pt" in r.getMessage() for r in caplog.records) == 1
