"""The rules for a checkpoint's directory name: outlast's own, and the ones a report asks for."""

from __future__ import annotations

import pytest

from outlast.controller.commit import CommitTracker
from outlast.protocol.messages import FileEntry
from outlast.storage import naming
from outlast.storage.local import LocalStorage
from outlast.storage.run_store import RunStore


def test_default_name_pads_attempt_and_index():
    assert naming.default_name(2, 15) == "checkpoint_002_000015"


def test_default_names_sort_in_commit_order():
    made = [naming.default_name(a, i) for a, i in [(1, 0), (1, 9), (1, 10), (2, 0), (10, 0)]]
    assert sorted(made) == made


def test_a_made_name_is_recognised_as_a_default_name():
    assert naming.is_default_name(naming.default_name(1, 0))


@pytest.mark.parametrize("name", ["checkpoint", "checkpoint_1", "checkpoint_1_2_3", "ckpt_1_2",
                                  "checkpoint_a_1", "checkpoint__1", "run_state.json", "Checkpoint_1_2"])
def test_other_names_are_not_default_names(name):
    assert not naming.is_default_name(name)


@pytest.mark.parametrize("name", ["full_model", "epoch_3", "checkpoint_epoch_1", "a", "x" * 255, "é" * 127,
                                  "with space", "checkpoint_1", "Checkpoint_001_000002", "run_state.json.bak"])
def test_a_name_of_one_directory_is_accepted(name):
    assert naming.check_name(name) == name


@pytest.mark.parametrize("name, why", [
    ("", "empty"), ("a/b", "without '/'"), ("a\\b", "without '/'"), ("/abs", "without '/'"),
    (".", "'.'"), ("..", "'.'"), (".hidden", "'.'"), ("a\nb", "control character"), ("a\0b", "control character"),
    ("x" * 256, "256 bytes"), ("é" * 128, "256 bytes"),
    ("run_state.json", "keeps its own"), ("reports", "keeps its own"), ("driver_lease.json", "keeps its own"),
    ("return_value.pkl", "keeps its own"), ("checkpoint_001_000002", "checkpoint_AAA_IIIIII"),
    (3, "must be a str"), (b"epoch", "must be a str"),
])
def test_a_name_that_cannot_name_a_directory_is_refused_saying_why_and_what_to_pass(name, why):
    with pytest.raises(naming.CheckpointNameError, match="checkpoint_dir_name=") as e:
        naming.check_name(name)
    assert why in str(e.value) and "unique to this report" in str(e.value)
    assert isinstance(e.value, ValueError)


def test_an_empty_place_or_another_rank_of_the_same_report_is_no_clash():
    same = naming.CheckpointMarker(attempt=2, report_index=5)
    assert naming.clash("m", "/s/m", 2, 5, None, committed=False, occupied=False) is None
    assert naming.clash("m", "/s/m", 2, 5, same, committed=False, occupied=True) is None


@pytest.mark.parametrize("attempt, index, committed, said", [
    (1, 5, True, "report #5 of attempt 1 (committed)"),  # an earlier attempt's
    (2, 4, False, "report #4 of attempt 2 (still being uploaded)"),  # this attempt's, still in flight
    (2, 6, True, "report #6 of attempt 2 (committed)"),  # a report further on, seen by a rank behind
])
def test_a_directory_holding_another_reports_checkpoint_is_a_clash(attempt, index, committed, said):
    found = naming.CheckpointMarker(attempt=attempt, report_index=index)
    why = naming.clash("full_model", "/s/run/full_model", 2, 5, found, committed=committed, occupied=True)
    assert said in why and "/s/run/full_model" in why and "add the epoch or step" in why


def test_a_directory_that_is_not_a_checkpoint_is_a_clash_and_left_alone():
    why = naming.clash("notes", "/s/run/notes", 1, 0, None, committed=False, occupied=True)
    assert "not a checkpoint of this run" in why and "Choose another name" in why


def test_a_marker_round_trips_and_an_unreadable_one_reads_as_none():
    assert naming.decode_marker(naming.encode_marker(3, 7)) == naming.CheckpointMarker(attempt=3, report_index=7)
    assert naming.decode_marker(b"{half") is None


def _store(tmp_path) -> RunStore:
    (tmp_path / "run").mkdir()
    return RunStore(LocalStorage(tmp_path), "run")


def test_the_run_knows_named_checkpoints_by_their_marker_and_leaves_other_directories_alone(tmp_path):
    store = _store(tmp_path)
    for d in ["checkpoint_001_000000", "full_model", "user_notes", "reports"]:
        (tmp_path / "run" / d).mkdir()
    (tmp_path / "run" / "full_model" / naming.MARKER_NAME).write_bytes(naming.encode_marker(1, 1))
    (tmp_path / "run" / "full_model" / "full-model.pt").write_bytes(b"weights")
    (tmp_path / "run" / "user_notes" / "todo.txt").write_text("mine")
    assert sorted(store.checkpoint_dirs()) == ["checkpoint_001_000000", "full_model"]
    assert sorted(store.remove_uncommitted(set())) == ["checkpoint_001_000000", "full_model"]
    assert (tmp_path / "run" / "user_notes" / "todo.txt").read_text() == "mine"
    assert (tmp_path / "run" / "reports").is_dir()


def test_ranks_that_name_one_reports_directory_differently_get_the_commit_refused_saying_so():
    tracker = CommitTracker(2)
    entry = FileEntry(path="a.pt", size=1, xxh3_128="0" * 32)
    assert tracker.on_report(0, 0, "full_model", [entry], {}) == []
    (pending,) = tracker.on_report(1, 0, "model_rank1", [entry], {})
    assert pending.checkpoint_dir == "full_model"
    assert "rank 1 stored its files under 'model_rank1', another rank under 'full_model'" in pending.errors[1]
    assert "same checkpoint_dir_name on every rank" in pending.errors[1]


def test_ranks_that_name_it_alike_commit_it_whole():
    tracker = CommitTracker(2)
    entry = FileEntry(path="a.pt", size=1, xxh3_128="0" * 32)
    tracker.on_report(0, 0, "full_model", [entry], {})
    (pending,) = tracker.on_report(1, 0, "full_model", [entry], {})
    assert not pending.errors and set(pending.files) == {0, 1}


def test_a_restarts_clean_up_spares_the_new_attempts_named_directories_by_their_marker(tmp_path):
    store = _store(tmp_path)
    for d, attempt in [("epoch_1", 1), ("epoch_2", 2), ("epoch_3", 3)]:
        (tmp_path / "run" / d).mkdir()
        (tmp_path / "run" / d / naming.MARKER_NAME).write_bytes(naming.encode_marker(attempt, 0))
    assert store.checkpoint_dirs() == {"epoch_1": 1, "epoch_2": 2, "epoch_3": 3}
    assert store.remove_uncommitted(set(), from_attempt=2) == ["epoch_1"]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["epoch_2", "epoch_3"]
