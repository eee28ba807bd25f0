"""A fuzzer on every door, N cases each: prints one JSON object per door, and writes them all with --out.

    python -m bench.fuzz_doors --count 100000 --out bench/results/fuzz-doors.json

Doors (tests/fuzz/doors.py, tests/fuzz/documents.py): the agent's control socket, the tier server's request
and data sockets (a real `LocalCluster` node), the fork server's pipe (a real fork server), and the readers
of a run's directory (run_state.json, manifests, markers, report segments, the lease), of the node file and
of etcd records. Every `--batch` cases the process must still answer a valid request; the canary directory
outside every root must stay empty, and no answer may carry its secret. Per door: cases, what came back by
class, crashes (with the seed and the case that found the first), writes outside the root, reads of the
canary's secret, cases per second.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

from outlast.protocol.auth import ClusterKey
from outlast.testing import LocalCluster
from tests.fuzz import documents as docs
from tests.fuzz.doors import AgentDoor, ForkServerDoor, TierDataDoor, TierDoor, outside_writes, plant_canary
from tests.fuzz.hostile import Hostile, Targets

SOCKET_DOORS = ("agent", "tier", "tier-data", "fork-server")
DOCUMENT_DOORS = ("run-directory", "node-file", "etcd-records")


def run_socket_door(name: str, count: int, seed: int, batch: int, work: Path, deadline: float) -> dict:
    canary = plant_canary(work / f"canary-{name}")
    cluster = None
    if name == "fork-server":
        door = ForkServerDoor(work / "fork-root")
        proc = door.forks.proc
    else:
        cluster = LocalCluster(num_nodes=1, preload=[], node_args=["--checkpoint-memory", "64MiB"],
                               workdir=work / f"node-{name}")
        cluster.wait_ready()
        key = ClusterKey.load(cluster.key_file)
        proc = next(iter(cluster.nodes.values())).proc
        tier = next(n.tier_address for n in cluster.node_table() if n.node_id == "node-0")
        if name == "agent":
            door = AgentDoor(cluster.head_address, key, proc)
        elif name == "tier":
            door = TierDoor(tier, key)
        else:
            door = TierDataDoor(tier, key)
    h = Hostile(random.Random(seed), Targets(str(canary)))
    out = {"door": name, "cases": 0, "crashes": 0}
    started = time.monotonic()
    try:
        while out["cases"] < count and time.monotonic() < deadline:
            for _ in range(min(batch, count - out["cases"])):
                door.knock(h)
                out["cases"] += 1
            problem = door.alive()
            if problem is not None:
                out["crashes"] += 1
                out["crash"] = {"after_cases": out["cases"], "seed": seed, "problem": problem}
                if cluster is not None:
                    log = next(iter(cluster.nodes.values())).log_path.read_text(errors="replace")
                    at = log.find("Exception in thread")
                    at = at if at >= 0 else log.rfind("Traceback")
                    out["crash"]["log_tail"] = log[at:at + 3000] if at >= 0 else log[-1500:]
                break
    except Exception:  # noqa: BLE001 - the harness's own failure is reported, not hidden
        out["harness_error"] = traceback.format_exc()[-2000:]
    finally:
        out["seconds"] = round(time.monotonic() - started, 1)
        out["answers"] = dict(door.answers.most_common())
        out["writes_outside_root"] = outside_writes(canary)
        out["secrets_read"] = door.secrets_read
        out["rate_per_s"] = round(out["cases"] / max(out["seconds"], 1e-9), 1)
        door.close()
        if cluster is not None:
            cluster.shutdown()
        del proc
    return out


def run_document_door(name: str, count: int, seed: int, work: Path, deadline: float) -> dict:
    import logging

    logging.disable(logging.WARNING)  # each unreadable document is logged: millions of lines, and their time
    canary = plant_canary(work / f"canary-{name}")
    docs.plant_decoy(canary)
    answers: Counter[str] = Counter()
    out = {"door": name, "cases": 0, "crashes": 0}
    outside: list[str] = []
    started = time.monotonic()
    home = work / f"home-{name}"
    home.mkdir(parents=True, exist_ok=True)
    import os

    os.environ["OUTLAST_HOME"] = str(home)
    from outlast.client import discovery
    from outlast.cluster.sealed import Sealer
    from outlast.cluster.store_view import ClusterView, StoreEvent
    from outlast.protocol import messages as m

    sealer = Sealer(b"k" * 40)
    while out["cases"] < count and time.monotonic() < deadline:
        case_seed = seed * 1_000_003 + out["cases"]
        h = Hostile(random.Random(case_seed), Targets(str(canary)), wrong=0.005, json=True)
        try:
            if name == "run-directory":
                with tempfile.TemporaryDirectory(dir=work) as tmp:
                    outcome, asked = run_directory_case(Path(tmp), canary, case_seed)
                outside += asked
            elif name == "node-file":
                discovery.node_file_path().write_bytes(docs.document(h, discovery.NodeFile))
                node = discovery.published_node()
                outcome = "no node" if node is None else "a node"
            else:
                view = ClusterView(sealer)
                key = h.rng.choice(["head", "members/", "nodes/", "drains/", "dead/", ""]) + h.string()[:80]
                kind = m.NodeDraining if key.startswith("drains/") else m.NodeInfo
                value = docs.document(h, kind) if h.rng.random() < 0.8 else None
                if value is not None and h.rng.random() < 0.7:
                    value = sealer.seal(key, value)
                changed = view.apply(StoreEvent(key, value))
                view.table()
                outcome = "refused" if view.refused else "malformed" if view.malformed else \
                    "taken" if changed else "ignored"
            answers[outcome] += 1
        except Exception as e:  # noqa: BLE001 - what the fuzzer is for
            out["crashes"] += 1
            answers[f"crash: {type(e).__name__}"] += 1
            out.setdefault("crash", {"case_seed": case_seed, "error": traceback.format_exc()[-2000:]})
        out["cases"] += 1
    out["seconds"] = round(time.monotonic() - started, 1)
    out["answers"] = dict(answers.most_common())
    out["writes_outside_root"] = outside_writes(canary)[2:] + sorted(set(outside))[:20]
    out["secrets_read"] = 0
    out["rate_per_s"] = round(out["cases"] / max(out["seconds"], 1e-9), 1)
    return out


def run_directory_case(root: Path, canary: Path, seed: int) -> tuple[str, list[str]]:
    from tests.unit.test_fuzz_documents import read_run

    return read_run(root, canary, seed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=100_000, help="cases per door")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--batch", type=int, default=200, help="cases between two checks that the process answers")
    ap.add_argument("--doors", default=",".join(SOCKET_DOORS + DOCUMENT_DOORS))
    ap.add_argument("--minutes", type=float, default=0, help="stop each door after this long (0: never)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="outlast-fuzz-") as tmp:
        for name in args.doors.split(","):
            deadline = time.monotonic() + (args.minutes * 60 if args.minutes else float("inf"))
            work = Path(tmp) / name
            work.mkdir()
            if name in SOCKET_DOORS:
                result = run_socket_door(name, args.count, args.seed, args.batch, work, deadline)
            else:
                result = run_document_door(name, args.count, args.seed, work, deadline)
            result["asked"] = args.count
            print(json.dumps(result), flush=True)
            results.append(result)
            if args.out:
                args.out.write_text(json.dumps({"seed": args.seed, "count_per_door": args.count, "doors": results},
                                               indent=2) + "\n")


if __name__ == "__main__":
    main()
