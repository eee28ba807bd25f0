"""What must hold of every simulated fleet run, whatever its mechanisms: each a sentence when broken."""

from __future__ import annotations

from outlast.sim.fleet import WALL0, FleetRun

TOLERANCE_S = 1e-3


def violations(run: FleetRun, days: float) -> list[str]:
    out: list[str] = []
    g, state = run.goodput, run.state
    whole = days * 86_400.0
    parts = sum(g.parts().values())
    if abs(parts - g.held_s) > TOLERANCE_S or abs(g.held_s - whole) > TOLERANCE_S * max(1.0, whole / 86_400):
        out.append(f"goodput's parts add up to {parts:.3f} s, held {g.held_s:.3f} s, the run lasted {whole:.3f} s")
    # Every interruption that struck is charged to its budget: a failure, a hang or a lost node to max_failures,
    # a drain to max_preemption_failures; nothing else is charged.
    worker = sum(run.struck.get(k, 0) for k in ("rank_dies", "node_lost", "hang"))
    want = {k: v for k, v in (("worker", worker), ("preemption", run.struck.get("drain", 0))) if v}
    if run.budgets != want:
        out.append(f"budgets charged {run.budgets}, the interruptions that struck call for {want}")
    # Nothing committed is lost: each attempt restores the newest checkpoint committed before it began.
    committed = sorted((c.committed_at, c.seq, c.checkpoint_dir) for c in state.checkpoints)
    for a in state.attempts[1:]:
        before = [c for c in committed if c[0] <= a.started_at + TOLERANCE_S]
        newest = before[-1][2] if before else None
        if a.restored_from != newest:
            out.append(f"attempt {a.attempt} began at {a.started_at - WALL0:.1f} s and restored {a.restored_from}, "
                       f"but {newest} was the newest committed checkpoint")
    if any(x.ended_at is None or y.started_at != x.ended_at for x, y in zip(state.attempts, state.attempts[1:])):
        out.append("an attempt does not begin where the one before it ended")
    if not run.progress >= g.steps:
        out.append(f"{g.steps} productive steps, but the run reached only {run.progress}")
    return out
