"""The kills of bench/live_recovery_kills.py, and what its runs' events say of them: the pure part.

A plan names each kill: the step, the rank, the phase of the step it lands in, and how far into that
phase (a fraction of the phase's usual length on the victim). The loop (bench/lib/live_kill_loop.py)
carries it out on the victim itself and appends a "kill" event with the phase it found itself in at
the instant of the kill. From the runs' events this module reads each kill's steps lost:
- live: the steps that the surviving processes threw away after the kill, by their own count;
- restart (live recovery off): the steps applied since the checkpoint the restarted group restored,
  and the one in flight, all trained again.
Standard library only: the workers import it.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import asdict, dataclass

# The phases of a step, in the order the loop runs them. "checkpoint" is rank 0's report that uploads a
# checkpoint (its save and upload); "report" a report of metrics alone.
PHASES = ("forward", "backward", "allreduce", "optimizer", "report", "checkpoint")


@dataclass(frozen=True)
class Kill:
    index: int
    step: int
    rank: int
    phase: str
    fraction: float  # of the phase's usual length on the victim, before the SIGKILL


def plan(kills: int, every: int, ranks: int, seed: int, first: int = 20, ckpt_every: int = 0,
         phases: tuple[str, ...] = PHASES) -> list[Kill]:
    """`kills` kills, the i-th in the i-th window of `every` steps from step `first`, their phases taken in
    turn from `phases` (so each phase gets its share), the ranks in turn. A checkpoint kill lands on rank 0
    (the rank that uploads) at a step that reports a checkpoint, so it needs `ckpt_every` <= `every`."""
    if every < 1 or kills < 0 or ranks < 1:
        raise ValueError(f"plan needs every >= 1, kills >= 0, ranks >= 1; got every={every}, kills={kills}, "
                         f"ranks={ranks}")
    if "checkpoint" in phases and not 0 < ckpt_every <= every:
        raise ValueError(f"a checkpoint kill needs a checkpoint in each window of {every} steps: "
                         f"ckpt_every={ckpt_every}; drop 'checkpoint' from the phases or checkpoint more often")
    unknown = set(phases) - set(PHASES)
    if unknown:
        raise ValueError(f"unknown phases {sorted(unknown)}: the loop has {PHASES}")
    rng = random.Random(seed)
    out: list[Kill] = []
    for i in range(kills):
        start = first + every * i
        phase = phases[i % len(phases)]
        if phase == "checkpoint":
            # The window's steps that report a checkpoint: (step + 1) % ckpt_every == 0.
            step = rng.choice([s for s in range(start, start + every) if (s + 1) % ckpt_every == 0])
            rank = 0
        else:
            # Not a checkpoint step: there rank 0's report is the checkpoint's.
            step = rng.choice([s for s in range(start, start + every)
                               if not ckpt_every or (s + 1) % ckpt_every != 0] or [start])
            rank = (i // len(phases) + i) % ranks
        out.append(Kill(i, step, rank, phase, round(rng.random(), 4)))
    return out


def as_config(kills: list[Kill]) -> list[dict]:
    return [asdict(k) for k in kills]


def _windows(events: list[dict]) -> list[tuple[dict, float]]:
    """Each kill event with the time of the next one (inf for the last)."""
    kills = sorted((e for e in events if e["ev"] == "kill"), key=lambda e: e["t"])
    ends = [k["t"] for k in kills[1:]] + [float("inf")]
    return list(zip(kills, ends))


def live_losses(events: list[dict]) -> list[dict]:
    """Per kill of a live run: the steps each surviving process (one whose start came before the kill,
    other than the victim) threw away between this kill and the next, and the seconds from the kill to the
    first step applied by a process started since."""
    started = [(e["t"], e["pid"]) for e in events if e["ev"] == "start"]
    out = []
    for kill, end in _windows(events):
        alive = {pid for t, pid in started if t < kill["t"]} - {kill["pid"]}
        thrown: dict[int, set[int]] = {}
        for e in events:
            if e["ev"] == "thrown" and e["pid"] in alive and kill["t"] < e["t"] < end:
                thrown.setdefault(e["pid"], set()).add(e["step"])
        counts = sorted({len(s) for s in thrown.values()}) or [0]
        # Every other rank applied a step after the kill in the process it ran before it: none was restarted.
        ranks = {e["rank"] for e in events if e["ev"] == "start"} - {kill["rank"]}
        kept = {e["rank"] for e in events if e["ev"] == "step" and e["pid"] in alive and kill["t"] < e["t"] < end}
        out.append({**_kill_fields(kill), "steps_lost": max(counts), "survivors_agree": len(counts) == 1,
                    "survivor_pids_kept": ranks <= kept,
                    "kill_to_training_s": _to_training(events, kill, end, alive)})
    return out


def restart_losses(events: list[dict]) -> list[dict]:
    """Per kill of a run without live recovery: the steps the killed attempt applied since the checkpoint that
    the next attempt restored, and the step in flight (the first step the next attempt runs is the one after
    the checkpoint)."""
    out = []
    for kill, end in _windows(events):
        attempt = kill["attempt"]
        applied = [e["step"] for e in events if e["ev"] == "step" and e["attempt"] == attempt]
        resumed = [e["step"] for e in events if e["ev"] == "start" and e["attempt"] == attempt + 1]
        if not resumed:
            out.append({**_kill_fields(kill), "steps_lost": None, "kill_to_training_s": None})
            continue
        # max(applied) + 1 is the step in flight; the next attempt trains again from min(resumed).
        lost = (max(applied) + 1 if applied else 0) - min(resumed) + 1
        before = {e["pid"] for e in events if e["ev"] == "start" and e["t"] < kill["t"]}
        out.append({**_kill_fields(kill), "steps_lost": lost, "restored_step": min(resumed) - 1,
                    "kill_to_training_s": _to_training(events, kill, end, before, new_only=True)})
    return out


def _kill_fields(kill: dict) -> dict:
    return {k: kill[k] for k in ("index", "step", "rank", "phase", "hit_phase", "hit_step", "attempt", "load1")
            if k in kill}


def _to_training(events: list[dict], kill: dict, end: float, before: set[int], new_only: bool = False) -> float | None:
    """From the kill to the first step applied after it by a process started since (the replacement, or the
    restarted group)."""
    firsts = [e["t"] for e in events if e["ev"] == "step" and kill["t"] < e["t"] < end
              and e["pid"] not in before and e["pid"] != kill["pid"]]
    return round(min(firsts) - kill["t"], 4) if firsts else None


def by_phase(losses: list[dict], key: str = "hit_phase") -> dict[str, dict[str, int]]:
    """The kills' steps lost counted per phase the kill landed in (`key` "phase": the phase planned):
    {"allreduce": {"0": 3, "1": 30}, ...}."""
    out: dict[str, dict[str, int]] = {}
    for k in losses:
        cell = out.setdefault(k.get(key, k["phase"]), {})
        key = "unknown" if k["steps_lost"] is None else str(k["steps_lost"])
        cell[key] = cell.get(key, 0) + 1
    return {p: dict(sorted(c.items())) for p, c in sorted(out.items(), key=lambda pc: _phase_order(pc[0]))}


def _phase_order(phase: str) -> int:
    return PHASES.index(phase) if phase in PHASES else len(PHASES)


def counts(values: list[int | None]) -> dict[str, int]:
    """{"0": n, "1": n, "2+": n, "unknown": n}: how many kills lost how many steps."""
    out = {"0": 0, "1": 0, "2+": 0, "unknown": 0}
    for v in values:
        out["unknown" if v is None else str(v) if v < 2 else "2+"] += 1
    return out


def training_span(events: list[dict], rank: int = 0) -> dict:
    """From rank `rank`'s first applied step to its last, in whichever processes ran it: the training's wall
    time, start-up left out (it is the same with failures and without)."""
    steps = [e for e in events if e["ev"] == "step" and e["rank"] == rank]
    if not steps:
        return {"steps": 0, "wall_s": None}
    t = [e["t"] for e in steps]
    return {"steps": len({e["step"] for e in steps}), "last_step": max(e["step"] for e in steps),
            "wall_s": round(max(t) - min(t), 3)}


def efficiency(clean_wall_s: float, killed_wall_s: float) -> float:
    """Useful steps over wall time with failures, against the same steps without: both runs apply the same
    steps, so it is the ratio of their wall times."""
    return round(clean_wall_s / killed_wall_s, 4)


def efficiency_bound(every: int, steps_lost: float) -> float:
    """The most a run can reach with a kill every `every` applied steps when each kill costs `steps_lost`
    steps' time and recovers in no time: every / (every + steps_lost)."""
    return round(every / (every + steps_lost), 4)


def summary(xs: list[float], digits: int = 3) -> dict | None:
    xs = [x for x in xs if x is not None]
    return {"median": round(statistics.median(xs), digits), "min": round(min(xs), digits),
            "max": round(max(xs), digits), "n": len(xs)} if xs else None
