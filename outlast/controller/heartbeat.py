"""What the controller's heartbeat tells each agent of its run: how long a silence means the driver is gone,
and where what a kill would throw away begins (the memory policy weighs it, `outlast/agent/`)."""

from __future__ import annotations

from outlast.controller import states as st
from outlast.controller.core_state import CoreState
from outlast.protocol import messages as m


def heartbeat(c: CoreState) -> m.RunHeartbeat:
    return m.RunHeartbeat(run_id=c.run_id, timeout_s=c.plan.timeouts.driver_lost_after_s,
                          last_commit_at=last_commit_this_attempt(c), saved_for_drain_at=saved_for_drain_at(c))


def saved_for_drain_at(c: CoreState) -> float | None:
    """When the checkpoint the loop saved for the drain it is in was committed: it is `Saved` with nowhere to go
    (a run that found room elsewhere restarts there at once)."""
    s = c.state
    record = c.book.committed(s.checkpoint) if isinstance(s, st.Saved) else None
    return record.committed_at if record is not None else None


def last_commit_this_attempt(c: CoreState) -> float | None:
    """What a kill would throw away starts here (None: the attempt's start, as the agent knows it)."""
    a, latest = c.attempt, c.book.state.checkpoints[-1:]
    if a is None or not latest or latest[0].attempt != a.number:
        return None
    return latest[0].committed_at
