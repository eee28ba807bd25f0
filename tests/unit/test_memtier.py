"""The memory tier's pure decisions: budget and eviction, peers, commit levels, restore choice."""

from outlast.storage.memtier import (Candidate, Copy, CopyKey, Level, PeerCandidate, SourceKind, TierBook,
                                     choose_peer, choose_restore, memory_committed, sources)

MB = 2**20


def copy(ckpt, seq, nbytes=100 * MB, at=None, rank=0, run="r", committed=False):
    return Copy(CopyKey(run, ckpt, rank), seq, nbytes, float(seq if at is None else at), committed=committed)


def admit(book, c):
    plan = book.plan(c)
    book.apply(c, plan)
    return plan


def test_a_copy_that_fits_evicts_nothing():
    book = TierBook(300 * MB)
    assert admit(book, copy("c1", 1)).evict == ()
    assert admit(book, copy("c2", 2)).admit
    assert book.used() == 200 * MB


def test_the_oldest_copies_are_evicted_first():
    book = TierBook(300 * MB)
    for i in range(3):
        admit(book, copy(f"c{i}", i))
    plan = admit(book, copy("c3", 3, nbytes=150 * MB))
    assert plan.admit and plan.evict == (CopyKey("r", "c0", 0), CopyKey("r", "c1", 0))
    assert sorted(k.checkpoint_dir for k in book.copies) == ["c2", "c3"]


def test_the_newest_committed_copy_is_never_evicted_even_when_it_is_the_oldest():
    book = TierBook(300 * MB)
    admit(book, copy("c0", 0))
    admit(book, copy("c1", 1))
    book.mark_committed("r", "c0")  # c1 pending, c0 the newest committed
    plan = admit(book, copy("c2", 2, nbytes=200 * MB))
    assert plan.admit and plan.evict == (CopyKey("r", "c1", 0),)
    assert CopyKey("r", "c0", 0) in book.copies


def test_a_copy_that_cannot_fit_beside_the_newest_committed_one_is_refused_and_nothing_is_evicted():
    book = TierBook(300 * MB)
    admit(book, copy("c0", 0, nbytes=200 * MB, committed=True))
    admit(book, copy("c1", 1, nbytes=50 * MB))
    plan = book.plan(copy("c2", 2, nbytes=150 * MB))
    assert not plan.admit and plan.evict == ()
    assert "c0" in plan.reason and "--checkpoint-memory" in plan.reason
    assert book.apply(copy("c2", 2), plan) == [] and len(book.copies) == 2


def test_a_copy_larger_than_the_whole_budget_is_refused_saying_which_flag_to_raise():
    plan = TierBook(100 * MB).plan(copy("c0", 0, nbytes=100 * MB + 1))
    assert not plan.admit and "--checkpoint-memory" in plan.reason


def test_a_copy_exactly_the_budget_fits():
    assert TierBook(100 * MB).plan(copy("c0", 0, nbytes=100 * MB)).admit


def test_each_run_keeps_its_own_newest_committed_copy():
    book = TierBook(300 * MB)
    admit(book, copy("a0", 0, run="a", committed=True))
    admit(book, copy("b0", 0, run="b", committed=True, at=1))
    admit(book, copy("b1", 1, run="b", committed=True, at=2))
    plan = book.plan(copy("b2", 2, run="b", at=3))
    assert plan.evict == (CopyKey("b", "b0", 0),)  # a0 is older, but it is run a's newest committed


def test_an_older_copy_does_not_push_out_its_runs_newer_pending_copies():
    book = TierBook(200 * MB)
    admit(book, copy("c5", 5, at=1))
    admit(book, copy("c6", 6, at=2))
    plan = book.plan(copy("c4", 4, at=3))  # a replica that arrived late
    assert not plan.admit


def test_the_peer_is_the_next_live_node_in_another_failure_domain():
    nodes = [PeerCandidate("n1", "rackA"), PeerCandidate("n2", "rackA"), PeerCandidate("n3", "rackB"),
             PeerCandidate("n4", "rackB", draining=True)]
    assert choose_peer("n1", nodes).node_id == "n3"
    assert choose_peer("n3", nodes).node_id == "n1"  # wraps, skipping draining n4
    assert choose_peer("n3", nodes, exclude=["n1"]).node_id == "n2"


def test_nodes_without_a_failure_domain_are_each_a_domain_of_their_own():
    nodes = [PeerCandidate("a"), PeerCandidate("b"), PeerCandidate("c", alive=False)]
    assert choose_peer("b", nodes).node_id == "a"


def test_no_peer_says_why_each_node_was_passed_over():
    nodes = [PeerCandidate("a", "x"), PeerCandidate("b", "x"), PeerCandidate("c", "y", alive=False)]
    choice = choose_peer("a", nodes)
    assert choice.node_id is None
    assert "b (same failure domain)" in choice.reason and "c (not alive)" in choice.reason


def test_memory_commit_needs_every_rank_on_its_node_and_in_another_domain():
    node_of = {0: "n1", 1: "n2"}
    domain = {"n1": "A", "n2": "A", "n3": "B"}
    ok, why = memory_committed([0, 1], node_of, {0: ["n1", "n3"], 1: ["n2", "n1"]}, domain)
    assert not ok and "rank 1 has no copy outside the failure domain of n2" in why
    ok, _ = memory_committed([0, 1], node_of, {0: ["n1", "n3"], 1: ["n2", "n3"]}, domain)
    assert ok
    ok, why = memory_committed([0], node_of, {0: ["n3"]}, domain)
    assert not ok and "no copy on its node n1" in why


def test_a_checkpoint_without_files_is_committed_in_memory_at_once():
    assert memory_committed([], {}, {}, {})[0]


def test_a_restore_takes_the_newest_memory_checkpoint_while_one_copy_lives():
    cands = [Candidate("c1", 1, 10, Level.DURABLE, frozenset({0})),
             Candidate("c2", 2, 20, Level.MEMORY, frozenset({0, 1}))]
    holders = {("c2", 0): ["n1", "n2"], ("c2", 1): ["n2", "n3"]}
    choice = choose_restore(cands, holders, live=["n2"])
    assert choice.checkpoint_dir == "c2" and choice.steps_lost == 0 and choice.level is Level.MEMORY


def test_a_restore_falls_back_to_the_newest_durable_one_when_both_copies_are_gone_and_counts_the_steps():
    cands = [Candidate("c1", 1, 10, Level.DURABLE, frozenset({0})),
             Candidate("c2", 2, 20, Level.MEMORY, frozenset({0, 1})),
             Candidate("c3", 3, 30, Level.MEMORY, frozenset({0, 1}))]
    holders = {("c2", 0): ["n1", "n2"], ("c2", 1): ["n2", "n3"],
               ("c3", 0): ["n1", "n2"], ("c3", 1): ["n2", "n3"]}
    choice = choose_restore(cands, holders, live=["n1", "n3"])
    assert choice.checkpoint_dir == "c3"
    choice = choose_restore(cands, holders, live=["n1"])
    assert choice.checkpoint_dir == "c1" and choice.steps_lost == 20 and choice.lost == ("c3", "c2")
    assert "20 steps" in choice.reason


def test_with_nothing_left_the_run_starts_over_and_the_steps_are_counted():
    choice = choose_restore([Candidate("c1", 1, 7, Level.MEMORY, frozenset({0}))], {("c1", 0): ["n1"]}, live=[])
    assert choice.checkpoint_dir is None and choice.steps_lost == 7
    assert choose_restore([], {}, []).reason == "no committed checkpoint exists"


def test_a_rank_reads_its_own_node_first_then_peers_then_storage():
    got = sources("n2", ["n3", "n2", "n1"], durable=True)
    assert [(s.kind, s.node_id) for s in got] == [(SourceKind.LOCAL_MEMORY, "n2"), (SourceKind.PEER_MEMORY, "n1"),
                                                  (SourceKind.PEER_MEMORY, "n3"), (SourceKind.STORAGE, "")]
    assert [s.kind for s in sources("n9", [], durable=False)] == []



def test_a_memory_checkpoint_with_one_rank_held_nowhere_is_lost_however_many_nodes_hold_the_others():
    cands = [Candidate("c1", 1, 10, Level.MEMORY, frozenset({0, 1})), Candidate("c2", 2, 20, Level.MEMORY,
                                                                              frozenset({0, 1}))]
    holders = {("c1", 0): ["n1"], ("c1", 1): ["n1"], ("c2", 0): ["n1", "n2"], ("c2", 1): ["n2", "n3"]}
    choice = choose_restore(cands, holders, live=["n1", "n4"])
    assert choice.checkpoint_dir == "c1" and choice.lost == ("c2",) and choice.gone == {"c2": (1,)}
    assert choice.steps_lost == 10
