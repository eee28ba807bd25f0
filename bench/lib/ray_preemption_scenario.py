"""Ray 2.60 side of the preemption benchmark: drain a node under Ray Train V2.

    bench/.ray-venv/bin/python -m bench.lib.ray_preemption_scenario \
        [--variant both|spare|nospare] [--drain-step 30] [--deadline-s 20] \
        [--observe-s 60] [--idle-calls 2000] [--poll-s 5] [--no-reclaim]

A local `ray.cluster_utils.Cluster` on loopback: a head with 0 CPUs (it
hosts the driver and the Train controller only) and 2-CPU worker nodes. A
TorchTrainer (gloo, 2 CPU workers, STRICT_PACK so both land on one node)
runs a tiny loop: sleep ~20 ms, all-reduce one number (lock step, as DDP),
`ray.train.get_preemption_info()`,
`ray.train.report()` every step, a checkpoint every 10 steps, and a
just-in-time checkpoint the first time the preemption info is not None.

When rank 0 reports step --drain-step, the node holding the workers is
drained with `ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION
--deadline-remaining-seconds N`. That command only announces the drain, so
unless --no-reclaim this script plays the cloud provider and kills the node
at the deadline Ray reports for it.

  spare:   head + 2 worker nodes. Measures drain -> preemption info on every
           rank, drain -> first step on the spare node (the driver is stopped
           there), and steps lost.
  nospare: head + 1 worker node. Drains it and watches the driver's output
           for --observe-s after the deadline, then stops it.

Ray's report() paces this loop at ~1 step / 2 s (see notes.report_pace), so
the whole run takes ~5 minutes; --budget-s caps it, whatever Ray does.

Every variant runs in its own session (a child of this script); the driver
is a grandchild in its own process group. Workers append JSON lines to an
events file; the variant process reads them and the driver log. One JSON
document goes to stdout, progress to stderr. Every Ray process started here
is killed at the end by session id, even on error or timeout.
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

from bench.lib.events import emit, read_events
from bench.lib.harness import wait_for
from bench.lib.preemption_loop import preemption_loop
from bench.lib.venvs import ROOT, module

RAY_BIN = os.path.dirname(sys.executable)
# Driver-log lines that say something about the preemption or about waiting.
INTERESTING = re.compile(
    r"preempt|drain|wait|pending|resource|insufficient|placement|schedul|"
    r"retry|restart|fail|error|timed? ?out|deadline", re.I)
# Repeated once a second because this install (ray[train], no ray[default])
# has no dashboard for the state API; counted, not listed.
NOISE = re.compile(r"Failed to query Ray Train Controller actor state|^\[state-dump\]")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def log(msg):
    print(f"[preempt {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def ray_env():
    return dict(os.environ, RAY_TRAIN_V2_ENABLED="1", RAY_USAGE_STATS_ENABLED="0",
                PYTHONUNBUFFERED="1")


# ---------------------------------------------------------------- workers

def train_loop_per_worker(config):
    import ray
    from ray import train

    preemption_loop(train, config, ray.get_runtime_context().get_node_id(),
                    lambda info: {"preempted_node_to_ranks": info.preempted_node_to_ranks,
                                  "info_type": type(info).__module__ + "." + type(info).__qualname__},
                    ip=ray.util.get_node_ip_address())


def run_driver(args):
    """The user's script: connects to the cluster and calls fit()."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    ray.init(address=args.address, log_to_driver=True)
    emit(args.events, ev="driver", node=ray.get_runtime_context().get_node_id(),
         t=time.time())
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "events": args.events, "idle_calls": args.idle_calls,
            "step_s": args.step_s, "ckpt_every": args.ckpt_every,
            "steps_after_restart": args.steps_after_restart},
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False,
                                     placement_strategy="STRICT_PACK"),
        run_config=RunConfig(
            name="preempt", storage_path=args.storage,
            failure_config=FailureConfig(max_failures=-1, max_preemption_failures=-1),
            checkpoint_config=CheckpointConfig(num_to_keep=2)),
    )
    result = trainer.fit()
    emit(args.events, ev="fit_end", t=time.time(), error=repr(result.error))
    return 0 if result.error is None else 1


# ---------------------------------------------------------------- one variant

class DriverLog:
    """Tails the driver's output file, stamping each line with when it was read."""

    def __init__(self, path):
        self.path, self.pos, self.lines = path, 0, []

    def poll(self):
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                chunk = f.read()
        except FileNotFoundError:
            return
        end = chunk.rfind(b"\n") + 1
        self.pos += end
        now = time.time()
        for line in chunk[:end].decode(errors="replace").splitlines():
            self.lines.append((now, ANSI.sub("", line).strip()))


def stop_driver(proc, grace=5):
    """SIGINT (Train aborts the run), then SIGKILL to the driver's group."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=grace)
            return "exited after SIGINT"
        except (subprocess.TimeoutExpired, ProcessLookupError):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    return "killed"


def run_variant(args):
    from ray.cluster_utils import Cluster

    spare = args.variant == "spare"
    # Keep ~15 s for stopping the driver and the cluster before our parent's limit.
    until = args.until - 15 if args.until else float("inf")
    work = tempfile.mkdtemp(prefix=f"ray-preempt-{args.variant}-")
    events = os.path.join(work, "events.jsonl")
    driver_log = DriverLog(os.path.join(work, "driver.log"))
    out = {"variant": args.variant, "workdir": work}
    proc = cluster = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "include_dashboard": False})
        nodes = [cluster.add_node(num_cpus=2) for _ in range(2 if spare else 1)]
        cluster.wait_for_nodes()
        out["head_node"] = cluster.head_node.node_id
        out["worker_nodes"] = [n.node_id for n in nodes]
        log(f"{args.variant}: cluster up, head {out['head_node'][:8]}, "
            f"workers {[n[:8] for n in out['worker_nodes']]}")

        cmd = module(sys.executable, __spec__.name, "--_driver", "--address", cluster.address,
                     "--events", events, "--storage", os.path.join(work, "storage"),
                     "--idle-calls", str(args.idle_calls), "--step-s", str(args.step_s),
                     "--ckpt-every", str(args.ckpt_every),
                     "--steps-after-restart", str(args.steps_after_restart))
        env = ray_env()
        env["RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"] = str(args.poll_s)
        with open(driver_log.path, "w") as f:
            proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=f,
                                    stderr=subprocess.STDOUT, process_group=0)

        def at_drain_step():
            evs = read_events(events)
            hit = [e for e in evs if e.get("ev") == "step" and e["rank"] == 0
                   and e["step"] >= args.drain_step]
            if proc.poll() is not None:
                raise RuntimeError(f"driver exited early (rc={proc.returncode})")
            return hit and evs

        evs = wait_for(at_drain_step, min(args.start_timeout, until - time.time()),
                       f"step {args.drain_step}", poll_s=0.2, tick=driver_log.poll)
        starts = [e for e in evs if e.get("ev") == "attempt_start"]
        victim = starts[0]["node"]
        out["driver_node"] = next((e["node"] for e in evs if e.get("ev") == "driver"), None)
        out["workers_node_before"] = sorted({e["node"] for e in starts})
        out["spare_node"] = next((n for n in out["worker_nodes"] if n != victim), None)
        cost = [e for e in evs if e.get("ev") == "idle_cost"]
        if cost:
            out["idle_calls"] = cost[0]["n"]
            out["get_preemption_info_idle_call_us"] = 1e6 * max(e["per_call_s"] for e in cost)
            out["idle_call_us_by_rank"] = {e["rank"]: 1e6 * e["per_call_s"] for e in cost}

        drain = [os.path.join(RAY_BIN, "ray"), "drain-node", "--address", cluster.address,
                 "--node-id", victim, "--reason", "DRAIN_NODE_REASON_PREEMPTION",
                 "--reason-message", "bench",
                 "--deadline-remaining-seconds", str(args.deadline_s)]
        log(f"{args.variant}: draining {victim[:8]}")
        t_cmd = time.time()
        r = subprocess.run(drain, env=ray_env(), capture_output=True, text=True, timeout=60)
        t_drain = time.time()
        out.update(drain_cmd=" ".join(drain[1:]), drain_cmd_rc=r.returncode,
                   drain_cmd_s=t_drain - t_cmd, drain_t=t_drain,
                   drain_cmd_output=(r.stdout + r.stderr).strip()[-500:])
        draining = cluster.global_state.get_draining_nodes()
        deadline = draining.get(victim, 0) / 1000 or t_drain + args.deadline_s
        out["draining_nodes_after_cmd"] = draining
        out["drain_to_deadline_s"] = deadline - t_drain

        stop_at = min(until, deadline + (args.observe_s if not spare else args.after_timeout))
        reclaimed = False
        while time.time() < stop_at:
            driver_log.poll()
            if not reclaimed and not args.no_reclaim and time.time() >= deadline:
                reclaimed = True
                victim_node = next(n for n in nodes if n.node_id == victim)
                t = time.time()
                cluster.remove_node(victim_node, allow_graceful=False)
                out["reclaim_t_after_drain_s"] = t - t_drain
                log(f"{args.variant}: reclaimed (killed) {victim[:8]} at the deadline")
            if proc.poll() is not None:
                break
            if spare and any(e.get("ev") == "fit_end" or (
                    e.get("ev") == "step" and e["node"] == out["spare_node"])
                    for e in read_events(events)):
                break  # the figure is in; the rest of the run proves nothing more
            time.sleep(0.2)
        driver_log.poll()
        out["observed_after_deadline_s"] = time.time() - deadline
        out["bound_t"] = time.time()
        out["driver_running_at_bound"] = proc.poll() is None
        out["driver_rc"] = proc.returncode
        if proc.poll() is None and not spare:
            out["placement_groups_at_bound"] = sorted(
                pg.get("state", "?") for pg in cluster.global_state.placement_group_table().values())
            out["alive_nodes_at_bound"] = len(cluster.global_state._live_node_ids())
        out["driver_stop"] = stop_driver(proc) if proc.poll() is None else "exited by itself"
        driver_log.poll()
        out.update(figures(read_events(events), out, t_drain, deadline, driver_log, spare))
    except Exception as e:  # report what we have; the caller sees the error
        out["error"] = f"{type(e).__name__}: {e}"
        log(f"{args.variant}: {out['error']}")
    finally:
        if proc is not None and proc.poll() is None:
            stop_driver(proc, grace=3)
        if cluster is not None:
            try:
                cluster.shutdown()
            except Exception as e:
                out["shutdown_error"] = repr(e)
        with open(args.out, "w") as f:
            json.dump(out, f)
    return 0


def figures(evs, out, t_drain, deadline, driver_log, spare):
    fig = {}
    seen = [e for e in evs if e.get("ev") == "preempt_seen"]
    ranks = {e["rank"] for e in evs if e.get("ev") == "attempt_start"}
    first_seen = {}
    for e in seen:
        first_seen.setdefault(e["rank"], e)
    if first_seen and set(first_seen) >= ranks:
        fig["drain_to_preemption_info_all_ranks_s"] = max(
            e["t"] for e in first_seen.values()) - t_drain
        e0 = first_seen[min(first_seen)]
        fig["preemption_info_example"] = {
            "type": e0["info_type"], "deadline_ms": e0["deadline_ms"],
            "preempted_node_to_ranks": e0["preempted_node_to_ranks"],
            "seen_at_step": e0["step"]}
    jit = [e for e in evs if e.get("ev") == "ckpt" and e.get("jit") and e["rank"] == 0]
    if jit:
        fig["jit_checkpoint_step"] = jit[0]["step"]
        fig["drain_to_jit_checkpoint_s"] = jit[0]["t"] - t_drain
    steps = [e for e in evs if e.get("ev") == "step"]
    first_pids = {e["pid"] for e in evs if e.get("ev") == "attempt_start"
                  and e["restored_from"] is None}
    before = [e for e in steps if e["pid"] in first_pids]
    if before:
        fig["last_step_before_restart"] = max(e["step"] for e in before)
        fig["last_step_t_after_drain_s"] = max(e["t"] for e in before) - t_drain
    restarts = [e for e in evs if e.get("ev") == "attempt_start" and e["t"] > t_drain]
    fig["ranks_started_after_drain"] = len(restarts)
    ck = [e for e in evs if e.get("ev") == "ckpt" and e["pid"] in first_pids and e["rank"] == 0]
    if ck:
        fig["last_ckpt_step_written_before_restart"] = max(e["step"] for e in ck)
    if spare:
        on_spare = [e for e in steps if e["t"] > t_drain and e["node"] == out.get("spare_node")]
        if on_spare:
            first = min(on_spare, key=lambda e: e["t"])
            fig["drain_to_first_step_on_spare_s"] = first["t"] - t_drain
            fig["deadline_to_first_step_on_spare_s"] = first["t"] - deadline
            fig["restarted_attempt"] = {
                "node": first["node"], "ip": next(
                    e["ip"] for e in restarts if e["pid"] == first["pid"]),
                "resumed_from_step": first["restored_from"], "first_step": first["step"]}
            if before and first["restored_from"] is not None:
                fig["steps_lost"] = fig["last_step_before_restart"] - first["restored_from"]
    lines = [(t, line) for t, line in driver_log.lines if t >= t_drain - 0.5]
    after = [(round(t - t_drain, 1), line[:240]) for t, line in lines
             if INTERESTING.search(line) and not NOISE.search(line)]
    fig["driver_log_lines_after_drain"] = len(lines)
    fig["driver_log_noise_lines_after_drain"] = sum(bool(NOISE.search(x)) for _, x in lines)
    fig["driver_log_interesting_after_drain"] = after[:30]
    if after:
        later = [a for a in after if a[0] > deadline - t_drain]
        if later:
            fig["first_interesting_line_after_deadline_s"] = later[0][0] - (deadline - t_drain)
    if not spare and "bound_t" in out:
        # What the user sees: the last thing Ray printed before our bound, and since when.
        said = [(t, x) for t, x in lines if t <= out["bound_t"] and x and not NOISE.search(x)]
        if said:
            fig["last_driver_line_before_bound"] = said[-1][1][:240]
            fig["driver_silent_for_s_at_bound"] = out["bound_t"] - said[-1][0]
    return fig


# ---------------------------------------------------------------- orchestration

def session_procs(sid):
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # field 6 of stat: session id
            pids.append(int(d))
    return pids


def sweep(sid):
    """Kills everything left in a variant's session (Ray daemons, workers)."""
    left = [p for p in session_procs(sid) if p != os.getpid()]
    for p in left:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(left)


def run_child(variant, args, timeout):
    fd, result = tempfile.mkstemp(prefix=f"ray-preempt-{variant}-", suffix=".json")
    os.close(fd)
    spare = variant == "spare"
    cmd = [*module(sys.executable, __spec__.name), "--_variant", variant, "--out", result,
           "--until", str(time.time() + timeout),
           "--drain-step", str(args.drain_step if spare else args.nospare_drain_step),
           "--deadline-s", str(args.deadline_s), "--observe-s", str(args.observe_s),
           "--idle-calls", str(args.idle_calls if spare else 0),
           "--poll-s", str(args.poll_s), "--step-s", str(args.step_s),
           "--ckpt-every", str(args.ckpt_every), "--after-timeout", str(args.after_timeout),
           "--steps-after-restart", str(args.steps_after_restart),
           "--start-timeout", str(args.start_timeout)]
    if args.no_reclaim:
        cmd.append("--no-reclaim")
    log(f"{variant}: starting (limit {timeout:.0f}s)")
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=ray_env(), cwd=ROOT, start_new_session=True)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    finally:
        killed = sweep(proc.pid)  # start_new_session: the sid is the child's pid
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with open(result) as f:
        text = f.read()
    os.unlink(result)
    res = json.loads(text) if text else {"error": f"no result (rc={proc.returncode}, "
                                         f"timed out after {timeout:.0f}s?)"}
    res["wall_s"] = time.time() - t0
    res["leftover_processes_killed"] = killed
    log(f"{variant}: done in {res['wall_s']:.0f}s, swept {killed} leftover processes")
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", choices=["both", "spare", "nospare"], default="both")
    p.add_argument("--drain-step", type=int, default=30, help="spare: drain once rank 0 has reported this step")
    p.add_argument("--nospare-drain-step", type=int, default=2,
                   help="nospare: the same (early: each Ray report takes ~2 s)")
    p.add_argument("--deadline-s", type=int, default=20, help="--deadline-remaining-seconds given to ray drain-node")
    p.add_argument("--observe-s", type=float, default=60, help="nospare: how long to watch after the deadline")
    p.add_argument("--idle-calls", type=int, default=2000,
                   help="spare: back-to-back get_preemption_info() calls timed before the loop (nospare skips them)")
    p.add_argument("--poll-s", type=float, default=5.0,
                   help="RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S (Ray's default is 5)")
    p.add_argument("--step-s", type=float, default=0.02)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--steps-after-restart", type=int, default=3,
                   help="the restarted attempt runs this many steps, then returns"
                        " (the spare run stops the driver at the first one anyway)")
    p.add_argument("--after-timeout", type=float, default=60, help="spare: give up this long after the deadline")
    p.add_argument("--start-timeout", type=float, default=120,
                   help="limit for cluster + training start up to --drain-step")
    p.add_argument("--budget-s", type=float, default=320, help="wall-clock limit for the whole script")
    p.add_argument("--no-reclaim", action="store_true", help="only announce the drain; never kill the drained node")
    # Internal roles.
    p.add_argument("--_variant", choices=["spare", "nospare"], help=argparse.SUPPRESS)
    p.add_argument("--_driver", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--until", type=float, help=argparse.SUPPRESS)
    p.add_argument("--address", help=argparse.SUPPRESS)
    p.add_argument("--events", help=argparse.SUPPRESS)
    p.add_argument("--storage", help=argparse.SUPPRESS)
    args = p.parse_args()

    if args._driver:
        return run_driver(args)
    if args._variant:
        args.variant = args._variant
        return run_variant(args)

    t0 = time.time()
    variants = ["spare", "nospare"] if args.variant == "both" else [args.variant]
    results = {}
    for i, v in enumerate(variants):
        left = args.budget_s - (time.time() - t0) - 3
        # The spare run needs ~175 s on 2 busy cores, the nospare one ~135 s (60 s
        # of it watching); a squeezed nospare run watches for less and says so.
        limit = left if i == len(variants) - 1 else min(left - 125, 195)
        results[v] = run_child(v, args, max(limit, 30))

    import ray
    s = results.get("spare", {})
    written, resumed = (s.get("last_ckpt_step_written_before_restart"),
                        (s.get("restarted_attempt") or {}).get("resumed_from_step"))
    doc = {
        "ray_version": ray.__version__,
        "drain_to_preemption_info_all_ranks_s": s.get("drain_to_preemption_info_all_ranks_s"),
        "get_preemption_info_idle_call_us": s.get("get_preemption_info_idle_call_us"),
        "drain_to_first_step_on_spare_s": s.get("drain_to_first_step_on_spare_s"),
        "steps_lost": s.get("steps_lost"),
        "last_ckpt_step_written_before_restart": s.get("last_ckpt_step_written_before_restart"),
        "resumed_from_step": (s.get("restarted_attempt") or {}).get("resumed_from_step"),
        "total_wall_s": time.time() - t0,
        "notes": {
            "api": "ray.train.get_preemption_info() -> Optional[ray.train.PreemptionInfo]"
                   " (frozen dataclass: deadline_ms: Optional[int] epoch ms,"
                   " preempted_node_to_ranks: Dict[node_id_hex, List[rank]];"
                   " properties preempted_node_ids, preempted_ranks). It is a"
                   " broadcast from rank 0 through Train's sync actor: a barrier.",
            "detection": "A PreemptionWatcher actor polls GCS draining nodes every"
                         f" RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S (set to {args.poll_s}s;"
                         " Ray's default 5 s) and pushes the info to the workers.",
            "restart": "The controller enters PREEMPTING and restarts the worker group"
                       " only when the drain deadline passes (or every rank exits);"
                       " FailureConfig.max_preemption_failures (default -1) is the"
                       " retry budget, separate from max_failures.",
            "reclaim": "ray drain-node does not kill the node; " + (
                "--no-reclaim: the drained node stayed up." if args.no_reclaim else
                "this script killed the drained node (cluster.remove_node) at the"
                " deadline, as a cloud provider would."),
            "drain_time": "drain_t is when `ray drain-node` returned (the CLI takes"
                          " ~1-2 s to import Ray first); figures are measured from it.",
            "report_pace": "ray.train.report() hands its result to a queue of size 1"
                           " that the controller empties once per poll"
                           " (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, default 2 s, left as is),"
                           " so this loop, which reports every step, runs at ~1 step / 2 s"
                           " however short the step is.",
            "checkpoint_after_detection": (
                f"rank 0 wrote and reported a checkpoint at step {written} before the"
                f" deadline, yet the restart resumed from step {resumed}; see"
                " checkpoint_manager_snapshot.json under spare.workdir."
                if written is not None and resumed is not None and written > resumed
                else "the restart resumed from the last checkpoint written."),
            "no_spare_timeout": "with no node to go to, the controller retries the"
                                " worker group start, which waits for a placement group"
                                " and fails after RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"
                                " (60 s, i.e. ~66 s after the deadline), then retries"
                                " forever; a 60 s watch ends just before that message.",
            "ip": "all nodes share this machine's IP; the node id proves the restarted"
                  " workers are on the spare node.",
        },
        "no_spare": {k: (results.get("nospare") or {}).get(k) for k in (
            "observed_after_deadline_s", "driver_running_at_bound",
            "placement_groups_at_bound", "alive_nodes_at_bound",
            "ranks_started_after_drain", "last_driver_line_before_bound",
            "driver_silent_for_s_at_bound", "driver_stop", "error")},
        "spare": s,
        "nospare": results.get("nospare"),
    }
    print(json.dumps(doc, indent=1, default=str))
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
