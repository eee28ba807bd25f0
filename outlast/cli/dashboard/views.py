"""What each page shows, worked out from the run's history and rank 0's reports: pure, no I/O.

The pages draw these documents as they are (`static/app.js`, `static/run.js`): every number on a page is one
worked out here, so the tests of this module are the tests of what the dashboard says.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from outlast.protocol import messages as m
from outlast.storage import goodput
from outlast.storage.records import AttemptRecord, FailureRecord, Manifest, ReportEntry, RunState, signal_name


def failure_view(f: FailureRecord) -> dict[str, Any]:
    if f.oom_report:
        cause = "killed for memory"
    elif f.named:
        cause = f"{f.named}: {f.message}" if f.message else f.named
    elif f.signal is not None:
        cause = f"killed by {signal_name(f.signal)}"
    else:
        cause = f"exit code {f.exit_code}"
    return {"attempt": f.attempt, "rank": f.rank, "node_id": f.node_id, "pid": f.pid, "time": f.time,
            "cause": cause, "signal": signal_name(f.signal) if f.signal is not None else None,
            "exit_code": f.exit_code, "exc_type": f.exc_type, "kind": f.kind, "message": f.message,
            "traceback": f.traceback, "phase": f.phase, "oom_report": f.oom_report}


def _number(v: Any) -> float | None:
    """A number to draw, NaN and infinities included: a diverging loss must show (app.py sends them by name)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def series(state: RunState, reports: dict[int, list[ReportEntry]]) -> dict[str, Any]:
    """Every numeric metric of rank 0's reports, one point per report, on two x axes.

    `step` is the report's own "step" metric when it has one; otherwise the count of reports
    the run's line had made by then, where an attempt's line goes on from the checkpoint it
    restored (so a restart draws over the steps it lost, as the training did)."""
    position: dict[tuple[int, int], int] = {}  # (attempt, index) -> the report's place in the run's line
    by_dir = {c.checkpoint_dir: c for c in state.checkpoints}
    out: dict[str, Any] = {"time": [], "step": [], "attempt": [], "index": [], "values": {}}
    for a in state.attempts:
        base = 0
        restored = by_dir.get(a.restored_from or "")
        if restored is not None:
            base = position.get((restored.attempt, restored.report_index), restored.report_index) + 1
        for r in reports.get(a.attempt, []):
            position[(a.attempt, r.index)] = base + r.index
            own = _number(r.metrics.get("step"))
            own = own if own is not None and math.isfinite(own) else None
            i = len(out["time"])
            out["time"].append(r.time)
            out["step"].append(own if own is not None else base + r.index)
            out["attempt"].append(a.attempt)
            out["index"].append(r.index)
            values = out["values"]
            for k, v in r.metrics.items():
                x = _number(v)
                if x is not None:
                    if k not in values:
                        values[k] = [None] * i
                    values[k].append(x)
            for col in values.values():
                if len(col) < i + 1:
                    col.append(None)
    out["names"] = sorted(out["values"])
    return out


def steps_lost(state: RunState, reports: dict[int, list[ReportEntry]]) -> dict[int, int]:
    """Attempt -> the reports of the attempt before it made after the checkpoint it restored."""
    by_dir = {c.checkpoint_dir: c for c in state.checkpoints}
    lost: dict[int, int] = {}
    for prev, a in zip(state.attempts, state.attempts[1:]):
        made = len(reports.get(prev.attempt, []))
        restored = by_dir.get(a.restored_from or "")
        kept = restored.report_index + 1 if restored is not None and restored.attempt == prev.attempt else 0
        lost[a.attempt] = max(0, made - kept)
    for r in state.resizes:  # the resize's own count, taken when it happened
        lost[r.attempt] = r.steps_lost
    return lost


def _attempt_view(a: AttemptRecord, lost: dict[int, int], reports: int, now: float) -> dict[str, Any]:
    return {"attempt": a.attempt, "start": a.started_at, "end": a.ended_at, "drawn_to": a.ended_at or now,
            "outcome": a.outcome or ("running" if a.ended_at is None else "-"), "workers": a.workers,
            "restored_from": a.restored_from, "failures": [failure_view(f) for f in a.failures],
            "ranks": sorted({o.rank for o in a.outputs}), "steps_lost": lost.get(a.attempt, 0), "reports": reports}


def run_view(state: RunState, location: str, reports: dict[int, list[ReportEntry]], now: float) -> dict[str, Any]:
    lost = steps_lost(state, reports)
    latest = state.latest_checkpoint
    return {
        "name": state.name, "location": location, "status": state.status, "error": state.error,
        "waiting_for": state.waiting_for, "created_at": state.created_at, "updated_at": state.updated_at,
        "now": now, "failure_counts": state.failure_counts,
        "last_metrics": state.last_metrics or _last_report(reports),
        "attempts": [_attempt_view(a, lost, len(reports.get(a.attempt, [])), now) for a in state.attempts],
        "drains": [{"attempt": d.attempt, "start": d.time, "deadline": d.deadline, "node_ids": d.node_ids,
                    "reason": d.reason, "message": d.message, "ranks": d.ranks} for d in state.drains],
        "checkpoints": [{"dir": c.checkpoint_dir, "seq": c.seq, "attempt": c.attempt, "report_index": c.report_index,
                         "time": c.committed_at, "metrics": c.metrics, "latest": c.checkpoint_dir == latest,
                         "durable": c.durable, "memory": c.memory, "memory_at": c.memory_at}
                        for c in sorted(state.checkpoints, key=lambda c: c.seq)],
        "restores": [{"attempt": a.attempt, "time": a.started_at, "from": a.restored_from}
                     for a in state.attempts if a.restored_from],
        "resizes": [{"attempt": r.attempt, "time": r.time, "from": r.from_workers, "to": r.to_workers,
                     "reason": r.reason, "steps_lost": r.steps_lost} for r in state.resizes],
        "skipped": [{"dir": s.checkpoint_dir, "reason": s.reason, "time": s.time} for s in state.skipped_checkpoints],
        "hangs": [{"attempt": h.attempt, "time": h.time, "summary": h.summary,
                   "stacks": [{"ranks": g.ranks, "where": g.where, "text": g.text} for g in h.stacks]}
                  for h in state.hangs],
        "notes": [{"time": n.time, "text": n.text} for n in state.notes],
        "series": series(state, reports),
        "goodput": goodput_view(goodput.split(state, reports, now)),
    }


def goodput_view(g: goodput.Goodput) -> dict[str, Any]:
    """The bar beside the timeline: each part's seconds and label, in the order shown (docs/guide/watching.md)."""
    return {"held_s": g.held_s, "fraction": g.fraction, "steps": g.steps, "replayed_steps": g.replayed_steps,
            "complete": g.complete,
            "parts": [{"part": p, "label": goodput.LABELS[p], "seconds": s} for p, s in g.parts().items()]}


def _last_report(reports: dict[int, list[ReportEntry]]) -> dict[str, Any] | None:
    """While a run trains, its history has no last metrics yet: its newest report's stand in."""
    newest = [r[-1] for r in reports.values() if r]
    return max(newest, key=lambda r: r.time).metrics if newest else None


def checkpoint_view(manifest: Manifest) -> dict[str, Any]:
    return {"dir": manifest.checkpoint_dir, "files": len(manifest.files), "bytes": sum(f.size for f in manifest.files),
            "ranks": manifest.ranks, "metrics": manifest.metrics,
            "checksum": sorted({f.checksum[0] for f in manifest.files})}


def _node_view(n: m.NodeInfo, status: m.StatusReply | None, why_not: str | None, now: float) -> dict[str, Any]:
    d = n.draining
    out: dict[str, Any] = {
        "node_id": n.node_id, "address": n.address, "state": n.state, "is_head": n.is_head,
        "resources": n.resources, "used": n.used, "labels": n.labels, "failure_domain": n.failure_domain,
        "last_seen": n.last_seen_unix, "silent_s": max(0.0, now - n.last_seen_unix) if n.last_seen_unix else None,
        "draining": None if d is None else {
            "reason": d.reason, "message": d.message, "deadline": d.deadline_unix_s, "node_ids": d.node_ids,
            "left_s": None if d.deadline_unix_s is None else d.deadline_unix_s - now},
        "status_error": why_not, "workers": [], "isolation": None, "kills": [],
    }
    if status is not None:
        out["workers"] = [{"run_id": w.run_id, "attempt": w.attempt, "rank": w.rank, "pid": w.pid,
                           "rss_bytes": w.rss_bytes, "memory_bytes": w.memory_bytes,
                           "reserved_memory": w.resources.memory_bytes} for w in status.workers]
        if status.isolation is not None:
            i = status.isolation
            out["isolation"] = {"cgroup_version": i.cgroup_version, "user_limit": i.user_limit,
                                "counted_memory": i.counted_memory, "total_memory": i.total_memory,
                                "system_reserved_memory": i.system_reserved_memory, "kills": i.kills}
        out["kills"] = [{"time": k.time, "trigger": k.trigger, "policy": k.policy, "reason": k.reason,
                         "selected": k.selected, "usage_bytes": k.usage_bytes, "limit_bytes": k.limit_bytes,
                         "target_bytes": k.target_bytes,
                         "considered": msgspec.to_builtins(k.considered)} for k in status.recent_kills]
    return out


def cluster_view(nodes: list[m.NodeInfo], statuses: dict[str, m.StatusReply | str], now: float,
                 reached_through: str) -> dict[str, Any]:
    """The head's node table, each node with what its own agent said (or why it could not be asked)."""
    rows = []
    for n in nodes:
        got = statuses.get(n.node_id)
        rows.append(_node_view(n, got if isinstance(got, m.StatusReply) else None,
                               got if isinstance(got, str) else None, now))
    return {"now": now, "reached_through": reached_through, "nodes": rows,
            "counts": {s: sum(n.state == s for n in nodes) for s in ("alive", "draining", "dead")}}
