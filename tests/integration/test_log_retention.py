"""A node removes old runs' output files: its agent at start, and at the end of a run."""

from __future__ import annotations

import os
import time
from pathlib import Path

from outlast.client.discovery import start_agent_process
from outlast.train import RunConfig, ScalingConfig, Trainer


def say_hello(config):
    print("hello from the run")


def _old_run(home: Path, name: str, age_h: float) -> Path:
    run = home / "logs" / f"{name}-{name}"
    run.mkdir(parents=True)
    (run / "attempt1-rank0.log").write_text("old lines\n")
    then = time.time() - age_h * 3600
    for p in (run / "attempt1-rank0.log", run):
        os.utime(p, (then, then))
    return run


def test_the_agent_removes_old_runs_output_at_its_start(_isolated_outlast_home, monkeypatch):
    monkeypatch.setenv("OUTLAST_LOG_KEEP_RUNS", "2")
    oldest, older, young = (_old_run(_isolated_outlast_home, name, age) for name, age in
                            [("oldest", 72), ("older", 48), ("young", 1)])
    proc, _ = start_agent_process([], embedded=False, extra_args=["--die-with-parent"])
    try:
        assert not oldest.exists()  # it listens only once it has pruned
        assert older.exists() and young.exists()  # among the 2 most recent
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_end_of_a_run_removes_an_old_runs_output(_isolated_outlast_home, monkeypatch, storage_path):
    monkeypatch.setenv("OUTLAST_LOG_KEEP_RUNS", "1")
    old = _old_run(_isolated_outlast_home, "old", 48)  # the newest at the agent's start: kept then
    Trainer(say_hello, scaling_config=ScalingConfig(num_workers=1),
            run_config=RunConfig(name="fresh", storage_path=storage_path)).fit()
    fresh = [p for p in (_isolated_outlast_home / "logs").iterdir() if p.name.startswith("fresh-")]
    assert not old.exists()
    assert len(fresh) == 1 and "hello from the run" in (fresh[0] / "attempt1-rank0.log").read_text()
