"""Where a restart's time goes: a worker, the fork server or the embedded agent killed mid-run.

    .venv/bin/python -m bench.restart_breakdown [--repeat N] [--before DIR] [--out FILE]

Runs bench/lib/node_restart_scenario.py for each kind with OUTLAST_TRACE_FILE set (outlast/trace.py:
every process of the run appends timestamps to it), and splits kill-to-training-again into the
phases below, each the time since the phase before it that happened. The warm floor
(bench/lib/warm_floor.py: a warm process forks two ranks that run one DDP step) runs in the same
loop, so every figure has a floor measured at the same load. With --before DIR (a checkout of
an earlier outlast), the same kills run on it too, interleaved, untraced, for the totals.
Each run records the 1-minute load average when it started.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench.lib import node_restart_scenario
from bench.lib.events import read_events
from bench.lib.harness import publish
from bench.lib.venvs import ROOT, module
KINDS = ["worker", "forkserver", "agent"]

# (phase, the trace marks that end it): the first mark after the kill, or the last one of the new attempt.
PHASES = [
    ("detected", "first", {"zygote.reaped", "agent.forkserver_died", "embedded.agent_died"}),
    ("controller_told", "first", {"controller.exited", "controller.agent_gone"}),
    ("old_ranks_reaped", "last_before_spawn", {"zygote.reaped"}),
    ("standby_took_over", "first", {"agent.standby_took_over", "agent.listening"}),
    ("spawn_sent", "spawn", {"controller.spawn"}),
    ("forked", "last_new", {"zygote.fork"}),
    ("worker_connected", "last_new", {"worker.hello"}),
    ("rendezvous", "last_new", {"worker.rendezvous"}),
    ("restored", "last_new", {"worker.restored"}),
    ("ddp_built", "last_new", {"worker.ddp"}),
]


def breakdown(trace, kill_t, end_t):
    """{phase: seconds since the phase before it} for the marks between the kill and the first step."""
    marks = sorted((e for e in trace if kill_t <= e["t"] <= end_t), key=lambda e: e["t"])
    spawn = next((e["t"] for e in marks if e["phase"] == "controller.spawn" and e.get("attempt") == 2), None)
    at = {}
    for name, how, phases in PHASES:
        hits = [e for e in marks if e["phase"] in phases]
        if how == "first" and hits:
            at[name] = hits[0]["t"]
        elif how == "spawn" and spawn is not None:
            at[name] = spawn
        elif how == "last_before_spawn" and spawn is not None:
            before = [e["t"] for e in hits if e["t"] <= spawn]
            if len(before) > 1:  # the killed rank's reap is "detected"; the others' are the teardown
                at[name] = before[-1]
        elif how == "last_new" and spawn is not None:
            new = [e["t"] for e in hits if e["t"] >= spawn]
            if new:
                at[name] = new[-1]
    at["first_step"] = end_t
    out, prev = {}, kill_t
    for name, t in sorted(at.items(), key=lambda kv: kv[1]):
        out[name] = round(t - prev, 4)
        prev = t
    return out


def one(kind, python, pythonpath, traced):
    with tempfile.TemporaryDirectory(prefix="outlast-restart-") as tmp:
        trace = os.path.join(tmp, "trace.jsonl")
        env = {**os.environ, "OUTLAST_HOME": os.path.join(tmp, "home"), "PYTHONPATH": pythonpath}
        env.pop("OUTLAST_ADDRESS", None)
        env.pop("OUTLAST_TRACE_FILE", None)
        if traced:
            env["OUTLAST_TRACE_FILE"] = trace
        load = os.getloadavg()[0]
        try:
            kill_t, end = node_restart_scenario.run(kind, python, tmp, env, 900)
        except RuntimeError as e:
            return None, str(e)
        out = {"kill_to_training_s": round(end - kill_t, 4), "load1": round(load, 2)}
        if traced:
            out["phases"] = breakdown(read_events(trace), kill_t, end)
        return out, None


def floor_once(python):
    with tempfile.TemporaryDirectory(prefix="outlast-floor-") as tmp:
        events = os.path.join(tmp, "floor.jsonl")
        load = os.getloadavg()[0]
        subprocess.run(module(python, "bench.lib.warm_floor", "--events", events, "--repeat", "1"),
                       capture_output=True, timeout=300, cwd=ROOT)
        got = [e["fork_to_step_s"] for e in read_events(events) if e.get("ev") == "warm_floor"]
        return {"fork_to_first_step_s": round(got[0], 4), "load1": round(load, 2)} if got else None


def summary(xs):
    return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3), "max": round(max(xs), 3),
            "n": len(xs)} if xs else None


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--kinds", nargs="+", default=KINDS, choices=KINDS)
    p.add_argument("--before", help="a checkout of an earlier outlast, run untraced beside this one")
    p.add_argument("--out")
    a = p.parse_args()
    python = sys.executable
    runs = {k: {"after": [], "before": []} for k in a.kinds}
    floors, errors = [], []
    started = time.time()
    for i in range(a.repeat):
        floor = floor_once(python)
        if floor:
            floors.append(floor)
        for kind in a.kinds:  # interleaved, so load changes hit every kind and both versions alike
            for version, path in [("after", ROOT)] + ([("before", os.path.abspath(a.before))] if a.before else []):
                got, err = one(kind, python, path, traced=version == "after")
                if err:
                    errors.append(f"{version} {kind}: {err}")
                    continue
                runs[kind][version].append(got)
                print(f"[{i + 1}/{a.repeat}] {version} {kind}: {got['kill_to_training_s']:.3f} s "
                      f"(load {got['load1']}) {got.get('phases', '')}", file=sys.stderr, flush=True)
    floor_med = statistics.median(f["fork_to_first_step_s"] for f in floors) if floors else None
    results = {}
    for kind, by in runs.items():
        after = [r["kill_to_training_s"] for r in by["after"]]
        row = {"after": summary(after), "after_runs": by["after"]}
        phases = sorted({ph for r in by["after"] for ph in r.get("phases", {})},
                        key=lambda ph: [n for n, _, _ in PHASES].index(ph) if ph != "first_step" else 99)
        row["phases_median_s"] = {ph: round(statistics.median(r["phases"].get(ph, 0.0) for r in by["after"]), 4)
                                  for ph in phases}
        if by["before"]:
            before = [r["kill_to_training_s"] for r in by["before"]]
            row["before"], row["before_runs"] = summary(before), by["before"]
            row["ratio_before_to_after"] = round(statistics.median(before) / statistics.median(after), 2) \
                if after else None
        if floor_med and after:
            row["ratio_after_to_floor"] = round(statistics.median(after) / floor_med, 2)
        results[kind] = row
    doc = {"benchmark": "restart_breakdown", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "repeat": a.repeat, "cpus": os.cpu_count(), "wall_s": round(time.time() - started, 1),
           "floor": {"warm_fork_to_first_step_s": summary([f["fork_to_first_step_s"] for f in floors]),
                     "runs": floors},
           "results": results, "errors": errors,
           "note": "phases: each is the time from the phase before it (bench/restart_breakdown.py PHASES); "
                   "load1 is the 1-minute load average at each run's start, on a 2-core machine shared with "
                   "other work"}
    publish(doc, a.out)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
