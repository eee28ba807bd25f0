"""Small promises, with real workers: the return value is the finishing attempt's, and local:/// storage
keeps its absolute path."""

from __future__ import annotations

from pathlib import Path

from outlast.train import FailureConfig, RunConfig, ScalingConfig, Trainer
from tests.integration.edge_jobs import reports_once, returns_then_fails


def test_a_failed_attempts_return_value_is_not_the_result_of_an_attempt_that_returns_none(storage_path):
    return_file = Path(storage_path) / "run" / "return_value.pkl"
    result = Trainer(returns_then_fails, train_loop_config={"return_file": str(return_file)},
                     scaling_config=ScalingConfig(num_workers=2),
                     run_config=RunConfig(name="run", storage_path=storage_path,
                                          failure_config=FailureConfig(max_failures=1))).fit()
    assert len(result.error.failures if result.error else []) == 0
    assert result.return_value is None, "the failed attempt's return value survived into the result"
    assert not return_file.exists()


def test_local_storage_with_three_slashes_keeps_the_absolute_path(tmp_path, monkeypatch):
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # where a path that lost its slash would land
    store = tmp_path / "store"
    result = Trainer(reports_once, scaling_config=ScalingConfig(num_workers=1),
                     run_config=RunConfig(name="run", storage_path=f"local://{store}")).fit()
    assert result.return_value == "done"
    assert (store / "run" / "run_state.json").exists()
    assert not list(elsewhere.rglob("run_state.json"))
