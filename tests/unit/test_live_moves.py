"""Live recovery's planned changes in the controller: a drained node's ranks move to a node that stays, the
survivors going on (`live.py` decides, `live_steps.py` carries it out), and the rank side's verdict for a
generation published while every member lives. No processes."""

from __future__ import annotations

import pytest

from outlast.controller import group as g
from outlast.controller.live import Leave, LiveRun, Planned, Recovered, Replace, StayPut
from outlast.controller.live_room import where_to
from outlast.controller.placement import NodeView, NoCapacity
from outlast.controller.states import State
from outlast.protocol import messages as m
from outlast.protocol.membership import Membership
from outlast.protocol.transport import incarnation_of, watch_identity, worker_identity
from outlast.train.live.step_commit import Ledger, StepVerdict, tally, while_waiting
from tests.fakes.controller import finish_all, make, start


def formed(world_size: int) -> LiveRun:
    live = LiveRun(world_size)
    live.on_joined(0, 0, wall=0.0)
    return live


# ---- the pure core ---------------------------------------------------------------------------------


def test_a_drained_rank_moves_in_a_planned_generation_published_once_its_replacement_waits_and_all_were_told():
    live = formed(3)
    d = live.on_drain([1], "drain: node b", wall=10.0, no_room=None)
    assert isinstance(d, Planned) and d.ranks == (1,) and d.incarnations == {1: 1}
    assert d.membership == Membership(1, ("r0i0", "r1i1", "r2i0"), (1,), 0, planned=True)
    assert "rank 0 sends" in d.reason and live.starting_members() == ["r1i1"]
    assert live.publishable(told=True) is None  # its replacement has not started yet
    live.on_started("r1i0")  # the drained process itself is no new member
    assert live.starting_members() == ["r1i1"]
    live.on_started("r1i1")
    assert live.publishable(told=False) is None  # the ranks have not all been told of the drain yet
    assert live.publishable(told=True) == d.membership and live.unpublished is None
    assert live.publishable(told=True) is None  # published once
    done = live.on_joined(1, 0, wall=10.5)
    assert done == Recovered(1, (1,), "drain: node b", 10.0, 0.5, 0)


def test_two_drained_ranks_are_published_when_both_replacements_started():
    live = formed(4)
    d = live.on_drain([2, 3], "drain", wall=1.0, no_room=None)
    assert isinstance(d, Planned) and d.membership.joiners == (2, 3) and d.membership.source == 0
    live.on_started("r3i1")
    assert live.publishable(told=True) is None
    live.on_started("r2i1")
    assert live.publishable(told=True) == d.membership


def test_a_drain_stays_put_with_its_reason():
    assert "before the ranks formed" in LiveRun(2).on_drain([1], "drain", 1.0, None).reason
    assert "every rank" in formed(2).on_drain([0, 1], "drain", 1.0, None).reason
    assert "no node that stays has room for ranks [1]: full" in formed(2).on_drain([1], "drain", 1.0, "full").reason
    busy = formed(2)
    assert isinstance(busy.on_death(0, "killed", wall=1.0), Replace)
    d = busy.on_drain([1], "drain", 1.0, None)
    assert isinstance(d, StayPut) and "still take the state" in d.reason


def test_a_death_during_a_move_publishes_the_planned_generation_first_and_widens_the_recovery():
    live = formed(3)
    live.on_drain([2], "drain", wall=1.0, no_room=None)
    planned = live.take_unpublished()
    assert planned is not None and planned.planned and live.publishable(told=True) is None
    d = live.on_death(1, "killed", wall=1.2)
    assert isinstance(d, Replace) and d.membership == Membership(2, ("r0i0", "r1i1", "r2i1"), (1, 2), 0)
    assert not d.membership.planned
    assert live.on_joined(2, 1, wall=2.0) == Recovered(2, (2, 1), "drain", 1.0, 1.0, 1)


def test_a_drained_process_dead_before_its_planned_generation_formed_sends_it_out_again_unplanned():
    # Its vote of the step in flight never comes, and the others take a planned generation for no sign of a loss:
    # they waited for that vote for ever (seed 13131 of the simulator's --live sweep).
    live = formed(3)
    d = live.on_drain([1], "drain", wall=1.0, no_room=None)
    planned = live.take_unpublished()
    assert planned == d.membership and planned.planned
    again = live.on_retired_death()
    assert again == Membership(2, planned.members, planned.joiners, planned.source) and not again.planned
    assert live.on_retired_death() is None  # unplanned now: nothing more to send
    assert live.on_joined(2, 0, wall=2.0) == Recovered(2, (1,), "drain", 1.0, 1.0, 0)
    assert live.on_retired_death() is None  # the move is over: a drained process's death is no one's


def test_a_drained_process_dead_before_its_replacement_waits_makes_the_generation_unplanned_when_it_goes_out():
    live = formed(3)
    live.on_drain([1], "drain", wall=1.0, no_room=None)
    assert live.on_retired_death() is None  # not out yet: it goes out unplanned once its new member waits
    live.on_started("r1i1")
    out = live.publishable(told=True)
    assert out == Membership(1, ("r0i0", "r1i1", "r2i0"), (1,), 0) and not out.planned


def test_the_moving_ranks_go_to_nodes_that_are_not_draining_beside_the_ranks_kept():
    nodes = [NodeView("a", "", {"CPU": 2}), NodeView("b", "", {"CPU": 1}, draining=True), NodeView("c", "", {"CPU": 1})]
    assert where_to(nodes, {0: "a", 1: "b"}, [1], {"CPU": 1}, "SPREAD") == {1: "a"}
    assert where_to(nodes, {0: "a", 1: "a", 2: "b"}, [2], {"CPU": 1}, "PACK") == {2: "c"}
    full = where_to(nodes, {0: "a", 1: "a", 2: "c", 3: "b"}, [3], {"CPU": 1}, "STRICT_SPREAD")
    assert isinstance(full, NoCapacity) and "1 draining" in full.reason


# ---- the rank side's verdict ----------------------------------------------------------------------------


def test_a_planned_generation_commits_the_step_in_flight_as_regroup_and_aborts_nothing():
    assert tally(True, 2, 2, newer_generation=True).verdict is StepVerdict.REGROUP
    assert tally(True, 2, 2, newer_generation=False).verdict is StepVerdict.COMMIT
    assert while_waiting(True, planned=True).verdict is None  # every member lives: its vote comes
    assert while_waiting(True, planned=False).verdict is StepVerdict.ABORT
    assert Ledger(0).begin(0).after(StepVerdict.REGROUP).committed == 0


def test_a_replacement_has_identities_of_its_own_beside_the_process_it_replaces():
    assert worker_identity(3, 1) == b"3:1" and worker_identity(3, 1, 2) == b"3:1:i2"
    assert watch_identity(3, 1, 2) == b"3:1:i2:watch" and watch_identity(3, 1) == b"3:1:watch"
    assert [incarnation_of(i) for i in (b"3:1", b"3:1:i2", b"3:1:i2:watch", b"3:1:watch", b"3:1:fetch")] \
        == [0, 2, 2, 0, 0]


# ---- the core carrying it out ---------------------------------------------------------------------------


def _live(**kw):
    h = make(nodes=("n1", "n2", "n3"), live_recovery=True, live_store="controller:7", **kw)
    placement = start(h)
    h.step(g.LiveJoined(attempt=1, generation=0, steps_lost=0, wall=h.wall()))
    h.effects.clear()
    return h, placement


def _drain(h, node_id: str) -> None:
    h.agent(node_id, m.NodeDraining(node_id=node_id, reason="spot", message="reclaimed",
                                    deadline_unix_s=h.wall() + 30, node_ids=[node_id]))


def test_the_core_moves_a_drained_rank_to_the_spare_node_tells_every_rank_and_charges_the_preemption_budget():
    h, placement = _live(max_failures=0)
    assert placement == {0: "n1", 1: "n2"}
    _drain(h, "n2")
    assert h.state is State.RUNNING and not [e for e in h.effects if isinstance(e, g.StopRun)]
    [spawn] = [e for e in h.effects if isinstance(e, g.Spawn)]
    assert spawn.node_id == "n3" and [w.rank for w in spawn.msg.workers] == [1]
    assert spawn.msg.env["OUTLAST_LIVE_INCARNATION"] == "1"
    assert not [e for e in h.effects if isinstance(e, g.PublishMembership)]  # not before the replacement started
    # Every rank is told of the drain, as without live recovery.
    for rank in (0, 1):
        h.worker(m.PreemptionQuery(attempt=1, rank=rank, index=5))
    notices = [e for e in h.effects if isinstance(e, g.ToRank) and isinstance(e.msg, m.PreemptionNotice)]
    assert {e.rank for e in notices} == {0, 1} and notices[0].msg.ranks == [1]
    # The replacement says hello from its own socket, and is answered there.
    h.step(g.FromWorker(m.WorkerHello(attempt=1, rank=1, pid=300), incarnation=1))
    [welcome] = [e for e in h.effects if isinstance(e, g.ToRank) and isinstance(e.msg, m.Welcome)]
    assert welcome.incarnation == 1
    h.worker(m.PreemptionQuery(attempt=1, rank=1, index=6))  # the drained process asks again: answered there
    assert [e.incarnation for e in h.effects if isinstance(e, g.ToRank) and e.rank == 1][-1] == 0
    assert not [e for e in h.effects if isinstance(e, g.PublishMembership)]
    # Once it waits in the store for its generation, the planned generation is published.
    h.step(g.LiveReady(attempt=1, member="r1i1"))
    [published] = [Membership.from_json(e.membership) for e in h.effects if isinstance(e, g.PublishMembership)]
    assert published == Membership(1, ("r0i0", "r1i1"), (1,), 0, planned=True)
    h.step(g.LiveJoined(attempt=1, generation=1, steps_lost=0, wall=h.wall() + 0.5))
    [record] = h.core.book.state.live_recoveries
    assert record.path == "live" and record.cause.startswith("drain") and record.steps_lost == 0
    assert h.core.book.state.failure_counts == {"preemption": 1}  # not max_failures (0 here)
    assert [d.ranks for d in h.core.book.state.drains] == [[1]]
    # The drained process exits cleanly: not the rank's exit; the run finishes with the replacement's.
    h.agent("n2", h.exited(1, "n2"))
    assert h.state is State.RUNNING and 1 not in h.core.attempt.exited
    finish_all(h, {0: "n1", 1: "n3"})
    assert h.state is State.FINISHED and len(h.core.book.state.attempts) == 1


def test_a_drain_with_no_room_elsewhere_takes_its_usual_path_and_the_history_says_why():
    h, placement = _live()
    h.step(g.NodeTable([m.NodeInfo(node_id=n, address=f"tcp://{n}:1", host=n, resources={"CPU": 1.0})
                        for n in ("n1", "n2")]))
    _drain(h, "n2")
    assert h.state is State.PREEMPTING
    [record] = h.core.book.state.live_recoveries
    assert record.path == "restart" and "no node that stays has room" in record.reason


def test_a_drained_rank_that_returns_before_its_replacement_waits_ends_the_rank_and_stops_the_replacement():
    h, placement = _live()
    _drain(h, "n2")
    h.worker(m.WorkerDone(attempt=1, rank=0, reports=0))
    h.agent("n1", h.exited(0, "n1"))
    h.worker(m.WorkerDone(attempt=1, rank=1, reports=0))
    h.agent("n2", h.exited(1, "n2"))  # the loop ended before the move: the drained process returned
    [stop] = [e for e in h.effects if isinstance(e, g.StopRun)]
    assert stop.node_id == "n3" and h.core.live.unpublished is None and h.core.live.recovery is None
    assert not [e for e in h.effects if isinstance(e, g.PublishMembership)]
    assert h.state is State.FINISHED


# ---- an elastic run grows -----------------------------------------------------------------------------------


def test_added_ranks_join_a_planned_generation_of_the_larger_size_and_rank_0_sends_them_the_state():
    live = formed(2)
    d = live.on_grow(4, "grow", wall=5.0)
    assert isinstance(d, Planned) and d.ranks == (2, 3) and d.incarnations == {2: 0, 3: 0}
    assert d.membership == Membership(1, ("r0i0", "r1i0", "r2i0", "r3i0"), (2, 3), 0, planned=True)
    assert live.starting_members() == ["r2i0", "r3i0"]
    live.on_started("r2i0")
    live.on_started("r3i0")
    assert live.publishable(told=True) == d.membership
    assert live.on_joined(1, 0, wall=6.0) == Recovered(1, (2, 3), "grow", 5.0, 1.0, 0)
    assert isinstance(live.on_death(3, "killed", wall=7.0), Replace)  # an added rank is a rank like the others


def test_a_grow_stays_put_or_waits_with_its_reason():
    assert "before the ranks formed" in LiveRun(2).on_grow(3, "grow", 1.0).reason
    assert "no grow" in formed(3).on_grow(3, "grow", 1.0).reason
    busy = formed(2)
    busy.on_death(1, "killed", wall=1.0)
    d = busy.on_grow(3, "grow", 1.0)
    assert isinstance(d, StayPut) and d.later and "the grow waits" in d.reason


def test_the_core_grows_an_elastic_run_live_with_no_notice_no_restart_and_no_budget_drawn():
    from outlast.controller.resize import Elastic
    from tests.fakes.controller import node

    h = make(nodes=("n1", "n2"), world_size=3, elastic=Elastic(2, 3, min_interval_s=0), live_recovery=True,
             live_store="controller:7")
    placement = start(h)
    assert h.core.plan.world_size == 2
    h.step(g.LiveJoined(attempt=1, generation=0, steps_lost=0, wall=h.wall()))
    h.effects.clear()
    h.step(g.NodeTable([node(n) for n in ("n1", "n2", "n3")]))  # a node joins
    assert h.state is State.RUNNING and h.core.plan.world_size == 3
    [spawn] = [e for e in h.effects if isinstance(e, g.Spawn)]
    assert spawn.node_id == "n3" and [(w.rank, w.world_size) for w in spawn.msg.workers] == [(2, 3)]
    assert not h.to_rank(0)  # no notice: the loop is not asked to save
    h.step(g.LiveReady(attempt=1, member="r2i0"))
    [published] = [Membership.from_json(e.membership) for e in h.effects if isinstance(e, g.PublishMembership)]
    assert published == Membership(1, ("r0i0", "r1i0", "r2i0"), (2,), 0, planned=True)
    h.worker(m.WorkerHello(attempt=1, rank=2, pid=102))
    h.step(g.LiveJoined(attempt=1, generation=1, steps_lost=0, wall=h.wall() + 0.5))
    [record] = h.core.book.state.live_recoveries
    assert record.path == "live" and record.cause.startswith("grow") and record.ranks == [2]
    [resize] = h.core.book.state.resizes
    assert (resize.from_workers, resize.to_workers, resize.steps_lost) == (2, 3, 0)
    assert h.core.book.state.failure_counts == {}
    # The added rank's reports take up the count of the rank that sent it the state.
    for rank in (0, 1):
        for i in range(3):
            h.worker(m.Report(attempt=1, rank=rank, index=i, metrics={"step": i}))
    h.worker(m.Report(attempt=1, rank=2, index=3, metrics={"step": 3}))
    assert h.core.commit_tracker.reports == [3, 3, 4]
    finish_all(h, {**placement, 2: "n3"})
    assert h.state is State.FINISHED and len(h.core.book.state.attempts) == 1


def test_a_move_waits_for_the_notice_to_be_fixed_but_not_for_a_loop_that_stopped_asking():
    h, placement = _live()
    for rank in (0, 1):  # grants of many calls: each rank's next call decides the notice
        h.step(g.FromWorker(m.PreemptionQuery(attempt=1, rank=rank, index=0)))
        h.step(g.FromWorker(m.PreemptionQuery(attempt=1, rank=rank, index=40)), dt=0.01)
    _drain(h, "n2")
    assert h.core.horizons.decision_index is None
    h.step(g.LiveReady(attempt=1, member="r1i1"))
    assert not [e for e in h.effects if isinstance(e, g.PublishMembership)]  # the ranks have not been told yet
    h.step(dt=2.0)  # no rank asked since: the move goes on without waiting for the deadline
    [published] = [Membership.from_json(e.membership) for e in h.effects if isinstance(e, g.PublishMembership)]
    assert published.planned and published.generation == 1
    # The drained process, stopped with the attempt, is stopped where it runs too.
    from outlast.controller import ending
    ending.stop_workers(h.core)
    assert {e.node_id for e in h.core.out if isinstance(e, g.StopRun)} == {"n1", "n2", "n3"}


def test_a_grow_whose_loop_ends_before_the_added_rank_waits_finishes_and_stops_the_added_rank():
    from outlast.controller.resize import Elastic
    from tests.fakes.controller import node

    h = make(nodes=("n1", "n2"), world_size=3, elastic=Elastic(2, 3, min_interval_s=0), live_recovery=True,
             live_store="controller:7")
    placement = start(h)
    h.step(g.LiveJoined(attempt=1, generation=0, steps_lost=0, wall=h.wall()))
    h.step(g.NodeTable([node(n) for n in ("n1", "n2", "n3")]))
    h.effects.clear()
    finish_all(h, placement)  # ranks 0 and 1 return before rank 2 waited for its generation
    [stop] = [e for e in h.effects if isinstance(e, g.StopRun)]
    assert stop.node_id == "n3" and not [e for e in h.effects if isinstance(e, g.PublishMembership)]
    assert h.state is State.FINISHED and len(h.core.book.state.attempts) == 1


def test_the_core_shrinks_an_elastic_run_live_when_a_lost_node_has_no_room_elsewhere_and_grows_it_back():
    from outlast.controller.resize import Elastic
    from tests.fakes.controller import node

    h = make(nodes=("n1", "n2", "n3"), world_size=3, elastic=Elastic(2, 3, min_interval_s=0), live_recovery=True,
             live_store="controller:7", max_failures=1)
    placement = start(h)
    assert h.core.plan.world_size == 3
    h.step(g.LiveJoined(attempt=1, generation=0, steps_lost=0, wall=h.wall()))
    for rank in range(3):  # every rank reported step 0 at the world of 3
        h.worker(m.Report(attempt=1, rank=rank, index=0, metrics={"step": 0},
                          data_position=f'{{"world":3,"rank":{rank}}}'))
    h.effects.clear()
    lost = placement[1]
    h.step(g.AgentGone(lost, f"the agent of {lost} died"), dt=1.0)
    assert h.state is State.RUNNING and not [e for e in h.effects if isinstance(e, (g.StopRun, g.Spawn))]
    [published] = [Membership.from_json(e.membership) for e in h.effects if isinstance(e, g.PublishMembership)]
    assert published == Membership(1, ("r0i0", "r2i0"), (), None)
    assert h.core.attempt.lost == {1} and h.core.commit_tracker.lost == {1}
    [resize] = h.core.book.state.resizes
    assert (resize.from_workers, resize.to_workers, resize.steps_lost) == (3, 2, 1) and "shrink" in resize.reason
    assert h.core.book.state.attempts[-1].workers == 2 and h.core.book.failures_this_launch("worker") == 1
    h.step(g.LiveJoined(attempt=1, generation=1, steps_lost=1, wall=h.wall() + 0.5))
    [record] = h.core.book.state.live_recoveries
    assert record.path == "live" and record.cause.startswith("shrink") and record.ranks == [1]
    assert record.steps_lost == 1
    # The ranks that live report at the world of 2, under the numbers they were spawned as.
    for rank, group_rank in ((0, 0), (2, 1)):
        h.worker(m.Report(attempt=1, rank=rank, index=1, metrics={"step": 1}, checkpoint_dir="checkpoint_1",
                          files=[], data_position=f'{{"world":2,"rank":{group_rank}}}', generation=1))
    assert h.core.book.state.latest_checkpoint == "checkpoint_1"  # rank 1 holds no shard of the smaller world's
    assert h.core.commit_tracker.reports == [2, 1, 2]
    # A node joins: the run grows back live, the added rank numbered 3 (1 stays the lost one's), the group's rank 2.
    h.effects.clear()
    h.step(g.NodeTable([node(n) for n in ("n1", "n2", "n3", "n4")]), dt=1.0)
    [spawn] = [e for e in h.effects if isinstance(e, g.Spawn)]
    assert [(w.rank, w.world_size) for w in spawn.msg.workers] == [(3, 3)]
    assert spawn.node_id == "n4" and spawn.msg.env["OUTLAST_LIVE_GROUP_RANK"] == "2/3"
    # No checkpoint waits for it until its first report takes up the count of the rank that sent it the state.
    assert h.core.plan.world_size == 4 and h.core.commit_tracker.reports[:3] == [2, 1, 2]
    assert h.core.commit_tracker.absent == {3}
    h.step(g.LiveReady(attempt=1, member="r3i0"))
    [published] = [Membership.from_json(e.membership) for e in h.effects if isinstance(e, g.PublishMembership)]
    assert published == Membership(2, ("r0i0", "r2i0", "r3i0"), (2,), 0, planned=True)
    h.step(g.LiveJoined(attempt=1, generation=2, steps_lost=0, wall=h.wall() + 0.5))
    assert [(r.from_workers, r.to_workers) for r in h.core.book.state.resizes] == [(3, 2), (2, 3)]
    finish_all(h, {0: placement[0], 2: placement[2], 3: "n4"})
    assert h.state is State.FINISHED and len(h.core.book.state.attempts) == 1


# ---- a drained node with no room elsewhere: its ranks leave ----------------------------------------------------


def test_drained_ranks_with_no_room_leave_an_elastic_run_in_a_planned_smaller_generation():
    live = formed(3)
    d = live.on_drain([1], "drain", 2.0, no_room="no CPU left", least=2)
    assert isinstance(d, Leave) and d.ranks == (1,)
    assert d.membership == Membership(1, ("r0i0", "r2i0"), (), None, planned=True)
    assert "no step thrown away" in d.reason and live.slots == [0, 2] and live.left_in == {1: 1}
    assert live.starting_members() == [] and live.publishable(told=False) is None
    assert live.publishable(told=True) == d.membership  # nobody to wait for but the ranks' word of the drain
    assert live.on_joined(1, 0, wall=3.0) == Recovered(1, (1,), "drain", 2.0, 1.0, 0)


def test_drained_ranks_with_no_room_stay_put_with_the_reason():
    assert "no node that stays has room" in formed(3).on_drain([1], "drain", 2.0, no_room="full").reason
    few = formed(3).on_drain([1, 2], "drain", 2.0, no_room="full", least=2)
    assert isinstance(few, StayPut) and "fewer than the run's min_workers=2" in few.reason
    sharded = formed(4)
    sharded.shards = 2
    layout = sharded.on_drain([3], "drain", 2.0, no_room="full", least=1)
    assert isinstance(layout, StayPut) and "2 shards" in layout.reason


def test_the_core_lets_a_drained_rank_leave_and_takes_it_out_of_the_attempt_once_its_process_exits():
    from outlast.controller.resize import Elastic
    from tests.fakes.controller import node

    h = make(nodes=("n1", "n2", "n3"), world_size=3, elastic=Elastic(2, 3, min_interval_s=0), live_recovery=True,
             live_store="controller:7", max_failures=0)
    placement = start(h)
    h.step(g.LiveJoined(attempt=1, generation=0, steps_lost=0, wall=h.wall()))
    h.step(g.NodeTable([node(n) for n in ("n1", "n2", "n3")]))  # no spare node
    h.effects.clear()
    drained = placement[1]
    _drain(h, drained)
    assert h.state is State.RUNNING and not [e for e in h.effects if isinstance(e, (g.StopRun, g.Spawn))]
    [resize] = h.core.book.state.resizes
    assert (resize.from_workers, resize.to_workers, resize.steps_lost) == (3, 2, 0) and "drain" in resize.reason
    assert h.core.book.state.failure_counts == {"preemption": 1}
    # Published at once: no rank asks get_preemption_info(), so none waits to be told of the drain first.
    [published] = [Membership.from_json(e.membership) for e in h.effects if isinstance(e, g.PublishMembership)]
    assert published == Membership(1, ("r0i0", "r2i0"), (), None, planned=True)
    h.step(g.LiveJoined(attempt=1, generation=1, steps_lost=0, wall=h.wall() + 0.5))
    [record] = h.core.book.state.live_recoveries
    assert record.path == "live" and record.cause.startswith("drain") and record.steps_lost == 0
    # The drained process leaves the loop cleanly: no failure, and nothing waits for rank 1 from here.
    h.agent(drained, h.exited(1, drained))
    assert h.state is State.RUNNING and h.core.attempt.lost == {1} and 1 in h.core.attempt.done
    assert h.core.commit_tracker.lost == {1} and h.core.book.state.failure_counts == {"preemption": 1}
    finish_all(h, {0: placement[0], 2: placement[2]})
    assert h.state is State.FINISHED and len(h.core.book.state.attempts) == 1


def test_a_drained_rank_s_replacement_restores_no_checkpoint_the_attempt_began_from():
    # The attempt's checkpoint may be gone since it began (num_to_keep): a replacement that found it gone failed
    # before it joined, and the move turned into a death.
    h, _ = _live()
    h.core.attempt.restore = "checkpoint_000001"
    _drain(h, "n2")
    [spawn] = [e for e in h.effects if isinstance(e, g.Spawn)]
    assert spawn.msg.restore_checkpoint is None


def test_a_rank_a_grow_adds_restores_no_checkpoint_the_attempt_began_from():
    from outlast.controller.resize import Elastic
    from tests.fakes.controller import node

    h = make(nodes=("n1", "n2"), world_size=3, elastic=Elastic(2, 3, min_interval_s=0), live_recovery=True,
             live_store="controller:7")
    start(h)
    h.step(g.LiveJoined(attempt=1, generation=0, steps_lost=0, wall=h.wall()))
    h.core.attempt.restore = "checkpoint_000001"
    h.effects.clear()
    h.step(g.NodeTable([node(n) for n in ("n1", "n2", "n3")]))
    [spawn] = [e for e in h.effects if isinstance(e, g.Spawn)]
    assert spawn.msg.restore_checkpoint is None


def test_a_checkpoint_reported_between_a_grow_and_the_join_settles_without_the_added_rank():
    # A rank in a synchronous report() of it waits for its commit before it sends the added rank the state: had
    # the checkpoint waited for the added rank's report of it, which never comes, neither would go on.
    from outlast.controller.commit import CommitTracker

    tracker = CommitTracker(2)
    for rank in (0, 1):
        tracker.on_report(rank, 0, None, [], {"step": 0})
    tracker.grow(3)
    assert tracker.on_report(0, 1, "checkpoint_000001", [], {"step": 1}) == []
    [settled] = tracker.on_report(1, 1, "checkpoint_000001", [], {"step": 1})
    assert settled.checkpoint_dir == "checkpoint_000001" and not settled.missing_shards
    # The added rank takes up the count from its sender's, and counts from there.
    tracker.on_report(2, 2, "checkpoint_000002", [], {"step": 2})
    assert tracker.reports == [2, 2, 3]


def test_a_checkpoint_a_moved_rank_s_drained_process_never_reported_settles_once_it_exited():
    # The drained process died between a committed step and its report; its replacement reports from the count of
    # rank 0, which reported that step: the checkpoint of it waited for rank 1's report, and rank 0's synchronous
    # report() for its commit, never to go on.
    h, _ = _live()
    _drain(h, "n2")
    h.step(g.LiveReady(attempt=1, member="r1i1"))
    h.worker(m.Report(attempt=1, rank=0, index=0, metrics={"step": 0}, checkpoint_dir="checkpoint_0", files=[]))
    assert h.core.book.state.latest_checkpoint is None
    h.agent("n2", m.WorkerExited(run_id=h.core.run_id, attempt=1, rank=1, pid=101, exit_code=None, signal=9,
                                 error=None, node_id="n2"))
    assert h.state is State.RUNNING and h.core.book.state.latest_checkpoint == "checkpoint_0"
    h.step(g.FromWorker(m.Report(attempt=1, rank=1, index=1, metrics={"step": 1}), incarnation=1))
    assert h.core.commit_tracker.reports[1] == 2


def test_a_rank_that_was_to_leave_is_waited_for_by_the_restart_when_a_death_falls_back_first():
    from outlast.controller.resize import Elastic
    from tests.fakes.controller import node

    h = make(nodes=("n1", "n2", "n3"), world_size=3, elastic=Elastic(2, 3, min_interval_s=0), live_recovery=True,
             live_store="controller:7", max_failures=-1)
    placement = start(h)
    h.step(g.LiveJoined(attempt=1, generation=0, steps_lost=0, wall=h.wall()))
    h.step(g.NodeTable([node(n) for n in ("n1", "n2", "n3")]))  # no spare node
    drained = placement[1]
    _drain(h, drained)
    # Both ranks that stay die before the planned generation formed: no rank holds the state, a restart.
    for rank in (0, 2):
        h.agent(placement[rank], h.exited(rank, placement[rank], code=-9))
    assert h.state is State.RESTARTING and h.core.live is None
    # The restart's stop ends rank 0's replacement, and the drained rank, whose exit is its rank's again.
    h.agent(placement[0], h.exited(0, placement[0], code=-15))
    h.agent(drained, h.exited(1, drained, code=-15))
    assert h.state is not State.RESTARTING and len(h.core.book.state.attempts) == 2


def test_a_commit_is_answered_to_the_drained_process_that_reported_it_though_its_replacement_spoke_since():
    # The drained process waits in a synchronous report() for the commit: answered to the replacement, which said
    # hello in between, it waited for ever, and the ranks beside it in the step's allreduce with it.
    h, _ = _live()
    _drain(h, "n2")
    h.worker(m.Report(attempt=1, rank=1, index=0, metrics={"step": 0}, checkpoint_dir="checkpoint_0", files=[]))
    h.step(g.FromWorker(m.WorkerHello(attempt=1, rank=1, pid=300), incarnation=1))
    h.effects.clear()
    h.worker(m.Report(attempt=1, rank=0, index=0, metrics={"step": 0}, checkpoint_dir="checkpoint_0", files=[]))
    answers = [e for e in h.effects if isinstance(e, g.ToRank) and isinstance(e.msg, m.Committed)]
    assert {(e.rank, e.incarnation) for e in answers} == {(0, 0), (1, 0)}


def test_a_rank_a_death_s_generation_leaves_out_after_its_step_broke_exits_cleanly():
    # A drained rank whose move a death overtook: the death's generation, built on the planned one, names its
    # replacement. Its join after the broken step raised NotAMemberError out of step(), a failure of a process whose
    # rank its replacement held already.
    from outlast.train.live.live_rank import LiveRank
    from outlast.train.live.rendezvous import NotAMemberError
    from outlast.train.torch.live import LiveTraining

    live = object.__new__(LiveTraining)  # its join alone: no session, store or group
    live.rank = LiveRank(store=None, member="r1i0")

    def left_out() -> int:
        raise NotAMemberError("member r1i0 is not in generation 2 (members ['r0i0', 'r1i1'])")

    live._join = left_out
    with pytest.raises(SystemExit) as exited:
        live._rejoin()
    assert exited.value.code == 0
    live._join = lambda: 7
    assert live._rejoin() == 7


def test_a_run_ends_when_the_last_process_to_exit_is_a_drained_rank_that_left():
    # The rank that stayed finished its loop first; the drained rank's exit, taken as no rank's, never asked
    # whether the attempt was over, and the run stayed running for ever.
    from outlast.controller.resize import Elastic
    from tests.fakes.controller import node

    h = make(nodes=("n1", "n2"), world_size=2, elastic=Elastic(1, 2, min_interval_s=0), live_recovery=True,
             live_store="controller:7")
    placement = start(h)
    h.step(g.LiveJoined(attempt=1, generation=0, steps_lost=0, wall=h.wall()))
    h.step(g.NodeTable([node(n) for n in ("n1", "n2")]))  # no spare node
    _drain(h, placement[0])
    h.step(g.LiveJoined(attempt=1, generation=1, steps_lost=0, wall=h.wall() + 0.5))
    h.worker(m.WorkerDone(attempt=1, rank=1, reports=0))
    h.agent(placement[1], h.exited(1, placement[1]))
    assert h.state is State.RUNNING
    h.agent(placement[0], h.exited(0, placement[0]))
    assert h.state is State.FINISHED


def test_a_drained_rank_s_own_reports_while_it_moves_leave_its_replacement_s_first_report_to_take_up_the_count():
    # Taken for the replacement's first, the drained process's report spent it: the replacement's, from the count
    # of its sender (which had reported one more step), was refused as out of order, and every later checkpoint
    # waited for rank 1.
    h, _ = _live()
    _drain(h, "n2")
    h.step(g.LiveReady(attempt=1, member="r1i1"))
    for rank in (0, 1):
        h.worker(m.Report(attempt=1, rank=rank, index=0, metrics={"step": 0}))
    h.worker(m.Report(attempt=1, rank=0, index=1, metrics={"step": 1}))
    h.step(g.FromWorker(m.Report(attempt=1, rank=1, index=2, metrics={"step": 2}), incarnation=1))
    assert h.core.commit_tracker.reports == [2, 3]


def test_a_dead_rank_s_report_read_after_its_death_leaves_the_checkpoints_to_settle_without_it():
    # Rank 1 reported step 0, then step 1, and died after committing step 2: its report of step 1 is read after its
    # death. Counted, it made the rank present again at its count, and the checkpoint of step 2 waited for a report
    # of rank 1 that only its replacement could make, whose sender, rank 0, waited in that checkpoint's report().
    h, placement = _live(max_failures=3)
    for rank in (0, 1):
        h.worker(m.Report(attempt=1, rank=rank, index=0, metrics={"step": 0}))
    h.agent(placement[1], h.exited(1, placement[1], code=-9))
    assert h.state is State.RUNNING and h.core.live is not None  # replaced live
    h.worker(m.Report(attempt=1, rank=1, index=1, metrics={"step": 1}))  # its process, incarnation 0, is gone
    h.worker(m.Report(attempt=1, rank=0, index=1, metrics={"step": 1}))
    h.worker(m.Report(attempt=1, rank=0, index=2, metrics={"step": 2}, checkpoint_dir="checkpoint_2", files=[]))
    assert h.state is State.RUNNING and h.core.book.state.latest_checkpoint == "checkpoint_2"
    # Its replacement reports from its sender's count, and counts from there.
    h.step(g.FromWorker(m.Report(attempt=1, rank=1, index=3, metrics={"step": 3}), incarnation=1))
    assert h.core.commit_tracker.reports == [3, 4]
