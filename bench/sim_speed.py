"""The simulator's speed: schedules a second of `python -m outlast.sim --seeds N --jobs 1`, for one or more
source trees of outlast (this one, and e.g. an older commit's, checked out elsewhere), run in turn, interleaved.

Per tree and round: the sweep's own figure (`schedules_per_s`, wall clock) and the CPU seconds its process
took (user and system, imports included), from which `schedules_per_cpu_s`; on a shared machine the wall
clock says more about the other processes than about the simulator, the CPU time much less. The load
average is taken before and after. The sweep's summary without its timings (violations, outcomes, totals)
must be the same for every tree: a tree that gives another one is named in `summaries_differ`.
Prints one JSON line.

    python -m bench.sim_speed --seeds 300 --rounds 3 --tree . --tree /path/to/older/checkout
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys

TIMINGS = ("schedules_per_s", "elapsed_s")


def sweep(tree: str, seeds: int, flags: list[str]) -> tuple[dict, float]:
    """The sweep's JSON line, and the CPU seconds its process took."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
    out = subprocess.run([sys.executable, "-m", "outlast.sim", "--seeds", str(seeds), "--jobs", "1", *flags],
                         cwd=tree, env=env, capture_output=True, text=True, check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if not out.stdout.strip():
        raise SystemExit(f"the sweep in {tree} printed nothing: {out.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return json.loads(out.stdout.splitlines()[0]), cpu


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sim_speed", description=__doc__)
    p.add_argument("--seeds", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tree", action="append", help="a source tree of outlast (repeat it); default: this one")
    p.add_argument("--flag", action="append", default=[], help="a flag for the sweep, e.g. --flag=--edges")
    args = p.parse_args(argv)
    trees = args.tree or ["."]
    load_before = os.getloadavg()
    runs: dict[str, list[tuple[float, float]]] = {t: [] for t in trees}
    summaries: dict[str, str] = {}
    for _ in range(args.rounds):
        for tree in trees:
            summary, cpu = sweep(tree, args.seeds, args.flag)
            runs[tree].append((summary["schedules_per_s"], summary["schedules"] / cpu))
            summaries[tree] = json.dumps({k: v for k, v in summary.items() if k not in TIMINGS}, sort_keys=True)
    first = summaries[trees[0]]
    print(json.dumps({
        "seeds": args.seeds, "rounds": args.rounds, "flags": args.flag,
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "trees": {t: {"schedules_per_s": [w for w, _ in r], "schedules_per_cpu_s": [round(c, 1) for _, c in r],
                      "median_schedules_per_cpu_s": round(statistics.median(c for _, c in r), 1)}
                  for t, r in runs.items()},
        "summaries_differ": [t for t in trees if summaries[t] != first],
        "summary": json.loads(first),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
