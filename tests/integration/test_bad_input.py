"""Bad input through fit(): each is refused before anything starts with an error naming the setting, or
kept as it was given (a diverging loss), never changed or sent somewhere else without a word."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from outlast.cli.main import main as cli_main
from outlast.train import FailureConfig, RunConfig, ScalingConfig, Trainer, TrainingFailedError
from tests.browser.server import Dashboard
from tests.integration.bad_input_jobs import diverging_loop, set_metric_loop
from tests.integration.jobs import counting_loop


def test_an_empty_storage_path_is_refused_and_nothing_is_written_under_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("OUTLAST_STORAGE_PATH", raising=False)
    with pytest.raises(ValueError) as info:
        Trainer(counting_loop, run_config=RunConfig(name="run", storage_path="")).fit()
    assert "RunConfig.storage_path is ''" in str(info.value) and "leave it None" in str(info.value)
    assert not (tmp_path / "outlast_results").exists()


@pytest.mark.parametrize("name, says", [
    ("r" * 300, "300 bytes long"),
    ("two\nlines", "the control character '\\n'"),
    ("tab\there", "the control character '\\t'"),
    ("a/b", "has a '/'"),
    ("..", "is '..'"),
    ("", "is empty"),
])
def test_a_run_name_that_cannot_be_one_directory_name_is_refused_naming_run_config_name(storage_path, name, says):
    with pytest.raises(ValueError) as info:
        Trainer(counting_loop, run_config=RunConfig(name=name, storage_path=storage_path)).fit()
    text = str(info.value)
    assert text.startswith("RunConfig(name=") and says in text, text
    assert "storage_path" not in text and "at most 242 bytes" in text
    assert list(Path(storage_path).iterdir()) == []


def test_the_longest_name_allowed_trains(storage_path, tmp_path):
    name = "n" * 242
    Trainer(counting_loop, train_loop_config={"steps": 1, "events": str(tmp_path / "events.jsonl")},
            run_config=RunConfig(name=name, storage_path=storage_path)).fit()
    assert (Path(storage_path) / name / "run_state.json").exists()


def test_a_diverging_loss_is_kept_in_the_history_the_result_the_cli_and_the_dashboard(storage_path, capsys):
    result = Trainer(diverging_loop, scaling_config=ScalingConfig(num_workers=2),
                     run_config=RunConfig(name="diverged", storage_path=storage_path)).fit()

    # Result.metrics: the latest checkpoint's, NaN as reported; the best checkpoints keep theirs too.
    assert result.metrics["step"] == 2 and math.isnan(result.metrics["loss"])
    assert result.metrics["low"] == -math.inf and math.isnan(result.metrics["history"][0])
    assert [m["loss"] for _, m in result.best_checkpoints][0] == math.inf
    assert math.isnan(result.last_metrics["loss"])

    # On storage, by name (docs/json.md): JSON has no NaN, and null would say nothing was reported.
    state = json.loads((Path(storage_path) / "diverged" / "run_state.json").read_text())
    assert state["last_metrics"]["loss"] == "NaN" and state["last_metrics"]["low"] == "-Infinity"
    assert [c["metrics"]["loss"] for c in state["checkpoints"]] == ["Infinity", "NaN"]

    capsys.readouterr()
    with pytest.raises(SystemExit):
        cli_main(["runs", storage_path, "--json"])
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    assert run["last_metrics"]["loss"] == "NaN"
    with pytest.raises(SystemExit):
        cli_main(["runs", storage_path, "diverged"])
    assert "loss=nan" in capsys.readouterr().out

    dashboard = Dashboard(storage_path)
    try:
        status, body = dashboard.get("/api/runs/0/diverged")
    finally:
        dashboard.stop()
    assert status == 200, body
    view = json.loads(body)
    assert view["last_metrics"]["loss"] == "NaN"
    assert view["series"]["values"]["loss"] == [1.5, "Infinity", "NaN"]


def test_a_set_in_the_metrics_fails_the_report_naming_the_key_and_its_type(storage_path):
    with pytest.raises(TrainingFailedError) as info:
        Trainer(set_metric_loop, run_config=RunConfig(name="sets", storage_path=storage_path,
                                                      failure_config=FailureConfig(max_failures=0))).fit()
    text = str(info.value)
    assert "metrics['classes'] is a set" in text and "sorted(...)" in text, text
