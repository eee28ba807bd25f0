"""The simulator's speed: schedules a second of `python -m outlast.sim --seeds N --jobs 1`, for one or more
source trees of outlast (this one, and e.g. an older commit's, checked out elsewhere), run in turn, interleaved.

Per tree and round: the sweep's own figure (`schedules_per_s`, wall clock) and the CPU seconds its process
took (user and system, imports included), from which `schedules_per_cpu_s`; on a shared machine the wall
clock says more about the other processes than about the simulator, the CPU time much less. The load
average is taken before and after. The sweep's summary without its timings (violations, outcomes, totals)
must be the same for every tree: a tree that gives another one is named in `summaries_differ`; and for every
round of a tree (the same seeds give the same schedules, twice): a tree whose rounds differ is named in
`rounds_differ`. Each sweep runs on one core (`--cpu`, as `taskset -c 0`); each tree's commit is recorded.
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


def sweep(tree: str, seeds: int, flags: list[str], cpu: int | None) -> tuple[dict, float]:
    """The sweep's JSON line, and the CPU seconds its process took."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
    pin = None if cpu is None else lambda: os.sched_setaffinity(0, {cpu})
    out = subprocess.run([sys.executable, "-m", "outlast.sim", "--seeds", str(seeds), "--jobs", "1", *flags],
                         cwd=tree, env=env, capture_output=True, text=True, check=False, preexec_fn=pin)
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
    p.add_argument("--cpu", type=int, default=0, help="the one core each sweep runs on; -1: any")
    args = p.parse_args(argv)
    trees = args.tree or ["."]
    cpu = None if args.cpu < 0 else args.cpu
    load_before = os.getloadavg()
    runs: dict[str, list[tuple[float, float]]] = {t: [] for t in trees}
    summaries: dict[str, list[str]] = {t: [] for t in trees}
    for _ in range(args.rounds):
        for tree in trees:
            summary, cpu_s = sweep(tree, args.seeds, args.flag, cpu)
            runs[tree].append((summary["schedules_per_s"], summary["schedules"] / cpu_s))
            summaries[tree].append(json.dumps({k: v for k, v in summary.items() if k not in TIMINGS}, sort_keys=True))
    first = summaries[trees[0]][0]
    print(json.dumps({
        "seeds": args.seeds, "rounds": args.rounds, "flags": args.flag, "cpu": cpu,
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "trees": {t: {"commit": commit(t), "schedules_per_s": [w for w, _ in r],
                      "median_schedules_per_s": round(statistics.median(w for w, _ in r), 1),
                      "schedules_per_cpu_s": [round(c, 1) for _, c in r],
                      "median_schedules_per_cpu_s": round(statistics.median(c for _, c in r), 1)}
                  for t, r in runs.items()},
        "summaries_differ": [t for t in trees if summaries[t][0] != first],
        "rounds_differ": [t for t in trees if len(set(summaries[t])) > 1],
        "summary": json.loads(first),
    }))
    return 0


def commit(tree: str) -> str:
    """The tree's commit, with "+changes" when its files differ from it."""
    git = ["git", "-C", tree]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    if head.returncode != 0:
        return "?"
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                           check=False).stdout.strip()
    return head.stdout.strip() + ("+changes" if dirty else "")


if __name__ == "__main__":
    sys.exit(main())
