"""Live recovery under Trainer.fit() (FailureConfig(live_recovery=True)): real processes, gloo on CPU.

A rank, rank 0 included, SIGKILLs itself (or raises) in the middle of a step. The controller does not stop the others: it
forks a replacement for the lost rank from the node's fork server and publishes the next generation in the store
it holds; the survivors keep their gradients of the step that broke, form a new group with the replacement, one of
them sends it the state, and the replacement runs that step's forward and backward before all reduce it again. The
survivors keep their pids and run no step twice (no step is lost), every rank ends with the weights of the run in
which nothing failed, and the history records the recovery, charged to max_failures.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from outlast.train import FailureConfig, RunConfig, ScalingConfig
from tests.integration.jobs import read_events
from tests.integration.live_jobs import live_loop
from tests.integration.procs import wait_until

STEPS = 10


def _train(storage_path: str, tmp_path: Path, name: str, workers: int, kill: list[list], max_failures: int = 3,
           strategy: str = "PACK", hang_timeout_s: float | None = None, **config):
    from outlast.train.torch import TorchTrainer

    events = tmp_path / f"{name}.jsonl"
    result = TorchTrainer(
        live_loop, train_loop_config={"events": str(events), "steps": STEPS, "kill": kill, "report": True, **config},
        scaling_config=ScalingConfig(num_workers=workers, placement_strategy=strategy),
        run_config=RunConfig(name=name, storage_path=storage_path,
                             failure_config=FailureConfig(max_failures=max_failures, live_recovery=True,
                                                          hang_timeout_s=hang_timeout_s)),
    ).fit()
    state = json.loads((Path(storage_path) / name / "run_state.json").read_text())
    assert result.last_metrics == {"step": STEPS - 1}  # every rank reported each committed step, a replacement too
    return read_events(events), state


def _final(events: list[dict]) -> dict[int, list]:
    return {e["rank"]: e["exact"] for e in events if e["event"] == "end"}


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """Every rank's final weights in a run in which nothing failed, by world size."""
    def run(workers: int) -> dict[int, list]:
        where = tmp_path_factory.mktemp(f"clean{workers}")
        final = _final(_train(str(where / "storage"), where, "clean", workers, [])[0])
        assert len(final) == workers and all(w == final[0] for w in final.values())
        return final
    # Module-scoped, so before the per-test OUTLAST_HOME: a home of its own, never the user's (where another
    # process's node would be found and attached to).
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OUTLAST_HOME", str(tmp_path_factory.mktemp("clean_home")))
        mp.delenv("OUTLAST_ADDRESS", raising=False)
        mp.setenv("OUTLAST_PRELOAD", "")
        return {workers: run(workers) for workers in (2, 3)}


@pytest.mark.torch
@pytest.mark.parametrize("workers,kills", [
    (2, [[1, 4, "kill"]]),
    (2, [[0, 4, "kill"]]),
    (3, [[0, 3, "kill"], [1, 5, "raise"], [2, 7, "kill"]]),  # one after another, rank 0 first
    # In the first step: the death reaches the controller right after rank 0's word that the group formed.
    (2, [[1, 0, "kill"]]),
], ids=["rank1", "rank0", "three-ranks-each", "first-step"])
def test_a_killed_rank_is_replaced_while_the_others_go_on(storage_path, tmp_path, workers, kills, clean, caplog):
    events, state = _train(storage_path, tmp_path, "live", workers, kills)
    starts = [e for e in events if e["event"] == "start"]
    first = {e["rank"]: e["pid"] for e in starts if e["incarnation"] == 0}
    replacements = {e["rank"]: e for e in starts if e["incarnation"] == 1}
    victims = [k[0] for k in kills]
    assert sorted(replacements) == sorted(victims) and len(starts) == workers + len(kills)
    assert {e["attempt"] for e in events} == {1}
    # A rank's first process never stopped before its own death: every line it logged came from one pid, up to it.
    for rank, pid in first.items():
        mine = [e for e in events if e["rank"] == rank and e["incarnation"] == 0]
        assert {e["pid"] for e in mine} == {pid}
        if rank not in victims:
            assert mine[-1]["event"] == "end"
    _no_step_run_twice(events, workers, victims)
    for rank, step, _ in kills:
        assert replacements[rank]["step"] == step  # it runs the step that broke, which the others kept
    final = _final(events)
    assert set(final) == set(range(workers)) and final == clean[workers]
    # The replacements' reports took the index of the other ranks' reports of the same step.
    assert "ignored a report" not in caplog.text

    assert len(state["attempts"]) == 1 and state["status"] == "finished"
    assert state["failure_counts"] == {"worker": len(kills)}
    recoveries = state["live_recoveries"]
    assert [r["ranks"] for r in recoveries] == [[v] for v in victims]
    for r, (_, _, how) in zip(recoveries, kills):
        assert r["path"] == "live" and r["steps_lost"] == 0 and r["seconds"] >= 0
        assert ("SIGKILL" if how == "kill" else "RuntimeError") in r["cause"], r["cause"]


@pytest.mark.torch
def test_with_every_rank_lost_the_run_falls_back_to_a_restart_and_says_so(storage_path, tmp_path, clean):
    # Both ranks die in step 4: the first death starts a replacement, the second leaves no rank holding the state.
    events, state = _train(storage_path, tmp_path, "lost", 2, [[0, 4, "kill"], [1, 4, "kill"]])
    assert _final(events) == clean[2]  # the second attempt trained from scratch (no checkpoint was saved)
    assert {e["attempt"] for e in events if e["event"] == "end"} == {2}
    recoveries = state["live_recoveries"]
    assert recoveries[-1]["path"] == "restart" and "no rank that holds the state" in recoveries[-1]["reason"]
    assert len(state["attempts"]) == 2 and state["status"] == "finished"
    assert state["failure_counts"] == {"worker": 2}  # the live recovery's, and the restart's


@pytest.mark.torch
def test_a_replacement_killed_while_it_takes_the_state_widens_the_recovery(storage_path, tmp_path, clean):
    # Rank 1 dies in step 4; its replacement dies after the state's header, while rank 0 still sends 32 MB: the
    # same recovery replaces it again (the controller's core allows MAX_TRANSFER_DEATHS such deaths), and rank 0
    # sends the state to the third process, in the same attempt.
    events, state = _train(storage_path, tmp_path, "widen", 2, [[1, 4, "kill"]], die_in_transfer=[1], pad_mb=32)
    starts = [e for e in events if e["event"] == "start"]
    assert sorted((e["rank"], e["incarnation"]) for e in starts) == [(0, 0), (1, 0), (1, 2)]  # 1 died in start()
    assert len({e["pid"] for e in events if e["rank"] == 0}) == 1  # the sender lived through both deaths
    assert {e["attempt"] for e in events} == {1}
    assert _final(events) == clean[2]
    assert len(state["attempts"]) == 1 and state["status"] == "finished"
    assert state["failure_counts"] == {"worker": 2}
    [recovery] = state["live_recoveries"]  # one recovery, widened: not two
    assert recovery["path"] == "live" and recovery["ranks"] == [1] and recovery["steps_lost"] == 0
    _no_step_run_twice(events, 2, [1])
    assert "SIGKILL" in recovery["cause"]


@pytest.mark.torch
def test_replacements_that_keep_dying_while_they_take_the_state_fall_back_to_a_restart(storage_path, tmp_path,
                                                                                      clean):
    # Every replacement of rank 1 dies after the header: the third such death is past MAX_TRANSFER_DEATHS (2).
    events, state = _train(storage_path, tmp_path, "widen-fall", 2, [[1, 4, "kill"]], max_failures=6,
                           die_in_transfer=[1, 2, 3], pad_mb=32)
    assert _final(events) == clean[2]  # the second attempt trained from scratch (no checkpoint was saved)
    assert {e["attempt"] for e in events if e["event"] == "end"} == {2}
    recoveries = state["live_recoveries"]
    assert [r["path"] for r in recoveries] == ["restart"]
    assert "3 more ranks died while rank(s) [1] took the state (more than 2)" in recoveries[0]["reason"]
    assert len(state["attempts"]) == 2 and state["status"] == "finished"
    assert state["failure_counts"] == {"worker": 4}  # three charged to the recovery, and the restart's


def _no_step_run_twice(events: list[dict], workers: int, victims: list[int]) -> None:
    """No survivor threw a step away: each ran every step once, in order, its gradients of a step that broke kept and
    reduced again; each replacement went on from where its rank's process died, every step of the run once."""
    assert not [e for e in events if e["event"] == "thrown"]
    for rank in range(workers):
        steps = [e["step"] for e in events if e["rank"] == rank and e["event"] == "step"]
        if rank in victims:
            # The first process's steps, then its replacement's, none twice; the one missing, if any, is the step
            # the first process applied and died in before it logged it.
            assert steps == sorted(set(steps)) and len(set(range(STEPS)) - set(steps)) <= 1, (rank, steps)
        else:
            assert steps == list(range(STEPS)), (rank, steps)


def _one_recovery_kept_the_others(events: list[dict], state: dict, workers: int, victims: list[int]) -> dict:
    """The survivors kept their pids, the run ended in its first attempt, and one recovery replaced `victims`."""
    starts = [e for e in events if e["event"] == "start"]
    assert sorted(e["rank"] for e in starts if e["incarnation"] == 1) == sorted(victims)
    for rank in set(range(workers)) - set(victims):
        assert len({e["pid"] for e in events if e["rank"] == rank}) == 1
    assert {e["attempt"] for e in events} == {1}
    assert len(state["attempts"]) == 1 and state["status"] == "finished"
    assert state["failure_counts"] == {"worker": len(victims)}
    [recovery] = state["live_recoveries"]
    assert recovery["path"] == "live" and sorted(recovery["ranks"]) == sorted(victims)
    assert recovery["steps_lost"] == 0
    _no_step_run_twice(events, workers, victims)
    return recovery


@pytest.mark.torch
@pytest.mark.parametrize("victims", [[1, 2], [0, 2]], ids=["ranks-1-2", "ranks-0-2"])
def test_two_of_three_ranks_killed_at_once_are_replaced_in_one_recovery_from_the_one_left(
        storage_path, tmp_path, victims, clean):
    events, state = _train(storage_path, tmp_path, "two", 3, [[v, 4, "kill"] for v in victims])
    recovery = _one_recovery_kept_the_others(events, state, 3, victims)
    assert "SIGKILL" in recovery["cause"]
    assert _final(events) == clean[3]


PHASES = {  # the fault point a rank dies at in each phase of a step ("forward": the loop kills itself)
    "forward": "forward", "allreduce": "live.allreduce", "vote": "live.vote", "optimizer": "live.optimizer_step",
    "report": "report.begin", "upload": "upload.mid",
}


@pytest.mark.torch
@pytest.mark.parametrize("rank,phase", [(r, p) for p in PHASES for r in (0, 1) if not (p == "upload" and r == 1)],
                         ids=lambda v: str(v))
def test_a_rank_killed_in_each_phase_of_a_step_costs_no_step(storage_path, tmp_path, rank, phase, clean,
                                                                        caplog):
    # Rank 0 reports a checkpoint with every step, uploaded before its report() returns, and report() then waits
    # for the checkpoint's commit: a rank lost after a step's commit and before its report of it is counted by
    # the controller, or rank 0 would wait for that report forever. Rank 1 uploads nothing ("upload" is rank 0's).
    events, state = _train(storage_path, tmp_path, f"{phase}{rank}", 2, [], faults=[[rank, 4, PHASES[phase]]],
                           checkpoint=True)
    recovery = _one_recovery_kept_the_others(events, state, 2, [rank])
    assert "SIGKILL" in recovery["cause"]
    assert _final(events) == clean[2]
    assert "ignored a report" not in caplog.text
    # Every step's report was counted on every rank: the checkpoints went on committing after the recovery.
    steps = [c["metrics"]["step"] for c in state["checkpoints"]]
    assert steps[-1] == STEPS - 1 and set(range(5, STEPS)) <= set(steps)


@pytest.mark.torch
def test_a_stopped_rank_is_found_by_the_hang_watch_killed_and_replaced_while_the_other_goes_on(
        storage_path, tmp_path, clean):
    # Rank 1 SIGSTOPs itself before step 4: rank 0 waits in the allreduce, its sockets open. The hang watch (5 s)
    # asks both for their stacks; rank 1 sends none, is blamed, and is SIGKILLed by its agent, which breaks rank
    # 0's allreduce at once.
    events, state = _train(storage_path, tmp_path, "hang", 2, [], faults=[[1, 4, "stop"]], hang_timeout_s=5.0)
    recovery = _one_recovery_kept_the_others(events, state, 2, [1])
    assert "rank 1 hung" in recovery["cause"] and "made no progress" in recovery["cause"]
    assert state["attempts"][0]["failures"][0]["kind"] == "Hang"
    assert _final(events) == clean[2]


@pytest.mark.torch
def test_a_lost_node_s_rank_is_replaced_on_another_node_from_the_survivor(storage_path, tmp_path, clean,
                                                                            monkeypatch):
    from outlast.testing import LocalCluster

    monkeypatch.setenv("OUTLAST_NODE_TIMEOUT_S", "2")
    events = tmp_path / "node.jsonl"
    with LocalCluster(num_nodes=3, node_timeout_s=2, workdir=tmp_path / "cl") as cluster:
        def kill_rank_1s_node():
            wait_until(lambda: events.exists() and any(e["event"] == "step" and e["step"] >= 3
                                                       for e in read_events(events)), timeout_s=120, what="step 3")
            [node] = {e["node"] for e in read_events(events) if e["rank"] == 1}
            cluster.kill_node(node)
        killer = threading.Thread(target=kill_rank_1s_node, daemon=True)
        killer.start()
        got, state = _train(storage_path, tmp_path, "node", 2, [], strategy="SPREAD", sleep=0.3)
        killer.join()
    recovery = _one_recovery_kept_the_others(got, state, 2, [1])
    assert "lost" in recovery["cause"]
    assert state["attempts"][0]["failures"][0]["kind"] == "NodeLost"
    nodes = {(e["rank"], e["incarnation"]): e["node"] for e in got if e["event"] == "start"}
    assert nodes[1, 1] != nodes[1, 0]  # the replacement went to a node with room: the spare, or rank 0's
    assert _final(got) == clean[2]
