"""The kinds outlast gives a failure, the budgets a failed attempt is charged to, and the kinds of workload.

A failure record's `kind` is one of `FailureKind`, set by outlast alone; its `exc_type` is only
ever the name of the exception a rank raised. Both enums are `StrEnum`s whose values are the
spellings histories already hold: run states of version 1 kept a kind in `exc_type`, and are read
with it moved to `kind` (`records._kinds_apart`); `RunState.failure_counts` is keyed by `Budget`.
"""

from __future__ import annotations

import enum
import sys

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # Python 3.10 has no enum.StrEnum: the same behaviour, a member is its string to str() and format()

    class StrEnum(str, enum.Enum):
        def __str__(self) -> str:
            return str.__str__(self)

        def __format__(self, format_spec: str) -> str:
            return str.__format__(self, format_spec)


class FailureKind(StrEnum):
    NODE_LOST = "NodeLost"  # the rank's node went away (its agent is gone or silent)
    PREEMPTION = "Preemption"  # the attempt ended for a drain: one record for the attempt, about a node
    SPAWN_REFUSED = "SpawnRefused"  # a node turned the attempt's workers away (it began draining)
    HANG = "Hang"  # a rank made no progress for the hang timeout
    FORK_SERVER_DIED = "ForkServerDied"  # the node's fork server died, and its workloads with it
    CORRUPT_CHECKPOINT = "CorruptCheckpointError"  # the checkpoint to restore does not verify
    UNKILLABLE = "Unkillable"  # a workload SIGKILL did not end, given up by its node
    REFUSED_MESSAGE = "RefusedMessage"  # a rank sent the controller a message that does not decode (a bad path)


# Kinds about a node, not about one process of the user's.
NODE_KINDS = frozenset({FailureKind.PREEMPTION, FailureKind.SPAWN_REFUSED})


class Budget(StrEnum):
    """What a failed attempt is charged to (`RunState.failure_counts`)."""

    WORKER = "worker"  # FailureConfig.max_failures
    PREEMPTION = "preemption"  # FailureConfig.max_preemption_failures
    PLACEMENT = "placement"  # a node refused the spawn: charged to nothing that ends the run
    CORRUPT_CHECKPOINT = "corrupt_checkpoint"  # the restore fell back to an older checkpoint
    DRIVER = "driver"  # the driver died mid-attempt (counted, never limited)
    SETUP = "setup"  # outlast's own set-up failed (the ranks could not meet): a small budget of its own


class WorkloadKind(StrEnum):
    """What a workload on a node is, for the kill policy and its reports."""

    TRAINING = "training"  # a rank of a training run: killing one restarts the whole run from its last commit
    TASK = "task"  # an executor task: killing it loses that task's work alone
