"""A fuzzer on every door, N cases each: prints one JSON object per door, and writes them all with --out.

    python -m bench.fuzz_doors --count 100000 --out bench/results/fuzz-doors.json
    python -m bench.fuzz_doors --doors run-directory --count 100000 --out run-directory.json  # one door

Doors (tests/fuzz/doors.py, tests/fuzz/controller_job.py, tests/fuzz/documents.py): the agent's control
socket, the tier server's request and data sockets (a real `LocalCluster` node), the fork server's pipe (a
real fork server), the controller's socket (a run whose rank 0 sends its driver hostile messages), and the
readers of a run's directory (run_state.json, manifests, markers, report segments, the lease), of the node
file and of etcd records. Every `--batch` cases the process must still answer a valid request, and the
canary directory outside every root must still be empty; no answer may carry the canary's secret. Per
door: cases, what came back by class, crashes (with the seed and what found the first), writes outside the
root, reads of the canary's secret, cases per second. The cases' files live under --work, in memory where
the machine has /dev/shm: what is measured is the readers, not the disk.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import random
import tempfile
import time
import traceback
import sys
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from outlast.cluster.sealed import Sealer
from outlast.protocol.auth import ClusterKey
from outlast.testing import LocalCluster
from tests.fuzz import documents as docs
from tests.fuzz.controller_job import fuzz_a_run
from tests.fuzz.doors import AgentDoor, ForkServerDoor, TierDataDoor, TierDoor, outside_writes, plant_canary
from tests.fuzz.hostile import Hostile, Targets

SOCKET_DOORS = ("agent", "tier", "tier-data", "fork-server")
DOCUMENT_DOORS = ("run-directory", "node-file", "etcd-records")
DOORS = SOCKET_DOORS + ("controller",) + DOCUMENT_DOORS
PROGRESS_S = 60.0  # how often a door says how far it got (stderr)


class Formatted(logging.Handler):
    """What this process logs (the controller's driver, the readers of documents), formatted as a log file's
    handler would and then dropped: millions of lines would cost more than the cases, and a record whose
    hostile arguments do not format is still found (`failed`)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        self.failed: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.format(record)
        except Exception:  # noqa: BLE001 - what the fuzzer is for
            self.failed.append(traceback.format_exc()[-2000:])


class Progress:
    def __init__(self, name: str) -> None:
        self.name, self.started, self.said = name, time.monotonic(), time.monotonic()

    def __call__(self, cases: int) -> None:
        now = time.monotonic()
        if now - self.said >= PROGRESS_S:
            self.said = now
            print(f"{self.name}: {cases} cases, {cases / (now - self.started):.1f}/s", file=sys.stderr, flush=True)


def _finish(out: dict, started: float, answers: Counter, outside: list[str], secrets_read: int) -> dict:
    out["seconds"] = round(time.monotonic() - started, 1)
    out["answers"] = dict(answers.most_common())
    out["writes_outside_root"] = outside
    out["secrets_read"] = secrets_read
    out["rate_per_s"] = round(out["cases"] / max(out["seconds"], 1e-9), 1)
    return out


def run_socket_door(name: str, count: int, seed: int, batch: int, work: Path, deadline: float) -> dict:
    canary = plant_canary(work / f"canary-{name}")
    cluster = None
    if name == "fork-server":
        door = ForkServerDoor(work / "fork-root")
    else:
        cluster = LocalCluster(num_nodes=1, preload=[], node_args=["--checkpoint-memory", "64MiB"],
                               workdir=work / f"node-{name}")
        cluster.wait_ready()
        key = ClusterKey.load(cluster.key_file)
        tier = next(n.tier_address for n in cluster.node_table() if n.node_id == "node-0")
        if name == "agent":
            door = AgentDoor(cluster.head_address, key, next(iter(cluster.nodes.values())).proc)
        elif name == "tier":
            door = TierDoor(tier, key)
        else:
            door = TierDataDoor(tier, key)
    h = Hostile(random.Random(seed), Targets(str(canary)))
    out = {"door": name, "cases": 0, "crashes": 0}
    progress = Progress(name)
    started = time.monotonic()
    try:
        while out["cases"] < count and time.monotonic() < deadline:
            for _ in range(min(batch, count - out["cases"])):
                door.knock(h)
                out["cases"] += 1
            problem = door.alive() or _wrote_outside(canary)
            progress(out["cases"])
            if problem is not None:
                out["crashes"] += 1
                out["crash"] = {"after_cases": out["cases"], "seed": seed, "problem": problem}
                log_path = door.log_path if cluster is None else next(iter(cluster.nodes.values())).log_path
                if log_path.exists():
                    log = log_path.read_text(errors="replace")
                    at = log.find("Exception in thread")
                    at = at if at >= 0 else log.rfind("Traceback")
                    out["crash"]["log_tail"] = log[at:at + 3000] if at >= 0 else log[-1500:]
                break
    except Exception:  # noqa: BLE001 - the harness's own failure is reported, not hidden
        out["harness_error"] = traceback.format_exc()[-2000:]
    finally:
        _finish(out, started, door.answers, outside_writes(canary), door.secrets_read)
        door.close()
        if cluster is not None:
            cluster.shutdown()
    return out


def _wrote_outside(canary: Path, expected: tuple[str, ...] = ()) -> str | None:
    found = [p for p in outside_writes(canary) if p not in expected]
    return f"written outside the root: {found[:5]}" if found else None


def run_controller_door(count: int, seed: int, batch: int, work: Path, deadline: float) -> dict:
    """The controller's socket: one run, its rank 0 the fuzzer (tests/fuzz/controller_job.py), which checks
    after each batch that the driver answers a valid request. A driver that ended ends the run with an error
    (or this process), and the count its fuzzer reached says where."""
    canary = plant_canary(work / "canary-controller")
    until = time.time() + (deadline - time.monotonic()) if deadline != float("inf") else float("inf")
    out = {"door": "controller", "cases": 0, "crashes": 0}
    started = time.monotonic()
    try:
        result, seen = fuzz_a_run(str(work / "storage"), canary, work / "fuzzed.json", seed, count, batch,
                                  until=until, workdir=work / "node")
        out["cases"] = seen["cases"]
        if result.error is not None:
            out["crashes"] += 1
            out["crash"] = {"after_cases": seen["cases"], "seed": seed, "problem": f"the run ended with {result.error!r}"}
    except Exception:  # noqa: BLE001 - the harness's own failure is reported, not hidden
        out["harness_error"] = traceback.format_exc()[-2000:]
        seen = {"answers": {}}
    return _finish(out, started, Counter(seen["answers"]), outside_writes(canary), 0)


def run_document_door(name: str, count: int, seed: int, batch: int, work: Path, deadline: float, jobs: int) -> dict:
    """Each case its own generator (seed * 1,000,003 + its number: `crash.case_seed` replays it), and the
    run-directory's its own directory; every `batch` cases, nothing may have appeared beside the canary's
    secret and the decoy (a valid run that a reader following a document's path out of its root would find).
    The cases are independent, so `jobs` processes share them out (the same cases as one process runs)."""
    canary = plant_canary(work / f"canary-{name}")
    docs.plant_decoy(canary)
    started = time.monotonic()
    shares = [(count * i // jobs, count * (i + 1) // jobs) for i in range(jobs)]
    if jobs == 1:
        parts = [_document_cases(name, seed, *shares[0], batch, work, canary, deadline)]
    else:
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            parts = list(pool.map(_document_cases, *zip(*[(name, seed, first, end, batch, work, canary, deadline)
                                                          for first, end in shares])))
    out = {"door": name, "cases": sum(p["cases"] for p in parts), "crashes": sum(p["crashes"] for p in parts)}
    crashes = [p["crash"] for p in parts if "crash" in p]
    if crashes:
        out["crash"] = crashes[0]
    if jobs > 1:
        out["jobs"] = jobs
    answers = sum((Counter(p["answers"]) for p in parts), Counter())
    outside = sorted({w for p in parts for w in p["outside"]})[:20]
    return _finish(out, started, answers, outside, 0)


def _document_cases(name: str, seed: int, first: int, end: int, batch: int, work: Path, canary: Path,
                    deadline: float) -> dict:
    """Cases `first` to `end` (not included) of a document door, in this process."""
    decoy = tuple(outside_writes(canary))
    answers: Counter[str] = Counter()
    out: dict = {"cases": 0, "crashes": 0}
    asked_outside: list[str] = []
    home = work / f"home-{first}"  # the node file's: one per process
    home.mkdir(parents=True, exist_ok=True)
    os.environ["OUTLAST_HOME"] = str(home)
    logs = next(h for h in logging.getLogger().handlers if isinstance(h, Formatted))
    logs.failed.clear()
    sealer = Sealer(b"k" * 40)
    progress = Progress(f"{name} [{first}, {end})")
    case = first
    while case < end and time.monotonic() < deadline:
        stop = min(case + batch, end)
        for n in range(case, stop):
            case_seed = seed * 1_000_003 + n
            try:
                if name == "run-directory":
                    with tempfile.TemporaryDirectory(dir=work) as tmp:
                        outcome, asked = docs.read_run(Path(tmp), canary, case_seed)
                    asked_outside += asked
                elif name == "node-file":
                    outcome = docs.read_node_file(docs.hostile(case_seed, canary))
                else:
                    h = docs.hostile(case_seed, canary)
                    outcome = docs.apply_records(h, sealer, h.rng.random() < 0.7, 1)
                answers[outcome] += 1
            except Exception as e:  # noqa: BLE001 - what the fuzzer is for
                out["crashes"] += 1
                answers[f"crash: {type(e).__name__}"] += 1
                out.setdefault("crash", {"case_seed": case_seed, "error": traceback.format_exc()[-2000:]})
            out["cases"] += 1
        case = stop
        problem = _wrote_outside(canary, decoy)
        if logs.failed and problem is None:
            problem = f"a log record that does not format: {logs.failed[0]}"
        progress(out["cases"])
        if problem is not None:
            out["crashes"] += 1
            out.setdefault("crash", {"after_cases": out["cases"], "seed": seed, "problem": problem})
            break
    logs.failed.clear()
    out["answers"] = dict(answers)
    out["outside"] = [p for p in outside_writes(canary) if p not in decoy] + sorted(set(asked_outside))[:20]
    return out


def default_work() -> str | None:
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=100_000, help="cases per door")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--batch", type=int, default=200,
                    help="cases between two checks that the process answers and wrote nothing outside its root")
    ap.add_argument("--doors", default=",".join(DOORS), help=f"of {', '.join(DOORS)}")
    ap.add_argument("--minutes", type=float, default=0, help="stop each door after this long (0: never)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="processes sharing a document door's cases (independent: each has its own seed)")
    ap.add_argument("--work", default=default_work(), help="where the cases' files go (default: /dev/shm)")
    ap.add_argument("--machine", default="", help="a note on the machine the result was measured on")
    ap.add_argument("--out", type=Path, help="the result; doors already in it and not run now are kept")
    args = ap.parse_args()
    names = args.doors.split(",")
    unknown = [n for n in names if n not in DOORS]
    if unknown:
        ap.error(f"no door {', '.join(unknown)}; the doors are {', '.join(DOORS)}")
    logs = Formatted()
    logging.basicConfig(level=logging.INFO, handlers=[logs])
    results = []
    with tempfile.TemporaryDirectory(prefix="outlast-fuzz-", dir=args.work) as tmp:
        for name in names:
            deadline = time.monotonic() + (args.minutes * 60 if args.minutes else float("inf"))
            work = Path(tmp) / name
            work.mkdir()
            if name in SOCKET_DOORS:
                result = run_socket_door(name, args.count, args.seed, args.batch, work, deadline)
            elif name == "controller":
                result = run_controller_door(args.count, args.seed, args.batch, work, deadline)
            else:
                result = run_document_door(name, args.count, args.seed, args.batch, work, deadline, args.jobs)
            if logs.failed:
                result["crashes"] += 1
                result.setdefault("crash", {"problem": "a log record that does not format", "error": logs.failed[0]})
                logs.failed.clear()
            result["asked"] = args.count
            print(json.dumps(result), flush=True)
            results.append(result)
            if args.out:
                write(args.out, results, args)


def write(path: Path, results: list[dict], args: argparse.Namespace) -> None:
    """The doors run now, in the order of DOORS with those of an earlier result: a door at a time, one file."""
    doc = json.loads(path.read_text()) if path.exists() else {}
    by_door = {d["door"]: d for d in doc.get("doors", [])} | {d["door"]: d for d in results}
    doc.update(benchmark=f"bench/fuzz_doors.py --count {args.count} --seed {args.seed} --batch {args.batch}",
               count_per_door_asked=args.count,
               doors=[by_door[n] for n in DOORS if n in by_door])
    if args.machine:
        doc["machine"] = args.machine
    path.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
