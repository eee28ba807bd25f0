"""Live recovery under Trainer.fit() (FailureConfig(live_recovery=True)): real processes, gloo on CPU.

A rank, rank 0 included, SIGKILLs itself in the middle of a step. The controller does not stop the others: it
forks a replacement for the lost rank from the node's fork server and publishes the next generation in the store
it holds; the survivors throw the step away, form a new group with the replacement, and one of them sends it the
state. The survivors keep their pids, at most one step is lost, every rank ends with the weights of the run in which
nothing failed, and the history records the recovery, charged to max_failures.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from outlast.train import FailureConfig, RunConfig, ScalingConfig
from tests.integration.jobs import read_events
from tests.integration.live_jobs import live_loop

STEPS = 10


def _train(storage_path: str, tmp_path: Path, name: str, workers: int, kill: list[list[int]]):
    from outlast.train.torch import TorchTrainer

    events = tmp_path / f"{name}.jsonl"
    result = TorchTrainer(
        live_loop, train_loop_config={"events": str(events), "steps": STEPS, "kill": kill, "report": True},
        scaling_config=ScalingConfig(num_workers=workers),
        run_config=RunConfig(name=name, storage_path=storage_path,
                             failure_config=FailureConfig(max_failures=2, live_recovery=True)),
    ).fit()
    state = json.loads((Path(storage_path) / name / "run_state.json").read_text())
    assert result.last_metrics == {"step": STEPS - 1}  # every rank reported each committed step, a replacement too
    return read_events(events), state


def _final(events: list[dict]) -> dict[int, list]:
    return {e["rank"]: e["exact"] for e in events if e["event"] == "end"}


@pytest.mark.torch
@pytest.mark.parametrize("workers,victim", [(2, 1), (2, 0), (3, 0)])
def test_a_killed_rank_is_replaced_while_the_others_go_on(storage_path, tmp_path, workers, victim, caplog):
    events, _ = _train(storage_path, tmp_path, f"clean{workers}{victim}", workers, [])
    clean = _final(events)
    assert len(clean) == workers and all(w == clean[0] for w in clean.values())

    at = 4
    events, state = _train(storage_path, tmp_path, f"live{workers}{victim}", workers, [[victim, at]])
    starts = [e for e in events if e["event"] == "start"]
    first = {e["rank"]: e["pid"] for e in starts if e["incarnation"] == 0}
    replacement = [e for e in starts if e["incarnation"] == 1]
    assert len(replacement) == 1 and replacement[0]["rank"] == victim and replacement[0]["attempt"] == 1
    # The survivors are the processes that started: every step they logged, and their end, came from one pid.
    for rank, pid in first.items():
        if rank != victim:
            assert {e["pid"] for e in events if e["rank"] == rank} == {pid}
    # The step in flight was thrown away on every survivor, and nothing else.
    thrown = [e for e in events if e["event"] == "thrown"]
    assert len(thrown) <= workers - 1 and {e["step"] for e in thrown} <= {at}
    assert replacement[0]["step"] <= at  # it starts where the others are: at most the one step is run again
    final = _final(events)
    assert set(final) == set(range(workers)) and final == clean
    # The replacement's reports took the index of the other ranks' reports of the same step.
    assert "ignored a report" not in caplog.text and "rank(s) [%d] took the state" % victim in caplog.text

    assert len(state["attempts"]) == 1 and state["status"] == "finished"
    assert state["failure_counts"] == {"worker": 1}
    [recovery] = state["live_recoveries"]
    assert recovery["path"] == "live" and recovery["ranks"] == [victim] and recovery["steps_lost"] in (0, 1)
    assert "SIGKILL" in recovery["cause"] or "signal 9" in recovery["cause"], recovery["cause"]
    assert recovery["seconds"] is not None and recovery["seconds"] >= 0


@pytest.mark.torch
def test_with_every_rank_lost_the_run_falls_back_to_a_restart_and_says_so(storage_path, tmp_path):
    events, _ = _train(storage_path, tmp_path, "clean", 2, [])
    clean = _final(events)
    # Both ranks die in step 4: the first death starts a replacement, the second leaves no rank holding the state.
    events, state = _train(storage_path, tmp_path, "lost", 2, [[0, 4], [1, 4]])
    assert _final(events) == clean  # the second attempt trained from scratch (no checkpoint was saved)
    assert {e["attempt"] for e in events if e["event"] == "end"} == {2}
    recoveries = state["live_recoveries"]
    assert recoveries[-1]["path"] == "restart" and "no rank that holds the state" in recoveries[-1]["reason"]
    assert len(state["attempts"]) == 2 and state["status"] == "finished"
    assert state["failure_counts"] == {"worker": 2}  # the live recovery's, and the restart's
