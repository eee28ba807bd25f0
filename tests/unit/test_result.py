import pytest

from outlast.storage import records as r
from outlast.storage.run_store import RunStore
from outlast.train import Checkpoint, ControllerError, Result, TrainingFailedError, WorkerGroupError
from outlast.errors import classify
from outlast.train.result import build_result, rank_checkpoints
from tests.fakes.storage import MemoryStorage


def rec(seq, **metrics):
    return r.CheckpointRecord(checkpoint_dir=f"checkpoint_001_{seq:06d}", seq=seq, attempt=1, report_index=seq,
                              committed_at=float(seq), metrics=metrics)


def test_best_checkpoints_scored_on_loss_are_the_best_two_with_the_best_last_as_ray_orders_them():
    records = [rec(1, loss=3.0), rec(2, loss=1.0), rec(3, loss=2.0)]
    assert [c.seq for c in rank_checkpoints(records, 2, "loss", "min")] == [3, 2]
    assert [c.seq for c in rank_checkpoints(records, 2, "loss", "max")] == [3, 1]


def test_without_a_score_they_are_the_latest_in_report_order():
    records = [rec(2), rec(1), rec(3)]
    assert [c.seq for c in rank_checkpoints(records, 2, None, "max")] == [2, 3]
    assert [c.seq for c in rank_checkpoints(records, None, None, "max")] == [1, 2, 3]


def test_unscored_checkpoints_rank_below_scored_ones_and_ties_go_to_the_later_report():
    records = [rec(1), rec(2, acc=0.5), rec(3, acc=0.5), rec(4, acc=float("nan"))]
    assert [c.seq for c in rank_checkpoints(records, None, "acc", "max")][-2:] == [2, 3]
    assert {c.seq for c in rank_checkpoints(records, None, "acc", "max")[:2]} == {1, 4}


def test_a_nested_metric_is_found_by_its_flattened_name():
    records = [rec(1, val={"loss": 2.0}), rec(2, val={"loss": 1.0})]
    assert [c.seq for c in rank_checkpoints(records, 1, "val/loss", "min")] == [2]


def state(**kw):
    return r.RunState(name="exp", status="finished", created_at=0.0, updated_at=0.0, **kw)


def test_metrics_are_those_of_the_latest_checkpoint_not_the_last_report():
    mem = MemoryStorage()
    s = state(checkpoints=[rec(1, loss=3.0), rec(2, loss=1.0)], latest_checkpoint="checkpoint_001_000002",
              last_metrics={"loss": 0.5, "step": 99})
    result = build_result(s, mem, RunStore(mem, "exp"))
    assert result.metrics == {"loss": 1.0}
    assert result.checkpoint == Checkpoint("/memory/exp/checkpoint_001_000002")
    assert build_result(state(last_metrics={"loss": 0.5}), mem, RunStore(mem, "exp")).metrics is None


def test_return_value_is_read_only_for_a_finished_run_and_only_with_the_key_that_sealed_it(caplog):
    import cloudpickle

    from outlast.train import return_value as rv

    key = rv.key_from_secret(b"the run credential's secret")
    mem = MemoryStorage()
    mem.write_atomic("exp/return_value.pkl", rv.seal(cloudpickle.dumps({"acc": 0.9}), key))
    assert build_result(state(), mem, RunStore(mem, "exp"), return_key=key).return_value == {"acc": 0.9}
    running = r.RunState(name="exp", status="errored", created_at=0.0, updated_at=0.0)
    assert build_result(running, mem, RunStore(mem, "exp"), return_key=key).return_value is None
    # From storage alone (Result.from_path, a relaunched driver), or under another run's key: not unpickled.
    assert build_result(state(), mem, RunStore(mem, "exp")).return_value is None
    other = rv.key_from_secret(b"another run's secret")
    assert build_result(state(), mem, RunStore(mem, "exp"), return_key=other).return_value is None
    assert "its seal does not match" in caplog.text


class Boom:
    def __reduce__(self):
        return (exec, ("raise SystemExit('unpickled a stranger')",))


def test_a_pickle_written_to_the_storage_path_by_anyone_else_is_never_unpickled(caplog):
    import cloudpickle

    from outlast.train import return_value as rv

    key = rv.key_from_secret(b"secret")
    mem = MemoryStorage()
    payload = cloudpickle.dumps(Boom())
    forged = [payload,  # a bare pickle, as outlast wrote before it sealed them
              rv.MAGIC + b"\0" * rv.MAC_BYTES + payload,  # the header, with a made-up seal
              rv.seal(payload, rv.key_from_secret(b"guessed")),  # sealed under a key that is not the run's
              rv.MAGIC[:-1]]  # cut short
    for data in forged:
        mem.write_atomic("exp/return_value.pkl", data)
        assert build_result(state(), mem, RunStore(mem, "exp"), return_key=key).return_value is None
    # A file past the bound is not read whole.
    mem.write_atomic("exp/return_value.pkl", b"x" * (r.MAX_DOCUMENT_BYTES + 1))
    assert build_result(state(), mem, RunStore(mem, "exp"), return_key=key).return_value is None
    assert "larger than" in caplog.text


def test_a_seal_covers_every_byte_of_the_pickle():
    from outlast.train import return_value as rv

    key = rv.key_from_secret(b"secret")
    sealed = rv.seal(b"pickle bytes", key)
    assert rv.unseal(sealed, key) == b"pickle bytes"
    for i in range(len(sealed)):
        flipped = bytearray(sealed)
        flipped[i] ^= 1
        assert rv.unseal(bytes(flipped), key) is None
def result(*metrics):
    return Result(metrics=None, checkpoint=None, path="/runs/exp",
                  best_checkpoints=[(Checkpoint(f"/c{i}"), m) for i, m in enumerate(metrics)])


def test_get_best_checkpoint_skips_checkpoints_without_the_metric():
    res = result({"loss": 2.0}, {"other": 1}, {"loss": 1.0})
    assert res.get_best_checkpoint("loss", "min") == Checkpoint("/c2")
    assert res.get_best_checkpoint("loss", "max") == Checkpoint("/c0")
    with pytest.raises(RuntimeError, match="no checkpoint.*'acc'"):
        res.get_best_checkpoint("acc", "max")
    with pytest.raises(ValueError, match="'max' or 'min'"):
        res.get_best_checkpoint("loss", "lowest")
    with pytest.raises(RuntimeError, match="no committed checkpoint"):
        result().get_best_checkpoint("loss", "min")


def test_metrics_dataframe_has_one_row_per_best_checkpoint():
    pytest.importorskip("pandas")
    df = result({"loss": 2.0, "epoch": 0}, {"loss": 1.0, "epoch": 1}).metrics_dataframe
    assert list(df["epoch"]) == [0, 1] and list(df.columns) == ["loss", "epoch"]
    assert result().metrics_dataframe is None


def failure(attempt, rank, exc_type="RuntimeError"):
    return r.FailureRecord(attempt=attempt, rank=rank, node_id="n", pid=1, exit_code=1, signal=None, time=0.0,
                           exc_type=exc_type, message="boom")


def test_a_run_ended_by_failed_workers_raises_worker_group_error_with_the_last_attempts_ranks():
    err = classify(TrainingFailedError("training failed", [failure(1, 0), failure(2, 1), failure(2, 0)]))
    assert isinstance(err, WorkerGroupError) and isinstance(err, TrainingFailedError)
    assert sorted(err.worker_failures) == [0, 1] and "rank 1" in str(err.worker_failures[1])
    assert len(err.failures) == 3


def test_any_other_stop_raises_controller_error():
    err = classify(TrainingFailedError("the head did not answer", []))
    assert isinstance(err, ControllerError) and "did not answer" in str(err.controller_failure)


def test_result_from_path_reads_a_run_directory_and_says_when_it_is_not_one(tmp_path):
    from outlast.storage import open_storage

    store = RunStore(open_storage(tmp_path), "exp")
    store.save_state(state(checkpoints=[rec(1, loss=1.0)], latest_checkpoint="checkpoint_001_000001"))
    res = Result.from_path(tmp_path / "exp")
    assert res.metrics == {"loss": 1.0} and res.path == str(tmp_path / "exp")
    import pyarrow.fs

    assert isinstance(res.filesystem, pyarrow.fs.LocalFileSystem)  # what Ray gives, for a script that annotates it
    with res.filesystem.open_input_file(str(tmp_path / "exp" / "run_state.json")) as f:
        assert b"checkpoint_001_000001" in f.read()
    with pytest.raises(RuntimeError, match="no run_state.json"):
        Result.from_path(tmp_path / "nothing")


def test_result_filesystem_of_a_url_is_its_fsspec_file_system_wrapped_for_pyarrow():
    import fsspec
    import pyarrow.fs

    fsspec.filesystem("memory").pipe("/bucket/exp/run_state.json", b"{}")
    fs = Result(metrics=None, checkpoint=None, path="memory://bucket/exp").filesystem
    assert isinstance(fs, pyarrow.fs.PyFileSystem) and "memory" in fs.handler.fs.protocol
    assert [i.base_name for i in fs.get_file_info(pyarrow.fs.FileSelector("/bucket/exp"))] == ["run_state.json"]
