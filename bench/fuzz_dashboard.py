"""The dashboard's fuzzer at length: generated requests to every route of a real `outlast dashboard`.

    python3 -m bench.fuzz_dashboard [--count 100000] [--seed 1] [--out FILE]

Two dashboards (one on loopback, one off it, behind its token) serve a storage directory of
hostile documents beside one good run (tests/browser/dashboard_fuzz.py: garbage, empty, huge,
wrong types, newer versions, deep nesting, a FIFO, links out, histories naming files elsewhere),
with a canary file outside it. --count requests, from a seeded generator, go to them in turn:
hostile path segments (traversals plain and encoded, NUL, unicode digits, huge and empty), query
values and headers (no token, wrong ones, another Host). After each, a valid request must still
get the good run whole. Every route is reached (`requests_by_route`).

Counted as problems: an answer of 500 or more other than 503 (a store or node that does not
answer), a traceback in a body, the canary's bytes in a body, the good run not coming back, a
route no request reached, and a dashboard process that exited. One JSON document on stdout (and --out).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from tests.browser.dashboard_fuzz import NO_ROUTE, ROUTES, Probe, hostile_storage, target
from tests.browser.server import Dashboard


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out")
    ap.add_argument("--machine", default="", help="a note on the machine the result was measured on")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="outlast-fuzz-dashboard-") as tmp:
        home = Path(tmp) / "home"
        (home / "logs").mkdir(parents=True, mode=0o700)
        home.chmod(0o700)
        storage = hostile_storage(Path(tmp), home / "logs")
        env = {"OUTLAST_HOME": str(home), "OUTLAST_ADDRESS": ""}
        servers = [Dashboard(str(storage.root), env=env), Dashboard(str(storage.root), host="0.0.0.0", env=env)]
        try:
            token = servers[1].banner.split("?token=")[1].split()[0]
            probes = [Probe(servers[0].port, storage), Probe(servers[1].port, storage, token=token)]
            rng = random.Random(args.seed)
            started = time.monotonic()
            for n in range(args.count):
                probe = probes[n % 2]
                probe.judge(target(rng, storage), probe.headers(rng))
                probe.alive()
                if (n + 1) % 1000 == 0:
                    rate = (n + 1) / (time.monotonic() - started)
                    print(f"{n + 1} requests, {rate:.0f}/s (and as many valid ones), "
                          f"{sum(len(p.verdict.problems) for p in probes)} problem(s)", file=sys.stderr, flush=True)
            took = time.monotonic() - started
            exited = [s.proc.poll() for s in servers]
        finally:
            for s in servers:
                s.stop()
    problems = [p for probe in probes for p in probe.verdict.problems]
    by_status: dict[str, int] = {}
    by_class: dict[str, int] = {}
    by_route: Counter[str] = Counter()
    for probe in probes:
        for k, v in probe.verdict.summary()["by_status"].items():
            by_status[k] = by_status.get(k, 0) + v
        for k, v in probe.verdict.summary()["by_class"].items():
            by_class[k] = by_class.get(k, 0) + v
        by_route.update(probe.verdict.by_route)
    problems += [f"no request reached the route {route}" for route in ROUTES if not by_route[route]]
    doc = {
        "door": "dashboard (every route of `outlast dashboard`, on loopback and behind its token)",
        "requests": args.count, "valid_requests_after_each": args.count, "seed": args.seed,
        "seconds": round(took, 1), "requests_per_s": round(2 * args.count / took, 1),
        "answers_by_class": dict(sorted(by_class.items())), "answers_by_status": dict(sorted(by_status.items())),
        "requests_by_route": {route: by_route[route] for route in (*ROUTES, NO_ROUTE)},
        "crashes": sum(code is not None for code in exited), "problems": len(problems),
        "first_problems": problems[:20], "machine": {"cpus": os.cpu_count(), "load_1m": os.getloadavg()[0], "note": args.machine},
    }
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if not problems and doc["crashes"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
