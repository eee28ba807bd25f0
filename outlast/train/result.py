from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from outlast.train.checkpoint import Checkpoint


@dataclass
class Result:
    metrics: dict[str, Any] | None
    checkpoint: Checkpoint | None
    path: str
    error: BaseException | None = None
    best_checkpoints: list[tuple[Checkpoint, dict[str, Any]]] = field(default_factory=list)
