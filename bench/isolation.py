"""Memory oversubscription: isolation off, a 95% polling monitor, outlast's isolation, Ray 2.60.

    sudo .venv/bin/python -m bench.isolation [--node-mem 4GiB] [--task-mib 1024]
         [--over 1 2 4] [--kinds short long] [--modes off poll95 outlast ray]

A node confined to --node-mem (a memory limit on its own cgroup, made for the run) runs
tasks that each take --task-mib and work on it. `slots` tasks fit at once; each run offers
over x slots at once. Ideal time = total work / slots. Per cell: completion time and its
ratio to ideal, kernel OOM kills, tasks killed by the monitor (outlast, the poller or
Ray), failed tasks, the agent's worst answer time to a ping (heartbeat delay), lost nodes.
Prints one JSON document on stdout; progress on stderr.
"""
from __future__ import annotations

import argparse
import contextlib
import shutil
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import psutil
import zmq

import outlast
from bench.lib import harness, proctree
from bench.lib.oversub_task import hungry
from bench.lib.venvs import RAY_PY, ROOT
from outlast.client.discovery import request
from outlast.isolation.units import parse_bytes
from outlast.protocol import messages as m
from tests.kernel.cgroups import ScratchCgroup, kernel_oom_kills, start_agent

MiB = 1024**2
RESERVED = 512 * MiB


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Pinger(threading.Thread):
    """The agent's worst answer time while the workload runs: a stalled node shows here."""

    def __init__(self, address: str) -> None:
        super().__init__(daemon=True)
        self.address, self.worst, self.lost = address, 0.0, False
        self._halt = threading.Event()

    def run(self) -> None:
        ctx = zmq.Context()
        while not self._halt.is_set():
            t0 = time.monotonic()
            try:
                request(ctx, self.address, m.Ping(), timeout_s=10.0)
            except Exception:
                self.lost = True
            self.worst = max(self.worst, time.monotonic() - t0)
            time.sleep(0.1)
        ctx.term()

    def stop(self) -> None:
        self._halt.set()
        self.join()


class Poller95(threading.Thread):
    """What Ray does without isolation: every 250 ms, if the node is over 95% of its memory,
    kill the newest task (one per round), and leave the kernel's OOM killer on."""

    def __init__(self, address: str, cg: ScratchCgroup) -> None:
        super().__init__(daemon=True)
        self.address, self.cg, self.kills = address, cg, 0
        self._halt = threading.Event()
        v1 = cg.version == 1
        self.usage_file = os.path.join(cg.memory_dir, "memory.usage_in_bytes" if v1 else "memory.current")
        self.limit = int(open(os.path.join(cg.memory_dir, "memory.limit_in_bytes" if v1 else "memory.max")).read())

    def _used(self) -> int:
        stat = dict(line.split() for line in open(os.path.join(self.cg.memory_dir, "memory.stat")))
        cache = int(stat.get("total_inactive_file", stat.get("inactive_file", 0)))
        return int(open(self.usage_file).read()) - cache

    def run(self) -> None:
        import signal

        ctx = zmq.Context()
        while not self._halt.wait(0.25):
            try:
                if self._used() < 0.95 * self.limit:
                    continue
                reply = request(ctx, self.address, m.StatusRequest(), timeout_s=5.0)
            except Exception:
                continue
            tasks = [w for w in reply.workers if w.task_id]
            if tasks:
                newest = max(tasks, key=lambda w: w.pid)
                try:
                    os.kill(newest.pid, signal.SIGKILL)
                    self.kills += 1
                except ProcessLookupError:
                    pass
        ctx.term()

    def stop(self) -> None:
        self._halt.set()
        self.join()


def run_outlast(mode: str, args, over: int, seconds: float, n_tasks: int, slots: int, deadline_s: float) -> dict:
    import concurrent.futures as cf

    cg = ScratchCgroup(args.node_mem)
    oom0 = kernel_oom_kills()
    extra = ["--preload", "torch"]
    if mode == "outlast":
        extra += ["--enable-resource-isolation", "--system-reserved-memory", str(RESERVED)]
    logf = tempfile.mktemp(prefix=f"bench-agent-{mode}-", suffix=".log")
    agent = None
    try:
        agent, address = start_agent(cg, f"b{mode}", extra, logf)
        os.environ["OUTLAST_ADDRESS"] = address
        pinger, poller = Pinger(address), (Poller95(address, cg) if mode == "poll95" else None)
        pinger.start()
        if poller:
            poller.start()
        t0 = time.monotonic()
        # Retries without limit, as Ray retries OOM-killed tasks; a cell that cannot finish
        # (tasks killed over and over) is stopped at its deadline and its tasks count as failed.
        ex = outlast.Executor(max_workers=slots * over, num_cpus=0.01, max_retries=10**6,
                              oom_backoff_s=0.2, oom_backoff_max_s=2.0)
        futures = [ex.submit(hungry, args.task_mib, seconds) for _ in range(n_tasks)]
        done, not_done = cf.wait(futures, timeout=deadline_s)
        elapsed = time.monotonic() - t0
        failed = len(not_done) + sum(1 for f in done if f.exception() is not None)
        ex.shutdown(wait=not not_done, cancel_futures=True)
        pinger.stop()
        killed = 0
        if poller:
            poller.stop()
            killed = poller.kills
        lost = agent.poll() is not None or pinger.lost
        if mode == "outlast" and not lost:
            ctx = zmq.Context()
            killed = request(ctx, address, m.StatusRequest(), timeout_s=10).isolation.kills
            ctx.term()
    finally:
        if agent is not None:
            agent.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.wait(timeout=30)
            agent.kill()  # nothing left to do once it ended within the 30 s
        cg.remove()
    return {"seconds": round(elapsed, 2) if not not_done else None, "kernel_oom_kills": kernel_oom_kills() - oom0,
            "tasks_killed": killed, "tasks_failed": failed, "agent_worst_ping_s": round(pinger.worst, 3),
            "lost_nodes": int(lost)}


RAY_SCRIPT = r"""
import json, sys, time, os
import ray
from bench.lib.oversub_task import hungry
ray.init(num_cpus=%(conc)d, include_dashboard=False, log_to_driver=False)
f = ray.remote(num_cpus=1, max_retries=-1)(hungry)
t0 = time.monotonic()
refs = [f.remote(%(mib)d, %(seconds)r) for _ in range(%(n)d)]
failed = 0
ready, pending = ray.wait(refs, num_returns=len(refs), timeout=%(timeout)r)
for r in ready:
    try:
        ray.get(r)
    except Exception as e:
        failed += 1
        print("task failed:", type(e).__name__, str(e)[:200], file=sys.stderr)
print(json.dumps({"seconds": time.monotonic() - t0 if not pending else None, "failed": failed + len(pending)}))
ray.shutdown()
"""


def run_ray(args, over: int, seconds: float, n_tasks: int, slots: int, deadline_s: float,
            errors: list[str]) -> dict:
    cg = ScratchCgroup(args.node_mem)
    oom0 = kernel_oom_kills()
    script = RAY_SCRIPT % {"conc": slots * over, "mib": args.task_mib, "seconds": seconds,
                           "n": n_tasks, "timeout": deadline_s}
    # A private RAY_TMPDIR marks every process this Ray starts: those, and only those, are
    # stopped afterwards (`ray stop --force` would stop every Ray on the machine).
    private = tempfile.mkdtemp(prefix="r", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=ROOT,  # its workers import the task by name
               RAY_TMPDIR=private)
    before, since = set(psutil.pids()), time.time()
    try:
        p = subprocess.run([RAY_PY, "-c", script], capture_output=True, text=True, preexec_fn=cg.launcher(),
                           timeout=deadline_s + 120, env=env)
        out = [line for line in p.stdout.splitlines() if line.startswith("{")]
        res = json.loads(out[-1]) if out else {"seconds": None, "failed": n_tasks}
        tasks_killed_by_ray = p.stderr.count("OutOfMemoryError")
        oom_killed = tasks_killed_by_ray
        lost = int(p.returncode != 0 and not out)
        if not out:
            log(f"  ray failed: {p.stderr[-600:]}")
            errors.append(f"ray, {over}x: no result (exit {p.returncode}): {p.stderr[-300:]}")
    except subprocess.TimeoutExpired:
        res, oom_killed, lost = {"seconds": None, "failed": n_tasks}, 0, 1
    finally:
        proctree.kill_all(proctree.ours("RAY_TMPDIR", private, before, since))
        shutil.rmtree(private, ignore_errors=True)
    cg.remove()
    return {"seconds": round(res["seconds"], 2) if res["seconds"] else None,
            "kernel_oom_kills": kernel_oom_kills() - oom0, "tasks_killed": oom_killed,
            "tasks_failed": res["failed"], "agent_worst_ping_s": None, "lost_nodes": lost}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--node-mem", default="4GiB")
    p.add_argument("--task-mib", type=int, default=1024)
    p.add_argument("--over", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--kinds", nargs="+", default=["short", "long"], choices=["short", "long"])
    p.add_argument("--modes", nargs="+", default=["off", "poll95", "outlast", "ray"],
                   choices=["off", "poll95", "outlast", "ray"])
    p.add_argument("--short-s", type=float, default=0.8)
    p.add_argument("--long-s", type=float, default=10.0)
    p.add_argument("--waves", type=int, default=2,
                   help="tasks = max(waves, over) x slots (x 4 for short tasks)")
    p.add_argument("--deadline-x", type=float, default=6.0, help="a cell stops at this many times its ideal time")
    args = p.parse_args()
    args.node_mem = parse_bytes(args.node_mem)
    # What fits at once next to the system's reservation, with room for each task's Python.
    slots = max(int((args.node_mem - RESERVED) // ((args.task_mib + 160) * MiB)), 1)
    results, errors = [], []
    for kind in args.kinds:
        seconds = args.short_s if kind == "short" else args.long_s
        for over in args.over:
            # At least as many tasks as the oversubscription offers at once, or it would not be offered.
            n_tasks = slots * max(args.waves, over) * (4 if kind == "short" else 1)
            ideal = n_tasks * seconds / slots
            for mode in args.modes:
                if mode == "ray" and not os.path.exists(RAY_PY):
                    log("skipping ray: bench/.ray-venv is missing (bench/setup_ray_venv.sh)")
                    continue
                log(f"{kind} tasks ({seconds} s), {over}x oversubscription, {mode}: {n_tasks} tasks, "
                    f"{slots} fit at once, ideal {ideal:.1f} s")
                deadline = max(60.0, args.deadline_x * ideal)
                try:
                    cell = run_ray(args, over, seconds, n_tasks, slots, deadline, errors) if mode == "ray" else \
                        run_outlast(mode, args, over, seconds, n_tasks, slots, deadline)
                except Exception as e:  # the harness failed, not the system measured: say so and go on
                    errors.append(f"{kind} {over}x {mode}: {type(e).__name__}: {e}")
                    continue
                cell.update(kind=kind, over=over, mode=mode, tasks=n_tasks, ideal_s=round(ideal, 2),
                            vs_ideal=round(cell["seconds"] / ideal, 3) if cell["seconds"] else None)
                log(f"  -> {cell}")
                results.append(cell)
    print(json.dumps({"node_memory": args.node_mem, "task_mib": args.task_mib, "slots": slots,
                      "reserved": RESERVED, "cpus": os.cpu_count(), "load": harness.load(),
                      "results": results, "errors": errors}, indent=2))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
