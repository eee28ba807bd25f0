"""The controller's half of the memory tier, over the core with fakes: each rank's node keeps its files, a
replica goes to a node in another failure domain, and the commit waits at the level the run chose."""

from __future__ import annotations

import msgspec
import pytest

from outlast.controller import effects as fx
from outlast.controller.states import State
from outlast.protocol import messages as m
from outlast.train import CheckpointConfig
from tests.fakes.controller import finish_all, make, start

ENTRY = m.FileEntry("model.pt", 1, "0" * 64)
DIR = "checkpoint_001_000000"
NEXT = {"n1": "n2", "n2": "n3", "n3": "n1"}  # each node's peer: the next in node-id order, in another domain


def tiered(nodes=("n1", "n2", "n3"), domains=None, **kw):
    h = make(nodes=nodes, **kw)
    domains = domains or {}
    table = [msgspec.structs.replace(n, tier_address=f"tcp://{n.node_id}:9", failure_domain=domains.get(n.node_id, ""))
             for n in h.core.nodes.nodes.values()]
    h.core.nodes.set_table(table)
    placement = start(h)
    h.hold_storage = True
    return h, placement


def report(h, rank):
    h.worker(m.Report(attempt=1, rank=rank, index=0, metrics={"step": 0}, checkpoint_dir=DIR, files=[ENTRY],
                      local_dir=f"/tmp/rank{rank}"))


def asks(h, kind=m.TierHold):
    out = [e for e in h.effects if isinstance(e, fx.TierAsk) and isinstance(e.msg, kind)]
    h.effects = [e for e in h.effects if e not in out]
    return out


def stored(ask, ok=True, replica="", reason=""):
    return fx.TierAnswered(ask.id, reply=m.TierStored(run=ask.msg.run, checkpoint_dir=DIR, rank=ask.msg.rank,
                                                      node_id=ask.node_id, ok=ok, replica_node=replica,
                                                      reason=reason, replica_reason=reason))


def committed(h, rank):
    return [type(x) for x in h.to_rank(rank) if isinstance(x, (m.Committed, m.CommitFailed))]


def lose_nodes_and_restart(h, dead):
    """The head's table says `dead` are dead, both ranks (on n1 and n2) fail, and the next attempt is placed."""
    h.core.nodes.set_table([msgspec.structs.replace(n, state="dead" if n.node_id in dead else n.state)
                            for n in h.core.nodes.nodes.values()])
    h.agent("n1", h.exited(0, "n1", code=1))
    h.agent("n2", h.exited(1, "n2", code=1))
    for _ in range(5):
        h.release()
        h.step(dt=0.5)


def test_storage_ranks_hear_the_commit_once_the_manifest_is_written_and_their_nodes_have_copied_their_files():
    h, placement = tiered()
    report(h, 0)
    report(h, 1)
    local = asks(h)
    assert sorted((a.node_id, a.msg.source_dir, a.msg.peer_address) for a in local) == \
        sorted((placement[r], f"/tmp/rank{r}", "") for r in (0, 1))
    h.release()  # the manifest is written: durable, but the ranks' own directories are still being read
    assert h.core.book.state.latest_checkpoint == DIR and committed(h, 0) == committed(h, 1) == []
    for a in local:
        h.step(stored(a))
    assert committed(h, 0) == committed(h, 1) == [m.Committed]
    # Each copy kept goes on to the next node in another failure domain, after the commit.
    replicas = asks(h)
    assert sorted((a.node_id, a.msg.peer_address) for a in replicas) == \
        sorted((placement[r], f"tcp://{NEXT[placement[r]]}:9") for r in (0, 1))
    assert committed(h, 0) == [m.Committed]  # heard once, before any replica
    for a in replicas:
        h.step(stored(a, replica=NEXT[a.node_id]))
    record = h.core.book.state.checkpoints[-1]
    assert record.durable and record.memory_at is not None
    assert record.memory == sorted({placement[0], placement[1], NEXT[placement[0]], NEXT[placement[1]]})
    # Every holder hears it is committed, so its budget never evicts it.
    told = {a.node_id for a in asks(h, m.TierCommit)}
    assert told == set(record.memory)


def test_storage_a_node_that_refuses_or_never_answers_a_copy_does_not_hold_the_commit_back(caplog):
    h, placement = tiered()
    report(h, 0)
    report(h, 1)
    local = asks(h)
    h.release()
    h.step(stored(local[0], ok=False, reason="needs 4.0 GiB; raise `outlast start --checkpoint-memory`"))
    h.step(fx.TierAnswered(local[1].id, error="the memory tier of n2 did not answer: no answer for 120 s"))
    assert committed(h, 0) == committed(h, 1) == [m.Committed]
    assert "--checkpoint-memory" in caplog.text
    record = h.core.book.state.checkpoints[-1]
    assert record.durable and record.memory == [] and record.memory_at is None


def test_memory_the_manifest_is_written_only_once_two_nodes_in_different_domains_hold_every_ranks_files():
    h, placement = tiered(checkpoint_storage="memory")
    report(h, 0)
    report(h, 1)
    holds = asks(h)
    assert not [e for e in h.held if isinstance(e, fx.WriteManifest)]  # nothing is committed yet
    assert all(a.msg.peer_address for a in holds)
    for a in holds:
        h.step(stored(a, replica=NEXT[a.node_id]))
    manifest = next(e for e in h.held if isinstance(e, fx.WriteManifest)).manifest
    assert manifest.durable is False and len(manifest.memory) >= 2 and manifest.memory_at is not None
    assert committed(h, 0) == []
    h.release()
    assert committed(h, 0) == committed(h, 1) == [m.Committed]
    assert h.core.book.state.checkpoints[-1].durable is False


def test_memory_a_checkpoint_without_a_replica_is_refused_saying_why():
    h, placement = tiered(checkpoint_storage="memory")
    report(h, 0)
    report(h, 1)
    holds = asks(h)
    h.step(stored(holds[0], replica=NEXT[holds[0].node_id]))
    h.step(stored(holds[1], replica="", reason="n3 did not keep the replica: evicting frees only 0.0 MiB"))
    assert committed(h, 0) == [m.CommitFailed]
    reason = next(x for x in h.to_rank(0) if isinstance(x, m.CommitFailed)).reason
    assert "not committed in memory" in reason and "outside the failure domain" in reason and "evicting" in reason
    assert h.core.book.state.latest_checkpoint is None
    assert not [e for e in h.held if isinstance(e, fx.WriteManifest)]


def test_memory_with_every_node_in_one_failure_domain_the_commit_is_refused_at_once():
    h, placement = tiered(checkpoint_storage="memory", domains={"n1": "rack", "n2": "rack", "n3": "rack"})
    report(h, 0)
    report(h, 1)
    assert asks(h) == []
    reason = next(x for x in h.to_rank(0) if isinstance(x, m.CommitFailed)).reason
    assert "same failure domain" in reason and "checkpoint_storage='storage'" in reason


def test_memory_a_node_without_a_tier_is_refused_naming_the_flag_to_start_it_with():
    h = make(checkpoint_storage="memory")
    start(h)
    report(h, 0)
    report(h, 1)
    reason = next(x for x in h.to_rank(0) if isinstance(x, m.CommitFailed)).reason
    assert "--checkpoint-memory" in reason


@pytest.mark.parametrize("bad", ["disk", "", None, "Memory"])
def test_checkpoint_storage_must_be_storage_or_memory(bad):
    with pytest.raises(ValueError, match="checkpoint_storage must be 'storage'.*or 'memory'"):
        CheckpointConfig(checkpoint_storage=bad)
    assert CheckpointConfig(checkpoint_storage="memory").checkpoint_storage == "memory"


def test_outlast_runs_and_the_dashboard_say_at_which_level_each_checkpoint_is_held():
    from outlast.cli.dashboard.views import run_view
    from outlast.cli.runs import render
    from outlast.storage.records import CheckpointRecord, RunState

    records = [CheckpointRecord(checkpoint_dir="c1", seq=1, attempt=1, report_index=1, committed_at=1.0),
               CheckpointRecord(checkpoint_dir="c2", seq=2, attempt=1, report_index=2, committed_at=2.0,
                                memory=["node-a"]),
               CheckpointRecord(checkpoint_dir="c3", seq=3, attempt=1, report_index=3, committed_at=3.0,
                                memory=["node-a", "node-b"], memory_at=3.5, durable=False)]
    state = RunState(name="exp", status="running", created_at=0.0, updated_at=0.0, checkpoints=records,
                     latest_checkpoint="c3")
    lines = [line for line in render(state, "/runs/exp").splitlines() if line.startswith("  c")]
    assert "  durable  " in lines[0] and "memory" not in lines[0]
    assert "durable, memory: [node-a] (one copy)" in lines[1]
    assert "not in storage, memory: [node-a, node-b]" in lines[2] and "(one copy)" not in lines[2]
    shown = run_view(state, "/runs/exp", {}, now=4.0)["checkpoints"]
    assert [(c["durable"], c["memory"], c["memory_at"]) for c in shown] == \
        [(True, [], None), (True, ["node-a"], None), (False, ["node-a", "node-b"], 3.5)]


def test_memory_a_checkpoint_whose_every_holder_is_gone_is_skipped_for_the_one_before_saying_what_it_costs():
    h, placement = tiered(checkpoint_storage="memory", max_failures=1)
    for index in (0, 1):
        for rank in (0, 1):
            h.worker(m.Report(attempt=1, rank=rank, index=index, metrics={"step": index},
                              checkpoint_dir=f"checkpoint_001_{index:06d}", files=[ENTRY], local_dir=f"/tmp/r{rank}"))
        for a in asks(h):
            h.step(stored(a, replica=NEXT[a.node_id]))
        h.release()
    newest = h.core.book.state.checkpoints[-1]
    assert newest.checkpoint_dir == "checkpoint_001_000001" and newest.durable is False
    # Every node that holds it dies at once (the first checkpoint is kept, by hand, on a node that lives).
    h.core.book.note_memory("checkpoint_001_000000", {0: ["n9"], 1: ["n9"]}, 1.0)
    table = [msgspec.structs.replace(n, state="dead" if n.node_id in newest.memory else n.state)
             for n in h.core.nodes.nodes.values()]
    table.append(msgspec.structs.replace(table[0], node_id="n9", state="alive", address="tcp://n9:1"))
    h.core.nodes.set_table(table)
    h.agent(placement[0], h.exited(0, placement[0], code=1))
    h.agent(placement[1], h.exited(1, placement[1], code=1))
    for _ in range(5):
        h.release()
        h.step(dt=0.5)
    skipped = h.core.book.state.skipped_checkpoints
    assert [s.checkpoint_dir for s in skipped] == ["checkpoint_001_000001"]
    assert "kept in memory only" in skipped[0].reason and "the 1 reports between them" in skipped[0].reason
    assert h.core.book.state.latest_checkpoint == "checkpoint_001_000000"


def test_memory_a_checkpoint_one_of_whose_ranks_lost_both_holders_is_skipped_though_another_ranks_node_lives():
    # Rank 0's files on n1 (its node) and n2; rank 1's on n2 (its node) and n3. n2 and n3 die: rank 0's copy on n1
    # lives, but no copy of rank 1's files does. The next attempt restores the checkpoint before, which n1 pulled.
    h, placement = tiered(nodes=("n1", "n2", "n3", "n4"), checkpoint_storage="memory", max_failures=1)
    assert placement == {0: "n1", 1: "n2"}
    peer = {"n1": "n2", "n2": "n3"}
    files = {0: [ENTRY, m.FileEntry("state_rank0.json", 1, "0" * 64)], 1: [m.FileEntry("state_rank1.json", 1, "1" * 64)]}
    for index in (0, 3, 7):
        for rank in (0, 1):
            h.worker(m.Report(attempt=1, rank=rank, index=index, metrics={"step": index},
                              checkpoint_dir=f"checkpoint_001_{index:06d}", files=files[rank],
                              local_dir=f"/tmp/r{rank}"))
        for a in asks(h):
            h.step(stored(a, replica=peer[a.node_id]))
        h.release()
        for rank in (0, 1):  # the reports between checkpoints
            for i in range(index + 1, index + (3 if index == 0 else 4 if index == 3 else 1)):
                h.worker(m.Report(attempt=1, rank=rank, index=i, metrics={"step": i}))
    first, middle, newest = h.core.book.state.checkpoints
    assert newest.memory_ranks == {0: ["n1", "n2"], 1: ["n2", "n3"]}
    h.core.book.note_memory(first.checkpoint_dir, {0: ["n1", "n2"], 1: ["n2", "n3", "n1"]}, None)  # n1 pulled it
    lose_nodes_and_restart(h, dead=("n2", "n3"))
    assert h.core.attempt.number == 2 and h.core.attempt.restore == first.checkpoint_dir
    assert h.core.book.state.attempts[-1].restored_from == first.checkpoint_dir
    skipped = h.core.book.state.skipped_checkpoints
    assert [s.checkpoint_dir for s in skipped] == [newest.checkpoint_dir, middle.checkpoint_dir]
    # Named: rank 1 and its file, not rank 0, whose node lives; each says what going back to the first costs.
    assert all("rank 1's files (state_rank1.json) were on n2, n3" in s.reason and "rank 0" not in s.reason
               for s in skipped), skipped
    assert [s.steps_lost for s in skipped] == [7, 3]
    assert "costs the 7 reports between them" in skipped[0].reason


def test_memory_a_new_attempt_starts_its_ranks_once_their_nodes_have_pulled_the_files_they_lack():
    h, placement = tiered(checkpoint_storage="memory", max_failures=1)
    assert sorted(placement.values()) == ["n1", "n2"]
    report(h, 0)
    report(h, 1)
    for a in asks(h):
        h.step(stored(a, replica=NEXT[a.node_id]))
    h.release()
    assert h.core.book.state.checkpoints[-1].memory == ["n1", "n2", "n3"]
    # n2 dies: the new attempt goes to n1 and n3, which hold rank 0's copy and rank 1's replica.
    table = [msgspec.structs.replace(n, state="dead" if n.node_id == "n2" else n.state)
             for n in h.core.nodes.nodes.values()]
    h.core.nodes.set_table(table)
    h.agent("n1", h.exited(0, "n1", code=1))
    h.agent("n2", h.exited(1, "n2", code=1))
    spawns_before = len([e for e in h.effects if type(e).__name__ == "Spawn"])
    for _ in range(5):
        h.release()
        h.step(dt=0.5)
    pulls = asks(h, m.TierPull)
    # Each asks the one live node that holds the rank's files it lacks: n1 rank 1's replica on n3, n3 rank 0's on n1.
    assert sorted((a.node_id, a.msg.rank, a.msg.from_address) for a in pulls) == [
        ("n1", 1, "tcp://n3:9"), ("n3", 0, "tcp://n1:9")]
    assert h.core.book.state.checkpoints[-1].memory_ranks == {0: ["n1", "n2"], 1: ["n2", "n3"]}
    assert len([e for e in h.effects if type(e).__name__ == "Spawn"]) == spawns_before  # not yet
    for a in pulls:
        h.step(stored(a))
    spawned = h.spawned()
    assert sorted(spawned.values()) == ["n1", "n3"] and h.core.attempt.number == 2


def test_memory_ranks_writing_one_file_differently_keep_rank_0s_copy_without_reading_storage():
    h, placement = tiered(checkpoint_storage="memory")
    mine = {0: m.FileEntry("model.pt", 1, "0" * 64), 1: m.FileEntry("model.pt", 1, "1" * 64)}
    for rank in (0, 1):
        h.worker(m.Report(attempt=1, rank=rank, index=0, metrics={"step": 0}, checkpoint_dir=DIR, files=[mine[rank]],
                          local_dir=f"/tmp/rank{rank}"))
    assert not [e for e in h.held if isinstance(e, fx.ReadChecksums)]  # storage has no copy to read back
    for a in asks(h):
        h.step(stored(a, replica=NEXT[a.node_id]))
    manifest = next(e for e in h.held if isinstance(e, fx.WriteManifest)).manifest
    assert manifest.files == [mine[0]]
    assert "keeps rank 0's copy" in h.core.book.state.notes[0].text


def test_the_tier_executor_answers_a_silent_node_with_an_error_and_never_holds_the_driver_at_exit():
    import select
    import threading

    import zmq

    from outlast.controller.tier_executor import TierExecutor

    ctx = zmq.Context()
    ex = TierExecutor(ctx, None)
    ex.submit(fx.TierAsk(7, "n9", "tcp://127.0.0.1:9", m.TierList(), timeout_s=0.3))
    assert select.select([ex.wake_fd], [], [], 10)[0]
    (answer,) = ex.take()
    assert answer.id == 7 and answer.reply is None and "the memory tier of n9 did not answer" in answer.error
    ex.submit(fx.TierAsk(8, "n9", "tcp://127.0.0.1:9", m.TierList(), timeout_s=60))
    ex.close()  # returns at once, the request still waiting
    assert all(t.daemon for t in threading.enumerate() if t.name.startswith("outlast-tier-ask"))
    ctx.term()  # the waiting request's poll ends with the context (ETERM), and its socket is closed


def test_storage_a_new_attempt_pulls_from_the_peers_memory_first_and_notes_a_corrupt_copy_passed_over():
    h, placement = tiered(max_failures=1)
    report(h, 0)
    report(h, 1)
    h.release()
    for a in asks(h):
        h.step(stored(a))
    for a in asks(h):
        h.step(stored(a, replica=NEXT[a.node_id]))
    assert h.core.book.state.checkpoints[-1].memory == ["n1", "n2", "n3"]
    lose_nodes_and_restart(h, dead=("n2",))
    pulls = asks(h, m.TierPull)
    # Storage holds it too, but a peer's RAM comes first.
    assert sorted((a.node_id, a.msg.rank) for a in pulls) == [("n1", 1), ("n3", 0)]
    for a in pulls:
        reply = m.TierStored(run=a.msg.run, checkpoint_dir=DIR, rank=a.msg.rank, node_id=a.node_id, ok=True,
                             skipped="the copy of rank 0 in memory on n1 was skipped: bad" if a.node_id == "n3"
                             else "")
        h.step(fx.TierAnswered(a.id, reply=reply))
    assert sorted(h.spawned().values()) == ["n1", "n3"]
    assert any("the copy of rank 0 in memory on n1 was skipped: bad" in n.text for n in h.core.book.state.notes)


def test_a_drains_checkpoint_goes_through_a_peer_weighed_at_the_peers_rate_then_becomes_durable_from_it():
    h, placement = tiered()
    h.core.commits.holds.peer_bps[placement[0]] = 10e6  # its last replica went at 10 MB/s
    drained = placement[0]
    h.agent(drained, m.NodeDraining(node_id=drained, reason="spot", message="", deadline_unix_s=h.wall() + 20))
    assert h.core.state.preemption.through_peer
    # The ranks report the notice's checkpoint without uploading it.
    for rank in (0, 1):
        h.worker(m.Report(attempt=1, rank=rank, index=0, metrics={"step": 0}, checkpoint_dir=DIR,
                          files=[ENTRY], local_dir=f"/tmp/rank{rank}", in_memory=True, saw_preemption=True,
                          upload_bytes=10**9))
    notes = [n.text for n in h.core.book.state.notes]
    # 1 GB at the peer's 10 MB/s is 100 s: said at once, as the copy to a peer's memory.
    assert any("needs 100.0 s to reach a peer's memory" in n for n in notes), notes
    holds = asks(h)
    assert all(a.msg.peer_address and a.msg.peer_address != f"tcp://{drained}:9" for a in holds)
    # The drained node links its rank's files into its memory, with no time to copy them; the other copies.
    assert {a.msg.rank: a.msg.link for a in holds} == {r: placement[r] == drained for r in (0, 1)}
    assert placement[0] != placement[1]
    assert not [e for e in h.held if isinstance(e, fx.WriteManifest)]  # nothing before two nodes hold it
    peer = {a.msg.rank: a.msg.peer_address.split("//")[1].split(":")[0] for a in holds}
    for a in holds:
        h.step(stored(a, replica=peer[a.msg.rank]))
    (write,) = [e for e in h.held if isinstance(e, fx.WriteManifest)]
    assert write.manifest.durable is False
    h.release()
    record = h.core.book.state.checkpoints[-1]
    assert record.checkpoint_dir == DIR and record.durable is False and record.memory_at is not None
    # Uploaded by a holder that is not draining: rank 0's peer, rank 1's own node.
    uploads = asks(h, m.TierUpload)
    assert sorted((a.msg.rank, a.node_id) for a in uploads) == [(0, peer[0]), (1, placement[1])]
    assert "durable" not in " ".join(n.text for n in h.core.book.state.notes)
    first, second = sorted(uploads, key=lambda a: a.msg.rank)
    h.step(stored(first))
    h.step(fx.TierAnswered(second.id, reply=m.TierStored(run=second.msg.run, checkpoint_dir=DIR, rank=1,
                                                         node_id=second.node_id, ok=False, reason="storage said no")))
    # A failed upload goes on from the rank's next holder.
    (retry,) = asks(h, m.TierUpload)
    assert retry.msg.rank == 1 and retry.node_id == peer[1]
    h.step(stored(retry))
    (write,) = [e for e in h.held if isinstance(e, fx.WriteManifest)]
    assert write.manifest.durable is True
    h.release()
    assert h.core.book.state.checkpoints[-1].durable is True
    assert any("committed in memory for the drain, is durable" in n.text for n in h.core.book.state.notes)


def test_an_upload_from_a_holder_that_dies_goes_on_from_the_next_and_with_none_left_the_history_says_so():
    h, placement = tiered()
    drained = placement[0]
    h.agent(drained, m.NodeDraining(node_id=drained, reason="spot", message="", deadline_unix_s=h.wall() + 20))
    h.worker(m.Report(attempt=1, rank=0, index=0, metrics={"step": 0}, checkpoint_dir=DIR, files=[ENTRY],
                      local_dir="/tmp/rank0", in_memory=True, saw_preemption=True, upload_bytes=1))
    h.worker(m.Report(attempt=1, rank=1, index=0, metrics={"step": 0}, in_memory=False, saw_preemption=True))
    (hold,) = asks(h)
    peer = hold.msg.peer_address.split("//")[1].split(":")[0]
    h.step(stored(hold, replica=peer))
    h.release()
    (up,) = asks(h, m.TierUpload)
    assert up.node_id == peer
    for dead in (peer, drained):
        table = [msgspec.structs.replace(n, state="dead" if n.node_id == dead else n.state)
                 for n in h.core.nodes.nodes.values()]
        h.core.nodes.set_table(table)
        h.step(dt=0.5)
        h.release()
        nxt = asks(h, m.TierUpload)
        assert [a.node_id for a in nxt] == ([drained] if dead == peer else [])
    assert not h.core.commits.uploading_from_memory
    # Both holders gone: the next attempt skips it, saying why and what it costs.
    skipped = h.core.book.state.skipped_checkpoints
    assert [s.checkpoint_dir for s in skipped] == [DIR] and "whose upload from memory was not in yet" in skipped[0].reason
    assert "every step so far" in skipped[0].reason
    assert any(f"checkpoint {DIR} stays committed in memory only" in n.text and "is gone" in n.text
               for n in h.core.book.state.notes)


def _committed_on_two_nodes(h, placement):
    report(h, 0)
    report(h, 1)
    for a in asks(h):
        h.step(stored(a))
    h.release()
    for a in asks(h):
        h.step(stored(a, replica=NEXT[a.node_id]))
    asks(h, m.TierCommit)
    return h.core.book.state.checkpoints[-1]


def test_a_storage_run_that_ends_frees_its_copies_on_every_holder_and_closes_once_they_answer():
    h, placement = tiered()
    record = _committed_on_two_nodes(h, placement)
    assert record.durable and len(record.memory) >= 2
    finish_all(h, placement)
    h.release()
    frees = asks(h, m.TierFree)
    assert sorted(a.node_id for a in frees) == record.memory
    assert {a.msg.run for a in frees} == {frees[0].msg.run} and frees[0].msg.run
    assert h.state is State.FINISHED and not h.core.closed  # its close waits for the answers, briefly
    for a in frees:
        h.step(fx.TierAnswered(a.id, reply=m.TierAck(run=a.msg.run, checkpoint_dir="", rank=-1)))
    assert h.core.closed


def test_the_close_waits_for_the_frees_a_few_seconds_at_most():
    from outlast.controller.commits.holds import FREE_WAIT_S

    h, placement = tiered()
    _committed_on_two_nodes(h, placement)
    finish_all(h, placement)
    h.release()
    assert asks(h, m.TierFree) and not h.core.closed
    h.step(dt=FREE_WAIT_S + 0.1)  # a node that never answers keeps no driver waiting
    assert h.core.closed


def test_a_memory_run_keeps_its_copies_at_its_end_they_are_its_only_ones():
    h, placement = tiered(checkpoint_storage="memory")
    report(h, 0)
    report(h, 1)
    for a in asks(h):
        h.step(stored(a, replica=NEXT[a.node_id]))
    h.release()
    assert h.core.book.state.checkpoints[-1].durable is False
    finish_all(h, placement)
    h.release()
    assert asks(h, m.TierFree) == [] and h.core.closed
