"""Live recovery's decisions in the controller (`live.py`), and the core carrying them out: no processes."""

from __future__ import annotations

from outlast.controller import group as g
from outlast.controller.live import FallBack, LiveRun, Planned, Recovered, Replace
from outlast.controller.states import State
from outlast.protocol import messages as m
from outlast.protocol.membership import Membership
from outlast.controller.core import ControllerCore
from tests.fakes.controller import Harness, finish_all, make, make_plan, node, start


def formed(world_size: int, **kw) -> LiveRun:
    live = LiveRun(world_size, **kw)
    assert live.on_joined(0, 0, wall=0.0) is None and live.formed
    return live


def test_a_death_before_the_ranks_formed_their_group_falls_back():
    d = LiveRun(2).on_death(1, "killed", wall=1.0)
    assert isinstance(d, FallBack) and "LiveTraining" in d.reason


def test_a_dead_rank_is_replaced_under_its_own_number_and_the_lowest_rank_kept_sends_the_state():
    live = formed(3)
    d = live.on_death(1, "rank 1 was killed", wall=10.0)
    assert isinstance(d, Replace) and d.rank == 1 and d.incarnation == 1 and d.member == "r1i1"
    assert d.membership == Membership(1, ("r0i0", "r1i1", "r2i0"), (1,), 0)
    live = formed(2)
    d = live.on_death(0, "rank 0 was killed", wall=10.0)
    assert isinstance(d, Replace) and d.membership == Membership(1, ("r0i1", "r1i0"), (0,), 1)


def test_a_death_during_the_transfer_widens_the_recovery_and_the_first_replacement_receives_the_state_again():
    live = formed(3)
    live.on_death(1, "rank 1 was killed", wall=10.0)
    d = live.on_death(1, "its replacement was killed", wall=10.5)  # the replacement itself
    assert isinstance(d, Replace) and d.member == "r1i2" and d.membership.joiners == (1,)
    d = live.on_death(0, "rank 0 was killed", wall=10.7)
    assert isinstance(d, Replace) and d.membership == Membership(3, ("r0i1", "r1i2", "r2i0"), (0, 1), 2)
    # The runtime reads the words of the recovery's earlier generations too: generation 2 formed (its sender threw a
    # step away before), and rank 0 died after; generation 1 never did.
    assert live.unread() == [1, 2]
    assert live.on_joined(2, 1, wall=11.0) is None  # a stale generation's word: generation 3 still waits
    assert live.on_joined(2, 1, wall=11.1) is None and live.unread() == [1]  # read once
    done = live.on_joined(3, 1, wall=11.5)
    # What each sender threw away before its generation formed counts: the step thrown before generation 2, and the
    # one thrown in it (an FSDP2 run throws the step in flight away on every death).
    assert done == Recovered(3, (1, 0), "rank 1 was killed", 10.0, 1.5, 2)
    assert live.unread() == [] and live.on_joined(2, 1, wall=12.0) is None  # settled: an old word counts no more
    assert live.recovery is None and live.unsent == set()


def test_with_no_rank_left_that_holds_the_state_it_falls_back_to_a_restart():
    live = formed(2)
    assert isinstance(live.on_death(1, "killed", wall=1.0), Replace)
    d = live.on_death(0, "killed too", wall=1.1)
    assert isinstance(d, FallBack) and "no rank that holds the state" in d.reason


def test_replacements_that_keep_dying_in_their_transfer_fall_back_past_the_bound():
    live = formed(3, max_transfer_deaths=2)
    for _ in range(3):
        assert isinstance(live.on_death(2, "killed", wall=1.0), Replace)
    d = live.on_death(2, "killed", wall=1.0)
    assert isinstance(d, FallBack) and "more than 2" in d.reason


def test_two_ranks_lost_at_once_are_replaced_in_one_recovery_by_the_one_left():
    live = formed(3)
    assert isinstance(live.on_death(0, "rank 0 was killed", wall=1.0), Replace)
    d = live.on_death(1, "rank 1 was killed", wall=1.01)
    assert isinstance(d, Replace) and d.membership == Membership(2, ("r0i1", "r1i1", "r2i0"), (0, 1), 2)
    assert live.on_joined(2, 1, wall=1.5) == Recovered(2, (0, 1), "rank 0 was killed", 1.0, 0.5, 1)


def test_a_hung_rank_is_killed_once_and_only_after_the_group_formed():
    assert not LiveRun(2).on_hang(1, "rank 1 hung")
    live = formed(2)
    assert live.on_hang(1, "rank 1 hung") and not live.on_hang(1, "rank 1 hung again")
    assert live.hung == {1: "rank 1 hung"}


def _live(max_failures: int, **kw):
    h = make(max_failures=max_failures, live_recovery=True, live_store="controller:7", **kw)
    placement = start(h)
    published = [e for e in h.effects if isinstance(e, g.PublishMembership)]
    assert [Membership.from_json(p.membership).generation for p in published] == [0]
    assert all(s.msg.env["OUTLAST_LIVE_STORE"] == "controller:7" for s in h.effects if isinstance(s, g.Spawn))
    h.step(g.LiveJoined(attempt=1, generation=0, steps_lost=0, wall=h.wall()))  # rank 0: the group formed
    return h, placement


def killed(h, rank: int, node_id: str) -> m.WorkerExited:
    return m.WorkerExited(run_id=h.core.run_id, attempt=1, rank=rank, pid=100 + rank, exit_code=None, signal=9,
                          error=None, node_id=node_id)


def test_the_core_replaces_a_dead_rank_without_stopping_the_others_and_charges_max_failures():
    h, placement = _live(max_failures=1)
    h.effects.clear()
    h.agent(placement[1], killed(h, 1, placement[1]))
    assert h.state is State.RUNNING and not [e for e in h.effects if isinstance(e, g.StopRun)]
    [spawn] = [e for e in h.effects if isinstance(e, g.Spawn)]
    assert spawn.node_id == placement[1] and [w.rank for w in spawn.msg.workers] == [1]
    assert spawn.msg.attempt == 1 and spawn.msg.env["OUTLAST_LIVE_INCARNATION"] == "1"
    [published] = [Membership.from_json(e.membership) for e in h.effects if isinstance(e, g.PublishMembership)]
    assert published == Membership(1, ("r0i0", "r1i1"), (1,), 0)
    assert h.core.book.failures_this_launch("worker") == 1
    assert h.core.book.state.attempts[-1].failures[0].rank == 1
    h.step(g.LiveJoined(attempt=1, generation=1, steps_lost=1, wall=h.wall() + 0.25))
    [record] = h.core.book.state.live_recoveries
    assert record.path == "live" and record.ranks == [1] and record.steps_lost == 1 and record.seconds == 0.25
    # The replacement's first report takes the index its state came with; its predecessor's last never came.
    h.worker(m.Report(attempt=1, rank=0, index=0, metrics={"step": 0}))
    h.worker(m.Report(attempt=1, rank=0, index=1, metrics={"step": 1}))
    h.step(g.FromWorker(m.Report(attempt=1, rank=1, index=1, metrics={"step": 1}), incarnation=1))
    assert h.core.commit_tracker.reports == [2, 2]
    # The replacement's exit is the rank's: the run finishes when every rank returned.
    finish_all(h, placement)
    assert h.state is State.FINISHED and len(h.core.book.state.attempts) == 1


def test_the_core_restarts_when_no_survivor_holds_the_state_and_says_which_path_it_took():
    h, placement = _live(max_failures=3)
    h.agent(placement[1], killed(h, 1, placement[1]))
    h.agent(placement[0], killed(h, 0, placement[0]))
    assert h.state is State.RESTARTING
    [record] = h.core.book.state.live_recoveries
    assert record.path == "restart" and record.ranks == [0] and "no rank that holds the state" in record.reason
    assert h.core.book.failures_this_launch("worker") == 1  # the live recovery's; the restart's verdict adds its own


def test_with_max_failures_spent_a_death_gives_up_as_without_live_recovery():
    h, placement = _live(max_failures=0)
    h.agent(placement[1], killed(h, 1, placement[1]))
    assert h.state is State.RESTARTING and not h.core.book.state.live_recoveries


def test_a_death_after_another_rank_finished_its_loop_falls_back():
    # The finished rank committed the last step and left: a replacement would wait for it to form its group.
    d = formed(3).on_death(1, "killed", wall=5.0, finished=(2,))
    assert isinstance(d, FallBack) and "finished their loop" in d.reason


def test_a_replacement_restores_no_checkpoint_it_takes_the_state_from_the_others():
    # The attempt began from a checkpoint that retention may have deleted since: the replacement must not read it.
    h, placement = _live(max_failures=1)
    h.core.attempt.restore = "checkpoint_001_000003"
    h.effects.clear()
    h.agent(placement[1], killed(h, 1, placement[1]))
    [spawn] = [e for e in h.effects if isinstance(e, g.Spawn)]
    assert spawn.msg.restore_checkpoint is None and [w.rank for w in spawn.msg.workers] == [1]


def test_a_lost_node_s_rank_is_replaced_on_the_spare_node_while_the_other_goes_on():
    h, placement = _live(max_failures=1)  # ranks on n1 and n2; n3 is spare
    h.effects.clear()
    h.step(g.AgentGone(placement[1], f"the agent of {placement[1]} died"), dt=1.0)
    assert h.state is State.RUNNING and not [e for e in h.effects if isinstance(e, g.StopRun)]
    [spawn] = [e for e in h.effects if isinstance(e, g.Spawn)]
    assert spawn.node_id == "n3" and [w.rank for w in spawn.msg.workers] == [1]
    assert any(isinstance(e, g.ToNode) and e.node_id == "n3" and isinstance(e.msg, m.RunHeartbeat)
               for e in h.effects)  # the agent there knows the run before its worker
    assert h.core.attempt.placement == {0: placement[0], 1: "n3"}
    [published] = [Membership.from_json(e.membership) for e in h.effects if isinstance(e, g.PublishMembership)]
    assert published == Membership(1, ("r0i0", "r1i1"), (1,), 0)
    assert h.core.book.state.attempts[-1].failures[0].kind == "NodeLost"


def test_a_lost_node_with_no_room_elsewhere_falls_back_and_says_why():
    h = make(max_failures=2, live_recovery=True, live_store="controller:7", nodes=("n1", "n2"))
    placement = start(h)
    h.step(g.LiveJoined(attempt=1, generation=0, steps_lost=0, wall=h.wall()))
    h.step(g.AgentGone(placement[1], "gone"), dt=1.0)
    assert h.state is State.RESTARTING
    [record] = h.core.book.state.live_recoveries
    assert record.path == "restart" and "have no room on another node" in record.reason


def test_a_hang_kills_the_blamed_rank_and_its_death_is_replaced_with_the_hang_as_its_cause():
    h, placement = _live(max_failures=1, hang_timeout_s=5.0)
    h.effects.clear()
    h.step(dt=6.0)  # no progress from anyone: the watch asks for stacks
    h.worker(m.StackDump(attempt=1, rank=0, where="all_reduce", text="in allreduce"))
    h.step(dt=11.0)  # rank 1 (stopped) never answers: it is blamed, and killed
    [kill] = [e for e in h.effects if isinstance(e, g.ToNode) and isinstance(e.msg, m.KillRanks)]
    assert kill.node_id == placement[1] and kill.msg.ranks == [1] and h.state is State.RUNNING
    h.agent(placement[1], killed(h, 1, placement[1]))
    assert h.state is State.RUNNING
    [spawn] = [e for e in h.effects if isinstance(e, g.Spawn)]
    assert spawn.node_id == placement[1]
    failure = h.core.book.state.attempts[-1].failures[0]
    assert failure.kind == "Hang" and "rank 1 hung" in failure.message
    h.step(dt=1.0)
    assert len([e for e in h.effects if isinstance(e, g.ToNode) and isinstance(e.msg, m.KillRanks)]) == 1


def test_the_ranks_of_one_lost_node_are_one_death_and_one_failure():
    live = formed(4)
    first = live.on_death(0, "node n0 lost", wall=1.0, lost_node="n0")
    second = live.on_death(1, "node n0 lost", wall=1.0, lost_node="n0")
    assert isinstance(first, Replace) and first.charged and isinstance(second, Replace) and not second.charged
    assert live.losing("n0") and not live.losing("n1")
    assert live.recovery is not None and live.recovery.deaths == 0  # the bound on deaths in a transfer is untouched
    third = live.on_death(2, "rank 2 was killed", wall=2.0)
    assert isinstance(third, Replace) and third.charged and live.recovery.deaths == 1


def test_a_lost_node_that_held_every_rank_with_the_state_falls_back_at_its_first_rank():
    h = Harness(core=None)  # type: ignore[arg-type]
    h.core = ControllerCore(make_plan(max_failures=3, live_recovery=True, live_store="controller:7", strategy="PACK"),
                            "run1", "tcp://controller:1", wall=h.wall)
    h.step(g.NodeTable([node("n1", cpus=2.0), node("n2", cpus=2.0)]))
    h.step(g.Started())
    placement = start(h)
    assert placement[0] == placement[1]  # both ranks on one node, the other spare
    h.step(g.LiveJoined(attempt=1, generation=0, steps_lost=0, wall=h.wall()))
    h.step(g.AgentGone(placement[0], "gone"), dt=1.0)
    assert h.state in (State.RESTARTING, State.PLACING)  # the attempt is over, and the next one placed
    [record] = h.core.book.state.live_recoveries
    assert record.path == "restart" and "no rank that holds the state is left" in record.reason
    assert h.core.book.state.failure_counts == {"worker": 1}  # one node, one failure


# ---- a shrink: a lost node with no room elsewhere, in an elastic run ------------------------------------


def test_a_shrink_leaves_the_lost_ranks_out_and_numbers_the_others_afresh_with_nobody_to_send_to():
    from outlast.controller.live import Shrunk

    live = formed(3)
    d = live.on_shrink([1], "shrink: node b lost", wall=5.0, least=2, node="b")
    assert isinstance(d, Shrunk) and d.ranks == (1,)
    # Rank 2's process is the group's rank 1 from here; every rank announces, nobody joins.
    assert d.membership == Membership(1, ("r0i0", "r2i0"), (), None) and live.slots == [0, 2]
    assert "thrown away" in d.reason
    assert live.on_joined(1, 1, wall=5.5) == Recovered(1, (1,), "shrink: node b lost", 5.0, 0.5, 1)
    # A later death of the controller's rank 2 is replaced under its own name, in the group's rank 1.
    r = live.on_death(2, "rank 2 was killed", wall=9.0)
    assert isinstance(r, Replace) and r.member == "r2i1"
    assert r.membership == Membership(2, ("r0i0", "r2i1"), (1,), 0)
    assert isinstance(live.on_death(1, "the lost rank, again", wall=9.1), FallBack)  # not a rank of the group
    assert live.on_joined(2, 0, wall=9.5) is not None
    # A node joins: the rank added is numbered after every number the attempt gave, and is the group's rank 2.
    assert live.added_for(3) == [3]
    grow = live.on_grow(3, "grow", wall=10.0)
    assert isinstance(grow, Planned) and grow.ranks == (3,) and live.slots == [0, 2, 3]
    assert grow.membership == Membership(3, ("r0i0", "r2i1", "r3i0"), (2,), 0, planned=True)
    live.on_started("r3i0")
    assert live.starting_members() == [] and live.publishable(told=True) == grow.membership


def test_a_shrink_below_min_workers_or_under_a_replacement_still_waiting_falls_back_and_says_why():
    live = formed(2)
    d = live.on_shrink([1], "shrink", wall=1.0, least=2, node="b")
    assert isinstance(d, FallBack) and "min_workers=2" in d.reason and live.slots == [0, 1]
    live = formed(3)
    assert isinstance(live.on_death(2, "rank 2 was killed", wall=1.0), Replace)
    d = live.on_shrink([1], "shrink", wall=1.1, least=1, node="b")
    assert isinstance(d, FallBack) and "[2] still wait for the state" in d.reason
    d = formed(3).on_shrink([0, 1, 2], "shrink", wall=1.0, least=0, node="b")
    assert isinstance(d, FallBack) and "no rank that holds the state" in d.reason
    d = LiveRun(3).on_shrink([1], "shrink", wall=1.0, least=1, node="b")
    assert isinstance(d, FallBack) and "before the ranks formed" in d.reason


def test_a_run_over_live_mesh_is_never_resized_live_but_its_lost_ranks_are_replaced():
    """An FSDP2 model over live_mesh keeps the ranks and world its mesh was made for (`LiveMesh.attach` refuses
    another): the controller, told so with the word that generation 0 formed, neither shrinks nor grows it live, with
    one shard or more; a death with room to replace it goes live as in the other modes."""
    from outlast.controller.live import Leave, Shrunk, StayPut

    for shards in (1, 2):
        ddp = formed(4)
        mesh = LiveRun(4)
        assert mesh.on_joined(0, 0, wall=0.0, shards=shards, mesh=True) is None and mesh.mesh
        lost = mesh.on_shrink([3], "shrink: node d lost", wall=1.0, least=1, node="d")
        assert isinstance(lost, FallBack) and "live_mesh" in lost.reason and mesh.slots == [0, 1, 2, 3]
        left = mesh.on_drain([3], "drain: node d", wall=1.0, no_room="full", least=1)
        assert isinstance(left, StayPut) and "live_mesh" in left.reason and mesh.membership.generation == 0
        grow = mesh.on_grow(6, "grow", wall=1.0)
        assert isinstance(grow, StayPut) and not grow.later and "live_mesh" in grow.reason
        assert isinstance(mesh.on_death(3, "rank 3 was killed", wall=2.0), Replace)
        # The same decisions without the mesh: the data-parallel loop shrinks and leaves live.
        assert isinstance(ddp.on_shrink([3], "shrink: node d lost", wall=1.0, least=1, node="d"), Shrunk)
        assert isinstance(formed(4).on_drain([3], "drain: node d", wall=1.0, no_room="full", least=1), Leave)
