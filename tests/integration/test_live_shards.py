"""Live recovery with the optimizer's state split between ranks (`LiveTraining(shards=2)`): real processes, gloo.

Four ranks form two replicas of two shards: shard 0 on ranks 0 and 2, shard 1 on ranks 1 and 3, each rank's Adam
holding the moments of its shard alone. A lost rank's replacement takes the state from the other holder of its
shard, and the run ends with every rank's weights those of the run in which nothing failed. With both holders of a
shard lost, nobody can send it: the run restarts, and its history says why.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.test_live_recovery import _final, _no_step_run_twice, _train

WORKERS, SHARDS = 4, 2


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """Every rank's final weights in a sharded run in which nothing failed."""
    where = tmp_path_factory.mktemp("clean_shards")
    with pytest.MonkeyPatch.context() as mp:  # a home of its own, as test_live_recovery's fixture has
        mp.setenv("OUTLAST_HOME", str(tmp_path_factory.mktemp("clean_shards_home")))
        mp.delenv("OUTLAST_ADDRESS", raising=False)
        mp.setenv("OUTLAST_PRELOAD", "")
        final = _final(_train(str(where / "storage"), where, "clean", WORKERS, [], shards=SHARDS)[0])
    assert len(final) == WORKERS and all(w == final[0] for w in final.values())
    return final


@pytest.mark.torch
@pytest.mark.parametrize("victim,sender", [(1, 3), (0, 2)], ids=["rank1-from-rank3", "rank0-from-rank2"])
def test_a_lost_rank_takes_its_shard_from_the_other_replica_s_holder(storage_path, tmp_path, clean, caplog,
                                                                     victim, sender):
    events, state = _train(storage_path, tmp_path, "shards", WORKERS, [[victim, 4, "kill"]], shards=SHARDS)
    assert _final(events) == clean
    _no_step_run_twice(events, WORKERS, [victim])
    assert len(state["attempts"]) == 1 and state["failure_counts"] == {"worker": 1}
    [recovery] = state["live_recoveries"]
    assert recovery["path"] == "live" and recovery["ranks"] == [victim] and recovery["steps_lost"] == 0
    assert f"rank {sender} sends the state to rank(s) [{victim}]" in caplog.text


@pytest.mark.torch
@pytest.mark.parametrize("checkpoint", [False, True], ids=["reports", "checkpoints"])
def test_a_rank_lost_while_the_shards_are_gathered_costs_no_step(storage_path, tmp_path, clean, checkpoint):
    # Rank 1 dies after the step committed and every rank applied its shard: the others hold shard 1 a step behind
    # until the group, formed again with rank 1's replacement (which takes shard 1 from rank 3), gathers once more.
    # With a checkpoint at each step, rank 0's report() returns once every rank reported the step: the replacement,
    # joined before the others reported step 5, must report step 6 with their count.
    events, state = _train(storage_path, tmp_path, "gather", WORKERS, [], shards=SHARDS,
                           faults=[[1, 5, "live.gather"]], checkpoint=checkpoint)
    assert _final(events) == clean
    _no_step_run_twice(events, WORKERS, [1])
    [recovery] = state["live_recoveries"]
    assert recovery["path"] == "live" and recovery["steps_lost"] == 0
    assert len(state["attempts"]) == 1


@pytest.mark.torch
def test_with_every_holder_of_a_shard_lost_the_run_falls_back_and_says_which(storage_path, tmp_path, clean):
    events, state = _train(storage_path, tmp_path, "unheld", WORKERS, [[1, 4, "kill"], [3, 4, "kill"]],
                           shards=SHARDS)
    assert _final(events) == clean  # the second attempt trained from scratch (no checkpoint was saved)
    assert {e["attempt"] for e in events if e["event"] == "end"} == {2}
    last = state["live_recoveries"][-1]
    assert last["path"] == "restart", state["live_recoveries"]
    assert "every rank holding shard(s) [1] of the optimizer's 2" in last["reason"], last["reason"]
    assert len(state["attempts"]) == 2 and state["status"] == "finished"


@pytest.mark.torch
def test_a_fallback_restores_every_shard_from_the_checkpoint_the_ranks_saved_in_parts(storage_path, tmp_path, clean):
    # Every rank reports its part of LiveTraining.save with each step: rank 0 the weights and layout, ranks 0 and 1
    # (the first replica) the moments of shards 0 and 1. Ranks 1 and 3 die in step 4, leaving shard 1 no holder:
    # the restart loads step 3's checkpoint, each rank its own shard's moments, and goes on bit for bit.
    events, state = _train(storage_path, tmp_path, "parts", WORKERS, [[1, 4, "kill"], [3, 4, "kill"]],
                           shards=SHARDS, checkpoint="live")
    assert "every rank holding shard(s) [1] of the optimizer's 2" in state["live_recoveries"][-1]["reason"]
    restored = state["attempts"][1]["restored_from"]
    files = sorted(p.name for p in (Path(storage_path) / "parts" / restored).iterdir() if not p.name.startswith("."))
    assert files == ["live.json", "model.pt", "optimizer-shard-0-of-2.pt", "optimizer-shard-1-of-2.pt", "state.pt"]
    assert sorted(e["step"] for e in events if e["event"] == "start" and e["attempt"] == 2) == [4] * WORKERS
    assert _final(events) == clean  # Adam's moments of both shards came back, or the weights would differ
