"""What the controller's core does for a preemption (`preemption.py` and `horizons.py` decide): tell the ranks
the horizons' answers, and weigh what a decision needs (the notice's uploads, room elsewhere).

Plain functions over the core's state (`core_state.CoreState`), as `hang_steps.py` has; the
state changes a preemption makes are `lifecycle.py`'s.
"""

from __future__ import annotations

import logging

from outlast.controller.core_state import CoreState
from outlast.controller.horizons import Answer, NoticeAt
from outlast.controller.preemption import Preemption
from outlast.controller.upload_estimate import Estimate
from outlast.protocol import messages as m

log = logging.getLogger("outlast.controller")


def preemption(c: CoreState) -> Preemption | None:
    return getattr(c.state, "preemption", None)


def answer(c: CoreState, answers: list[Answer]) -> None:
    if not answers:  # the timers call it at every step
        return
    a = c.attempt
    p = preemption(c) or (a.preemption if a is not None else None)
    for ans in answers:
        if isinstance(ans.reply, NoticeAt):
            # A decision is only ever fixed after a notice, and the attempt keeps its preemption.
            assert p is not None and a is not None, "a preemption decision without a preemption"
            msg: m.Msg = p.notice_message(ans.index, ans.reply.decision_index)
        else:
            msg = m.PreemptionGrant(index=ans.index, horizon=ans.reply.horizon, valid_s=ans.reply.valid_s)
        c.send_to_rank(ans.rank, msg)


def jit_uploads(c: CoreState, p: Preemption, now: float) -> Estimate:
    """The uploads of the checkpoint saved for the notice: they go before any other (storage/priority.py)."""
    return c.uploads.estimate(now, only=p.after_notice)


def forecast_uploads(c: CoreState, p: Preemption) -> None:
    text = p.forecast(c.now, jit_uploads(c, p, c.now), c.book.state.latest_checkpoint)
    if text is not None:
        assert c.attempt is not None
        log.warning("attempt %d: %s", c.attempt.number, text)
        c.book.note_once(f"attempt {c.attempt.number}: {text}", c.wall())


def room_elsewhere(c: CoreState, now: float) -> bool:
    return c.resizes.room_elsewhere(c.nodes.views(c.run_id, now), c.plan.world_size, c.plan.per_worker,
                                    c.plan.strategy)
