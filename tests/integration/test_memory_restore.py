"""Restores of a run that keeps its checkpoints in storage (the default), on real nodes: the nodes of a new
attempt first pull what they lack from the nodes that keep it in memory, so a restore reads this node's RAM,
then a peer's, then storage, and a copy in RAM that does not match its record is passed over for the next."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from pathlib import Path

from outlast.storage.records import MANIFEST_NAME
from outlast.testing import LocalCluster
from outlast.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig, Trainer
from tests.integration.jobs import counting_loop, read_events
from tests.integration.procs import wait_until

RESTORED = r"\[rank (\d) (node-\d) a2\] outlast INFO rank \d restored (checkpoint_\d+_\d+) from (\w+)"


def _state(storage_path) -> dict:
    return json.loads((Path(storage_path) / "run" / "run_state.json").read_text())


def _replicated(storage_path, index: int) -> bool:
    try:
        return any(r["report_index"] == index and r["memory_at"] for r in _state(storage_path)["checkpoints"])
    except (FileNotFoundError, json.JSONDecodeError):
        return False


def _fit(storage_path, events, steps=24, every=6, **config):
    # Steps slow enough that the next checkpoint is far off when a test acts after step 7.
    config = {"events": str(events), "steps": steps, "every": every, "sharded": True, "delete_after_report": True,
              "step_sleep": 0.3, **config}
    return Trainer(counting_loop, train_loop_config=config,
                   scaling_config=ScalingConfig(num_workers=2, placement_strategy="SPREAD"),
                   run_config=RunConfig(name="run", storage_path=storage_path,
                                        failure_config=FailureConfig(max_failures=1),
                                        checkpoint_config=CheckpointConfig())).fit()


def _spoil_storage(storage_path) -> list[Path]:
    """Every stored file of every checkpoint but its manifest, overwritten: a restore that read one fails its
    checksum."""
    spoiled = [p for p in (Path(storage_path) / "run").glob("checkpoint_*/*") if p.name != MANIFEST_NAME]
    for p in spoiled:
        p.write_text("not the checkpoint")
    return spoiled


def _holdings_of(cluster, node_id: str):
    import zmq

    from outlast.agent.tier_client import ask
    from outlast.protocol import messages as m
    from outlast.protocol.auth import ClusterKey

    ctx = zmq.Context()
    try:
        address = next(n.tier_address for n in cluster.node_table() if n.node_id == node_id)
        return ask(ctx, ClusterKey.load(cluster.key_file), address, m.TierList(), timeout_s=30)
    finally:
        ctx.destroy(linger=0)


def test_a_lost_nodes_ranks_on_a_third_node_restore_from_the_peers_memory_not_from_storage(monkeypatch, tmp_path,
                                                                                         storage_path, capfd):
    monkeypatch.setenv("OUTLAST_NODE_TIMEOUT_S", "2")
    events = tmp_path / "events.jsonl"
    spoiled: list[Path] = []
    with LocalCluster(num_nodes=3, node_timeout_s=2, cpus_per_node=1, workdir=tmp_path / "cl") as cluster:
        def kill_once_replicated():
            wait_until(lambda: _replicated(storage_path, 5), 60, "checkpoint 5 held on two nodes")
            wait_until(lambda: any(e["event"] == "step" and e["step"] >= 7 for e in read_events(events)), 60,
                       "step 7")
            cluster.kill_node("node-1")
            spoiled.extend(_spoil_storage(storage_path))  # before the new attempt is placed (2 s)

        killer = threading.Thread(target=kill_once_replicated, daemon=True)
        killer.start()
        result = _fit(storage_path, events)
        killer.join()
    assert spoiled  # the durable copies were there, and unusable
    assert result.last_metrics == {"step": 23}
    starts = [e for e in read_events(events) if e["event"] == "start" and e["attempt"] == 2]
    assert [e["restored_step"] for e in starts] == [5, 5]
    said = "".join(capfd.readouterr())
    # node-2 kept only rank 1's replica, node-0 only rank 0's own copy: each pulled the other's from its RAM.
    restored = re.findall(RESTORED, said)
    assert sorted(restored) == [("0", "node-0", "checkpoint_001_000005", "local_memory"),
                                ("1", "node-2", "checkpoint_001_000005", "local_memory")], said[-4000:]
    assert "from storage" not in said
    record = next(r for r in _state(storage_path)["checkpoints"] if r["report_index"] == 5)
    assert record["durable"] is True


def test_a_corrupt_copy_in_ram_is_skipped_for_the_peers_and_the_history_says_so(monkeypatch, tmp_path, storage_path,
                                                                              capfd):
    monkeypatch.setenv("OUTLAST_NODE_TIMEOUT_S", "2")
    events = tmp_path / "events.jsonl"
    home: list[str] = []
    with LocalCluster(num_nodes=2, node_timeout_s=2, cpus_per_node=1, workdir=tmp_path / "cl") as cluster:
        def corrupt_then_kill():
            wait_until(lambda: _replicated(storage_path, 5), 60, "checkpoint 5 held on two nodes")
            wait_until(lambda: any(e["event"] == "step" and e["step"] >= 7 for e in read_events(events)), 60,
                       "step 7")
            # Rank 0's own copy on its node, flipped in place (same size): only a checksum tells.
            (own,) = [p / "state.json" for p in cluster.tier_dir.glob("node-*/*/checkpoint_001_000005/rank-0")
                      if json.loads(p.with_name("rank-0.json").read_text())["primary"]]
            home.append(own.parts[len(cluster.tier_dir.parts)])
            text = own.read_text()
            own.write_text(text.replace("5", "4"))
            pid = next(e["pid"] for e in read_events(events) if e["event"] == "start" and e["rank"] == 0)
            _spoil_storage(storage_path)
            os.kill(pid, signal.SIGKILL)

        killer = threading.Thread(target=corrupt_then_kill, daemon=True)
        killer.start()
        result = _fit(storage_path, events)
        killer.join()
    assert result.last_metrics == {"step": 23}
    starts = [e for e in read_events(events) if e["event"] == "start" and e["attempt"] == 2]
    assert [e["restored_step"] for e in starts] == [5, 5]
    said = "".join(capfd.readouterr())
    assert "from storage" not in said, said[-4000:]
    assert sorted(r[3] for r in re.findall(RESTORED, said)) == ["local_memory", "local_memory"]
    notes = [n["text"] for n in _state(storage_path)["notes"]]
    assert any(f"restoring checkpoint_001_000005: the copy of rank 0 in memory on {home[0]} was skipped: file "
               "state.json does not match its checksum" in n for n in notes), notes


def test_a_nodes_budget_evicts_the_oldest_copies_and_keeps_the_newest_committed(monkeypatch, tmp_path, storage_path):
    import zmq

    from outlast.agent.tier_client import ask
    from outlast.protocol import messages as m
    from outlast.protocol.auth import ClusterKey

    events, looked = tmp_path / "events.jsonl", tmp_path / "looked"
    names = [f"checkpoint_001_{i:06d}" for i in (2, 5, 8, 11, 14)]  # a checkpoint every 3 steps of 15
    seen: dict = {}
    # Each checkpoint is about 2.1 MiB on each node (its rank's copy and the other's replica): two fit in 5 MiB.
    with LocalCluster(num_nodes=2, cpus_per_node=1, workdir=tmp_path / "cl",
                      node_args=["--checkpoint-memory", "5MiB"]) as cluster:
        ctx = zmq.Context()
        try:
            key = ClusterKey.load(cluster.key_file)

            def holdings():
                return {n.node_id: ask(ctx, key, n.tier_address, m.TierList(), timeout_s=30)
                        for n in cluster.node_table()}

            def look_while_the_run_lives():
                try:
                    wait_until(lambda: all(sorted(c.rank for c in h.copies if c.checkpoint_dir == names[-1]) == [0, 1]
                                           for h in holdings().values()), 60, "the last checkpoint on both nodes")
                    seen.update(holdings())
                finally:
                    looked.touch()

            looker = threading.Thread(target=look_while_the_run_lives, daemon=True)
            looker.start()
            result = _fit(storage_path, events, steps=15, every=3, pad_bytes=1 << 20, step_sleep=0.05,
                          end_when=str(looked))
            looker.join()
            assert result.last_metrics == {"step": 14}
            assert [r["checkpoint_dir"] for r in _state(storage_path)["checkpoints"]] == names
            assert sorted(seen) == ["node-0", "node-1"]
            for node, held in seen.items():
                assert held.used_bytes <= 5 << 20
                kept = sorted({c.checkpoint_dir for c in held.copies})
                # The oldest went first; the newest committed is there, its node's own copy told committed.
                assert kept == names[-2:], (node, kept)
                assert any(c.checkpoint_dir == names[-1] and c.primary and c.committed for c in held.copies)
            # The run ended with every checkpoint in storage: its copies in memory are freed on both nodes, the
            # newest committed too, which no budget would evict.
            for node, held in holdings().items():
                assert held.copies == [] and held.used_bytes == 0, (node, held)
        finally:
            ctx.destroy(linger=0)


def test_a_restarted_agent_reclaims_its_copies_and_its_ranks_restore_from_them(monkeypatch, tmp_path, storage_path,
                                                                               capfd):
    monkeypatch.setenv("OUTLAST_NODE_TIMEOUT_S", "2")
    events = tmp_path / "events.jsonl"
    looked, held = tmp_path / "looked", None
    with LocalCluster(num_nodes=2, node_timeout_s=2, cpus_per_node=1, workdir=tmp_path / "cl") as cluster:
        def restart_once_replicated():
            nonlocal held
            try:
                wait_until(lambda: _replicated(storage_path, 5), 60, "checkpoint 5 held on two nodes")
                wait_until(lambda: any(e["event"] == "step" and e["step"] >= 7 for e in read_events(events)), 60,
                           "step 7")
                cluster.kill_node("node-1")  # its workers die with it
                cluster.restart_node("node-1")
                _spoil_storage(storage_path)
                held = _holdings_of(cluster, "node-1")  # while the run lives: its end frees them
            finally:
                looked.touch()

        thread = threading.Thread(target=restart_once_replicated, daemon=True)
        thread.start()
        result = _fit(storage_path, events, end_when=str(looked))
        thread.join()
        log = cluster.nodes["node-1"].log_path.read_text()
    # The restarted agent held what its predecessor kept, committed as it was.
    assert ("checkpoint_001_000005", 1, True, True) in {(c.checkpoint_dir, c.rank, c.primary, c.committed)
                                                         for c in held.copies}
    assert result.last_metrics == {"step": 23}
    assert re.search(r"reclaimed [1-9]\d* checkpoint copies in memory", log), log[-3000:]
    starts = [e for e in read_events(events) if e["event"] == "start" and e["attempt"] == 2]
    assert [e["restored_step"] for e in starts] == [5, 5]
    said = "".join(capfd.readouterr())
    assert sorted(r[3] for r in re.findall(RESTORED, said)) == ["local_memory", "local_memory"], said[-4000:]
    assert "from storage" not in said
