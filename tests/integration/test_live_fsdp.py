"""Live recovery of an FSDP2 model (HSDP over `live_mesh(shards=2)`): real processes, gloo on CPU.

Four ranks form two replicas of two shards: shard 0 on ranks 0 and 2, shard 1 on ranks 1 and 3; each holds its
shard's weights and Adam's moments alone, and the reductions run inside backward. A rank lost in its forward or
backward fails its peers' collectives at once (no timeout waited), the step in flight is thrown away on every rank,
the replacement takes its shard from the other replica's holder, and the step runs again: the run ends with every
rank's pieces of the weights those of the run in which nothing failed. With both holders of a shard lost, nobody can
send it: the run restarts from the checkpoint the ranks saved in parts, each shard's weights and moments its own.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from outlast.train import FailureConfig, RunConfig, ScalingConfig
from tests.integration.jobs import read_events
from tests.integration.live_jobs import live_fsdp_loop

WORKERS, STEPS = 4, 8


def _train(storage_path: str, tmp_path: Path, name: str, kill: list[list], max_failures: int = 3,
           hang_timeout_s: float | None = None, **config):
    from outlast.train.torch import TorchTrainer

    events = tmp_path / f"{name}.jsonl"
    result = TorchTrainer(
        live_fsdp_loop, train_loop_config={"events": str(events), "steps": STEPS, "kill": kill, **config},
        scaling_config=ScalingConfig(num_workers=WORKERS),
        run_config=RunConfig(name=name, storage_path=storage_path,
                             failure_config=FailureConfig(max_failures=max_failures, live_recovery=True,
                                                          hang_timeout_s=hang_timeout_s)),
    ).fit()
    assert result.last_metrics == {"step": STEPS - 1}
    return read_events(events), json.loads((Path(storage_path) / name / "run_state.json").read_text())


def _final(events: list[dict]) -> dict[int, list]:
    return {e["rank"]: e["exact"] for e in events if e["event"] == "end"}


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """Every rank's pieces of the weights in a run in which nothing failed."""
    where = tmp_path_factory.mktemp("clean_fsdp")
    with pytest.MonkeyPatch.context() as mp:  # a home of its own, as test_live_recovery's fixture has
        mp.setenv("OUTLAST_HOME", str(tmp_path_factory.mktemp("clean_fsdp_home")))
        mp.delenv("OUTLAST_ADDRESS", raising=False)
        mp.setenv("OUTLAST_PRELOAD", "")
        final = _final(_train(str(where / "storage"), where, "clean", [])[0])
    assert sorted(final) == list(range(WORKERS))
    assert final[0] == final[2] and final[1] == final[3] and final[0] != final[1]  # two replicas of two shards
    return final


@pytest.mark.torch
@pytest.mark.parametrize("victim,where,sender", [(1, "backward", 3), (0, "forward", 2), (2, "live.vote", 0),
                                                 (3, "live.optimizer_step", 1)],
                         ids=["rank1-in-backward", "rank0-in-forward", "rank2-at-its-vote", "rank3-at-its-apply"])
def test_a_lost_rank_takes_its_shard_from_the_other_replica_and_the_step_runs_again(storage_path, tmp_path, clean,
                                                                                    caplog, victim, where, sender):
    events, state = _train(storage_path, tmp_path, "fsdp", [[victim, 4, where]])
    assert _final(events) == clean
    assert len(state["attempts"]) == 1 and state["failure_counts"] == {"worker": 1}
    [recovery] = state["live_recoveries"]
    assert recovery["path"] == "live" and recovery["ranks"] == [victim] and recovery["steps_lost"] == 1
    assert f"rank {sender} sends the state to rank(s) [{victim}]" in caplog.text
    # The survivors lived on, and ran one step twice: thrown, then applied. Lost after the commit of step 4, the
    # victim's collectives of step 5 are missing: that is the step thrown away.
    thrown = 5 if where == "live.optimizer_step" else 4
    _survivors_ran_one_step_twice(events, [victim], thrown)


def _survivors_ran_one_step_twice(events: list[dict], victims: list[int], thrown: int) -> None:
    for rank in set(range(WORKERS)) - set(victims):
        assert len({e["pid"] for e in events if e["rank"] == rank}) == 1
        assert [e["step"] for e in events if e["rank"] == rank and e["event"] == "thrown"] == [thrown]
        assert [e["step"] for e in events if e["rank"] == rank and e["event"] == "step"] == list(range(STEPS))


@pytest.mark.torch
def test_a_rank_lost_while_the_mesh_s_groups_form_is_replaced_and_the_run_starts_live(storage_path, tmp_path, clean):
    # Rank 1 dies as generation 0's mesh groups form: the others, waiting for it in the store, see generation 1
    # published and form that one with its replacement (gloo's own rendezvous would hold them to its timeout).
    events, state = _train(storage_path, tmp_path, "attach", [[1, -1, "live.attach"]])
    assert _final(events) == clean
    [recovery] = state["live_recoveries"]
    assert recovery["path"] == "live" and recovery["ranks"] == [1]
    assert len(state["attempts"]) == 1 and state["failure_counts"] == {"worker": 1}


@pytest.mark.torch
def test_two_ranks_of_different_shards_lost_at_once_each_take_theirs_from_its_other_holder(storage_path, tmp_path,
                                                                                          clean, caplog):
    events, state = _train(storage_path, tmp_path, "two", [[0, 4, "backward"], [3, 4, "backward"]])
    assert _final(events) == clean
    assert len(state["attempts"]) == 1 and state["failure_counts"] == {"worker": 2}
    assert all(r["path"] == "live" for r in state["live_recoveries"]), state["live_recoveries"]
    assert sorted(r for rec in state["live_recoveries"] for r in rec["ranks"]) == [0, 3]
    for sender, victim in ((2, 0), (1, 3)):  # one sender names itself alone, several each with whom it sends to
        assert re.search(rf"rank {sender} sends the state to rank\(s\) \[{victim}\]|{sender} \(to \[{victim}\]\)",
                         caplog.text), caplog.text
    _survivors_ran_one_step_twice(events, [0, 3], 4)


@pytest.mark.torch
def test_a_rank_stopped_in_its_backward_is_found_killed_and_replaced_and_its_peers_go_on(storage_path, tmp_path,
                                                                                        clean):
    # Rank 1 SIGSTOPs itself in its backward: its peers wait in collectives with it, its sockets open. The hang
    # watch (5 s) blames it and its agent SIGKILLs it, which fails their collectives at once.
    events, state = _train(storage_path, tmp_path, "hang", [[1, 4, "stop-backward"]], hang_timeout_s=5.0)
    assert _final(events) == clean
    [recovery] = state["live_recoveries"]
    assert recovery["path"] == "live" and "rank 1 hung" in recovery["cause"] and recovery["steps_lost"] == 1
    assert state["attempts"][0]["failures"][0]["kind"] == "Hang"
    _survivors_ran_one_step_twice(events, [1], 4)


@pytest.mark.torch
def test_with_both_holders_of_a_shard_lost_the_run_restarts_from_the_shards_saved_in_parts(storage_path, tmp_path,
                                                                                           clean):
    events, state = _train(storage_path, tmp_path, "unheld", [[1, 4, "backward"], [3, 4, "backward"]],
                           checkpoint="live")
    last = state["live_recoveries"][-1]
    assert last["path"] == "restart" and "every rank holding shard(s) [1]" in last["reason"], last["reason"]
    restored = state["attempts"][1]["restored_from"]
    files = sorted(p.name for p in (Path(storage_path) / "unheld" / restored).iterdir() if not p.name.startswith("."))
    assert files == ["live.json", "model-shard-0-of-2.pt", "model-shard-1-of-2.pt", "optimizer-shard-0-of-2.pt",
                     "optimizer-shard-1-of-2.pt", "state.pt"]
    assert sorted(e["step"] for e in events if e["event"] == "start" and e["attempt"] == 2) == [4] * WORKERS
    assert _final(events) == clean  # each shard's weights and moments came back, or the weights would differ


@pytest.mark.torch
def test_a_loop_whose_forward_and_backward_are_not_guarded_is_told_how_to_write_them(storage_path, tmp_path):
    from outlast.train import TrainingFailedError

    with pytest.raises(TrainingFailedError, match=r"inside `with live.forward_backward\(\):`, then call live.step"):
        _train(storage_path, tmp_path, "unguarded", [], max_failures=0, unguarded=True)
