"""Live recovery of an FSDP2 model over `live_mesh(shards)` in the simulator: ranks that run the loop of
`LiveTraining(mesh=...)` (`outlast/train/torch/live.py`'s `forward_backward` and `_mesh_step`) against the real
controller, with the real `LiveRank` and its votes, as `live.py`'s ranks do for the other modes.

What differs from a data-parallel loop is where the reductions run: inside forward and backward, in the groups of
the mesh (replicas of `shards` ranks: the parameters gathered and the gradients reduce-scattered in a replica's group
of shards, the gradients of each shard all-reduced in its group of replicas), each a group of the generation that
outlives nothing: a rank lost fails the collectives of the groups it is in, at once, and a rank whose collective
failed closes all of its groups (`LiveMesh.close`), so that its peers blocked on it fail too. A peer lost elsewhere
does not fail them: that rank reduces its step and votes "reduced", and the vote (`LiveRank.vote`) throws the step away
all the same (a vote never comes, and the death's generation is published). A step with a failed collective anywhere
is thrown away on every rank, which forms the next generation, and runs it again from its start; a planned
generation is formed as the next step's forward begins. After each join the mesh's groups of the new generation form
(`LiveMesh.attach`): a member lost before it came leaves the others waiting out the formation's timeout (the real
attach, as `LiveGroup.form`, waits in the store and leaves at once when the next generation is published; the
simulated groups, the whole one's as these, take the slower course), and a break there sends the rank to the
generation after it. The mesh keeps the rank and the
world it was made for: a generation that renumbers the rank or changes the world's size is refused (`attach`
raises), and `LiveWatch` counts it a violation: the controller must not resize such a run live.

The model is a step count per rank, of its own shard's parameters and optimizer state: FSDP2 keeps no copy of the
others, and the forward's gathers tell them every step, which must all be at the step it runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Generator

from outlast.protocol.membership import Membership
from outlast.sim.live import BROKEN, Group, _after_commit, _failed, _point, _regroup, _rejoin, _vote

if TYPE_CHECKING:
    from outlast.sim.workers import SimRank


def mesh_groups(rank: int, world: int, shards: int) -> list[tuple[str, tuple[int, ...]]]:
    """The groups of the mesh that `rank` is in, in the order `LiveMesh.attach` forms them: its replica's group of
    shards, then its shard's group of replicas (`make_mesh`'s layout: rank r holds shard r % shards)."""
    replica, shard = divmod(rank, shards)
    return [(f"live-shards-of-replica{replica}", tuple(replica * shards + s for s in range(shards))),
            (f"live-replicas-of-shard{shard}", tuple(r * shards + shard for r in range(world // shards)))]


def loop(w: "SimRank", first_step: int) -> Generator:
    """The rank's loop with `LiveTraining(mesh=...)`: join; then each step's forward and backward inside
    `forward_backward()` (a planned generation formed first), voted on, and applied, or thrown away on every rank
    and run again once the rank joined the next generation."""
    sim, side, steps = w.sim, w.live, w.loop.steps
    assert side is not None
    side.restored(first_step)
    if first_step:
        side.rank.resume_at(first_step)  # LiveTraining.start(step)
    step = yield from _rejoin(w)
    w.core.generation = side.rank.ledger.generation
    while step < steps:
        if side.rank.regroup_due:
            # forward_backward(): the planned generation published during the last step is formed before this
            # step's collectives, which run in its groups; a rank it leaves out leaves (LiveRank.leave).
            if not (yield from _regroup(w)):
                sim.live_watch.left(w)
                side.rank.leave()
            if side.rank.joins[-1].committed + 1 != step:
                sim.observer.violation(f"rank {w.rank} ({side.rank.member}) of attempt {w.attempt} ran step {step}, "
                                       f"and the planned generation went on at step {side.rank.joins[-1].committed + 1}")
        reduced = yield from _forward_backward(w, step)
        side.rank.begin(step)  # LiveRank.vote: whether this rank's collectives of the step all completed
        committed = yield from _vote(w, step, reduced)
        if not committed:
            # _throw_away: the mesh's groups closed, the gradients (partial: reduced in backward) dropped, and the
            # step runs again from its start once the group formed again.
            close(w)
            resumed = yield from _rejoin(w)
            w.core.generation = side.rank.ledger.generation
            if resumed != step:
                sim.observer.violation(f"rank {w.rank} ({side.rank.member}) of attempt {w.attempt} threw step {step} "
                                       f"away, but its generation went on at step {resumed}")
            continue
        side.weights += 1  # optimizer.step() on this rank's shard
        yield from _after_commit(w, step)
        step += 1
    if side.rank.regroup_due and not (yield from _regroup(w)):
        # LiveTraining.close: a planned generation due after the last step is formed for its new members' sake.
        close(w)
        side.rank.close()
        return
    sim.live_watch.finished(w)


def _forward_backward(w: "SimRank", step: int) -> Generator:
    """FSDP2's collectives of one step, in the mesh's groups: each layer's parameters gathered from the replica's
    shards in forward, the gradients reduce-scattered there and all-reduced across the replicas in backward. A
    failed one ends the step on this rank (its error is taken in `forward_backward`, which closes the mesh): True
    when all completed."""
    side = w.live
    assert side is not None
    shards_of_replica, replicas_of_shard = side.mesh_groups
    yield from _point(w, "forward")
    told = yield from _meet(w, shards_of_replica, f"all-gather 0 {step}", side.weights)
    if told is not None:
        w.sim.live_watch.mesh_current(w, step, "gathered its replica's shards", told)
        yield from _point(w, "gather")  # between the layers' gathers
        told = yield from _meet(w, shards_of_replica, f"all-gather 1 {step}", side.weights)
    if told is not None:
        yield "sleep", w.loop.step_s * w.sim.world.rng.uniform(0.9, 1.1)
        yield from _point(w, "before_allreduce")
        told = yield from _meet(w, shards_of_replica, f"reduce-scatter {step}", side.weights)
    if told is not None:
        # A rank lost here leaves the peers of its replica reduced, and those of its shard's replicas not.
        yield from _point(w, "scattered")
        told = yield from _meet(w, replicas_of_shard, f"all-reduce {step}", side.weights)
        if told is not None:
            w.sim.live_watch.mesh_current(w, step, "reduced its shard's gradients across the replicas", told)
    if told is None:
        side.rank.last_break = "a collective of the mesh failed: a peer is gone"
        close(w)
    yield from _point(w, "after_allreduce")
    return told is not None


def _meet(w: "SimRank", group: Group, name: str, value: int) -> Generator:
    """One collective of `group`: every member's value, or None when it failed."""
    group.meet(w, name, value)
    told = yield "live", None
    return None if told == BROKEN else told


def close(w: "SimRank") -> None:
    """`LiveMesh.close`: this rank's groups of the generation freed, their sockets closed; a peer blocked on it
    fails now."""
    side = w.live
    assert side is not None
    for group in side.mesh_groups:
        group.lost(w)
    side.mesh_groups = []


def attach(w: "SimRank", membership: Membership) -> Generator:
    """`LiveMesh.attach` after the rank joined `membership`: the mesh's groups of the generation formed, one after
    the other. False when one broke (a member lost meanwhile): the rank joins the generation after it. A generation
    that does not keep the mesh's shape fails the rank."""
    side = w.live
    assert side is not None
    rank = membership.rank_of(side.rank.member)
    assert rank is not None
    if (rank, membership.world_size) != (side.mesh_rank, side.mesh_world):
        w.sim.live_watch.reshaped(w, membership, rank)
        raise _failed(w, RuntimeError(f"this rank's mesh was made at rank {side.mesh_rank} of {side.mesh_world}, "
                                      f"and generation {membership.generation} numbers it {rank} of "
                                      f"{membership.world_size}: an FSDP2 mesh keeps its shape"))
    close(w)
    yield from _point(w, "attach")
    for name, ranks in mesh_groups(rank, membership.world_size, side.shards):
        group = w.sim.live_group(w.attempt, membership, name, ranks)
        side.mesh_groups.append(group)
        group.meet(w, "form")
        if (yield "live", None) == BROKEN:
            side.rank.last_break = f"generation {membership.generation}: the mesh's group {name} could not form"
            close(w)
            return False
    return True
