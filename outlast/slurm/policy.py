"""What Slurm's signals and node states mean for the run (pure: state and time in, orders out).

- SIGUSR1 (from `sbatch --signal=B:USR1@N`, sent before the time limit and, with
  `SlurmctldParameters=preempt_send_user_signal`, at preemption): drain every node of the job
  with the deadline Slurm will enforce, then requeue the job once the checkpoint is committed.
- SIGTERM (`scancel`, and Slurm's own last word before a kill): not a preemption. Requeueing on
  it would bring a cancelled job back forever.
- A node of the job that an administrator drains (`scontrol update nodename=X state=drain`):
  drain it (reason maintenance; a deadline only if the reason names one), then requeue, since
  an allocation never grows back and a requeued job is placed on nodes that are not drained.
"""

from __future__ import annotations

import re
import signal

import msgspec

from outlast.slurm.scontrol import JobInfo, NodeState


class DrainOrder(msgspec.Struct, frozen=True, kw_only=True):
    node_ids: list[str]
    reason: str  # "preemption" | "maintenance": the reasons `outlast drain-node` knows
    message: str  # goes into the run's history with the preemption
    deadline_s: float | None  # seconds from now; None: Slurm named none
    requeue: bool  # requeue the job once the checkpoint that this drain asks for is committed


def on_signal(sig: signal.Signals, job: JobInfo, grace_s: float, nodes: list[str], restart_count: int,
              now: float) -> DrainOrder | None:
    """The answer to a signal the batch script got (None: not a preemption, only stop)."""
    if sig is not signal.SIGUSR1:
        return None
    if job.preempt_time is not None:
        deadline = job.preempt_time + grace_s - now
        cause = f"preempted (partition GraceTime {grace_s:.0f} s)"
    elif job.end_time is not None:
        deadline = job.end_time - now
        cause = "its time limit is near"
    else:
        deadline, cause = None, "no preemption or time limit in sight (sent by hand?)"
    return DrainOrder(
        node_ids=list(nodes), reason="preemption",
        message=f"Slurm job {job.job_id} (restart {restart_count}) got {sig.name}: {cause}",
        deadline_s=max(0.0, deadline) if deadline is not None else None, requeue=True,
    )


def on_node_states(states: list[NodeState], job_nodes: list[str], already: set[str], job_id: str,
                   restart_count: int, now: float) -> list[DrainOrder]:
    """One order per node of the job that Slurm shows draining and that was not drained before."""
    mine = set(job_nodes) - already
    return [
        DrainOrder(node_ids=[s.name], reason="maintenance",
                   message=f"Slurm job {job_id} (restart {restart_count}): node {s.name} drained by an "
                           f"administrator ({s.reason or 'no reason'})",
                   deadline_s=deadline_from_reason(s.reason, s.reason_set_at, now), requeue=True)
        for s in states if s.name in mine and s.draining
    ]


_DEADLINE = re.compile(r"\b(?:deadline\s*[=:]?\s*|in\s+)(\d+(?:\.\d+)?)\s*(s|sec|secs|seconds?|m|mins?|minutes?|h|"
                       r"hours?)?\b", re.IGNORECASE)
_UNIT_S = {"s": 1, "m": 60, "h": 3600}


def deadline_from_reason(reason: str, set_at: float | None, now: float) -> float | None:
    """`deadline=300`, `deadline 5m`, `in 2h` in a drain reason: seconds left from now, counted from
    when the administrator set it (None: the reason names no deadline)."""
    m = _DEADLINE.search(reason)
    if m is None:
        return None
    seconds = float(m.group(1)) * _UNIT_S[(m.group(2) or "s")[0].lower()]
    start = set_at if set_at is not None else now
    return max(0.0, start + seconds - now)


def failure_domain(features: list[str], prefix: str) -> str:
    """The node's failure domain: its first feature that starts with `prefix` ("" for none)."""
    return next((f for f in features if prefix and f.startswith(prefix)), "")


class AfterDrain(msgspec.Struct, frozen=True, kw_only=True):
    """What the job's nodes show some time after a drain went out."""

    now: float
    drained_at: float
    drained: frozenset[str]  # nodes of the job drained so far
    job_nodes: frozenset[str]
    had_workers: bool  # the run had workers when the first drain went out
    workers_on: frozenset[str]  # nodes with workers now
    drain_saves: tuple[float, ...]  # when the checkpoint the run saved for the drain committed, as the agents know it
    idle_since: float | None  # since when no node has had workers (None: some have now)
    deadline: float | None  # Slurm's, wall clock


def after_drain(s: AfterDrain, margin_s: float = 3.0, idle_s: float = 3.0) -> tuple[str, str]:
    """("requeue" | "moved" | "wait", why). The job is requeued when nowhere in the allocation is left
    to train: every node drained and the checkpoint committed (or the run stopped), or a run that has
    stayed without workers; a run that moved to the allocation's other nodes goes on there."""
    if not s.had_workers:
        return "requeue", "the run had no workers when the drain came: nothing to save"
    if s.deadline is not None and s.now >= s.deadline - margin_s:
        return "requeue", "Slurm's deadline is near: the job resumes from the latest committed checkpoint"
    if s.drained >= s.job_nodes:
        if any(t >= s.drained_at for t in s.drain_saves):
            return "requeue", "the checkpoint asked for at the drain is committed"
        if not s.workers_on:
            return "requeue", "the run stopped its workers for the drain"
        return "wait", "every node is draining; waiting for the checkpoint"
    if s.workers_on and not (s.workers_on & s.drained):
        return "moved", f"the run goes on on {', '.join(sorted(s.workers_on))}, nodes that are not drained"
    if s.idle_since is not None and s.now - s.idle_since >= idle_s:
        return "requeue", f"the run has had no workers for {s.now - s.idle_since:.0f} s: it waits for capacity"
    return "wait", "the run still has workers on drained nodes, or is between attempts"
