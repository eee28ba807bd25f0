"""The run's history as the controller keeps it, in memory; a change marks it `dirty`.

The book never writes while the controller runs: the core hands the changed state to storage
as an effect (`effects.WriteRunState`) after each step. `RunStore` replaces the document
atomically, so a crash at any point leaves the previous version readable. Only `open` and
`flush`, used before the controller's loop starts and after it ends, touch storage.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from outlast.protocol.kinds import Budget
from outlast.storage.records import (
    AttemptRecord, CheckpointRecord, CorruptDocument, DocumentTooLarge, DrainRecord, FailureRecord, LiveRecoveryRecord,
    Manifest, OutputFile, ResizeRecord,
    RunNote, RunState, SkippedCheckpoint, encode,
)
from outlast.storage.run_store import RunStore

log = logging.getLogger("outlast.controller")


class RunBook:
    def __init__(self, store: RunStore, state: RunState) -> None:
        self.store = store
        self.state = state
        # The failure budget is per driver launch: a relaunched driver gets max_failures anew.
        self.budget_base = dict(state.failure_counts)
        self.dirty = False

    @classmethod
    def open(cls, store: RunStore, name: str, now: float) -> "RunBook":
        """Load the run's history, or start one. Call only while holding the run's driver lease.

        A run-state document that cannot be read is set aside and rebuilt from the checkpoint
        manifests; a manifest that the run state does not name yet (a driver that died between
        the two writes) is adopted: the manifest is the commit point. A run-state document or
        manifest of a newer schema raises `NewerVersionError` before anything is written.
        """
        try:
            state = store.load_state()
        except DocumentTooLarge:
            raise  # not set aside: that would read it whole; the error says how to go on
        except CorruptDocument as e:
            aside = store.set_aside_state(now)
            log.warning("%s; moved it to %s and rebuilt the run's history from its checkpoints", e, aside)
            state = RunState(name=name, status="running", created_at=now, updated_at=now)
        if state is None:
            state = RunState(name=name, status="initializing", created_at=now, updated_at=now)
        if state.latest_checkpoint is not None:
            try:  # the one the next attempt restores: a newer one must stop the run here, not in a step
                store.read_manifest(state.latest_checkpoint)
            except (CorruptDocument, OSError):
                pass  # judged when the attempt restores it (checkpoints.restorable)
        book = cls(store, state)
        book._adopt_orphan_manifests(now)
        book.flush()
        return book

    def _adopt_orphan_manifests(self, now: float) -> None:
        known = {c.checkpoint_dir for c in self.state.checkpoints} | {
            s.checkpoint_dir for s in self.state.skipped_checkpoints}
        adopted = []
        for name in self.store.checkpoint_dirs():
            if name in known:
                continue
            try:
                manifest = self.store.read_manifest(name)
            except CorruptDocument as e:
                log.warning("ignoring checkpoint %s: %s", name, e)
                continue
            if manifest is not None:
                adopted.append(manifest)
        if not adopted:
            return
        # An orphan is not always the newest: a driver fenced mid-commit leaves one older than what the
        # driver after it committed. Commit order is (attempt, report index) across drivers, and seq
        # (what retention and results order by) is renumbered to follow it.
        merged = self.state.checkpoints + [record_of(mf, seq=0) for mf in adopted]
        first = min((c.seq for c in self.state.checkpoints), default=1)
        merged.sort(key=lambda c: (c.attempt, c.report_index))
        self.state.checkpoints = [msgspec.structs.replace(c, seq=seq) for seq, c in enumerate(merged, start=first)]
        newest = max(self.state.checkpoints, key=lambda c: (c.attempt, c.report_index))
        self.state.latest_checkpoint = newest.checkpoint_dir
        if not self.state.attempts:
            last = max(c.attempt for c in self.state.checkpoints)
            self.state.attempts = [AttemptRecord(attempt=last, started_at=now, ended_at=now, outcome="unknown")]
        log.info("adopted committed checkpoint%s the run state did not name yet: %s",
                 "s" if len(adopted) > 1 else "", ", ".join(mf.checkpoint_dir for mf in adopted))
        self._save(now)

    @property
    def resumable(self) -> bool:
        return bool(self.state.attempts) and self.state.status != "finished"

    def close_dead_drivers_attempt(self, now: float, last_seen: float | None) -> bool:
        """A previous driver died mid-attempt: end that attempt without charging any budget."""
        if not self.state.attempts or self.state.attempts[-1].ended_at is not None:
            return False
        self.state.attempts[-1].ended_at = last_seen or now
        self.state.attempts[-1].outcome = "driver_lost"
        self.state.failure_counts[Budget.DRIVER] = self.state.failure_counts.get(Budget.DRIVER, 0) + 1
        self.budget_base[Budget.DRIVER] = self.state.failure_counts[Budget.DRIVER]
        self._save(now)
        return True

    def failures_this_launch(self, kind: Budget) -> int:
        return self.state.failure_counts.get(kind, 0) - self.budget_base.get(kind, 0)

    def skip_checkpoint(self, checkpoint_dir: str, reason: str, now: float, steps_lost: int | None = None) -> str | None:
        """Stop restoring from a checkpoint that turned out unreadable, or lost with its nodes (`steps_lost`: what
        going back costs); return the one before it."""
        self.state.skipped_checkpoints.append(SkippedCheckpoint(checkpoint_dir=checkpoint_dir, reason=reason,
                                                                time=now, steps_lost=steps_lost))
        self.state.checkpoints = [c for c in self.state.checkpoints if c.checkpoint_dir != checkpoint_dir]
        latest = max(self.state.checkpoints, key=lambda c: c.seq, default=None)
        self.state.latest_checkpoint = latest.checkpoint_dir if latest else None
        self._save(now)
        return self.state.latest_checkpoint

    def note_uncommitted(self, checkpoint_dir: str, reason: str, now: float) -> None:
        """A checkpoint that could never be committed (a shard lost with its node): say why in the history."""
        self.state.skipped_checkpoints.append(SkippedCheckpoint(checkpoint_dir=checkpoint_dir, reason=reason,
                                                                time=now))
        self._save(now)

    def note_drain(self, record: DrainRecord) -> None:
        """A drain reached the attempt's nodes: its window, for the history's timeline."""
        self.state.drains.append(record)
        self._save(record.time)

    def note_once(self, text: str, now: float) -> bool:
        """Record `text` in the history unless it is there already; True when it is new."""
        if any(n.text == text for n in self.state.notes):
            return False
        self.state.notes.append(RunNote(text=text, time=now))
        self._save(now)
        return True

    def _save(self, now: float | None = None) -> None:
        if now is not None:
            self.state.updated_at = now
        self.dirty = True

    def take_snapshot(self) -> bytes | None:
        """The state encoded, if it changed since the last snapshot; the caller writes it."""
        if not self.dirty:
            return None
        self.dirty = False
        return encode(self.state)

    def flush(self) -> None:
        """Write the state now, if it changed: only outside the controller's loop."""
        data = self.take_snapshot()
        if data is not None:
            try:
                self.store.save_state_encoded(data)
            except OSError as e:
                log.error("could not write the run state of %s (%s)", self.store.storage.uri(self.store.run_dir), e)

    def begin_attempt(self, now: float) -> int:
        number = self.state.attempts[-1].attempt + 1 if self.state.attempts else 1
        self.state.attempts.append(
            AttemptRecord(attempt=number, started_at=now, restored_from=self.state.latest_checkpoint)
        )
        self.state.status = "running"
        self._save(now)
        return number

    def set_waiting(self, reason: str | None, now: float) -> None:
        """Waiting for nodes to place the attempt on (reason), or placed again (None)."""
        self.state.status = "waiting_for_capacity" if reason is not None else "running"
        self.state.waiting_for = reason
        if self.state.attempts:  # the window, for the run's goodput (outlast/storage/goodput.py)
            current = self.state.attempts[-1]
            if reason is not None and current.waiting_since is None:
                current.waiting_since = now
            elif reason is None and current.waiting_since is not None:
                current.capacity_at = now
        self._save(now)

    def note_size(self, workers: int, resize: ResizeRecord | None, now: float) -> None:
        """The current attempt's world size (written with the next change), and the resize that led to it
        (written now)."""
        if self.state.attempts:
            self.state.attempts[-1].workers = workers
        if resize is not None:
            self.state.resizes.append(resize)
            self._save(now)

    def charge_live_failure(self, record: FailureRecord, budget: Budget = Budget.WORKER) -> None:
        """A rank's death that live recovery answers: the attempt goes on, and the death draws on max_failures
        as a restart would (a drain whose ranks move live, on max_preemption_failures, as its restart would)."""
        if self.state.attempts:
            self.state.attempts[-1].failures.append(record)
        self.state.failure_counts[budget] = self.state.failure_counts.get(budget, 0) + 1
        self._save(record.time)

    def note_live_recovery(self, record: LiveRecoveryRecord) -> None:
        self.state.live_recoveries.append(record)
        self._save(record.time)

    def end_attempt(self, outcome: str, now: float) -> None:
        if self.state.attempts and self.state.attempts[-1].ended_at is None:
            self.state.attempts[-1].ended_at = now
            self.state.attempts[-1].outcome = outcome
        self._save(now)

    def note_output_file(self, rank: int, node_id: str, path: str) -> None:
        """Named in the history with the attempt's next write (a failure, a commit, its end)."""
        if self.state.attempts and path:
            self.state.attempts[-1].outputs.append(OutputFile(rank=rank, node_id=node_id, path=path))

    def add_failure(self, record: FailureRecord, save: bool = True) -> None:
        """`save=False`: kept for the next write (the attempt's verdict), as for the exits of a teardown."""
        if self.state.attempts:
            self.state.attempts[-1].failures.append(record)
        if save:
            self._save(record.time)

    def fail_attempt(self, root: FailureRecord, count_as: Budget, now: float) -> None:
        """End the current attempt as failed, its root cause first, charged to the budget `count_as`."""
        if self.state.attempts:
            current = self.state.attempts[-1]
            current.failures = [root] + [f for f in current.failures if f is not root]
            if current.ended_at is None:
                current.ended_at = now
                current.outcome = "failed"
        self.state.failure_counts[count_as] = self.state.failure_counts.get(count_as, 0) + 1
        self._save(now)

    def committed(self, checkpoint_dir: str) -> CheckpointRecord | None:
        """The history's record of a committed checkpoint, as it is now (its holders change as copies are pulled)."""
        return next((r for r in self.state.checkpoints if r.checkpoint_dir == checkpoint_dir), None)

    def record_commit(self, manifest: Manifest) -> None:
        """Phase two of a commit: its manifest is written, so the state may name it."""
        self.state.checkpoints.append(record_of(manifest, manifest.seq))
        self.state.latest_checkpoint = manifest.checkpoint_dir
        self._save(manifest.committed_at)

    def note_memory(self, checkpoint_dir: str, by_rank: dict[int, list[str]], committed_at: float | None) -> None:
        """Where a committed checkpoint's copies in memory are now, rank by rank (a change is saved, nothing else
        is)."""
        by_rank = {r: sorted(set(ns)) for r, ns in sorted(by_rank.items())}
        nodes = sorted({n for ns in by_rank.values() for n in ns})
        for i, r in enumerate(self.state.checkpoints):
            if r.checkpoint_dir != checkpoint_dir:
                continue
            at = r.memory_at if r.memory_at is not None else committed_at
            if r.memory != nodes or r.memory_ranks != by_rank or r.memory_at != at:
                self.state.checkpoints[i] = msgspec.structs.replace(r, memory=nodes, memory_ranks=by_rank,
                                                                    memory_at=at)
                self._save()
            return

    def note_durable(self, checkpoint_dir: str) -> None:
        """A checkpoint committed in memory is in storage now, its manifest rewritten to say so."""
        for i, r in enumerate(self.state.checkpoints):
            if r.checkpoint_dir == checkpoint_dir and not r.durable:
                self.state.checkpoints[i] = msgspec.structs.replace(r, durable=True)
                self._save()

    def forget_checkpoints(self, names: set[str]) -> None:
        self.state.checkpoints = [c for c in self.state.checkpoints if c.checkpoint_dir not in names]
        self._save()

    def finish(self, status: str, error: str | None = None, last_metrics: dict[str, Any] | None = None) -> None:
        self.state.status = status
        self.state.error = error
        if last_metrics is not None:
            self.state.last_metrics = last_metrics
        self._save()


def record_of(manifest: Manifest, seq: int) -> CheckpointRecord:
    """A committed checkpoint as the history names it, with its level: a manifest adopted by a relaunched
    driver keeps saying that it is held in memory only, and on which nodes, or its restore pulls nothing."""
    return CheckpointRecord(
        checkpoint_dir=manifest.checkpoint_dir, seq=seq, attempt=manifest.attempt,
        report_index=manifest.report_index, committed_at=manifest.committed_at, metrics=manifest.metrics,
        memory=list(manifest.memory), memory_at=manifest.memory_at, durable=manifest.durable,
        memory_ranks={r: list(ns) for r, ns in manifest.memory_ranks.items()})
