"""The loop's side of live recovery (`FailureConfig(live_recovery=True)`), for data-parallel training.

    live = outlast.train.torch.LiveTraining(model, optimizer, state=other)  # `other`: any state_dict() owner
    step = live.start(restored)      # restored: the step after a restored checkpoint's (0 without one); a rank
                                     # that replaced a lost one gets where the other ranks are
    while step < steps:
        loss_of(batch_for(step)).backward()
        step = live.step(step)       # the gradients averaged over the ranks, then optimizer.step()

`step` returns the step to run next, `step + 1`, once every rank reduced this one. When a rank died during it,
no rank applies it: the ranks that live keep their gradients of the step, form a new group with the replacement
the controller forked, and send it the model's, the optimizer's and `state`'s state dicts (and the torch RNG)
from one of them; the replacement starts at that step (`start()` returns it), runs its forward and backward, and
every rank reduces the step again. So a death costs the survivors no step, only the wait for the replacement.
The replacement must read the batch its rank would have read: either the loop draws each step's batch from the
step number and the rank, or it reads a loader of `prepare_data_loader` or a `get_dataset_shard` iterator, whose
place at the start of the step in flight goes with the state and is taken up by the replacement
(`positions.step_start`, `positions.take_up`).
`report()` after each committed step goes on as usual: the replacement's reports continue from the count of the
rank it took the state from.

A planned change of the group (a drained node's rank moved to another node, ranks added to an elastic run) throws
no step away: after a committed step, `step` forms the next generation before it reduces, and sends the state to
the ranks that joined. When the planned generation is larger (a grow), the step that announced it also splits the
rest of each reader's epoch between the ranks of the larger world before it returns (`positions.regroup`), so
that the next step's batches, the ranks that were there and the ones that join alike, come from the new split: a
joiner takes up its place there as a replacement does. A rank that the next generation leaves out (the drained
one) has nothing left to do: `step` raises SystemExit(0), and its process exits cleanly, its rank held by its
replacement.

A lost node whose ranks no other node has room for shrinks an elastic run: the next generation leaves them out and
numbers the ranks that live afresh (`get_context()`'s rank and world size change with it). Their parts of the step
in flight are gone, so `step` throws the step away on every rank and returns it (the loop runs it again), after
splitting the rest of each reader's epoch, from every rank's place at the step's start, between the smaller world.

The model is not wrapped in DistributedDataParallel (prepare_model returns it as it is in this mode): there is
no default process group, since it could not outlive a rank. Each step's gradients go as one flat tensor, so
the group reduces them in one order, the same in every generation.

`shards=S` splits the optimizer's state between the S ranks of each replica (`live_shards.py`): `optimizer` is
then a function that builds it over the parameters it is given (this rank's shard), a rank new to the group takes
its state from a rank that holds its shard, and a shard with no holder left falls back to the newest checkpoint.

`save(directory, step)` and `load(directory)` write and restore a checkpoint in parts (`live_checkpoint.py`): each
shard's optimizer state from one holder, the rest from rank 0.

`mesh=live_mesh(S)` takes an FSDP2 model sharded over that mesh (`live_mesh.py`), whose reductions run inside its
backward: the loop runs each step's forward and backward inside `with live.forward_backward():`, which takes a
peer's loss there as the step's void, and `step` only votes. A step that broke anywhere is thrown away on every
rank and run again from its start (its RNG, its batch) once the group formed again, the replacement taking its
shard's local pieces from a holder in another replica (`local_shards.py`): a death costs that one step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from typing import Any, Iterator

from outlast.faults import fault_point
from outlast.protocol.membership import member_name, store_prefix
from outlast.protocol.transport import INCARNATION_VAR, LIVE_STORE_VAR
from outlast.train import positions
from outlast.train._session import get_session
from outlast.train.live import rendezvous
from outlast.train.live.live_rank import LiveRank
from outlast.train.live.group import GroupBroken, LiveGroup
from outlast.train.live.rendezvous import NotAMemberError
from outlast.train.torch import live_checkpoint, local_shards
from outlast.train.torch.live_mesh import LiveMesh, is_peer_loss, live_of, make_mesh
from outlast.train.torch.live_shards import FlatShards, reports_after_gather

log = logging.getLogger("outlast.worker")

STORE_VAR = LIVE_STORE_VAR  # set by the controller (live_steps.py), as INCARNATION_VAR is


def live_mesh(shards: int) -> Any:
    """The (replicate, shard) DeviceMesh to give FSDP2's `fully_shard` in live recovery: the world's ranks in
    replicas of `shards` ranks, each holding one shard (rank r shard r % shards); its groups outlive a rank's death
    (`live_mesh.py`). Make it before `fully_shard`, and give it to `LiveTraining(mesh=...)`."""
    import torch.distributed as dist

    if not os.environ.get(STORE_VAR):
        raise RuntimeError("live_mesh() needs live recovery turned on: "
                           "RunConfig(failure_config=FailureConfig(live_recovery=True))")
    context = get_session("live_mesh").context
    mesh, _ = make_mesh(context.world_rank, context.world_size, shards, dist.HashStore())
    return mesh


class LiveTraining:
    def __init__(self, model: Any, optimizer: Any, state: Any = None, timeout_s: float = 60.0,
                 shards: int = 1, mesh: Any = None) -> None:
        address = os.environ.get(STORE_VAR)
        if not address:
            raise RuntimeError("LiveTraining needs live recovery turned on: "
                               "RunConfig(failure_config=FailureConfig(live_recovery=True))")
        if state is not None and not (hasattr(state, "state_dict") and hasattr(state, "load_state_dict")):
            raise TypeError(f"LiveTraining(state=...) must have state_dict() and load_state_dict(), got "
                            f"{type(state).__name__}")
        import torch.distributed as dist

        ctx = get_session("LiveTraining").context
        host, port = address.rsplit(":", 1)
        store = dist.PrefixStore(store_prefix(ctx.attempt), rendezvous.connect(host, int(port), timeout_s))
        self.model, self.state = model, state
        self.sharded: FlatShards | None = None
        self.mesh: LiveMesh | None = None  # an FSDP2 model over live_mesh: its reductions run in its backward
        self._broken = False  # with a mesh: a collective of the step in flight failed
        self._rng_at_step_start: Any = None
        self._took_state = False  # with shards: its count of reports is its sender's until a step's gather settles it
        self._settle_reports = False  # with shards: the next step's gather tells the counts (a group formed since)
        self._split: tuple[LiveGroup, LiveGroup] | None = None  # with shards: this generation's replica, holders
        if mesh is not None:
            self.mesh = live_of(mesh)
            if shards not in (1, self.mesh.shards):
                raise ValueError(f"LiveTraining(shards={shards}, mesh=...): the mesh splits the model in "
                                 f"{self.mesh.shards} shards; leave shards out, the mesh says it")
            shards = self.mesh.shards
        elif shards != 1:
            self.sharded = FlatShards(model, optimizer, ctx.world_rank, ctx.world_size, shards)
            optimizer = self.sharded.optimizer
        self.optimizer = optimizer
        session = get_session("LiveTraining")
        self.rank = LiveRank(store, member_name(session.spawned_rank, int(os.environ.get(INCARNATION_VAR, "0"))),
                             timeout_s, shards, mesh=self.mesh is not None)
        self._place = ""  # this rank's data positions at the start of the step in flight: what a joiner takes up

    def state_dict(self) -> dict[str, Any]:
        import torch

        if self.mesh is not None:
            model, optimizer = local_shards.model_state(self.model), local_shards.optimizer_state(self.optimizer)
        else:
            model = self.model.state_dict()
            optimizer = self.optimizer.state_dict() if self.sharded is None else self.sharded.state_dict()
        return {"model": model, "optimizer": optimizer,
                "state": self.state.state_dict() if self.state is not None else None,
                "rng": torch.get_rng_state(), "reports": get_session("LiveTraining").reports_made,
                "data": positions.step_start(self._place, self._place_now())}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        import torch

        if self.mesh is not None:
            local_shards.load_model_state(self.model, d["model"])
            local_shards.load_optimizer_state(self.optimizer, d["optimizer"])
        elif self.sharded is None:
            self.model.load_state_dict(d["model"])
            self.optimizer.load_state_dict(d["optimizer"])
        else:
            self.model.load_state_dict(d["model"])
            self.sharded.load_state_dict(d["optimizer"])
            self._took_state = True
        if self.state is not None:
            self.state.load_state_dict(d["state"])
        torch.set_rng_state(d["rng"])
        session = get_session("LiveTraining")
        session.continue_reports(d["reports"])
        for key in positions.take_up(d["data"], positions.shared_seed(session.context)):
            log.warning("live recovery: %s begins its epoch again on this rank: its place was shuffled with a seed "
                        "drawn at random", key)

    def save(self, directory: str, step: int) -> bool:
        """This rank's part of a checkpoint of committed step `step`, written into `directory` (`live_checkpoint.py`:
        rank 0's weights, `state` and layout, each shard's optimizer state from one holder). Returns False when this
        rank has no part: it reports the step without a checkpoint, the others with theirs."""
        rank = get_session("LiveTraining").context.world_rank
        if self.mesh is not None:
            return live_checkpoint.save(directory, rank, step, self.mesh.shards,
                                        lambda: local_shards.model_state(self.model),
                                        lambda: local_shards.optimizer_state(self.optimizer), self._state_dict,
                                        model_sharded=True)
        shards = 1 if self.sharded is None else self.sharded.shards
        return live_checkpoint.save(directory, rank, step, shards, self.model.state_dict, self.optimizer.state_dict,
                                    self._state_dict)

    def _state_dict(self) -> Any:
        return self.state.state_dict() if self.state is not None else None

    def load(self, directory: str) -> int:
        """Restores a checkpoint `save` wrote (every rank loads the weights, `state`, and its shard's optimizer
        state); returns the step after the checkpoint's, for `start`."""
        if self.mesh is not None:
            restored = live_checkpoint.load(directory, self.mesh.shard, self.mesh.shards, model_sharded=True)
            local_shards.load_model_state(self.model, restored.model)
            local_shards.load_optimizer_state(self.optimizer, restored.optimizer)
        else:
            shard, shards = (0, 1) if self.sharded is None else (self.sharded.shard, self.sharded.shards)
            restored = live_checkpoint.load(directory, shard, shards)
            self.model.load_state_dict(restored.model)
            self.optimizer.load_state_dict(restored.optimizer)
        if self.state is not None:
            self.state.load_state_dict(restored.state)
        return restored.step

    def start(self, step: int = 0) -> int:
        """Join the group; returns the step to run first. `step`: where a loop that restored a checkpoint goes on
        (every rank restored the same one); the ranks agree on it, and a replacement takes the state from them."""
        if step:
            self.rank.resume_at(step)
        return self._join()

    def step(self, step: int) -> int:
        """After backward(): average the gradients over the ranks and apply the optimizer's step. When a rank died
        meanwhile, join the next group first and reduce this step's gradients again in it. Returns `step + 1`, or
        `step` when the group shrank (the step thrown away, to run again)."""
        import torch

        if self.mesh is not None:
            return self._mesh_step(step)
        if self.rank.regroup_due:
            # The gradients of this step stay: they were computed on the committed state every member holds.
            if not self._regroup():
                self.rank.leave()  # moved, or left: its replacement, or the smaller world, goes on without it
            if self.rank.joins[-1].shrunk:  # a node lost meanwhile: as below, the step goes again on the new split
                self.optimizer.zero_grad()
                return step
        params = [p for p in self.model.parameters() if p.grad is not None]
        pieces: list[Any] = []  # with shards: this rank's shard of the gradients, summed over the ranks
        while True:
            # One flat copy: the group reduces it in one order, the same in every generation, and the gradients
            # themselves stay as backward() left them until the step is committed.
            if self.sharded is not None:
                flat = self.sharded.gradient()
                reduced = self.rank.reduce_by(step, lambda flat=flat: pieces.append(self._reduce_shard(flat)))
            else:
                flat = torch.cat([p.grad.reshape(-1) for p in params]) if params else torch.zeros(0)
                reduced = self.rank.reduce(step, [flat])
            if reduced:
                break
            # A rank died during this step. This rank's gradients were computed on the state every survivor still
            # holds, so it keeps them: once the group formed again, the replacement (which takes that state and
            # runs this step's forward and backward on its own batch) and the survivors reduce this step again.
            self.rank.keep_in_flight()
            resumed = self._rejoin()
            if resumed != step:
                raise RuntimeError(f"after step {step} broke, the survivors agreed to go on at step {resumed}: a "
                                   "survivor's committed step moved, so its gradients cannot be reduced again")
            if self.rank.joins[-1].shrunk:
                # A smaller world: the lost ranks' batches of this step are not there to reduce. Every rank throws
                # the step away and runs it again on its batch of the new split (`_split_for_shrink`).
                self.optimizer.zero_grad()
                return step
        fault_point("live.optimizer_step")  # committed everywhere, not applied here
        world = self.rank.group.world_size if self.rank.group is not None else 1
        if self.sharded is not None:
            self.sharded.apply(pieces[-1] / world)
        else:
            flat /= world
            offset = 0
            for p in params:
                n = p.grad.numel()
                p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
                offset += n
            self.optimizer.step()
            self.optimizer.zero_grad()
        if self.rank.regroup_due:
            self._split_for_planned()
        self._keep_place()
        if self.sharded is not None:
            # After the place is kept: a joiner of a group formed again in the gather runs the next step, and takes
            # up the data where it begins.
            self._gather(step + 1)
        return step + 1

    @contextlib.contextmanager
    def forward_backward(self) -> Iterator[None]:
        """Around each step's forward and backward when the model is FSDP2's over `live_mesh`, whose collectives
        run there: a peer lost meanwhile voids the step, and its error is not raised (`step` throws the step away
        on every rank and returns it, to run again); any other error is the loop's own, and goes up. Without a mesh
        it does nothing."""
        if self.mesh is None:
            yield
            return
        import torch

        if self.rank.regroup_due and not self._regroup():
            # A planned generation published during the last step: formed before this step's collectives, which run
            # in its groups. A rank it leaves out (drained, its replacement holding its rank) reported the last step
            # already, and leaves here.
            self.rank.leave()
        self._rng_at_step_start = torch.get_rng_state()  # the step runs again from here if it is thrown away
        try:
            yield
        except Exception as e:
            if not is_peer_loss(e):
                raise
            self.rank.last_break = str(e)
            self._broken = True
        if self._broken:
            self.mesh.close()  # out of the handler, whose traceback held the failed work: peers blocked here fail now

    def _mesh_step(self, step: int) -> int:
        """With an FSDP2 model over `live_mesh`: its gradients were reduced in backward, so the ranks only vote. A
        step every rank reduced is applied; one with a failed collective anywhere is thrown away on every rank, which
        forms the next generation (a replacement taking its shard from a rank of another replica that holds it) and
        runs the step again from its start: its batch, its RNG."""
        assert self.mesh is not None
        if self._rng_at_step_start is None:
            raise RuntimeError("LiveTraining(mesh=...): run each step's forward and backward inside "
                               "`with live.forward_backward():`, then call live.step(step): FSDP2's collectives "
                               "run in them, and a peer lost there must void the step, not fail the rank")
        broken = self._broken or self.mesh.broke()
        self._broken = False
        if self.rank.vote(step, not broken):
            self._rng_at_step_start = None
            fault_point("live.optimizer_step")  # committed everywhere, not applied here
            self.optimizer.step()
            self.optimizer.zero_grad()
            self._keep_place()
            return step + 1
        self._throw_away(step)
        return step

    def _throw_away(self, step: int) -> None:
        import torch

        assert self.mesh is not None
        self.mesh.close()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.reset_iter_state()  # FSDP2's: its unsharded parameters and pending reductions of the step, gone
        torch.set_rng_state(self._rng_at_step_start)
        self._rng_at_step_start = None
        context = get_session("LiveTraining").context
        start = positions.step_start(self._place, self._place_now())
        for key in positions.regroup(start, context.world_rank, context.world_size, positions.shared_seed(context)):
            log.warning("live recovery: %s goes on from where it is: its place at the start of the step thrown "
                        "away cannot be told, so its batch of that step is not read again", key)
        resumed = self._rejoin()
        if resumed != step:
            raise RuntimeError(f"after step {step} was thrown away, the ranks agreed to go on at step {resumed}")

    def _gather(self, next_step: int) -> None:
        """After a committed step, the shards this rank does not hold. A rank lost meanwhile: every rank applied its
        shard's step already, so the group forms again (the joiner taking the state of its shard, as it stands
        after the step, from a holder) and gathers there (`_join`)."""
        assert self.sharded is not None and self.rank.group is not None
        try:
            fault_point("live.gather")
            self._gather_all(self.rank.group, self._settle_reports)
            self._took_state = self._settle_reports = False  # settled: the others reported the step before this one
            return
        except GroupBroken as e:
            self.rank.last_break = str(e)
        # Joined outside the handler: nothing of the broken group may outlive the wait for the next one (the group
        # frees its failed work itself, `LiveGroup._run`; a handler's traceback would hold the caller's frames).
        resumed = self._rejoin()
        if resumed != next_step:
            raise RuntimeError(f"after step {next_step - 1} committed, the ranks agreed to go on at step {resumed}")

    def _gather_all(self, group: Any, counts: bool) -> None:
        """The shards this rank does not hold, and with `counts` every rank's count of reports, which a rank that
        took its state from a sender settles on (`reports_after_gather`). The counts are told in the first step's
        gather after a group formed, on every rank alike, and not in the others: a collective more a step is a
        wait on the slowest rank more a step. Raises GroupBroken."""
        assert self.sharded is not None and self._split is not None
        try:
            self.sharded.gather(self._split[0])
        except GroupBroken:
            self._close_split()  # the holders' group too: a peer blocked on this rank there fails now
            raise
        if not counts:
            return
        session = get_session("LiveTraining")
        told = group.allgather_int(session.reports_made)
        session.continue_reports(reports_after_gather(session.reports_made, told, self._took_state))

    def _reduce_shard(self, flat: Any) -> Any:
        assert self.sharded is not None and self._split is not None
        try:
            return self.sharded.reduce(flat, *self._split)
        except GroupBroken:
            self._close_split()  # the other group too: a peer blocked on this rank there fails now
            raise

    def _form_split(self) -> None:
        """This generation's groups of the split state (`live_shards.py`): this rank's replica (its ranks in shard
        order) and the holders of its shard (in replica order). Raises GroupBroken."""
        assert self.sharded is not None and self.rank.group is not None
        self._close_split()
        group, shards = self.rank.group, self.sharded.shards
        generation, timeout = self.rank.ledger.generation, self.rank.timeout_s
        replica = LiveGroup.form(self.rank.store, generation, group.rank % shards, shards, timeout,
                                 name=f"replica{group.rank // shards}")
        try:
            holders = LiveGroup.form(self.rank.store, generation, group.rank // shards, group.world_size // shards,
                                     timeout, name=f"shard{group.rank % shards}")
        except GroupBroken:
            replica.close()
            raise
        self._split = (replica, holders)

    def _close_split(self) -> None:
        if self._split is not None:
            for g in self._split:
                g.close()
            self._split = None

    def _join(self) -> int:
        self._close_split()  # before the wait for the next generation: a peer blocked on this rank fails now
        while True:
            step = self.rank.join(self.state_dict, self.load_state_dict)
            if self.mesh is not None:
                try:
                    assert self.rank.group is not None
                    self.mesh.attach(self.rank.store, self.rank.ledger.generation, self.rank.rank,
                                     self.rank.group.world_size, self.rank.timeout_s)
                    break
                except GroupBroken as e:
                    self.rank.last_break = str(e)
                    continue
            if self.sharded is None:
                break
            # The shards this rank does not hold may be a step behind (a rank lost while they were gathered, or this
            # rank new, holding the sender's): gathered before any step runs on them.
            try:
                self._form_split()
                self._gather_all(self.rank.group, counts=False)  # the others report the committed step after it
                self._settle_reports = True
                break
            except GroupBroken as e:
                self.rank.last_break = str(e)
        session = get_session("LiveTraining")
        session.in_live_generation(self.rank.ledger.generation)
        group = self.rank.group
        if group is not None and (session.context.world_size, session.context.world_rank) != (group.world_size,
                                                                                                group.rank):
            # A grow, or a shrink: get_context()'s world size, and after a shrink the rank, are the live group's
            # from here (a shrink numbers the ranks that live afresh, in order).
            was = session.context
            session.context = dataclasses.replace(was, world_size=group.world_size, world_rank=group.rank)
            if self.rank.joins[-1].shrunk:
                self._split_for_shrink(was.world_size)
        if not self._place:
            self._keep_place()
        return step

    def _split_for_shrink(self, world: int) -> None:
        """The group shrank from `world` ranks, and the step in flight is thrown away: the rest of each reader's
        epoch, from every rank's place at that step's start (told from this rank's own, as a replacement tells
        them), is split between the ranks that live, so the lost ranks' rows are read by them."""
        context = get_session("LiveTraining").context
        start = positions.step_start(self._place, self._place_now())
        for key in positions.regroup(start, context.world_rank, context.world_size, positions.shared_seed(context)):
            log.warning("live shrink from %d to %d ranks: %s goes on with this rank's share to its epoch's end: the "
                        "lost ranks' places cannot be told, and the rows they had not read this epoch are not read",
                        world, context.world_size, key)
        self._keep_place()

    def _split_for_planned(self) -> None:
        """The step just committed announced a planned generation: when its world is another size (ranks added, or
        a drained node's ranks leaving with no room elsewhere), split the rest of each reader's epoch between the
        ranks of that world now, before the loop takes the next step's batch. A rank that leaves reads on as it was:
        its next step is never reduced."""
        planned = rendezvous.newest_after(self.rank.store, self.rank.ledger.generation)
        context = get_session("LiveTraining").context
        if planned is None or planned.world_size == context.world_size:
            return
        rank = planned.rank_of(self.rank.member)
        if rank is None:
            return
        for key in positions.regroup(self._place_now(), rank, planned.world_size, positions.shared_seed(context)):
            log.warning("live resize from %d to %d ranks: %s goes on with this rank's share of the old world to its "
                        "epoch's end: its other ranks' places cannot be told", context.world_size, planned.world_size,
                        key)

    def _keep_place(self) -> None:
        """Once a step committed: the data positions from which a joiner of the next recovery takes up the batches
        of the step it runs with the survivors (`positions.step_start`)."""
        self._place = self._place_now()

    @staticmethod
    def _place_now() -> str:
        context = get_session("LiveTraining").context
        return positions.document(context.world_size, context.world_rank)

    @property
    def generation(self) -> int:
        """The live group's generation the next step runs in (a planned one due after the last step counts): the
        same on every rank, a new member too, after the same step."""
        return self.rank.ledger.generation + self.rank.regroup_due

    def _rejoin(self) -> int:
        """After a step broke: into the next generation. One that leaves this rank out (a drained rank whose planned
        generation a death overtook: the death's generation is built on the planned one) means what it means after
        a planned step: the rank leaves, cleanly. It raised NotAMemberError out of step() before, a failure of a
        process whose rank its replacement held already."""
        try:
            return self._join()
        except NotAMemberError:
            self.rank.leave()

    def _regroup(self) -> bool:
        """Form the planned generation published meanwhile; False when it leaves this rank out."""
        try:
            self._join()
        except NotAMemberError:
            return False
        return True

    def close(self) -> None:
        """At the loop's end. A planned generation due after the last step is formed first, so that its new
        members receive the state they wait for (and find the loop over, as the others do)."""
        if self.rank.regroup_due:
            self._regroup()
        if self.mesh is not None:
            self.mesh.close()
        self._close_split()
        self.rank.close()
