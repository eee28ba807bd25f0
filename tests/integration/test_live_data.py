"""Live recovery with prepare_data_loader: a replacement reads the batches of the step it takes up.

Two ranks read a shuffled DataLoader through prepare_data_loader; a rank is SIGKILLed mid-epoch and at the first
step of an epoch. The survivor keeps its batch of the step that broke; the replacement takes the loader's place
from it (the place at the start of that step, dealt to its own rank) and the epoch the loop is in, reads the batch
the lost rank was reading, and goes on. Every row is used once per epoch, in committed steps, and the weights are
those of the run in which nothing failed.
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from pathlib import Path

import pytest

from outlast.train import FailureConfig, RunConfig, ScalingConfig
from tests.integration.jobs import read_events
from tests.integration.live_jobs import live_loader_loop

ROWS, BATCH, EPOCHS = 48, 4, 2  # 6 steps an epoch at 2 ranks


def _fit(storage_path: str, tmp_path: Path, name: str, kill: list[list[int]], fsdp: bool = False
         ) -> tuple[list[dict], dict]:
    from outlast.train.torch import TorchTrainer

    events = tmp_path / f"{name}.jsonl"
    TorchTrainer(
        live_loader_loop,
        train_loop_config={"events": str(events), "rows": ROWS, "batch": BATCH, "epochs": EPOCHS, "kill": kill,
                           "fsdp": fsdp},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name=name, storage_path=storage_path,
                             failure_config=FailureConfig(max_failures=3, live_recovery=True)),
    ).fit()
    return read_events(events), json.loads((Path(storage_path) / name / "run_state.json").read_text())


@pytest.mark.torch
def test_a_replacement_reads_the_batches_of_the_step_it_takes_up_and_every_row_is_used_once_an_epoch(
        storage_path, tmp_path):
    clean, _ = _fit(storage_path, tmp_path, "clean", [])
    # Rank 1 dies mid-epoch 0 (step 3), rank 0 at the first step of epoch 1 (step 6).
    killed, state = _fit(storage_path, tmp_path, "killed", [[1, 3], [0, 6]])
    assert [r["path"] for r in state["live_recoveries"]] == ["live", "live"] and len(state["attempts"]) == 1
    starts = {(e["rank"], e["incarnation"]): e for e in killed if e["event"] == "start"}
    assert (starts[1, 1]["step"], starts[1, 1]["epoch"]) == (3, 0) and (starts[0, 1]["step"], starts[0, 1]["epoch"]) \
        == (6, 1)

    def batches(events: list[dict]) -> dict[tuple[int, int], list[int]]:
        return {(e["rank"], e["step"]): e["rows"] for e in events if e["event"] == "step"}

    # Each rank read, at each step, what it read in the run without failures: the replacements too.
    assert batches(killed) == batches(clean)
    for epoch in range(EPOCHS):
        used = Counter(r for e in killed if e["event"] == "step" and e["epoch"] == epoch for r in e["rows"])
        assert used == Counter(range(ROWS)), epoch
    final = {e["rank"]: e["exact"] for e in killed if e["event"] == "end"}
    assert final == {e["rank"]: e["exact"] for e in clean if e["event"] == "end"}


@pytest.mark.torch
def test_an_fsdp2_step_thrown_away_is_run_again_on_the_batches_it_read_and_every_row_is_used_once_an_epoch(
        storage_path, tmp_path):
    # FSDP2 over live_mesh: the survivor throws the step that broke away and reads its batch again; the
    # replacement reads the lost rank's. Rank 1 dies mid-epoch 0 (step 3), rank 0 at the first step of epoch 1.
    clean, _ = _fit(storage_path, tmp_path, "clean", [], fsdp=True)
    killed, state = _fit(storage_path, tmp_path, "killed", [[1, 3], [0, 6]], fsdp=True)
    assert [(r["path"], r["steps_lost"]) for r in state["live_recoveries"]] == [("live", 1), ("live", 1)]
    assert [(e["rank"], e["step"]) for e in killed if e["event"] == "thrown"] == [(0, 3), (1, 6)]
    applied = {(e["rank"], e["step"]): e["rows"] for e in killed if e["event"] == "step"}
    assert applied == {(e["rank"], e["step"]): e["rows"] for e in clean if e["event"] == "step"}
    for epoch in range(EPOCHS):
        used = Counter(r for e in killed if e["event"] == "step" and e["epoch"] == epoch for r in e["rows"])
        assert used == Counter(range(ROWS)), epoch
    assert {e["rank"]: e["exact"] for e in killed if e["event"] == "end"} == \
        {e["rank"]: e["exact"] for e in clean if e["event"] == "end"}


@pytest.mark.torch
def test_a_loader_whose_place_a_replacement_could_not_take_up_is_refused_saying_what_to_use(storage_path):
    from outlast.errors import WorkerGroupError
    from outlast.train.torch import TorchTrainer
    from tests.integration.live_jobs import live_custom_sampler_loop

    with pytest.raises(WorkerGroupError) as e:
        TorchTrainer(live_custom_sampler_loop, scaling_config=ScalingConfig(num_workers=2),
                     run_config=RunConfig(name="sampler", storage_path=storage_path,
                                          failure_config=FailureConfig(max_failures=0, live_recovery=True))).fit()
    assert "prepare_data_loader with FailureConfig(live_recovery=True)" in str(e.value)
    assert "SubsetRandomSampler" in str(e.value) and "docs/guide/live-recovery.md" in str(e.value)


@pytest.mark.torch
def test_a_replacement_goes_on_with_the_lost_ranks_shuffled_share_of_a_dataset_shard(storage_path, tmp_path):
    """get_dataset_shard: each rank shuffles its own share, with a seed drawn from the run's, which the replacement
    tells from the survivor's place; it reads the rest of the lost rank's share in the lost rank's order."""
    import numpy as np

    from outlast.train.torch import TorchTrainer
    from tests.integration.live_jobs import live_shard_loop

    events = tmp_path / "shard.jsonl"
    x = np.random.default_rng(7).standard_normal((ROWS, 8)).astype(np.float32)
    TorchTrainer(
        live_shard_loop, datasets={"train": {"i": np.arange(ROWS), "x": x}},
        train_loop_config={"events": str(events), "rows": ROWS, "batch": BATCH, "epochs": EPOCHS,
                           "kill": [[1, 3], [0, 6]]},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="shard", storage_path=storage_path,
                             failure_config=FailureConfig(max_failures=3, live_recovery=True)),
    ).fit()
    killed = read_events(events)
    state = json.loads((Path(storage_path) / "shard" / "run_state.json").read_text())
    assert [r["path"] for r in state["live_recoveries"]] == ["live", "live"] and len(state["attempts"]) == 1
    starts = {(e["rank"], e["incarnation"]): e for e in killed if e["event"] == "start"}
    assert (starts[1, 1]["step"], starts[1, 1]["epoch"]) == (3, 0) and (starts[0, 1]["step"], starts[0, 1]["epoch"]) \
        == (6, 1)
    for epoch in range(EPOCHS):
        for rank, share in ((0, range(ROWS // 2)), (1, range(ROWS // 2, ROWS))):
            used = Counter(r for e in killed if e["event"] == "step" and e["epoch"] == epoch and e["rank"] == rank
                           for r in e["rows"])
            assert used == Counter(share), (epoch, rank)  # the share once, its shuffled rest read by the replacement


@pytest.mark.torch
@pytest.mark.parametrize("loop", ["live_shard_loop", "live_loader_loop"])
def test_a_live_grow_splits_the_rest_of_the_epoch_between_the_new_ranks(storage_path, tmp_path, monkeypatch, loop):
    """An elastic run (min 2, max 3) grows live mid-epoch when a node joins: the two ranks that were there and the
    one that joined split the rest of the epoch between them (the joiner from the place it was sent, the others
    from their own), so every row is used once an epoch, in the same attempt, with no step lost."""
    import threading

    from outlast.testing import LocalCluster
    from tests.integration.procs import wait_until

    monkeypatch.setenv("OUTLAST_NODE_TIMEOUT_S", "2")
    rows, batch, epochs = 96, 4, 3  # 12 steps an epoch at 2 ranks
    events = tmp_path / "grow.jsonl"
    with LocalCluster(num_nodes=2, cpus_per_node=1, node_timeout_s=2, workdir=tmp_path / "cl") as cluster:
        def join() -> None:
            wait_until(lambda: any(e["event"] == "step" and e["step"] >= 3 for e in read_events(events)), 120,
                       "step 3")
            cluster.add_node("node-2")

        t = threading.Thread(target=join, daemon=True)
        t.start()
        # Each epoch read whole; on until the grown generation formed (the new node's fork server imports torch
        # first, which takes its time on a loaded machine).
        state = _fit_elastic(storage_path, "grow", loop, events, rows, max_failures=0, batch=batch, epochs=epochs,
                             until_generation=1)
        t.join()
    log = read_events(events)
    assert len(state["attempts"]) == 1 and state["attempts"][0]["workers"] == 3
    [recovery] = state["live_recoveries"]
    assert recovery["path"] == "live" and recovery["cause"].startswith("grow")
    joined = min(e["step"] for e in log if e["event"] == "step" and e["rank"] == 2)
    assert joined > 0  # it joined mid-run
    _each_row_once_an_epoch(log, rows, epochs)


@pytest.mark.torch
@pytest.mark.parametrize("loop,lost", [("live_shard_loop", 1), ("live_loader_loop", 0)])
def test_a_live_shrink_splits_the_rest_of_the_epoch_between_the_ranks_left(storage_path, tmp_path, monkeypatch, loop,
                                                                            lost):
    """An elastic run (min 2, max 3) on three one-CPU nodes loses a rank's node mid-epoch (rank 1's, or rank 0's:
    the rank that sends the state and writes the run's return value), with no room for the rank elsewhere: the two
    ranks left go on in the same processes as a world of two, numbered afresh, the step in flight thrown away (one
    step lost), and split the rest of the epoch from every rank's place at that step's start, so every row is used
    once an epoch; the history has the shrink, charged as one failure. Then the process spawned as rank 2, the
    group's rank 1 since, is killed: its replacement, forked as rank 2 and told it is the group's rank 1 of 2, takes
    up that rank's place in the new split. Then a node joins: the run grows back to three live, the rank added
    numbered 3 by the controller and 2 in the group, and every row is still used once an epoch."""
    import threading

    from tests.integration.procs import wait_until

    monkeypatch.setenv("OUTLAST_NODE_TIMEOUT_S", "2")
    rows, batch, epochs = 96, 4, 3  # 8 steps an epoch at 3 ranks, 12 at 2
    events = tmp_path / "shrink.jsonl"
    kept = [r for r in range(3) if r != lost]  # the group's ranks 0 and 1 after the shrink
    with _three_one_cpu_nodes(tmp_path) as cluster:

        def lose_a_node() -> None:
            cluster.kill_node(_node_at_step_3(events, lost))
            wait_until(lambda: any(e["event"] == "start" and e["incarnation"] == 1 for e in read_events(events)),
                       120, "the replacement")
            cluster.add_node(extra_args=["--num-cpus", "1"])

        t = threading.Thread(target=lose_a_node, daemon=True)
        t.start()
        # On until the grown generation formed: the shrink's is 1, the replacement's 2, the grow's 3. The kill is
        # of the rank spawned as 2 (the loop's rank as it started).
        state = _fit_elastic(storage_path, "shrink", loop, events, rows, max_failures=2, batch=batch, epochs=epochs,
                             kill=[[2, 14]], until_generation=3)
        t.join()
    log = read_events(events)
    assert len(state["attempts"]) == 1 and state["attempts"][0]["workers"] == 3 and state["status"] == "finished"
    assert state["failure_counts"] == {"worker": 2}
    assert [(r["from_workers"], r["to_workers"], r["steps_lost"]) for r in state["resizes"]] == [(3, 2, 1), (2, 3, 0)]
    [shrink, replaced, grown] = state["live_recoveries"]
    assert shrink["path"] == "live" and shrink["cause"].startswith("shrink") and shrink["ranks"] == [lost]
    assert shrink["steps_lost"] == 1
    assert replaced["path"] == "live" and replaced["ranks"] == [2] and replaced["steps_lost"] == 0
    assert grown["path"] == "live" and grown["cause"].startswith("grow") and grown["ranks"] == [3]
    # The ranks kept went on in their own processes, numbered 0 and 1 of 2 from the shrink; each threw one step away.
    begun = [e for e in log if e["event"] == "start"]
    starts = {(e["rank"], e["incarnation"]): e["pid"] for e in begun[:4]}
    # The replacement is the group's rank 1; the rank added last, the group's rank 2 (a start there of its own).
    assert sorted(starts) == [(0, 0), (1, 0), (1, 1), (2, 0)] and len(begun) == 5
    added = begun[4]["pid"]
    assert (begun[4]["rank"], begun[4]["incarnation"]) == (2, 0)
    for pid in (starts[kept[0], 0], starts[2, 0]):
        assert len([e for e in log if e["event"] == "thrown" and e["pid"] == pid]) == 1
    assert [e["rank"] for e in log if e["pid"] == starts[2, 0] and e["event"] == "step"][-1] == 1
    ends = {e["pid"]: e for e in log if e["event"] == "end"}
    assert set(ends) == {starts[kept[0], 0], starts[1, 1], added} and {e["world"] for e in ends.values()} == {3}
    assert [ends[p]["rank"] for p in (starts[kept[0], 0], starts[1, 1], added)] == [0, 1, 2]
    _each_row_once_an_epoch(log, rows, epochs)


@pytest.mark.torch
def test_a_drained_node_with_no_room_elsewhere_leaves_the_run_live_with_no_step_lost(storage_path, tmp_path,
                                                                                    monkeypatch):
    """An elastic run (min 2, max 3) on three one-CPU nodes: rank 1's node is drained mid-epoch, and no node has room
    for it. Its rank leaves the group after the step in flight, the two others go on as a world of two in their
    own processes, and the rest of the epoch is split between them at that step: no step is thrown away, every row
    is used once an epoch, nothing is written to storage, and the drained process exits cleanly."""
    import threading


    monkeypatch.setenv("OUTLAST_NODE_TIMEOUT_S", "2")
    rows, batch, epochs = 96, 4, 3
    events = tmp_path / "leave.jsonl"
    with _three_one_cpu_nodes(tmp_path) as cluster:

        def drain() -> None:
            cluster.drain_node(_node_at_step_3(events, 1), deadline_s=120, message="spot reclaimed")

        t = threading.Thread(target=drain, daemon=True)
        t.start()
        state = _fit_elastic(storage_path, "leave", "live_shard_loop", events, rows, max_failures=0, batch=batch,
                             epochs=epochs, until_generation=1)
        t.join()
    log = read_events(events)
    assert len(state["attempts"]) == 1 and state["status"] == "finished"
    assert state["failure_counts"] == {"preemption": 1}
    assert [(r["from_workers"], r["to_workers"], r["steps_lost"]) for r in state["resizes"]] == [(3, 2, 0)]
    [left] = state["live_recoveries"]
    assert left["path"] == "live" and left["cause"].startswith("drain") and left["ranks"] == [1]
    assert left["steps_lost"] == 0
    assert state["checkpoints"] == []
    assert not [e for e in log if e["event"] == "thrown"]
    starts = {e["rank"]: e["pid"] for e in log if e["event"] == "start"}
    assert sorted(starts) == [0, 1, 2]  # no process forked after the first three
    ends = {e["pid"]: e for e in log if e["event"] == "end"}
    assert set(ends) == {starts[0], starts[2]} and {e["world"] for e in ends.values()} == {2}
    assert [ends[starts[r]]["rank"] for r in (0, 2)] == [0, 1]  # rank 2 is the group's rank 1 after the drain
    _each_row_once_an_epoch(log, rows, epochs)


@contextlib.contextmanager
def _three_one_cpu_nodes(tmp_path: Path):
    """A cluster of three one-CPU nodes beside a head that takes no rank, so that losing or draining the node of
    rank 0 leaves the node table where it was."""
    from outlast.testing import LocalCluster

    with LocalCluster(num_nodes=1, cpus_per_node=0, node_timeout_s=2, workdir=tmp_path / "cl") as cluster:
        for _ in range(3):
            cluster.add_node(extra_args=["--num-cpus", "1"])
        yield cluster


def _node_at_step_3(events: Path, rank: int) -> str:
    """Once the ranks reached step 3, the node `rank` started on."""
    from tests.integration.procs import wait_until

    wait_until(lambda: any(e["event"] == "step" and e["step"] >= 3 for e in read_events(events)), 120, "step 3")
    [node] = {e["node"] for e in read_events(events) if e["event"] == "start" and e["rank"] == rank}
    return node


def _fit_elastic(storage_path: str, name: str, loop: str, events: Path, rows: int, max_failures: int,
                 **config) -> dict:
    """`loop` of live_jobs.py under fit(), an elastic run of 2 to 3 one-CPU ranks with live recovery, over `rows`
    rows of an id and 8 features: the run's history once it finished."""
    import numpy as np

    from outlast.train.torch import TorchTrainer
    from tests.integration import live_jobs

    x = np.random.default_rng(7).standard_normal((rows, 8)).astype(np.float32)
    TorchTrainer(
        getattr(live_jobs, loop), datasets={"train": {"i": np.arange(rows), "x": x}},
        train_loop_config={"events": str(events), "rows": rows, "sleep": 0.1, **config},
        scaling_config=ScalingConfig(num_workers=(2, 3), resources_per_worker={"CPU": 1},
                                     elastic_resize_monitor_interval_s=0),
        run_config=RunConfig(name=name, storage_path=storage_path,
                             failure_config=FailureConfig(max_failures=max_failures, live_recovery=True)),
    ).fit()
    return json.loads((Path(storage_path) / name / "run_state.json").read_text())


def _each_row_once_an_epoch(log: list[dict], rows: int, epochs: int) -> None:
    """Every row was used once in each epoch the run trained (at least `epochs`), in steps applied."""
    run = 1 + max(e["epoch"] for e in log if e["event"] == "step")
    assert run >= epochs
    applied = [e for e in log if e["event"] == "step"] + _applied_unlogged(log)
    for epoch in range(run):
        used = Counter(r for e in applied if e["epoch"] == epoch for r in e["rows"])
        assert used == Counter(range(rows)), (epoch, sorted((r, n) for r, n in used.items() if n != 1),
                                              sorted(set(range(rows)) - set(used)))


def _applied_unlogged(log: list[dict]) -> list[dict]:
    """The batch of a process that died in a step after the step was committed, before it logged it (a node lost at
    that instant): its last event is the batch it reduced, and the others applied that step, throwing none away at
    that number. A process that left the group (a drained one) reduced no batch of that step."""
    thrown = {e["step"] for e in log if e["event"] == "thrown"}
    last = {e["pid"]: e for e in log}
    return [e for e in last.values() if e["event"] == "batch" and e["step"] not in thrown]
