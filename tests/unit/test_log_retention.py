"""Which runs' output files a node removes: the pure decision, its settings, and the files."""

from __future__ import annotations

import os
import time

import pytest

from outlast.agent.log_retention import Retention, RunLogs, retention_from_env, to_remove
from outlast.agent.output import OutputTails, output_path

H = 3600.0
NOW = 1_000_000_000.0


def _runs(*ages_h):
    return [RunLogs(f"run{i}", NOW - age * H) for i, age in enumerate(ages_h)]


def _removed(runs, policy, active=frozenset()):
    return sorted(r.name for r in to_remove(runs, NOW, policy, set(active)))


def test_the_newest_runs_and_the_young_ones_are_kept_the_rest_removed_with_the_reason():
    runs = _runs(48, 30, 72, 1, 25)
    assert _removed(runs, Retention(keep_runs=2, keep_hours=24)) == ["run0", "run1", "run2"]
    reason = to_remove(runs, NOW, Retention(keep_runs=2, keep_hours=24), set())[0].reason
    assert "h ago" in reason and "OUTLAST_LOG_KEEP_HOURS=24" in reason and "2 most recent" in reason


def test_runs_younger_than_keep_hours_stay_however_many_there_are():
    assert _removed(_runs(*[0.5] * 50), Retention(keep_runs=1, keep_hours=24)) == []


def test_a_run_exactly_keep_hours_old_is_old_enough_to_go():
    assert _removed(_runs(0, 24), Retention(keep_runs=1, keep_hours=24)) == ["run1"]


def test_zero_and_zero_keeps_only_the_runs_still_being_written():
    runs = _runs(0, 100, 1000)
    assert _removed(runs, Retention(keep_runs=0, keep_hours=0), active={"run2"}) == ["run0", "run1"]


def test_thousands_of_runs_keep_exactly_the_newest_n():
    runs = _runs(*[100 + i for i in range(5000)])
    kept = {r.name for r in runs} - set(_removed(runs, Retention(keep_runs=20, keep_hours=24)))
    assert kept == {f"run{i}" for i in range(20)}


def test_no_runs_nothing_to_remove():
    assert _removed([], Retention()) == []


def test_settings_come_from_the_environment_with_defaults():
    assert retention_from_env({}) == Retention(20, 24.0)
    assert retention_from_env({"OUTLAST_LOG_KEEP_RUNS": "3", "OUTLAST_LOG_KEEP_HOURS": "0.5"}) == Retention(3, 0.5)


@pytest.mark.parametrize("env, says", [
    ({"OUTLAST_LOG_KEEP_RUNS": "-1"}, "OUTLAST_LOG_KEEP_RUNS='-1': give a whole number"),
    ({"OUTLAST_LOG_KEEP_RUNS": "ten"}, "OUTLAST_LOG_KEEP_RUNS='ten'"),
    ({"OUTLAST_LOG_KEEP_HOURS": "nan"}, "OUTLAST_LOG_KEEP_HOURS='nan': give a number of hours"),
    ({"OUTLAST_LOG_KEEP_HOURS": "inf"}, "OUTLAST_LOG_KEEP_HOURS='inf'"),
])
def test_a_bad_setting_says_which_and_what_it_takes(env, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(")):
        retention_from_env(env)


def _old_run(log_dir, name, age_h):
    path = output_path(log_dir, name, name, 1, 0)
    path.parent.mkdir(parents=True)
    path.write_text("a line\n")
    then = time.time() - age_h * H
    os.utime(path, (then, then))
    os.utime(path.parent, (then, then))
    return path.parent


def test_the_end_of_a_run_removes_old_runs_files_but_not_a_run_still_being_written(tmp_path, monkeypatch):
    monkeypatch.setenv("OUTLAST_LOG_KEEP_RUNS", "0")
    tails = OutputTails("node-1", tmp_path)
    writing = tails.watch("live", 1, 0, output_path(tmp_path, "live", "live", 1, 0), True)
    unread = tails.watch("quiet", 1, 0, output_path(tmp_path, "quiet", "quiet", 1, 0), False)  # worker_output="off"
    os.utime(writing, (time.time() - 100 * H,) * 2)
    for p in (unread, os.path.dirname(writing), os.path.dirname(unread)):
        os.utime(p, (time.time() - 100 * H,) * 2)
    old = _old_run(tmp_path, "old", 48)
    young = _old_run(tmp_path, "young", 1)
    tails.watch("ended", 1, 0, output_path(tmp_path, "ended", "ended", 1, 0), True)
    tails.finish_run("ended")
    assert not old.exists() and young.exists() and os.path.exists(writing) and os.path.exists(unread)
    tails.close()


def test_a_bad_setting_removes_nothing(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("OUTLAST_LOG_KEEP_HOURS", "-3")
    old = _old_run(tmp_path, "old", 480)
    OutputTails("node-1", tmp_path).close()
    assert old.exists() and "OUTLAST_LOG_KEEP_HOURS='-3'" in caplog.text
