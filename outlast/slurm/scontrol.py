"""Reading `scontrol show node|job|partition -o` (pure): one record a line, `Key=Value` pairs.

Values may hold spaces (`OS=Linux 6.1 #1 SMP`) and `=` (`TRES=cpu=2,node=2`); keys are the
words that follow a space and start with a capital letter. A node's `Reason` comes last and
is free text, so everything after it is the reason (a job's `Reason` is one word).
"""

from __future__ import annotations

import re
from datetime import datetime

import msgspec

_KEY = re.compile(r"(?:^|\s)([A-Z][A-Za-z0-9:/_]*)=")


def parse_record(line: str) -> dict[str, str]:
    line = line.strip()
    reason = None
    head, sep, tail = line.partition(" Reason=")
    if sep and line.startswith("NodeName="):  # a job's Reason is one word, in the middle
        line, reason = head, tail.strip()
    keys = list(_KEY.finditer(line))
    out = {}
    for k, nxt in zip(keys, keys[1:] + [None]):
        out[k.group(1)] = line[k.end():nxt.start() if nxt else len(line)].strip()
    if reason is not None:
        out["Reason"] = reason
    return out


def parse_records(text: str) -> list[dict[str, str]]:
    return [parse_record(line) for line in text.splitlines() if "=" in line]


def parse_time(text: str) -> float | None:
    """Slurm's local `2026-11-30T14:14:19` as Unix time; None for Unknown, None, N/A."""
    try:
        return datetime.strptime(text.strip(), "%Y-%m-%dT%H:%M:%S").timestamp()
    except ValueError:
        return None


class NodeState(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    states: frozenset[str]  # ALLOCATED, DRAIN, DOWN, NOT_RESPONDING, ...
    addr: str = ""
    features: list[str] = []
    reason: str = ""
    reason_set_at: float | None = None  # when the administrator set the reason

    @property
    def draining(self) -> bool:
        return "DRAIN" in self.states

    @property
    def down(self) -> bool:
        return bool(self.states & {"DOWN", "FAIL", "NOT_RESPONDING"})


def node_states(text: str) -> list[NodeState]:
    out = []
    for rec in parse_records(text):
        if "NodeName" not in rec:
            continue
        reason, set_at = rec.get("Reason", ""), None
        m = re.fullmatch(r"(.*?)\s*\[[^@\]]*@([0-9T:-]+)\]", reason)
        if m:
            reason, set_at = m.group(1), parse_time(m.group(2))
        features = rec.get("ActiveFeatures") or rec.get("AvailableFeatures") or ""
        out.append(NodeState(
            name=rec["NodeName"], states=frozenset(s.rstrip("*~#!%$@^-") for s in re.split(r"[+]", rec.get("State", ""))
                                                   if s),
            addr=rec.get("NodeAddr", ""), features=[f for f in features.split(",") if f and f != "(null)"],
            reason=reason, reason_set_at=set_at,
        ))
    return out


class JobInfo(msgspec.Struct, frozen=True, kw_only=True):
    job_id: str
    state: str
    partition: str
    restarts: int
    end_time: float | None  # None: no time limit
    preempt_time: float | None  # set once the job is chosen for preemption


def job_info(text: str) -> JobInfo:
    recs = [r for r in parse_records(text) if "JobId" in r]
    if not recs:
        raise ValueError(f"no job in scontrol's answer: {text.strip()[:200]!r}")
    r = recs[0]
    return JobInfo(job_id=r["JobId"], state=r.get("JobState", ""), partition=r.get("Partition", ""),
                   restarts=int(r.get("Restarts", "0") or 0), end_time=parse_time(r.get("EndTime", "")),
                   preempt_time=parse_time(r.get("PreemptTime", "")))


def partition_grace_s(text: str) -> float:
    """The partition's GraceTime: how long Slurm lets a preempted job run on (seconds)."""
    for r in parse_records(text):
        if "PartitionName" in r:
            g = r.get("GraceTime", "0")
            return float(g) if g.isdigit() else 0.0
    return 0.0


def leaf_switches(text: str) -> dict[str, str]:
    """node -> its leaf switch (Level=0) in `scontrol show topology` (topology/tree): a failure domain."""
    from outlast.slurm.allocation import expand_hostlist

    out: dict[str, str] = {}
    for rec in parse_records(text):
        if rec.get("Level") == "0" and rec.get("SwitchName") and rec.get("Nodes"):
            for node in expand_hostlist(rec["Nodes"]):
                out.setdefault(node, rec["SwitchName"])
    return out
