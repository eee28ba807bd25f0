"""What must hold in every schedule, checked as the simulation runs and at its end.

- Nothing escapes the controller's `step()`.
- Every rank's first non-None `get_preemption_info()` is at the same call index, and no rank
  that calls later than max(0.5 s, one step) after the drain (plus the channels' delays and
  storage time; a step is the loop's as it runs, a report() waiting on an upload included)
  gets None.
- A checkpoint whose `report()` returned on every rank is restored by the next attempt, or a
  newer one is.
- No attempt starts while a worker of an earlier attempt lives: a rank stuck in the kernel (unkillable)
  excepted, on other nodes than its own.
- Preemptions never draw on `max_failures`: the failures charged to it are at most the worker
  deaths, node losses and deaths of outlast's own processes (a fork server, an agent: one
  failure each) the schedule caused; so a relaunched driver, a restarted agent or the
  controller's own teardown (a SIGKILL after the stop's grace) costs nothing.
- Every run ends, finished or with an error that says why, within a bound, and every attempt of
  its history has ended.
- A live driver's workers are never killed for its silence, storage slow or not.
- No complete checkpoint of a finished run is deleted: the newest checkpoint of the last attempt
  that every rank reported and whose every file was written is committed, with its files.
- With `edges`: each failure is charged to its cause's budget: a rank killed, or its node lost,
  on a node that was not draining, while its attempt was in a drain, is charged to max_failures,
  never to max_preemption_failures; and every state answers every message without raising: each
  state the controller enters is handed, in a copy, each message a worker or an agent may send
  (stale ones too).
- No process a rank started outlives the rank (its children, in its process group).
- A driver that opens a run a newer outlast wrote (its run state, latest manifest or lease) refuses it, saying
  which document and to upgrade, and changes nothing but its own lease.
- With memory tiers on the nodes: those of `tier_invariants.py` (restores read only copies that match their
  checksums; a checkpoint committed in memory is restored while one copy of it lives; a fallback past one whose
  copies are gone is in the history with its cost; no budget evicts the newest committed checkpoint).
"""

from __future__ import annotations

import copy
import io
import pickle
import traceback
from typing import TYPE_CHECKING

from outlast.controller import group as g
from outlast.controller import states as st
from outlast.controller.resize import RESIZE
from outlast.protocol import messages as m
from outlast.sim.tier_invariants import TierWatch

if TYPE_CHECKING:
    from outlast.controller.core import ControllerCore
    from outlast.sim.driver import SimDriver
    from outlast.sim.run import Sim
    from outlast.sim.workers import SimRank


class Observer:
    def __init__(self, sim: "Sim") -> None:
        self.sim = sim
        self.violations: list[str] = []
        self.live: dict[tuple[str, int, int], "SimRank"] = {}
        self.noticed: dict[tuple[str, int], float] = {}  # (run id, attempt) -> when its drain began
        self.first_notice: dict[tuple[str, int], dict[int, int]] = {}
        self._returned: dict[str, set[int]] = {}
        self._last_call: dict[tuple[tuple[str, int], int], float] = {}
        self.durable: list[str] = []
        self._checked_spawns: set[tuple[str, int]] = set()
        self.harm = 0  # worker deaths, node losses and fork-server or agent deaths the schedule caused
        self.transitions: set[tuple[str, str]] = set()
        self._last_kind: dict[int, st.State] = {}
        self._struck: list[tuple[str, int, int, str, float, bool]] = []  # run, attempt, rank, node, when, in a drain
        self._preemptions: dict[int, int] = {}  # driver generation -> failures charged to preemption so far
        self._parts: dict[tuple[int, str], dict[str, set[int]]] = {}  # (attempt, checkpoint) -> part -> ranks
        self._world: dict[int, int] = {}
        self._probed: set[tuple[int, str]] = set()
        self.tier = TierWatch(sim) if sim.schedule.tier is not None else None  # the memory tier's invariants

    def violation(self, what: str) -> None:
        self.sim.world.note(f"VIOLATION {what}")
        self.violations.append(f"t={self.sim.world.now:.4f}: {what}")
        self.sim.world.stopped = True

    # ---- the controller ---------------------------------------------------------------------

    def escaped(self, driver: "SimDriver", event: g.InEvent, e: Exception) -> None:
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-3:]).strip().replace("\n", " | ")
        self.violation(f"{type(e).__name__} escaped the controller on {type(event).__name__}: {e} [{tb}]")

    def on_kill(self, node_id: str, kill) -> None:
        """A live driver's workers are never killed for its silence: its loop never waits on storage."""
        d = self.sim.driver
        if d is None or not d.alive or d.core is None or d.core.closed:
            return
        if kill.reason == f"run {d.core.run_id}: its driver fell silent":
            self.violation(f"node {node_id} killed pid {kill.pid} of live driver {d.core.run_id}: {kill.reason}")

    def after_step(self, driver: "SimDriver", event: g.InEvent, effects: list[g.Effect]) -> None:
        core = driver.core
        assert core is not None
        s, a = core.state, core.attempt
        before = self._last_kind.get(driver.generation, st.State.INITIALIZING)
        if before is not s.kind:
            self.transitions.add((before.value, s.kind.value))
            self._last_kind[driver.generation] = s.kind
        if isinstance(s, (st.Preempting, st.Saved)):  # at every step: Running, the common case, asks no more
            if isinstance(s, st.Preempting) and s.preemption.notice.reason == RESIZE and self.sim.armed_in_grow:
                self.sim.grow_noticed()
            if a is not None and (key := (core.run_id, a.number)) not in self.noticed:
                began = [self.sim.drained_at[n] for n in s.preemption.node_ids if n in self.sim.drained_at]
                self.noticed[key] = min(began, default=self.sim.world.now)
        for effect in effects:
            if type(effect) is g.Spawn:  # no effect's class subclasses another (`SimDriver.perform`)
                self._check_spawn(core.run_id, effect.msg, effect.node_id)
        if self.tier is not None:
            self.tier.after_step(driver)
        if self.sim.schedule.live:
            self.sim.live_watch.after_step(core.book.state.live_recoveries)
        if self.sim.edges:
            self._check_budget(driver)
            # Initializing lasts from the node table to Started, two steps of one call: nothing comes between.
            if s.kind is not st.State.INITIALIZING and (driver.generation, s.kind.value) not in self._probed:
                self._probed.add((driver.generation, s.kind.value))
                self._probe(driver)

    def _check_budget(self, driver: "SimDriver") -> None:
        core = driver.core
        charged = core.book.state.failure_counts.get("preemption", 0)
        before = self._preemptions.setdefault(driver.generation, charged)
        self._preemptions[driver.generation] = charged
        ended = [a for a in core.book.state.attempts if a.ended_at is not None]
        if charged <= before or not ended:
            return
        attempt = ended[-1].attempt  # the one just ended (the next may have started in the same step)
        drained = self.sim.drained_at
        for run_id, a, rank, node_id, when, in_drain in self._struck:
            if run_id == core.run_id and a == attempt and in_drain and not drained.get(node_id, when + 1) <= when:
                self.violation(f"rank {rank} of attempt {a}, killed at t={when:.3f} on node {node_id}, which was not "
                               "draining, was charged to max_preemption_failures")

    def _probe(self, driver: "SimDriver") -> None:
        """The state just entered, in a copy (its storage a copy too), handed each message in turn."""
        core, sim = driver.core, self.sim
        a = core.attempt.number if core.attempt is not None else 0
        node = sorted(core.nodes.heard)[0] if core.nodes.heard else "n0"
        sim.facts["states_probed"] += 1
        image = _Image(core, sim)
        for event in probes(core.run_id, a, node, sim.wall()):
            twin = image.copy()
            try:
                twin.step(event, sim.world.now)
            except Exception as e:  # noqa: BLE001 - what the probe looks for
                tb = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-3:]).strip().replace("\n", " | ")
                self.violation(f"{type(e).__name__} escaped the controller in state {core.state.kind.value} on "
                               f"{_describe(event)}: {e} [{tb}]")
                return

    def _check_spawn(self, run_id: str, spawn: m.SpawnWorkers, node_id: str) -> None:
        key = (run_id, spawn.attempt)
        # A rank stuck in the kernel cannot be waited for: the next attempt may be asked for, and starts on
        # other nodes, or on its node once it is gone (`worker_started`); a relaunched driver cannot know of it.
        older = sorted({(w.attempt, w.rank) for w in self.live.values() if w.attempt < spawn.attempt
                        and w.unkillable_until <= self.sim.world.now})
        if key in self._checked_spawns and not older:
            return
        self._checked_spawns.add(key)
        if older:
            self.violation(f"attempt {spawn.attempt} started while workers (attempt, rank) {older} live")
        if self.tier is not None:
            self.tier.spawned(spawn, self.durable)
        elif self.durable and (spawn.restore_checkpoint is None or spawn.restore_checkpoint < self.durable[-1]):
            self.violation(f"attempt {spawn.attempt} restores {spawn.restore_checkpoint}, older than "
                           f"{self.durable[-1]}, whose report() returned on every rank")

    def refused(self, e: Exception, before: dict[str, bytes]) -> None:
        """A driver refused the run as written by a newer outlast: it must say which document and what to do,
        and leave storage as it was (but its own lease, unless the lease is what is newer)."""
        sim = self.sim
        sim.facts["refused_as_newer"] += 1
        text = str(e)
        if not sim.newer or not any(path in text for path in sim.newer):
            self.violation(f"a driver refused the run, naming no document a newer outlast wrote ({text})")
        if "upgrade outlast" not in text:
            self.violation(f"the refusal does not say what to do: {text}")
        lease = "run/driver_lease.json"
        spare = set() if lease in sim.newer else {lease}
        after = sim.storage.files
        changed = sorted(p for p in set(before) | set(after) if p not in spare and before.get(p) != after.get(p))
        if changed:
            self.violation(f"refusing a run written by a newer outlast changed {changed}")

    # ---- workers ---------------------------------------------------------------------------

    def worker_started(self, w: "SimRank") -> None:
        beside = sorted((o.attempt, o.rank) for o in self.live.values() if o.attempt < w.attempt and o.node is w.node)
        if beside:
            self.violation(f"rank {w.rank} of attempt {w.attempt} started on node {w.node.node_id} beside workers "
                           f"(attempt, rank) {beside} of an earlier attempt")
        self.live[(w.run_id, w.attempt, w.rank)] = w

    def worker_gone(self, w: "SimRank") -> None:
        if self.live.get(key := (w.run_id, w.attempt, w.rank)) is w:  # not its replacement, started while it lived
            del self.live[key]
        self.sim.world.after(0.0, self._children_gone, w)  # once its end has been handled, whatever killed it

    def _children_gone(self, w: "SimRank") -> None:
        if w.children:
            self.violation(f"processes {sorted(w.children)} started by rank {w.rank} of attempt {w.attempt} "
                           "outlived it")
            w.children = set()

    def children_ended(self, w: "SimRank", pids: set[int]) -> None:
        pass

    def struck(self, w: "SimRank") -> None:
        """A fault of the schedule hit this rank: it dies (or hangs) of something that is not a drain."""
        self.harm += 1
        driver = self.sim.driver
        state = driver.core.state if driver is not None and driver.core is not None else None
        in_drain = isinstance(state, (st.Preempting, st.Saved))
        self._struck.append((w.run_id, w.attempt, w.rank, w.node.node_id, self.sim.world.now, in_drain))
        if in_drain:
            grow = state.preemption.notice.reason == RESIZE
            self.sim.facts["failures_in_grows" if grow else "failures_in_drains"] += 1

    def checkpoint_part(self, w: "SimRank", name: str, part: str) -> None:
        """`report`: the rank reported the checkpoint; `files`: its files are all on storage."""
        self._parts.setdefault((w.attempt, name), {}).setdefault(part, set()).add(w.rank)
        self._world[w.attempt] = w.world_size

    def restored(self, w: "SimRank", name: str, step: int) -> None:
        pass

    def call_failed(self, w: "SimRank", error: Exception) -> None:
        """A run that keeps checkpoints in memory only refuses a commit that cannot reach two failure domains
        (the cluster shrank to one, a budget was full): that attempt's failure is the schedule's doing."""
        if self.tier is not None and self.tier.memory_only and type(error).__name__ == "CheckpointCommitError":
            self.harm += 1


    def wrote(self, w: "SimRank", name: str, entry: m.FileEntry) -> None:
        if self.tier is not None:
            self.tier.wrote(w, name, entry)

    def read_checkpoint(self, w: "SimRank", manifest, read: dict[str, bytes], source: str) -> None:
        if self.tier is not None:
            self.tier.read(w, manifest, read, source)

    def restore_failed(self, w: "SimRank", name: str, why: str) -> None:
        if self.tier is not None:
            self.tier.restore_failed(w, name, why)

    def evicted(self, node_id: str, copies) -> None:
        if self.tier is not None:
            self.tier.evicted(node_id, copies)

    def preemption_answer(self, w: "SimRank", index: int, notice: m.PreemptionNotice | None) -> None:
        key, now = (w.run_id, w.attempt), self.sim.world.now
        # "One step" is the loop's step as it runs: a report() blocked on an upload lengthens it.
        last = self._last_call.get((key, w.rank))
        self._last_call[(key, w.rank)] = now
        if notice is None:
            began = self.noticed.get(key)
            step = now - last if last is not None else 0.0
            bound = self.sim.notice_bound_s + max(0.0, step - self.sim.schedule.loop.step_s)
            if began is not None and now > began + bound:
                self.violation(f"rank {w.rank} of attempt {w.attempt} got None from get_preemption_info() call "
                               f"#{index}, {now - began:.3f} s after the drain (bound {bound:.3f} s, this step "
                               f"{step:.3f} s)")
            return
        seen = self.first_notice.setdefault(key, {})
        if w.rank in seen:
            return
        seen[w.rank] = index
        if len(set(seen.values())) > 1:
            self.violation(f"ranks of attempt {w.attempt} saw the notice at different calls: {seen}")

    def report_returned(self, w: "SimRank", index: int, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        ranks = self._returned.setdefault(checkpoint, set())
        ranks.add(w.rank)
        if len(ranks) == w.world_size and checkpoint not in self.durable:
            self.durable.append(checkpoint)
            self.durable.sort()

    # ---- the end ---------------------------------------------------------------------------

    def at_end(self, closed: bool, limit_s: float) -> None:
        sim = self.sim
        if not closed:
            core = sim.driver.core if sim.driver is not None else None
            state = core.state.kind.value if core is not None else "no driver"
            self.violation(f"the run did not end within {limit_s:.0f} s (state {state})")
            return
        if sim.refused is not None:
            return  # the run is the newer outlast's now: `refused` judged the refusal
        # The history as the last driver left it in memory: a final write that storage refused is
        # retried by the next change, and a closed run has none.
        book = sim.driver.core.book if sim.driver is not None and sim.driver.core is not None else sim.final_book()
        if book is None:
            return
        if book.state.status == "errored" and not (book.state.error or "").strip():
            self.violation("the run errored without saying why")
        if self.sim.edges and book.state.status == "finished" and book.state.attempts:
            self._check_last_checkpoint(book)
        unended = [a.attempt for a in book.state.attempts if a.ended_at is None]
        if unended:
            self.violation(f"attempts {unended} never ended")
        charged = book.state.failure_counts.get("worker", 0)
        if not sim.storage_faults and charged > self.harm:
            self.violation(f"{charged} failures drawn on max_failures, but the schedule killed only {self.harm} "
                           f"workers or nodes: {dict(book.state.failure_counts)}")

    def _check_last_checkpoint(self, book) -> None:
        last = book.state.attempts[-1].attempt
        writers = set(range(self._world.get(last, 0))) if self.sim.schedule.loop.sharded else {0}
        complete = [name for (a, name), parts in self._parts.items() if a == last
                    and parts.get("report", set()) >= set(range(self._world[a])) and parts.get("files", set()) >= writers]
        if not complete:
            return
        newest = max(complete)
        files = self.sim.storage.files
        missing = [r for r in sorted(writers) if f"run/{newest}/rank_{r}.bin" not in files]
        if newest not in {c.checkpoint_dir for c in book.state.checkpoints} or missing:
            self.violation(f"the run finished without its last complete checkpoint {newest}: "
                           + (f"the files of ranks {missing} are gone" if missing else "it was never committed"))


class _Image:
    """A controller core, pickled once, from which each probe takes a copy of its own, with a copy of storage:
    as `copy.deepcopy` would make it (the simulation itself shared, not copied), in a fraction of the time."""

    def __init__(self, core: object, sim: "Sim") -> None:
        self.sim = sim
        out = io.BytesIO()
        pickler = pickle.Pickler(out, pickle.HIGHEST_PROTOCOL)
        pickler.persistent_id = self._persistent_id  # type: ignore[method-assign]
        pickler.dump(core)
        self.data = out.getvalue()

    def _persistent_id(self, obj: object) -> str | None:
        return "sim" if obj is self.sim else "storage" if obj is self.sim.storage else None

    def copy(self) -> "ControllerCore":
        sim, storage = self.sim, copy.copy(self.sim.storage)
        storage.files, storage.failing = dict(sim.storage.files), list(sim.storage.failing)
        unpickler = _Unpickler(io.BytesIO(self.data))
        unpickler.persistent_load = lambda pid: sim if pid == "sim" else storage  # type: ignore[method-assign]
        return unpickler.load()  # type: ignore[no-any-return]


class _Unpickler(pickle.Unpickler):
    """Each class found once: the plain one imports its module again for every class it names (a third of a
    copy's time)."""

    _found: dict[tuple[str, str], object] = {}

    def find_class(self, module: str, name: str) -> object:
        found = self._found.get((module, name))
        if found is None:
            found = self._found[(module, name)] = super().find_class(module, name)
        return found


def probes(run_id: str, a: int, node: str, wall: float) -> list[g.InEvent]:
    """What a worker or an agent may send at any time: late, early, for this attempt or an older one."""
    far = 10**6
    return [
        g.FromWorker(m.PreemptionQuery(attempt=a, rank=0, index=0)),
        g.FromWorker(m.PreemptionQuery(attempt=a, rank=0, index=far)),
        g.FromWorker(m.Report(attempt=a, rank=0, index=far, metrics={})),
        g.FromWorker(m.Report(attempt=a, rank=0, index=far, metrics={}, checkpoint_dir="checkpoint_999_000000",
                              upload_pending=True)),
        g.FromWorker(m.UploadDone(attempt=a, rank=0, index=far, checkpoint_dir="checkpoint_999_000000", files=[],
                                  error=None)),
        g.FromWorker(m.CollectiveRequest(attempt=a, rank=0, seq=far, op="barrier")),
        g.FromWorker(m.WorkerHello(attempt=a, rank=0, pid=1)),
        g.FromWorker(m.WorkerDone(attempt=a, rank=0, reports=0)),
        g.FromWorker(m.PreemptionQuery(attempt=max(0, a - 1), rank=0, index=0)),
        g.FromAgent(node, m.WorkerStarted(run_id=run_id, attempt=a, rank=0, pid=1)),
        g.FromAgent(node, m.WorkerExited(run_id=run_id, attempt=a, rank=0, pid=1, exit_code=0, signal=None,
                                         error=None, node_id=node)),
        g.FromAgent(node, m.SpawnRefused(run_id=run_id, attempt=a, reason="probe")),
        g.FromAgent(node, m.NodeDraining(node_id=node, reason="spot", message="probe", deadline_unix_s=wall,
                                         node_ids=[node])),
        g.Tick(), g.Interrupted(), g.LeaseLost("probe"),
    ]


def _describe(event: g.InEvent) -> str:
    inner = getattr(event, "msg", None) or getattr(event, "event", None)
    return type(inner).__name__ if inner is not None else type(event).__name__
