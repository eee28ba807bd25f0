"""The tier server's schedule, driven on a given clock: no sockets, no files, no threads."""

from __future__ import annotations

import pytest

from outlast.agent.tier_schedule import DRAIN_HOLD_S, SWEEP_EVERY_S, ReplicaGate, Transfers, queue_for
from outlast.protocol import messages as m
from outlast.storage.memtier import CopyKey

KEY = CopyKey("run", "c1", 0)
A, B = b"asker-a", b"asker-b"


def transfers(timeout_s: float = 60.0) -> Transfers[None]:
    return Transfers("n1", timeout_s)


# ---- which thread a request waits for -----------------------------------------------------------------------

@pytest.mark.parametrize(("msg", "queue"), [
    (m.TierHold(run="r", checkpoint_dir="c", rank=0, seq=1, files=[], source_dir="/dev/shm/r0"), "waited"),
    (m.TierPull(run="r", checkpoint_dir="c", rank=0, from_address="tcp://x:1"), "waited"),
    (m.TierHold(run="r", checkpoint_dir="c", rank=0, seq=1, files=[], source_dir="", peer_address="tcp://x:1"),
     "hold"),
    (m.TierUpload(run="r", checkpoint_dir="c", rank=0), "upload"),
])
def test_what_a_commit_or_a_restore_waits_for_never_queues_behind_a_replica_beside_a_durable_commit(msg, queue):
    assert queue_for(msg) == queue


# ---- transfers in flight ------------------------------------------------------------------------------------

def test_a_chunk_belongs_only_to_an_open_transfer_of_the_same_copy():
    t = transfers()
    t.open(b"s1", KEY, now=0.0, carrier=None, sender=A, sizes={"model.pt": 10})
    assert t.touch(b"s1", KEY, now=1.0).used == 1.0
    assert t.touch(b"s1", CopyKey("run", "c2", 0), now=1.0) == "no transfer of c2 rank 0 is open on n1"
    assert t.touch(b"nope", KEY, now=1.0) == "no transfer of c1 rank 0 is open on n1"


def test_a_chunk_past_the_declared_size_of_its_file_is_refused():
    t = transfers()
    offer = t.open(b"s1", KEY, now=0.0, carrier=None, sender=A, sizes={"model.pt": 10, "empty": 0})
    assert offer.is_offer
    assert offer.past_declared("model.pt", 0, 10) is None and offer.past_declared("empty", 0, 0) is None
    assert "goes past its declared 10 bytes" in offer.past_declared("model.pt", 4, 7)
    assert "goes past its declared 10 bytes" in offer.past_declared("model.pt", -1, 1)


def test_an_offer_is_ended_by_its_own_sender_only_and_once():
    t = transfers(timeout_s=60.0)
    t.open(b"s1", KEY, now=0.0, carrier=None, sender=A, sizes={"model.pt": 10})
    assert t.receiving(KEY)
    refused = t.finish_offer(B, KEY)
    assert refused == "no transfer of c1 rank 0 from this sender is open on n1: it failed, or was silent for 60 s"
    assert t.finish_offer(A, KEY).session == b"s1"
    assert not t.receiving(KEY) and t.all() == []
    assert isinstance(t.finish_offer(A, KEY), str)


def test_a_fetch_is_no_offer_and_its_end_lets_nothing_of_the_copy_go():
    t = transfers()
    fetch = t.open(b"f1", KEY, now=0.0, carrier=None)
    assert not fetch.is_offer and not t.receiving(KEY)
    assert t.offer_of(A, KEY) is None
    assert t.end(b"f1") is fetch and t.end(b"f1") is None


def test_an_ended_offer_can_no_longer_be_finished_by_its_sender():
    t = transfers()
    t.open(b"s1", KEY, now=0.0, carrier=None, sender=A, sizes={"model.pt": 10})
    assert t.offer_of(A, KEY) == b"s1"
    assert t.end(t.offer_of(A, KEY)).session == b"s1"
    assert t.offer_of(A, KEY) is None and isinstance(t.finish_offer(A, KEY), str)
    assert t.end(None) is None


def test_freeing_a_run_names_its_transfers_only():
    t = transfers()
    t.open(b"s1", KEY, now=0.0, carrier=None, sender=A, sizes={})
    t.open(b"f1", CopyKey("other", "c1", 0), now=0.0, carrier=None)
    assert t.of_run("run") == [b"s1"]


def test_a_transfer_silent_past_the_timeout_is_ended_saying_so():
    t = transfers(timeout_s=60.0)
    t.open(b"s1", KEY, now=0.0, carrier=None, sender=A, sizes={"model.pt": 10})
    t.open(b"f1", KEY, now=0.0, carrier=None)
    assert t.sweep(0.0) == []
    t.touch(b"f1", KEY, now=50.0)
    ended = t.sweep(61.0)
    assert [e.transfer.session for e in ended] == [b"s1"]
    assert ended[0].reason == ("a replica of c1 rank 0 being received on n1 has been silent for 61 s: its sender "
                               "died or gave up; what came of it is dropped")
    assert t.offer_of(A, KEY) is None and [x.session for x in t.all()] == [b"f1"]
    ended = t.sweep(200.0)
    assert [e.transfer.session for e in ended] == [b"f1"] and "a fetch of c1 rank 0" in ended[0].reason


def test_transfers_are_looked_over_no_more_often_than_the_sweep_allows():
    t = transfers(timeout_s=8.0)  # a quarter of it, 2 s, is sooner than SWEEP_EVERY_S
    t.sweep(0.0)
    t.open(b"s1", KEY, now=0.0, carrier=None, sender=A, sizes={})
    assert t.sweep(1.9) == []  # silent past nothing yet, and not looked over anyway
    assert t.sweep(9.0) != []
    t.open(b"s2", KEY, now=0.0, carrier=None, sender=B, sizes={})
    assert t.sweep(9.5) == []  # looked over 0.5 s ago: s2's silence waits for the next look
    assert [e.transfer.session for e in t.sweep(11.5)] == [b"s2"]
    slow = transfers(timeout_s=600.0)
    slow.sweep(0.0)
    slow.open(b"s1", KEY, now=-1000.0, carrier=None, sender=A, sizes={})
    assert slow.sweep(SWEEP_EVERY_S) == [] and slow.sweep(SWEEP_EVERY_S + 0.1) != []


# ---- replicas held back while the node drains -----------------------------------------------------------------

def test_replicas_go_while_the_node_is_not_draining():
    gate = ReplicaGate().may_go(now=1000.0)
    assert gate.go and gate.reason == "the node is not draining"


def test_a_drain_holds_replicas_back_until_what_its_commit_waits_for_is_held():
    g = ReplicaGate()
    g.drain(deadline_unix_s=1060.0, now=1000.0)
    held = g.may_go(now=1000.0)
    assert not held.go and held.wait_s == 60.0 and "the node drains" in held.reason
    g.waited_began()
    assert not g.may_go(now=1001.0).go
    g.waited_began()
    g.waited_ended()
    assert not g.may_go(now=1002.0).go  # one of the two still being carried out
    g.waited_ended()
    went = g.may_go(now=1003.0)
    assert went.go and went.reason == "what the drain's commit waits for has been held"
    assert g.may_go(now=1004.0).reason == "the node is not draining"


def test_what_was_held_before_the_drain_does_not_let_its_replicas_go():
    g = ReplicaGate()
    g.waited_began()
    g.waited_ended()
    g.drain(deadline_unix_s=1060.0, now=1000.0)
    assert not g.may_go(now=1001.0).go


def test_a_drain_whose_checkpoint_never_comes_holds_replicas_back_until_its_deadline_only():
    g = ReplicaGate()
    g.drain(deadline_unix_s=1010.0, now=1000.0)
    assert not g.may_go(now=1009.5).go
    went = g.may_go(now=1010.0)
    assert went.go and went.reason == "the drain's hold on replicas reached its deadline"


def test_a_drain_without_a_deadline_holds_replicas_back_for_drain_hold_s():
    g = ReplicaGate()
    g.drain(deadline_unix_s=None, now=1000.0)
    assert g.may_go(now=1000.0).wait_s == DRAIN_HOLD_S
    assert not g.may_go(now=1000.0 + DRAIN_HOLD_S - 1).go and g.may_go(now=1000.0 + DRAIN_HOLD_S).go
