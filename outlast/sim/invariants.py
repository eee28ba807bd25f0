"""What must hold in every schedule, checked as the simulation runs and at its end.

- Nothing escapes the controller's `step()`.
- Every rank's first non-None `get_preemption_info()` is at the same call index, and no rank
  that calls later than max(0.5 s, one step) after the drain (plus the channels' delays and
  storage time; a step is the loop's as it runs, a report() waiting on an upload included)
  gets None.
- A checkpoint whose `report()` returned on every rank is restored by the next attempt, or a
  newer one is.
- No attempt starts while a worker of an earlier attempt lives.
- Preemptions never draw on `max_failures`: the failures charged to it are at most the worker
  deaths, node losses and deaths of outlast's own processes (a fork server, an agent: one
  failure each) the schedule caused; so a relaunched driver, a restarted agent or the
  controller's own teardown (a SIGKILL after the stop's grace) costs nothing.
- Every run ends, finished or with an error that says why, within a bound, and every attempt of
  its history is settled.
- A live driver's workers are never killed for its silence, storage slow or not.
"""

from __future__ import annotations

import traceback
from typing import TYPE_CHECKING

from outlast.controller import group as g
from outlast.controller import states as st
from outlast.protocol import messages as m

if TYPE_CHECKING:
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
        self._last_kind: dict[int, str] = {}

    def violation(self, what: str) -> None:
        self.sim.world.note(f"VIOLATION {what}")
        self.violations.append(f"t={self.sim.world.now:.4f}: {what}")

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
        before = self._last_kind.get(driver.generation, "initializing")
        if before != s.kind.value:
            self.transitions.add((before, s.kind.value))
            self._last_kind[driver.generation] = s.kind.value
        if isinstance(s, (st.Preempting, st.Saved)) and a is not None:
            key = (core.run_id, a.number)
            if key not in self.noticed:
                began = [self.sim.drained_at[n] for n in s.preemption.node_ids if n in self.sim.drained_at]
                self.noticed[key] = min(began, default=self.sim.world.now)
        for effect in effects:
            if isinstance(effect, g.Spawn):
                self._check_spawn(core.run_id, effect.msg)

    def _check_spawn(self, run_id: str, spawn: m.SpawnWorkers) -> None:
        key = (run_id, spawn.attempt)
        if key in self._checked_spawns:
            return
        self._checked_spawns.add(key)
        older = sorted({(w.attempt, w.rank) for w in self.live.values() if w.attempt < spawn.attempt})
        if older:
            self.violation(f"attempt {spawn.attempt} started while workers (attempt, rank) {older} live")
        if self.durable and (spawn.restore_checkpoint is None or spawn.restore_checkpoint < self.durable[-1]):
            self.violation(f"attempt {spawn.attempt} restores {spawn.restore_checkpoint}, older than "
                           f"{self.durable[-1]}, whose report() returned on every rank")

    # ---- workers ---------------------------------------------------------------------------

    def worker_started(self, w: "SimRank") -> None:
        self.live[(w.run_id, w.attempt, w.rank)] = w

    def worker_gone(self, w: "SimRank") -> None:
        self.live.pop((w.run_id, w.attempt, w.rank), None)

    def restored(self, w: "SimRank", name: str, step: int) -> None:
        pass

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
        # The history as the last driver left it in memory: a final write that storage refused is
        # retried by the next change, and a closed run has none.
        book = sim.driver.core.book if sim.driver is not None and sim.driver.core is not None else sim.final_book()
        if book is None:
            return
        if book.state.status == "errored" and not (book.state.error or "").strip():
            self.violation("the run errored without saying why")
        unsettled = [a.attempt for a in book.state.attempts if a.ended_at is None]
        if unsettled:
            self.violation(f"attempts {unsettled} were never settled")
        charged = book.state.failure_counts.get("worker", 0)
        if not sim.storage_faults and charged > self.harm:
            self.violation(f"{charged} failures drawn on max_failures, but the schedule killed only {self.harm} "
                           f"workers or nodes: {dict(book.state.failure_counts)}")
