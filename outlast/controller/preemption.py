"""One preemption of an attempt: the notice, its deadline, the checkpoint saved for it.

It answers the controller's one question, "restart now, or wait?", with a reason.
The horizons that tell every rank the notice at the same call are in `horizons.py`.
Pure: times come in as arguments (`now` monotonic, `wall` for records and deadlines).

What the upload estimate (`upload_estimate.py`: bytes left over each rank's measured
bandwidth) changes: the words, at once, not the verdict. When the notice's checkpoint needs
longer to upload than the deadline leaves, `forecast` says so the moment its reports arrive,
with what a restart from the last committed checkpoint would lose (the same steps, since the
checkpoint would not make it either way, and less of the node's time). The controller still
waits for the deadline rather than restart early: the rate is the previous upload's, measured
before the notice's checkpoint had the network to itself (`storage/priority.py`), and
cutting short an upload that would have made it loses every step since the last commit,
while waiting in vain costs only the rest of a window of seconds to minutes. At the
deadline the verdict names the bytes still in flight and their rate.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

import msgspec

from outlast.controller.upload_estimate import Estimate
from outlast.protocol.kinds import FailureKind
from outlast.protocol import messages as m
from outlast.storage.records import FailureRecord

NO_DEADLINE_WINDOW_S = 120.0  # how long a notice without a deadline leaves the loop to save


@dataclass(frozen=True)
class Verdict:
    restart_now: bool
    reason: str


@dataclass
class Preemption:
    notice: m.NodeDraining
    ranks: list[int]  # ranks on the draining nodes
    node_ids: list[str]
    noticed_at: float  # wall clock, for the history
    deadline: float  # monotonic: restart by then whatever happened
    reports_at_notice: list[int]  # per rank: its reports with an index >= this were made after the notice
    node_to_ranks: dict[str, list[int]] = field(default_factory=dict)  # the draining nodes' ranks
    jit_reports: set[tuple[int, int]] = field(default_factory=set)  # (rank, index) reported after seeing it
    forecast_told: bool = False  # the uploads-too-slow warning is said once
    through_peer: bool = False  # its checkpoint goes to a peer's memory first (controller/commits/peer.py)

    @classmethod
    def begin(cls, notice: m.NodeDraining, placement: dict[int, str], node_ids: list[str], reports: list[int],
              now: float, wall: float, grace_s: float,
              exited: Collection[int] = ()) -> "Preemption":
        """`placement`: rank -> node of the attempt; ranks in `exited` are gone already."""
        node_to_ranks: dict[str, list[int]] = {n: [] for n in node_ids}
        for rank, node in sorted(placement.items()):
            if node in node_to_ranks:
                node_to_ranks[node].append(rank)
        ranks = sorted(r for rs in node_to_ranks.values() for r in rs if r not in exited)
        return cls(notice=notice, ranks=ranks, node_ids=node_ids, noticed_at=wall,
                   deadline=now + window_s(notice, wall, grace_s), reports_at_notice=list(reports),
                   node_to_ranks=node_to_ranks)

    def widen(self, notice: m.NodeDraining, placement: dict[int, str], exited: Collection[int] = ()) -> list[str]:
        """Another drain while saving for this one (a whole Slurm job, drained node by node): its nodes of the
        attempt join this preemption, so that a rank told from now on hears of every node. Returns the nodes
        added."""
        added = [n for n in dict.fromkeys([notice.node_id, *notice.node_ids])
                 if n and n not in self.node_to_ranks and n in placement.values()]
        for node in added:
            self.node_ids.append(node)
            self.node_to_ranks[node] = sorted(r for r, n in placement.items() if n == node)
        self.ranks = sorted(r for rs in self.node_to_ranks.values() for r in rs if r not in exited)
        self.notice = msgspec.structs.replace(self.notice, until_commit=self.notice.until_commit or notice.until_commit)
        return added

    def tighten(self, notice: m.NodeDraining, now: float, wall: float, grace_s: float) -> float | None:
        """A second drain while saving for the first: the ranks already told keep their answer, but the
        attempt ends by the earlier deadline. Returns the new time left, if it is earlier."""
        if notice.deadline_unix_s is None:
            return None
        deadline = now + window_s(notice, wall, grace_s)
        if deadline >= self.deadline:
            return None
        self.deadline = deadline
        return deadline - now

    def saved_by(self, index: int, ranks_with_files: Iterable[int], watched: bool) -> bool:
        """Whether checkpoint `index` is the loop's answer to this notice. A loop that asks
        get_preemption_info() gets to save its just-in-time checkpoint: only one saved after the
        notice reached it counts. A loop that never asks has its first checkpoint reported after the
        notice count."""
        if watched:
            return all((r, index) in self.jit_reports for r in ranks_with_files)
        return all(index >= self.reports_at_notice[r] for r in ranks_with_files)

    def after_notice(self, rank: int, index: int) -> bool:
        """Whether report `index` of `rank` was made for this notice (its upload is the one that goes first)."""
        if (rank, index) in self.jit_reports:
            return True
        return rank < len(self.reports_at_notice) and index >= self.reports_at_notice[rank]

    def forecast(self, now: float, uploads: Estimate, latest: str | None) -> str | None:
        """Said once, as soon as the notice's checkpoint is known not to upload before the deadline."""
        left = self.deadline - now
        if self.forecast_told or uploads.seconds is None or uploads.seconds <= left:
            return None
        self.forecast_told = True
        how = "to reach a peer's memory" if self.through_peer else "to upload"
        return (f"the checkpoint saved for the preemption needs {uploads.seconds:.1f} s {how} "
                f"({uploads.reason}) and the deadline is in {left:.1f} s: unless the upload goes faster, the run "
                f"restarts from {latest or 'scratch'} at the deadline; restarting from it now would lose the same "
                f"steps and {left:.1f} s less of the node's time, but the rate is the last upload's, so the run "
                "waits for the deadline")

    def decide(self, now: float, saved: str | None, room_elsewhere: bool, uploads: Estimate | None = None) -> Verdict:
        """`uploads`: the notice's checkpoint uploads still in flight, for the reason at the deadline."""
        if now >= self.deadline:
            if uploads is not None and uploads.bytes_left > 0:
                left = uploads.reason if uploads.seconds is not None else \
                    f"{uploads.bytes_left / 1e6:.1f} MB left; {uploads.reason}"
                return Verdict(True, "the preemption deadline has passed with the checkpoint saved for it still "
                                     f"uploading: {left}")
            return Verdict(True, "the preemption deadline has passed")
        if saved is not None and room_elsewhere:
            return Verdict(True, f"checkpoint {saved}, saved after the notice, is committed and the run has room "
                                 "elsewhere")
        if saved is not None:
            return Verdict(False, f"checkpoint {saved} is committed, but no node that is not draining has room for "
                                  f"the run; it trains on until the deadline ({self.deadline - now:.1f} s) or until "
                                  "room appears")
        return Verdict(False, f"waiting {self.deadline - now:.1f} s for the loop to save a checkpoint")

    def as_failure(self, attempt: int) -> FailureRecord:
        n = self.notice
        when = f"deadline in {n.deadline_unix_s - self.noticed_at:.1f} s" if n.deadline_unix_s else "no deadline"
        return FailureRecord(
            attempt=attempt, rank=self.ranks[0] if self.ranks else 0, node_id=n.node_id, pid=0, exit_code=None,
            signal=None, time=self.noticed_at, kind=FailureKind.PREEMPTION,
            message=f"{_nodes(self.node_ids or [n.node_id])} draining ({n.reason}: {n.message}; {when})",
        )

    def notice_message(self, index: int, decision_index: int) -> m.PreemptionNotice:
        n = self.notice
        return m.PreemptionNotice(
            index=index, decision_index=decision_index, node_ids=self.node_ids, node_to_ranks=self.node_to_ranks,
            ranks=self.ranks, reason=n.reason, message=n.message,
            deadline_unix_ms=int(n.deadline_unix_s * 1000) if n.deadline_unix_s is not None else None,
            through_peer=self.through_peer)


def _nodes(ids: list[str]) -> str:
    return f"node {ids[0]} is" if len(ids) == 1 else f"nodes {', '.join(ids)} are"


def window_s(notice: m.NodeDraining, wall: float, grace_s: float) -> float:
    left = notice.deadline_unix_s - wall if notice.deadline_unix_s is not None else NO_DEADLINE_WINDOW_S
    return max(0.0, left + grace_s)
