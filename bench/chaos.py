"""Faults of every kind on a real cluster, and nothing lost.

    sudo .venv/bin/python -m bench.chaos --seed 1 --faults 20 [--out bench/results/chaos-1.json]

A head and three member agents, each member in a network namespace of its own
(`tests/integration/netns.py`), all with resource isolation in a cgroup made for the run
(`bench/lib/chaos_cgroups.py`); an S3 server process (moto) the harness kills and starts again with
its data, or slows (`bench/lib/chaos_store.py`); a deterministic DDP job of `--workers` ranks, 2 by default
(`bench/lib/chaos_job.py`), driven by a driver process the harness can kill and relaunch
(`bench/lib/chaos_driver.py`). It first trains without
faults, then trains again injecting the faults `bench/lib/chaos_plan.schedule(seed, n)` draws, one
at a time, each once the run is seen training again. It prints one JSON document: the fault log,
the run's history, timings, and each promise with null when it held or what broke it
(`bench/lib/chaos_plan.verdicts`). Exit status 0 only when every promise held. Needs root.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from bench.lib.chaos_cgroups import ClusterCgroups, unavailable_reason
from bench.lib.chaos_plan import Fault, Timeouts, pick_node, schedule, verdicts
from bench.lib.chaos_store import ObjectStore
from bench.lib.venvs import ROOT
from outlast.client.preload import default_preload
from outlast.procutil import pid_alive
from outlast.storage.records import MANIFEST_NAME
from tests.integration.jobs import read_events
from tests.integration.netns import NetnsCluster, _kill_pids, namespace_pids

PACE_S = 0.1


class StoredCluster(NetnsCluster):
    """The object store starts on the bridge before the agents do: each node is configured for it
    (endpoint and credentials in its environment), as a machine would be; a run's environment
    reaches its workers without secrets."""

    def _start_agents(self) -> None:
        self.store = ObjectStore(self.bridge_ip, workdir=self.workdir / "s3")
        os.environ.update(self.store.env())
        super()._start_agents()

    def shutdown(self) -> None:
        super().shutdown()
        if getattr(self, "store", None) is not None:
            with contextlib.suppress(Exception):
                self.store.close()


class Chaos:
    def __init__(self, workdir: Path, t: Timeouts, workers: int, members: int = 3) -> None:
        self.workdir, self.t, self.workers = workdir, t, workers
        self.isolation = unavailable_reason() or "on"
        self.cgroups = ClusterCgroups() if self.isolation == "on" else None
        try:
            self.cluster = StoredCluster(num_members=members, node_timeout_s=t.node_s, workdir=workdir / "cluster",
                                         extra_args=["--preload", ",".join(default_preload()),
                                                     *(self.cgroups.agent_args() if self.cgroups else [])],
                                         launcher=self.cgroups.launcher() if self.cgroups else None,
                                         keep_mounts=self.cgroups is not None)
            self.store = self.cluster.store
            self.cluster.wait_joined()
        except BaseException:
            self.close()
            raise
        self.driver: subprocess.Popen | None = None
        self.driver_args: list[str] = []

    def env(self) -> dict[str, str]:
        return {**os.environ, **self.cluster.env, **self.store.env(), "OUTLAST_NODE_TIMEOUT_S": str(self.t.node_s),
                "OUTLAST_DRIVER_TIMEOUT_S": str(self.t.driver_s), "OUTLAST_CAPACITY_TIMEOUT_S": "120",
                "PYTHONPATH": ROOT}

    # ---- the driver ---------------------------------------------------------------------------

    def launch(self, name: str, steps: int) -> tuple[str, str]:
        events, orders = str(self.workdir / f"{name}.jsonl"), self.workdir / f"{name}-orders"
        orders.mkdir(exist_ok=True)
        self.driver_args = [sys.executable, "-m", "bench.lib.chaos_driver", f"s3://{self.store.bucket}/runs", name,
                            events, str(orders), str(steps), "--workers", str(self.workers)]
        self._start_driver(name)
        return events, str(orders)

    def _start_driver(self, name: str) -> None:
        log = open(self.workdir / f"{name}-driver.log", "ab")
        self.driver = subprocess.Popen(self.driver_args, cwd=ROOT, env=self.env(), stdout=log, stderr=log,
                                       start_new_session=True)
        log.close()

    # ---- one fault ----------------------------------------------------------------------------

    def members(self) -> list[str]:
        return [n for n in self.cluster.nodes if n != "head"]

    def holders(self, events: list[dict]) -> tuple[int, list[str]]:
        attempt = max((e["attempt"] for e in events), default=0)
        where = self.cluster.node_of_netns()
        return attempt, sorted({where.get(e["netns"], "?") for e in events
                                if e["event"] == "where" and e["attempt"] == attempt})

    def kill_node(self, node_id: str) -> None:
        node = self.cluster.nodes[node_id]
        _kill_pids(namespace_pids(node.netns))
        with contextlib.suppress(Exception):
            node.proc.wait(timeout=10)

    def restart_node(self, node_id: str) -> None:
        node = self.cluster.nodes[node_id]
        self.cluster._start(node_id, node.ip, node.netns, node.host_veth)

    def inject(self, f: Fault, events_path: str, orders: str, name: str) -> None:
        f.attempt, f.holders = self.holders(read_events(events_path))
        if f.kind in ("node_lost", "partition_short", "partition_long", "drain"):
            f.node = pick_node(f, self.members(), f.holders)
        f.t_start = time.time()
        if f.kind == "node_lost":
            self.kill_node(f.node)
            time.sleep(f.duration_s)
            self.restart_node(f.node)
        elif f.kind.startswith("partition"):
            self.cluster.cut(f.node)
            time.sleep(f.duration_s)
            self.cluster.heal(f.node)
        elif f.kind == "drain":
            try:
                out = subprocess.run([str(Path(sys.executable).with_name("outlast")), "drain-node", "--node-id", f.node,
                                      "--reason", "preemption", "--deadline-remaining-seconds", str(f.duration_s)],
                                     env=self.env(), capture_output=True, text=True, timeout=120)
                f.note = ("" if out.returncode == 0 else "FAILED: ") + (out.stdout + out.stderr).strip()
            except subprocess.TimeoutExpired as e:
                # Said in every_fault_injected, and the run goes on: a stopped harness reports nothing.
                f.note = f"FAILED: outlast drain-node did not answer in {e.timeout:.0f} s"
            time.sleep(f.duration_s)
            self.kill_node(f.node)  # the drained machine goes away at its deadline, and is replaced
            self.restart_node(f.node)
        elif f.kind == "store_outage":
            down = time.monotonic()
            self.store.kill()
            time.sleep(f.duration_s)
            self.store.start()
            f.note = f"the S3 server was down {time.monotonic() - down:.1f} s"
        elif f.kind == "store_slow":
            self.store.delay_s = self.t.driver_s + 1.0
            time.sleep(f.duration_s)
            self.store.delay_s = 0.0
        elif f.kind == "driver_kill":
            # Slow the store so that the next checkpoint's asynchronous upload is still in flight.
            self.store.delay_s = 1.0
            start = len(read_events(events_path))
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not any(
                    e["event"] == "step" and e.get("saved") for e in read_events(events_path)[start:]):
                time.sleep(0.02)
            self.driver.kill()
            self.driver.wait()
            self.store.delay_s = 0.0
            time.sleep(f.duration_s)
            self._start_driver(name)
        elif f.kind == "rank_spawn":
            Path(orders, f"spawn-{f.index}").write_text(str(f.rank))
        f.t_end = time.time()

    def wait_training(self, events_path: str, since: float, after_attempt: int = 0, timeout_s: float = 180.0) -> bool:
        """A step since `since` by an attempt newer than `after_attempt`: the ranks of an attempt a fault ended
        (a driver killed, say) may step on for a moment, and a fault aimed at them would end no attempt."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(e["event"] == "step" and e["t"] > since and e["attempt"] > after_attempt
                   for e in read_events(events_path)):
                return True
            if self.driver.poll() is not None:
                return False
            time.sleep(0.05)
        return False

    def finish(self, timeout_s: float = 600.0) -> int | None:
        try:
            return self.driver.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.driver.kill()
            return None

    def state(self, name: str) -> dict:
        data = self.store.read(f"runs/{name}/run_state.json")
        return json.loads(data) if data else {}

    def close(self) -> None:
        if getattr(self, "driver", None) is not None and self.driver.poll() is None:
            self.driver.kill()
            self.driver.wait()
        if getattr(self, "cluster", None) is not None:
            self.cluster.shutdown()
        if self.cgroups is not None:
            self.cgroups.remove()


def run(seed: int, n: int, steps: int | None = None, workers: int = 2, workdir: Path | None = None,
        timeouts: Timeouts | None = None) -> dict:
    t = timeouts or Timeouts()
    faults = schedule(seed, n, t, workers)
    steps = steps or 60 + 40 * n  # 25 per fault ran out before the 95th of 100 (bench/results/chaos-100-seed1.json)
    tmp = tempfile.TemporaryDirectory(prefix="outlast-chaos-") if workdir is None else None
    workdir = Path(workdir or tmp.name)
    chaos = Chaos(workdir, t, workers)
    try:
        t0 = time.monotonic()
        events, _ = chaos.launch("clean", steps)
        clean_rc = chaos.finish()
        clean_s = time.monotonic() - t0
        clean_digest = next((e["digest"] for e in read_events(events) if e["event"] == "weights"), None)
        chaos.store.delete("runs/clean/")  # a restarted S3 server puts back what it holds: only the run under faults

        t0 = time.monotonic()
        events, orders = chaos.launch("chaos", steps)
        Path(orders, "pace").write_text(str(PACE_S))
        seen: set[str] = set()
        stalled = None
        for f in faults:
            before = faults[f.index - 1] if f.index else None
            if not chaos.wait_training(events, since=before.t_end if before else 0.0,
                                       after_attempt=before.attempt if before and before.ends_attempt else 0):
                stalled = f"the run was not training before fault {f.index} ({f.kind})"
                break
            time.sleep(f.gap_s)
            seen |= {c["checkpoint_dir"] for c in chaos.state("chaos").get("checkpoints", [])}
            chaos.inject(f, events, orders, "chaos")
        Path(orders, "pace").unlink()
        chaos_rc = chaos.finish()
        chaos_s = time.monotonic() - t0

        evs = read_events(events)
        state = chaos.state("chaos")
        seen |= {c["checkpoint_dir"] for c in state.get("checkpoints", [])}
        manifests = {k.split("/")[2] for k in chaos.store.keys("runs/chaos/") if k.endswith("/" + MANIFEST_NAME)}
        pids = {e["pid"] for e in evs} | {e["pid_spawned"] for e in evs if e["event"] == "spawned"}
        time.sleep(1.0)  # the fork servers reap and kill what the last workers left
        alive = sorted(p for p in pids if pid_alive(p))
        leaves = chaos.cgroups.worker_leaves() if chaos.cgroups else []
        chaos.cluster.stop_agents()
        leftover = chaos.cluster.leftover_pids()
        cgroups_left = chaos.cgroups.left() if chaos.cgroups else []
        held = verdicts(faults, state, evs, clean_digest, seen, manifests, alive, leftover, leaves, cgroups_left)
        failed = [f"fault {f.index} ({f.kind}): {f.note}" for f in faults if f.note.startswith("FAILED")]
        held["every_fault_injected"] = stalled or ("; ".join(failed) if failed else None)
        held["driver_exit_0"] = None if (clean_rc, chaos_rc) == (0, 0) else f"exit codes {clean_rc}, {chaos_rc}"
        return {
            "seed": seed, "faults": n, "steps": steps, "workers": workers, "nodes": 1 + len(chaos.members()),
            "timeouts": asdict(t), "pace_s": PACE_S, "isolation": chaos.isolation,
            "store_restarts": chaos.store.restarts,
            "mix": {k: sum(f.kind == k for f in faults) for k in sorted({f.kind for f in faults})},
            "clean_s": round(clean_s, 2), "chaos_s": round(chaos_s, 2), "ratio": round(chaos_s / clean_s, 2),
            "attempts": len(state.get("attempts", [])), "failure_counts": state.get("failure_counts", {}),
            "checkpoints_committed": len(state.get("checkpoints", [])),
            "load_1m": os.getloadavg()[0], "cpus": os.cpu_count(),
            "ok": all(v is None for v in held.values()), "promises": held,
            "fault_log": [asdict(f) for f in faults],
            "history": [{k: a.get(k) for k in ("attempt", "outcome", "restored_from")}
                        | {"failures": [(x.get("kind") or x.get("exc_type"), x.get("node_id"), x.get("rank"))
                                       for x in a["failures"]]}
                        for a in state.get("attempts", [])],
        }
    finally:
        chaos.close()
        if tmp is not None and "OUTLAST_CHAOS_KEEP" not in os.environ:
            tmp.cleanup()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--faults", type=int, default=20)
    p.add_argument("--steps", type=int, default=None, help="training steps (default: 60 + 40 per fault)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--workdir", type=Path, default=None, help="keep logs and events here")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` undoes the cluster
    result = run(args.seed, args.faults, args.steps, args.workers, args.workdir)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
