"""Worker output on the driver: does a rank printing 10,000 lines per second slow its loop, and
do its lines all reach the driver? outlast and Ray Train V2 (2.60), the same script.

    python3 -m bench.worker_output [--only ray|outlast] [--repeat N] [--out FILE]

bench/lib/output_scenario.py runs 2 ranks for 300 steps of 10 ms (a spin standing in for compute);
"quiet" prints nothing, "chatty" prints 100 lines a step (10,000 lines/s per rank). Figures, each
the median and range over --repeat runs interleaved between frameworks: the median step time of
each mode, the overhead (chatty / quiet), and the share of the 60,000 lines that reached the
driver's stdout. Each run has a private state directory (OUTLAST_HOME, RAY_TMPDIR) and only
processes carrying it are stopped. Ray comes from bench/.ray-venv (bench/setup_ray_venv.sh) or
$RAY_VENV. Prints one JSON document on stdout; progress on stderr.
"""
import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from bench.lib import harness, proctree
from bench.lib.venvs import OUTLAST_PY, RAY_PY, ROOT, module

PY = {"outlast": OUTLAST_PY,
      "ray": os.path.join(os.environ["RAY_VENV"], "bin", "python") if "RAY_VENV" in os.environ else RAY_PY}
PRIVATE = {"outlast": "OUTLAST_HOME", "ray": "RAY_TMPDIR"}
LINES = {"quiet": 0, "chatty": 100}
EXPECTED = 2 * 300 * 100
LINE = re.compile(r"rank (\d) step (\d+) line (\d+)$")


def run_once(framework, mode):
    with tempfile.TemporaryDirectory(prefix=f"bench-output-{framework}-") as tmp:
        events, out = os.path.join(tmp, "events"), os.path.join(tmp, "stdout")
        private = os.path.join(tmp, "home")
        os.makedirs(private)
        env = {**os.environ, PRIVATE[framework]: private, "OUTLAST_PRELOAD": "torch,torch.distributed",
               "RAY_DEDUP_LOGS": "0", "PYTHONUNBUFFERED": "1"}
        env.pop("OUTLAST_ADDRESS", None)
        started = time.time()
        with open(out, "w") as stdout:
            proc = subprocess.run(module(PY[framework], "bench.lib.output_scenario", "--framework", framework,
                                         "--lines-per-step", str(LINES[mode]), "--events", events,
                                         "--storage", os.path.join(tmp, "storage")),
                                  stdout=stdout, stderr=subprocess.DEVNULL, env=env, timeout=600, cwd=ROOT)
        for p in proctree.ours(PRIVATE[framework], private, since=started):
            try:
                p.send_signal(signal.SIGKILL)
            except Exception:
                pass
        if proc.returncode != 0:
            print(f"{framework} {mode}: exit {proc.returncode}", file=sys.stderr)
            return None
        with open(events) as f:
            times = json.loads(f.readline())["step_times"]
        seen = set()
        with open(out, errors="replace") as f:
            for line in f:
                if (m := LINE.search(line.rstrip("\n"))):
                    seen.add(m.groups())
        return {"step_s": statistics.median(times[10:]), "delivered": len(seen) / EXPECTED if LINES[mode] else None}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--only", choices=["ray", "outlast"])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    frameworks = [args.only] if args.only else [f for f in ("outlast", "ray") if os.path.exists(PY[f])]
    runs = {(f, mode): [] for f in frameworks for mode in LINES}
    loads = []
    for i, framework in harness.interleaved(frameworks, args.repeat):
        for mode in LINES:
            print(f"[{i + 1}/{args.repeat}] {framework} {mode}", file=sys.stderr)
            loads.append(harness.load())
            runs[(framework, mode)].append(run_once(framework, mode))
    figures = {}
    for f in frameworks:
        quiet = [r["step_s"] if r else None for r in runs[(f, "quiet")]]
        chatty = [r["step_s"] if r else None for r in runs[(f, "chatty")]]
        overhead = [c / q if c and q else None for c, q in zip(chatty, quiet)]
        figures[f] = {"quiet_step_s": harness.summary(quiet), "chatty_step_s": harness.summary(chatty),
                      "chatty_over_quiet": harness.summary(overhead),
                      "lines_delivered": harness.summary([r["delivered"] if r else None
                                                          for r in runs[(f, "chatty")]])}
    doc = {"benchmark": "worker_output", "when": harness.stamp(), "load": loads, "figures": figures,
           "machine": harness.machine({})}
    if "ray" in figures and "outlast" in figures:
        doc["ratio_ray_over_outlast"] = {
            "chatty_over_quiet": harness.ratio(figures["ray"]["chatty_over_quiet"],
                                               figures["outlast"]["chatty_over_quiet"])}
    harness.publish(doc, args.out)
    failed = any(r is None for rs in runs.values() for r in rs)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
