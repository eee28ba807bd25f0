"""What `get_preemption_info()` returns when the node of some ranks is going away."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PreemptionInfo:
    """The same on every rank, from the same call on.

    `deadline_ms` is the Unix time in milliseconds by which the preempted nodes go away
    (None when the notice gave no deadline). Save one checkpoint now and keep going:
    the run restarts from it on nodes that are not draining.
    """

    node_ids: list[str]
    ranks: list[int]
    deadline_ms: int | None
    reason: str
    message: str
    preempted_node_to_ranks: dict[str, list[int]] = field(default_factory=dict)

    # Ray Train's names for the same facts.
    @property
    def preempted_node_ids(self) -> list[str]:
        return sorted(self.preempted_node_to_ranks or self.node_ids)

    @property
    def preempted_ranks(self) -> list[int]:
        return sorted(self.ranks)
