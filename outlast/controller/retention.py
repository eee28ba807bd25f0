"""Which committed checkpoints `CheckpointConfig` lets go. Pure: records in, records out."""

from __future__ import annotations

import math
from dataclasses import dataclass

from outlast.storage.records import CheckpointRecord


@dataclass(frozen=True)
class RetentionRule:
    num_to_keep: int | None
    score_attribute: str | None
    score_order: str


def checkpoints_to_delete(
    records: list[CheckpointRecord],
    num_to_keep: int | None,
    score_attribute: str | None,
    score_order: str,
) -> list[CheckpointRecord]:
    """The latest checkpoint is always kept, since a restart restores it."""
    if num_to_keep is None or len(records) <= num_to_keep:
        return []
    latest = max(records, key=lambda r: r.seq)
    if score_attribute is None:
        ranked = sorted(records, key=lambda r: r.seq, reverse=True)
    else:
        sign = 1 if score_order == "max" else -1

        def score(r: CheckpointRecord) -> tuple[int, float, int]:
            value = r.metrics.get(score_attribute)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
                return (0, 0.0, r.seq)  # unscored checkpoints (NaN too) rank below every scored one
            return (1, sign * float(value), r.seq)

        ranked = sorted(records, key=score, reverse=True)
    keep = {r.checkpoint_dir for r in ranked[:num_to_keep]} | {latest.checkpoint_dir}
    return [r for r in records if r.checkpoint_dir not in keep]
