"""`python -m outlast.sim --seeds N [--start K] [--jobs J] [--elastic] [--edges] [--tier] [--live]`: run N schedules, print
one JSON line, exit 1 on a violation (printing each failing seed's trace). `--seed S` replays one schedule and prints its
trace.
`python -m outlast.sim fleet ...`: a fleet's months, with each mechanism on and off (`fleet --help`).
`python -m outlast.sim check-model RUN_DIR [--json]`: the fleet model replaying a real run, against its goodput."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from outlast.sim.run import quiet, run_seed
from outlast.sim.schedule import draw, draw_live


def _run_range(bounds: tuple[int, int, bool, bool, bool, bool]) -> list[tuple[int, list[str], str, dict[str, int]]]:
    quiet()
    out = []
    for seed in range(bounds[0], bounds[1]):
        o = run_seed(seed, elastic=bounds[2], edges=bounds[3], tier=bounds[4], live=bounds[5])
        out.append((seed, o.violations, o.status, o.facts))
    return out


def run_many(start: int, count: int, jobs: int, elastic: bool = False, edges: bool = False,
             tier: bool = False, live: bool = False) -> dict:
    began = time.perf_counter()
    chunk = max(1, min(500, count // (jobs * 4) or 1))
    ranges = [(s, min(s + chunk, start + count), elastic, edges, tier, live)
              for s in range(start, start + count, chunk)]
    if jobs > 1:
        with ProcessPoolExecutor(jobs) as pool:
            results = [r for part in pool.map(_run_range, ranges) for r in part]
    else:
        results = [r for part in map(_run_range, ranges) for r in part]
    elapsed = time.perf_counter() - began
    failing = [(seed, v) for seed, v, _, _ in results if v]
    statuses: dict[str, int] = {}
    totals: dict[str, int] = {}
    for _, _, status, facts in results:
        statuses[status] = statuses.get(status, 0) + 1
        for k, v in facts.items():
            totals[k] = totals.get(k, 0) + v
    return {"schedules": len(results), "violations": sum(len(v) for _, v in failing),
            "failing_seeds": [seed for seed, _ in failing][:50], "schedules_per_s": round(len(results) / elapsed, 1),
            "elapsed_s": round(elapsed, 2), "jobs": jobs, "edges": edges, "tier": tier, "live": live, "outcomes": statuses,
            "totals": totals,
            "first_violation": failing[0][1][0] if failing else None}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["fleet"]:
        from outlast.sim.fleet_command import main as fleet
        return fleet(argv[1:])
    if argv[:1] == ["check-model"]:
        from outlast.sim.model_check import main as check_model
        return check_model(argv[1:])
    p = argparse.ArgumentParser(prog="python -m outlast.sim", description=__doc__)
    p.add_argument("--seeds", type=int, help="how many schedules to run")
    p.add_argument("--start", type=int, default=0, help="the first seed")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes to run them in")
    p.add_argument("--seed", type=int, help="replay one schedule, printing its trace")
    p.add_argument("--elastic", action="store_true", help="each schedule as an elastic run, with nodes that join")
    p.add_argument("--edges", action="store_true",
                   help="add failures during drains and grows, Ctrl+C and lease loss, unkillable ranks, ranks' "
                        "children and messages lost at a rank's exit; probe every state with every message")
    p.add_argument("--tier", action="store_true",
                   help="memory tiers on the nodes, the run keeping checkpoints in storage or in memory only, with "
                        "budgets that evict, copies corrupted in RAM and the nodes holding a checkpoint lost")
    p.add_argument("--live", action="store_true",
                   help="runs with live recovery: ranks that run its step commit against the controller, killed at "
                        "each point of a step, two at once, and in their transfer, their nodes drained, and elastic "
                        "runs grown (outlast/sim/live.py)")
    args = p.parse_args(argv)
    if args.seed is not None:
        quiet()
        o = run_seed(args.seed, trace=True, elastic=args.elastic, edges=args.edges, tier=args.tier, live=args.live)
        schedule = draw_live(args.seed) if args.live else draw(args.seed, args.elastic, edges=args.edges, tier=args.tier)
        print(f"schedule: {schedule}")
        print("\n".join(o.trace))
        print(json.dumps({"seed": o.seed, "status": o.status, "virtual_s": round(o.virtual_s, 3),
                          "violations": o.violations}))
        return 1 if o.violations else 0
    if args.seeds is None:
        p.error("give --seeds N (run N schedules) or --seed S (replay one)")
    summary = run_many(args.start, args.seeds, max(1, args.jobs), args.elastic, args.edges, args.tier, args.live)
    print(json.dumps(summary))
    if summary["violations"]:
        for seed in summary["failing_seeds"][:3]:
            flags = "".join(f" --{k}" for k in ("elastic", "edges", "tier", "live") if getattr(args, k))
            print(f"--- seed {seed} fails; replay with: python -m outlast.sim --seed {seed}{flags}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
