"""The commit machine on its own (`outlast/controller/commits/`): events and a frozen view in, effects and
outcomes out, with no core around it."""

from __future__ import annotations

from outlast.controller import effects as fx
from outlast.controller.commit import PendingCheckpoint
from outlast.controller.commits import MEMORY, STORAGE, Commits, NodeFacts, View
from outlast.controller.commits import events as ce
from outlast.protocol import messages as m

DIR = "checkpoint_001_000000"
ENTRY = m.FileEntry("model.pt", 1, "0" * 64)


def view(level=STORAGE, tiers=False, **kw) -> View:
    nodes = {n: NodeFacts(n, f"tcp://{n}:9" if tiers else "", f"tcp://{n}:9" if tiers else "", "", False, True)
             for n in ("n1", "n2")}
    return View(**{"attempt": 1, "placement": {0: "n1", 1: "n2"}, "nodes": nodes, "level": level,
                   "duplicate_files": "keep_rank0", "records": (), "run_key": "mem://run", "head_lost": None,
                   "wall": 1000.0, **kw})


def settled(**kw) -> PendingCheckpoint:
    return PendingCheckpoint(0, DIR, files={0: [ENTRY], 1: []}, waiting={0, 1}, **kw)


def kinds(out) -> list[str]:
    return [type(x).__name__ for x in out]


def test_a_settled_checkpoint_gets_its_manifest_and_once_written_the_history_names_it_and_its_ranks_hear_it():
    machine = Commits(fx.EffectIds())
    (write,) = machine.step(ce.Settled(settled()), view(), 5.0)
    assert isinstance(write, fx.WriteManifest) and write.manifest.checkpoint_dir == DIR
    assert write.manifest.seq == 1 and write.manifest.committed_at == 1000.0 and write.manifest.durable
    assert machine.in_progress() == {DIR} and machine.unsettled_below(1, 1)
    record, told = machine.step(fx.ManifestWritten(write.id), view(), 6.0)
    assert record == ce.RecordCommit(write.manifest) and isinstance(told, ce.CommitDone) and told.attempt == 1
    assert machine.in_progress() == set() and not machine.unsettled_below(1, 1)


def test_a_checkpoint_missing_a_shard_is_refused_saying_where_without_asking_storage():
    (refused,) = Commits(fx.EffectIds()).step(ce.Settled(settled(missing_shards=[1], errors={1: "lost"})), view(), 0.0)
    assert isinstance(refused, ce.CommitRefused) and "ranks [1]" in refused.reason and "n2" in refused.reason


def test_a_manifest_storage_failed_to_write_is_refused_with_what_storage_said():
    machine = Commits(fx.EffectIds())
    (write,) = machine.step(ce.Settled(settled()), view(), 0.0)
    (refused,) = machine.step(fx.StorageFailed(write.id, "writing the manifest", "disk full"), view(), 1.0)
    assert isinstance(refused, ce.CommitRefused) and refused.reason == "storage failed writing the manifest: disk full"
    assert machine.step(fx.ManifestWritten(write.id), view(), 2.0) == []  # an answer to nothing asked changes nothing


def test_a_storage_commit_is_told_once_the_nodes_copies_answered_and_the_history_learns_where_they_are():
    machine, v = Commits(fx.EffectIds()), view(tiers=True)
    machine.step(ce.Reported(1, 0, 0, "/tmp/rank0", through_peer=False), v, 0.0)
    write, hold = machine.step(ce.Settled(settled()), v, 0.0)
    assert isinstance(hold, fx.TierAsk) and hold.node_id == "n1" and hold.msg.source_dir == "/tmp/rank0"
    out = machine.step(fx.ManifestWritten(write.id), v, 1.0)
    assert kinds(out) == ["RecordCommit", "NoteMemory", "NoteFiles"]  # not told yet: the copy has not answered
    stored = m.TierStored(run="mem://run", checkpoint_dir=DIR, rank=0, node_id="n1", ok=True)
    out = machine.step(fx.TierAnswered(hold.id, reply=stored), v, 2.0)
    replica = next(x for x in out if isinstance(x, fx.TierAsk) and isinstance(x.msg, m.TierHold))
    assert replica.msg.peer_address == "tcp://n2:9"
    assert ce.NoteMemory(DIR, {0: ["n1"]}, None) in out and kinds(out)[-1] == "CommitDone"


def test_a_memory_commit_is_refused_on_a_node_without_checkpoint_memory():
    machine = Commits(fx.EffectIds())
    machine.step(ce.Reported(1, 0, 0, "/tmp/rank0", through_peer=False), view(MEMORY), 0.0)
    (refused,) = machine.step(ce.Settled(settled()), view(MEMORY), 0.0)
    assert isinstance(refused, ce.CommitRefused) and "--checkpoint-memory" in refused.reason
    assert machine.in_progress() == set()


def test_a_storage_commit_whose_copy_comes_from_storages_own_directory_asks_for_the_copy_after_telling_the_ranks():
    # On a file system the node sees, the copy is taken from the checkpoint's directory in storage, which outlives
    # report(): the ranks hear the commit once the manifest is written, and only then is the node asked for the
    # copy, which goes on beside their next steps instead of competing with the commit they wait for.
    machine, v = Commits(fx.EffectIds()), view(tiers=True)
    machine.step(ce.Reported(1, 0, 0, "/storage/run/" + DIR, through_peer=False, stored=True), v, 0.0)
    (write,) = machine.step(ce.Settled(settled()), v, 0.0)
    assert isinstance(write, fx.WriteManifest)
    out = machine.step(fx.ManifestWritten(write.id), v, 1.0)
    assert kinds(out)[-2:] == ["CommitDone", "TierAsk"] and machine.in_progress() == set()
    hold = out[-1]
    assert hold.node_id == "n1" and hold.msg.source_dir == "/storage/run/" + DIR and hold.msg.files == [ENTRY]
    stored = m.TierStored(run="mem://run", checkpoint_dir=DIR, rank=0, node_id="n1", ok=True)
    out = machine.step(fx.TierAnswered(hold.id, reply=stored), v, 2.0)
    assert ce.NoteMemory(DIR, {0: ["n1"]}, None) in out and "CommitDone" not in kinds(out)  # told once, before
    assert any(isinstance(x, fx.TierAsk) and isinstance(x.msg, m.TierHold) and x.msg.peer_address for x in out)


def test_a_copy_from_storages_directory_is_checked_against_what_storage_kept_of_a_file_ranks_wrote_differently():
    theirs = m.FileEntry("model.pt", 1, "1" * 64)  # rank 1's model.pt; storage kept rank 0's (ENTRY)
    pending = PendingCheckpoint(0, DIR, files={0: [ENTRY], 1: [theirs]}, waiting={0, 1})
    machine, v = Commits(fx.EffectIds()), view(tiers=True)
    machine.step(ce.Reported(1, 0, 1, "/storage/run/" + DIR, through_peer=False, stored=True), v, 0.0)
    (read,) = machine.step(ce.Settled(pending), v, 0.0)
    assert isinstance(read, fx.ReadChecksums)
    out = machine.step(fx.ChecksumsRead(read.id, checksums={"model.pt": ENTRY.checksum}), v, 1.0)
    (write,) = [x for x in out if isinstance(x, fx.WriteManifest)]
    assert not any(isinstance(x, fx.TierAsk) for x in out)  # not before the manifest is written
    out = machine.step(fx.ManifestWritten(write.id), v, 2.0)
    holds = [x for x in out if isinstance(x, fx.TierAsk)]
    assert [(h.node_id, h.msg.rank, h.msg.files) for h in holds] == [("n2", 1, [ENTRY])]
