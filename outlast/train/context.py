"""What a worker knows about itself: `outlast.train.get_context()`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainContext:
    world_rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    experiment_name: str
    attempt: int
    storage_path: str

    def get_world_rank(self) -> int:
        return self.world_rank

    def get_world_size(self) -> int:
        return self.world_size

    def get_local_rank(self) -> int:
        return self.local_rank

    def get_local_world_size(self) -> int:
        return self.local_world_size

    def get_node_rank(self) -> int:
        return self.node_rank

    def get_experiment_name(self) -> str:
        return self.experiment_name

    def get_attempt(self) -> int:
        """1 for the first attempt, one more after each restart."""
        return self.attempt

    def get_storage_path(self) -> str:
        return self.storage_path
