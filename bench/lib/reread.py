"""Counting the rows a run with faults used more than once in an epoch, from the events of
bench/lib/exact_loop.py or bench/lib/ray_exact_loop.py (start, used, kill), and what the same restore points
would cost a loop whose data starts an epoch over. Standard library only."""

from __future__ import annotations

from collections import Counter


def restored_steps(events: list[dict]) -> dict[int, int | None]:
    """Attempt -> the step its checkpoint held (None: it started afresh)."""
    return {e["attempt"]: e["restored_step"] for e in events if e["event"] == "start"}


def counted(events: list[dict]) -> list[dict]:
    """The `used` events whose step counted: no later than the step the next attempt restored (later steps were
    taken again, their updates lost), and all of the last attempt's."""
    restored = restored_steps(events)

    def counts(e: dict) -> bool:
        nxt = e["attempt"] + 1
        if nxt not in restored:
            return True
        return restored[nxt] is not None and e["step"] <= restored[nxt]
    return [e for e in events if e["event"] == "used" and counts(e)]


def uses_by_epoch(events: list[dict]) -> dict[int, Counter]:
    """Epoch -> row -> how many counted steps used it."""
    uses: dict[int, Counter] = {}
    for e in counted(events):
        uses.setdefault(e["epoch"], Counter()).update(e["rows"])
    return uses


def used_again(uses: dict[int, Counter]) -> dict[int, int]:
    """Epoch -> the uses past each row's first: what a run read again and trained on again."""
    return {epoch: sum(n - 1 for n in rows.values() if n > 1) for epoch, rows in uses.items()}


def derived_again(restores: list[int], steps_per_epoch: int, rows_per_step: int) -> dict[int, int]:
    """Epoch -> the rows a loop whose data starts an epoch over would read again at these restored steps,
    placed as a run that never reads a row twice places them (epoch e is steps e * steps_per_epoch on): the
    epoch's rows up to each restored step. A restore at an epoch's last step costs nothing."""
    again: Counter = Counter()
    for step in restores:
        epoch, place = divmod(step, steps_per_epoch)
        if place < steps_per_epoch - 1:
            again[epoch] += (place + 1) * rows_per_step
    return dict(again)


def restart_seconds(events: list[dict]) -> list[float]:
    """For each kill, the seconds from it to the next attempt's first step (events carrying `time`)."""
    took = []
    for kill in (e for e in events if e["event"] == "kill"):
        firsts = [e["time"] for e in events if e["event"] == "used" and e["attempt"] == kill["attempt"] + 1]
        if firsts:
            took.append(round(min(firsts) - kill["time"], 1))
    return took
