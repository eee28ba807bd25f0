import pytest

from outlast.controller.retention import checkpoints_to_delete
from outlast.storage.records import CheckpointRecord


def rec(seq: int, **metrics) -> CheckpointRecord:
    return CheckpointRecord(checkpoint_dir=f"c{seq}", seq=seq, attempt=1, report_index=seq,
                            committed_at=float(seq), metrics=metrics)


def names(records):
    return sorted(r.checkpoint_dir for r in records)


def test_keeping_everything_deletes_nothing():
    assert checkpoints_to_delete([rec(1), rec(2), rec(3)], None, None, "max") == []


def test_nothing_is_deleted_while_there_are_at_most_num_to_keep():
    assert checkpoints_to_delete([rec(1), rec(2)], 2, None, "max") == []


def test_without_a_score_the_most_recent_are_kept():
    records = [rec(3), rec(1), rec(4), rec(2)]
    assert names(checkpoints_to_delete(records, 2, None, "max")) == ["c1", "c2"]


def test_score_order_max_keeps_the_highest_scores_and_the_latest():
    records = [rec(1, acc=0.9), rec(2, acc=0.5), rec(3, acc=0.7), rec(4, acc=0.1)]
    assert names(checkpoints_to_delete(records, 2, "acc", "max")) == ["c2"]


def test_score_order_min_keeps_the_lowest_scores_and_the_latest():
    records = [rec(1, loss=0.9), rec(2, loss=0.2), rec(3, loss=0.1), rec(4, loss=0.5)]
    assert names(checkpoints_to_delete(records, 2, "loss", "min")) == ["c1"]


def test_the_latest_is_never_deleted_even_when_it_scores_worst():
    records = [rec(1, loss=0.1), rec(2, loss=0.2), rec(3, loss=9.0)]
    assert names(checkpoints_to_delete(records, 1, "loss", "min")) == ["c2"]


@pytest.mark.parametrize("bad", [{}, {"loss": "n/a"}, {"loss": True}, {"loss": None}])
def test_unscored_checkpoints_rank_below_every_scored_one(bad):
    records = [rec(1, loss=5.0), rec(2, **bad), rec(3, loss=4.0), rec(4, loss=3.0)]
    assert names(checkpoints_to_delete(records, 2, "loss", "min")) == ["c1", "c2"]


def test_among_unscored_checkpoints_the_newer_are_kept():
    records = [rec(1), rec(2), rec(3), rec(4)]
    assert names(checkpoints_to_delete(records, 2, "loss", "max")) == ["c1", "c2"]


def test_equal_scores_keep_the_newer_checkpoint():
    records = [rec(1, acc=1.0), rec(2, acc=1.0), rec(3, acc=0.0)]
    assert names(checkpoints_to_delete(records, 1, "acc", "max")) == ["c1"]


def test_integer_scores_count_as_scored():
    records = [rec(1, step=10), rec(2), rec(3, step=1)]
    assert names(checkpoints_to_delete(records, 1, "step", "max")) == ["c2"]


def test_a_nan_score_ranks_below_every_real_score_and_never_costs_the_best_checkpoint():
    nan = float("nan")
    records = [rec(1, loss=0.5), rec(2, loss=nan), rec(3, loss=0.1), rec(4, loss=0.9), rec(5, loss=0.7)]
    # keep the best (c3) and the latest (c5)
    assert names(checkpoints_to_delete(records, 1, "loss", "min")) == ["c1", "c2", "c4"]
