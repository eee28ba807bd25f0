"""The run's history as the controller keeps it: every change is written through.

Writes go through `RunStore`, which replaces the document atomically, so a crash at
any point leaves the previous version readable.
"""

from __future__ import annotations

from outlast.storage.records import AttemptRecord, CheckpointRecord, FailureRecord, Manifest, RunState
from outlast.storage.run_store import RunStore


class RunBook:
    def __init__(self, store: RunStore, state: RunState) -> None:
        self.store = store
        self.state = state

    @classmethod
    def open(cls, store: RunStore, name: str, now: float) -> "RunBook":
        state = store.load_state()
        if state is None:
            state = RunState(name=name, status="initializing", created_at=now, updated_at=now)
        return cls(store, state)

    def _save(self, now: float | None = None) -> None:
        if now is not None:
            self.state.updated_at = now
        self.store.save_state(self.state)

    def begin_attempt(self, now: float) -> int:
        number = self.state.attempts[-1].attempt + 1 if self.state.attempts else 1
        self.state.attempts.append(
            AttemptRecord(attempt=number, started_at=now, restored_from=self.state.latest_checkpoint)
        )
        self.state.status = "running"
        self._save(now)
        return number

    def end_attempt(self, outcome: str, now: float) -> None:
        if self.state.attempts and self.state.attempts[-1].ended_at is None:
            self.state.attempts[-1].ended_at = now
            self.state.attempts[-1].outcome = outcome
        self._save(now)

    def add_failure(self, record: FailureRecord, count_as: str | None = None) -> None:
        if self.state.attempts:
            current = self.state.attempts[-1]
            current.failures.append(record)
            if current.ended_at is None and count_as is not None:
                current.ended_at = record.time
                current.outcome = "failed"
        if count_as is not None:
            self.state.failure_counts[count_as] = self.state.failure_counts.get(count_as, 0) + 1
        self._save(record.time)

    def commit_checkpoint(self, checkpoint_dir: str, attempt: int, report_index: int, ranks: list[int],
                          files, metrics: dict, now: float) -> None:
        """Manifest first, then the run state: a checkpoint the state names always has its manifest."""
        seq = max((c.seq for c in self.state.checkpoints), default=0) + 1
        self.store.write_manifest(Manifest(
            checkpoint_dir=checkpoint_dir, seq=seq, attempt=attempt, report_index=report_index,
            committed_at=now, ranks=ranks, files=files, metrics=metrics,
        ))
        self.state.checkpoints.append(CheckpointRecord(
            checkpoint_dir=checkpoint_dir, seq=seq, attempt=attempt, report_index=report_index,
            committed_at=now, metrics=metrics,
        ))
        self.state.latest_checkpoint = checkpoint_dir
        self._save(now)

    def forget_checkpoints(self, names: set[str]) -> None:
        self.state.checkpoints = [c for c in self.state.checkpoints if c.checkpoint_dir not in names]
        self._save()

    def finish(self, status: str, error: str | None = None) -> None:
        self.state.status = status
        self.state.error = error
        self._save()
