"""The controller core stepped in-process: events in, effects out, no processes."""

from __future__ import annotations

import msgspec

from outlast.controller import group as g
from outlast.controller import states as st
from outlast.controller.states import State
from outlast.controller.types import Timeouts
from outlast.protocol import messages as m
from tests.fakes.controller import finish_all, make, node, start

ENTRY = m.FileEntry("model.pt", 1, "0" * 64)


def report(h, rank, index, checkpoint=True, saw=False):
    return h.worker(m.Report(attempt=h.core.attempt.number, rank=rank, index=index, metrics={"step": index},
                             checkpoint_dir=f"checkpoint_{h.core.attempt.number:03d}_{index:06d}" if checkpoint else None,
                             files=[ENTRY] if checkpoint else [], saw_preemption=saw))


def test_a_clean_run_finishes_closes_and_tells_its_nodes_the_run_ended():
    h = make()
    placement = start(h)
    assert h.state is State.RUNNING and set(placement.values()) == {"n1", "n2"}
    report(h, 0, 0)
    report(h, 1, 0)
    assert [type(x) for x in h.to_rank(0)] == [m.Committed]
    finish_all(h, placement)
    assert h.state is State.FINISHED and h.core.closed
    assert {e.node_id for e in h.effects if isinstance(e, g.ToNode) and isinstance(e.msg, m.EndRun)} == {"n1", "n2"}
    assert h.core.book.state.status == "finished"


def test_a_failed_rank_restarts_only_after_every_worker_of_the_attempt_exited():
    h = make(max_failures=1)
    placement = start(h)
    h.agent(placement[0], h.exited(0, placement[0], code=1))
    assert h.state is State.RESTARTING
    assert {e.node_id for e in h.effects if isinstance(e, g.StopRun)} == {"n1", "n2"}
    h.step(dt=5.0)
    assert h.core.attempt.number == 1  # rank 1 still lives
    h.agent(placement[1], h.exited(1, placement[1], code=None))
    assert h.core.attempt.number == 2 and h.state is State.PLACING
    h.step(g.NodeTable([node(n) for n in ("n1", "n2", "n3")]))
    assert h.state is State.SCHEDULING and len(h.spawned()) == 2


def test_waiting_for_capacity_is_a_state_with_its_reason_and_ends_when_a_node_joins():
    h = make(nodes=("n1",))
    assert isinstance(h.core.state, st.WaitingForCapacity)
    assert "do not fit" in h.core.state.reason
    assert h.core.book.state.status == "waiting_for_capacity"
    h.step(g.NodeTable([node("n1"), node("n2")]), dt=0.5)
    h.step(dt=0.6)
    assert h.state is State.SCHEDULING and h.core.book.state.status == "running"


def test_waiting_for_capacity_gives_up_after_the_capacity_timeout_saying_what_to_do():
    h = make(nodes=("n1",), timeouts=Timeouts(capacity_s=3.0))
    for _ in range(50):
        h.step(dt=0.1)
    assert h.state is State.ERRORED and h.core.closed
    assert "OUTLAST_CAPACITY_TIMEOUT_S" in str(h.core.error)


def test_a_jit_checkpoint_with_room_elsewhere_restarts_at_once_and_keeps_the_ranks_blocked():
    h = make()
    placement = start(h)
    for rank in (0, 1):
        h.worker(m.PreemptionQuery(attempt=1, rank=rank, index=0))
    h.step(dt=2.0)
    h.agent(placement[0], m.NodeDraining(node_id=placement[0], reason="spot", message="", deadline_unix_s=h.wall() + 20))
    for rank in (0, 1):
        h.worker(m.PreemptionQuery(attempt=1, rank=rank, index=1))
        assert [x.decision_index for x in h.to_rank(rank) if isinstance(x, m.PreemptionNotice)] == [1]
    report(h, 0, 0, saw=True)
    report(h, 1, 0, saw=True)
    assert h.state is State.RESTARTING
    assert not [x for r in (0, 1) for x in h.to_rank(r) if isinstance(x, m.Committed)]
    for rank, node_id in placement.items():
        h.agent(node_id, h.exited(rank, node_id, code=None))
    h.step(g.NodeTable([node(n) for n in ("n1", "n2", "n3")]))
    assert h.core.attempt.restore == "checkpoint_001_000000"
    assert placement[0] not in set(h.spawned().values())
    assert h.core.book.failures_this_launch("worker") == 0
    assert h.core.book.failures_this_launch("preemption") == 1


def test_saved_with_nowhere_to_go_is_a_state_that_trains_on_until_room_appears():
    h = make(nodes=("n1", "n2"))
    start(h)
    h.agent("n1", m.NodeDraining(node_id="n1", reason="spot", message="", deadline_unix_s=h.wall() + 600))
    report(h, 0, 0)
    report(h, 1, 0)  # a loop that never asks: its first checkpoint after the notice counts
    assert isinstance(h.core.state, st.Saved) and h.core.state.checkpoint == "checkpoint_001_000000"
    assert [type(x) for x in h.to_rank(0)] == [m.Committed]  # the loop trains on
    h.step(g.NodeTable([node("n1"), node("n2"), node("n3")]), dt=1.0)
    h.step(dt=0.1)
    assert h.state is State.RESTARTING


def test_an_interrupt_tears_down_through_the_one_event_path_and_a_drain_meanwhile_is_kept():
    h = make()
    placement = start(h)
    h.step(g.Interrupted())
    assert h.state is State.ABORTED and not h.core.closed
    h.agent("n3", m.NodeDraining(node_id="n3", reason="spot", message="", deadline_unix_s=None))
    assert h.core.nodes.nodes["n3"].state == "draining"
    for rank, node_id in placement.items():
        h.agent(node_id, h.exited(rank, node_id, code=None))
    assert h.core.closed and h.core.book.state.status == "aborted"


def test_a_silent_node_is_lost_with_its_ranks_and_counts_as_a_failure():
    h = make(max_failures=0)
    placement = start(h)
    for _ in range(60):
        h.step(g.FromAgent(placement[1], m.WorkerStarted(run_id=h.core.run_id, attempt=1, rank=1, pid=101)), dt=0.1)
    assert h.state is State.RESTARTING  # rank 1 still lives
    h.agent(placement[1], h.exited(1, placement[1], code=None))
    assert h.state is State.ERRORED and h.core.closed
    assert "stopped answering" in str(h.core.error)
    assert any(isinstance(e, g.ForgetNode) and e.node_id == placement[0] for e in h.effects)


def test_a_drained_node_that_goes_away_at_once_preempts_the_attempt_instead_of_drawing_on_max_failures():
    h = make(max_failures=0)
    placement = start(h)
    peer_loss = m.WorkerError(exc_type="RuntimeError", message="[/gloo/...] Connection closed by peer", traceback="",
                              phase="train")
    h.agent(placement[1], m.WorkerExited(run_id="run1", attempt=1, rank=1, pid=101, exit_code=1, signal=None,
                                         error=peer_loss, node_id=placement[1]))
    h.agent(placement[0], m.NodeDraining(node_id=placement[0], reason="spot", message="", deadline_unix_s=h.wall()))
    for _ in range(60):  # rank 0 went with its node: lost once silent
        h.step(g.FromAgent(placement[1], m.Pong(node_id=placement[1], pid=1)), dt=0.1)
    assert h.core.attempt.number == 2
    assert h.core.book.state.failure_counts == {"preemption": 1}


def test_a_users_error_is_not_blamed_on_a_drain_heard_after_it():
    h = make(max_failures=0)
    placement = start(h)
    raised = m.WorkerError(exc_type="ValueError", message="bad batch", traceback="", phase="train")
    h.agent(placement[1], m.WorkerExited(run_id="run1", attempt=1, rank=1, pid=101, exit_code=1, signal=None,
                                         error=raised, node_id=placement[1]))
    h.agent(placement[0], m.NodeDraining(node_id=placement[0], reason="spot", message="", deadline_unix_s=None))
    h.agent(placement[0], h.exited(0, placement[0], code=None))
    assert h.state is State.ERRORED and "bad batch" in str(h.core.error)
    assert h.core.book.state.failure_counts == {"worker": 1}


def test_a_refusal_after_another_refusal_ended_the_attempt_still_counts_its_ranks_as_never_started():
    h = make(world_size=3, nodes=("n1", "n2", "n3"))
    placement = h.spawned()
    h.agent(placement[0], m.SpawnRefused(run_id="run1", attempt=1, reason="draining"))
    assert h.state is State.RESTARTING and h.core.attempt.number == 1
    h.agent(placement[1], m.SpawnRefused(run_id="run1", attempt=1, reason="draining"))
    assert h.core.attempt.number == 1  # rank 2 was spawned and lives until it exits
    h.agent(placement[2], h.exited(2, placement[2], code=None))
    assert h.core.attempt.number == 2


def test_a_new_attempt_places_on_a_table_newer_than_the_step_that_began_it():
    h = make(max_failures=1)
    placement = start(h)
    h.agent(placement[0], h.exited(0, placement[0], code=1))
    h.agent(placement[1], h.exited(1, placement[1], code=None))
    assert h.state is State.PLACING and h.core.attempt.number == 2
    h.step(dt=30.0)  # the first event after a step that spent long on storage: the table it has is old
    assert h.state is State.PLACING
    dead = m.NodeInfo(node_id="n1", address="tcp://n1:1", host="n1", resources={"CPU": 1.0}, state="dead")
    h.step(g.NodeTable([dead, node("n2"), node("n3")]))
    assert h.state is State.SCHEDULING and set(h.spawned().values()) == {"n2", "n3"}


def test_without_an_answer_from_the_head_a_new_attempt_places_on_the_last_table_after_a_second():
    h = make(max_failures=1)
    placement = start(h)
    h.agent(placement[0], h.exited(0, placement[0], code=1))
    h.agent(placement[1], h.exited(1, placement[1], code=None))
    h.step(dt=0.5)
    assert h.state is State.PLACING
    h.step(dt=1.1)
    assert h.state is State.SCHEDULING



def test_a_rank_killed_after_the_stops_grace_is_the_teardown_not_a_failure_that_spends_max_failures():
    h = make(max_failures=0)
    placement = start(h)
    drained = m.NodeDraining(node_id=placement[0], reason="spot", message="", deadline_unix_s=h.wall(),
                             node_ids=[placement[0]])
    # The head's table shows the drain (the node had told no run: it had none when it drained), then it is gone.
    h.step(g.NodeTable([msgspec.structs.replace(node(n), state="draining", draining=drained) if n == placement[0]
                        else node(n) for n in ("n1", "n2", "n3")]))
    for _ in range(80):
        h.step(g.FromAgent(placement[1], m.Pong(node_id=placement[1], pid=1)), dt=0.1)
        if h.state is State.RESTARTING:
            break
    assert h.state is State.RESTARTING
    # Rank 1 ignored the stop's SIGTERM; the agent's SIGKILL after the grace ended it.
    h.step(dt=h.core.plan.timeouts.teardown_grace_s)
    h.agent(placement[1], msgspec.structs.replace(h.exited(1, placement[1]), exit_code=None, signal=9))
    assert h.core.attempt.number == 2
    assert h.core.book.state.failure_counts == {"preemption": 1}


def test_the_last_asynchronous_upload_arriving_after_every_rank_exited_is_still_committed():
    # The upload thread's UploadDone comes on a connection of its own: it may follow the rank's
    # WorkerDone and its exit. Finishing before it would drop the run's last checkpoint.
    h = make()
    placement = start(h)
    for rank in (0, 1):
        h.worker(m.Report(attempt=1, rank=rank, index=0, metrics={"step": 0}, checkpoint_dir="checkpoint_001_000000",
                          files=[], upload_pending=True))
    finish_all(h, placement)
    assert h.state is State.FINISHING and not h.core.book.state.checkpoints
    for rank in (0, 1):
        h.worker(m.UploadDone(attempt=1, rank=rank, index=0, checkpoint_dir="checkpoint_001_000000",
                              files=[ENTRY] if rank == 0 else [], error=None))
    assert h.state is State.FINISHED
    assert h.core.book.state.latest_checkpoint == "checkpoint_001_000000"


def test_every_hello_is_welcomed_so_a_rank_knows_it_was_heard_before_its_set_up():
    h = make()
    start(h)
    welcomes = [(e.rank, e.msg) for e in h.effects if isinstance(e, g.ToRank) and isinstance(e.msg, m.Welcome)]
    n = h.core.attempt.number
    assert sorted(welcomes, key=lambda x: x[0]) == [(0, m.Welcome(attempt=n, rank=0)), (1, m.Welcome(attempt=n, rank=1))]


def test_every_set_up_is_heard_so_a_rank_knows_a_death_after_it_is_its_train_functions():
    h = make()
    start(h)
    n = h.core.attempt.number
    heard = sorted((e.rank, e.msg) for e in h.effects if isinstance(e, g.ToRank) and isinstance(e.msg, m.SetUpHeard))
    assert heard == [(0, m.SetUpHeard(attempt=n, rank=0)), (1, m.SetUpHeard(attempt=n, rank=1))]
