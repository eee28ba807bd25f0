"""Core-runtime benchmark: outlast vs Ray Train V2 on the same script.

    python3 -m bench.core [--only ray|outlast] [--modes startup report kill]
                          [--where cold cluster] [--repeat N] [--no-memory] [--out bench/results/core.json]

Runs bench/lib/core_scenario.py for each framework, cold (the framework starts
its own node inside fit()) and against a running cluster/agent, the two
frameworks interleaved run by run; plus two floors: the cold floor
(bench/lib/floor.py, two fresh Pythons that import torch and run one DDP step) and
the warm floor (bench/lib/warm_floor.py, a process with torch imported forks two
ranks that run one DDP step: the limit for a warm start and a restart).

Timings and memory come from separate runs: sampling every process's memory
map takes CPU from the processes being timed (Ray's workers run at nice 15).
`report()` is also timed on Ray with RAY_TRAIN_HEALTH_CHECK_INTERVAL_S set low
(row "ray_fast_poll"), so the ratio is not only about Ray's 2 s default poll.

outlast runs from this checkout, byte-compiled first (compileall, as `pip install` does): an environment
with PYTHONDONTWRITEBYTECODE=1 (this machine's) would otherwise have every process of a run compile
outlast's modules again at each import, a cost no install has (bench/startup_profile.py measures it).

Every figure is the median, min and max of --repeat runs (at least 5), with the
load average at each run. Ray and outlast run with private state directories
(RAY_TMPDIR, OUTLAST_HOME), and only the processes that carry them are stopped.
Prints one JSON document on stdout (and --out); progress goes to stderr. Every
figure is lower-is-better, so ratio = ray / outlast (> 1: outlast better).
Exits 1 when any scenario failed.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import time

from bench.lib import venvs
from bench.lib.venvs import OUTLAST_PY, OUTLAST_VENV, RAY_PY, RAY_VENV, ROOT

venvs.in_project_venv(__spec__.name, "psutil")

import psutil  # noqa: E402  (ensured above)

from bench.lib import harness, proctree  # noqa: E402
from bench.lib.events import read_events  # noqa: E402

FW = {
    "ray": {"python": RAY_PY, "cli": os.path.join(RAY_VENV, "ray"),
            "start": ["start", "--head", "--num-cpus=2", "--disable-usage-stats"],
            "private": "RAY_TMPDIR"},
    "outlast": {"python": OUTLAST_PY,
                "cli": os.path.join(OUTLAST_VENV, "outlast"),
                "start": ["start"], "stop": ["stop"], "private": "OUTLAST_HOME"},
}
FAST_POLL_S = "0.05"  # Ray's controller poll for the ray_fast_poll row (default 2 s)


def log(msg):
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def env_for(fw, fast_poll=False):
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_TRAIN_V2_ENABLED="1")
    if fw == "outlast":
        # A source checkout runs without outlast installed; harmless once it is.
        env = venvs.with_root(env)
    if fast_poll:
        env["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = FAST_POLL_S
    return env


def sweep_ours(fw, before, since):
    """Stops what this benchmark started for `fw` and nothing else: the processes that
    carry its private state directory (never `ray stop`, which stops every Ray on the machine)."""
    var = FW[fw]["private"]
    procs = proctree.ours(var, os.environ[var], before, since)
    if procs:
        proctree.kill_all(procs)
    if fw == "ray":
        # Else the next ray.init() would try to join the cluster just stopped.
        try:
            os.remove(os.path.join(os.environ["RAY_TMPDIR"], "ray", "ray_current_cluster"))
        except FileNotFoundError:
            pass
    return len(procs)


def run_measured(cmd, env, logfile, timeout, cluster_roots=(), memory=False):
    """Runs cmd; returns (rc or 'timeout', Popen time, peak PSS in bytes or None).
    Memory is sampled only when asked: the sampler's CPU would slow what is timed."""
    with open(logfile, "w") as out:
        t0 = time.time()
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    sampler = proctree.PssSampler(cluster_roots) if memory else None
    if sampler:
        try:
            sampler.add_root(psutil.Process(proc.pid))
        except psutil.NoSuchProcess:
            pass
        sampler.start()
    rc = "timeout"
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    finally:
        peak = sampler.stop() if sampler else None
        proctree.killpg(proc.pid)
        proc.wait()
    return rc, t0, peak


def scenario_figures(mode, events, t0):
    steps = [e for e in events if e.get("ev") == "step"]
    fit_start = next((e["t"] for e in events if e.get("ev") == "fit_start"), None)
    out = {}
    if mode == "startup":
        first = min((e["t"] for e in steps if e["rank"] == 0), default=None)
        if first is not None and fit_start is not None:
            out["fit_to_first_step_s"] = first - fit_start
            out["start_to_first_step_s"] = first - t0
    elif mode == "report":
        cost = next((e for e in events if e.get("ev") == "report_cost"), None)
        if cost:
            out["report_call_s"] = cost["per_call_s"]
    elif mode == "kill":
        kill = next((e for e in events if e.get("ev") == "kill"), None)
        if kill:
            # The other rank may log its own last step just after the kill;
            # only a process that was not running before the kill has recovered.
            before = {e["pid"] for e in steps if e["t"] <= kill["t"]}
            after = [e for e in steps if e["t"] > kill["t"] and e["pid"] not in before]
            if after:
                first = min(after, key=lambda e: e["t"])
                out["kill_to_training_s"] = first["t"] - kill["t"]
                out["steps_lost"] = kill["step"] - (first["restored_from"] or 0)
    return out


def run_scenario(row, mode, cluster, args, workdir, cluster_roots=(), memory=False):
    """One run of bench/lib/core_scenario.py; returns (figures, error). `row` is a framework or
    ray_fast_poll (Ray with its controller poll set low)."""
    fw = "ray" if row.startswith("ray") else "outlast"
    where = "cluster" if cluster else "cold"
    tag = f"{row}-{mode}-{where}{'-mem' if memory else ''}-{time.time_ns()}"
    events = os.path.join(workdir, tag + ".jsonl")
    reports = args.reports_ray if fw == "ray" else args.reports_outlast
    cmd = venvs.module(FW[fw]["python"], "bench.lib.core_scenario", "--framework", fw,
                       "--mode", mode, "--events", events, "--reports", str(reports))
    if cluster:
        cmd += ["--address", "auto"]
    load = harness.load()
    before, since = proctree.pids(), time.time()
    rc, t0, peak = run_measured(cmd, env_for(fw, fast_poll=row == "ray_fast_poll"),
                                os.path.join(workdir, tag + ".log"), args.timeout, cluster_roots, memory)
    if not cluster:
        sweep_ours(fw, before, since)  # a cold node's leftovers, if it did not stop by itself
    figs = scenario_figures(mode, read_events(events), t0)
    if memory:
        figs = {"peak_pss_gib": peak / 2**30} if figs else {}
    log(f"{tag}: rc={rc} load={load[0]} {json.dumps({k: round(v, 4) for k, v in figs.items()})}")
    if rc == 0 and figs:
        figs["load1"] = load[0]
        return figs, None
    # A failed run's partial figures (e.g. memory up to a timeout) would mislead.
    return {}, f"{tag}: rc={rc}, figures={figs}, see {os.path.join(workdir, tag + '.log')}"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_cluster(fw, workdir):
    logfile = os.path.join(workdir, f"{fw}-cluster-start.log")
    # Ray's fixed default ports may belong to someone else's cluster on this machine.
    extra = [f"--{flag}={free_port()}" for flag in ("port", "dashboard-port", "dashboard-agent-listen-port")
             ] if fw == "ray" else []
    before, since = proctree.pids(), time.time()
    with open(logfile, "a") as out:
        subprocess.run([FW[fw]["cli"], *FW[fw]["start"], *extra], env=env_for(fw), cwd=ROOT,
                       stdout=out, stderr=subprocess.STDOUT, timeout=180, check=True)
    roots = proctree.ours(FW[fw]["private"], os.environ[FW[fw]["private"]], before, since)
    log(f"{fw} cluster up: {len(roots)} processes")
    return roots, before, since


def stop_cluster(fw, workdir, before, since):
    if FW[fw].get("stop"):
        with open(os.path.join(workdir, f"{fw}-cluster-stop.log"), "a") as out:
            try:
                subprocess.run([FW[fw]["cli"], *FW[fw]["stop"]], env=env_for(fw), cwd=ROOT,
                               stdout=out, stderr=subprocess.STDOUT, timeout=120)
            except (OSError, subprocess.TimeoutExpired) as e:
                log(f"{fw} stop failed: {e}")
    left = sweep_ours(fw, before, since)
    if left:
        log(f"{fw}: killed {left} leftover processes")


def versions(fw):
    code = ("import importlib, importlib.metadata as m, json, torch\n"
            f"try: v = m.version('{fw}')\n"
            f"except m.PackageNotFoundError: v = getattr(importlib.import_module('{fw}'),"
            " '__version__', 'unversioned')\n"
            f"print(json.dumps({{'torch': torch.__version__, '{fw}': v}}))")
    try:
        r = subprocess.run([FW[fw]["python"], "-c", code], env=env_for(fw),
                           capture_output=True, text=True, timeout=120)
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return {fw: None}


def byte_compile():
    """outlast's modules and bench's, compiled into their __pycache__ as an install's are (module docstring)."""
    subprocess.run([OUTLAST_PY, "-m", "compileall", "-q", os.path.join(ROOT, "outlast"), os.path.join(ROOT, "bench")],
                   stdout=subprocess.DEVNULL, check=True, timeout=300)


def run_floors(repeat, workdir, errors):
    """The cold floor (fresh Pythons, mp.spawn) and the warm floor (forks of a warm process)."""
    python = next(FW[fw]["python"] for fw in ("outlast", "ray") if os.path.exists(FW[fw]["python"]))
    cold = []
    for i in range(repeat):
        events = os.path.join(workdir, f"floor-{i}.jsonl")
        load = harness.load()
        rc, t0, _ = run_measured(venvs.module(python, "bench.lib.floor", "--events", events),
                                 dict(os.environ), os.path.join(workdir, f"floor-{i}.log"), 180)
        step = next((e for e in read_events(events) if e.get("ev") == "step"), None)
        if rc != 0 or step is None:
            errors.append(f"floor-{i}: rc={rc}")
            continue
        cold.append({"start_to_first_step_s": step["t"] - t0, "load1": load[0]})
    events = os.path.join(workdir, "warm-floor.jsonl")
    load = harness.load()
    rc, _, _ = run_measured(venvs.module(python, "bench.lib.warm_floor", "--events", events,
                                         "--repeat", str(repeat)), dict(os.environ),
                            os.path.join(workdir, "warm-floor.log"), 300)
    warm = [{"fork_to_first_step_s": e["fork_to_step_s"], "load1": load[0]}
            for e in read_events(events) if e.get("ev") == "warm_floor"]
    if rc != 0 or len(warm) < repeat:
        errors.append(f"warm floor: rc={rc}, {len(warm)} of {repeat} runs, see {workdir}/warm-floor.log")
    out = {"cold": harness.summarize_runs(cold), "warm": harness.summarize_runs(warm)}
    log(f"floors: {json.dumps(out)}")
    return out


def timing_runs(frameworks, modes, args, workdir, errors):
    """{row: {figure key: [per-run dicts]}}, the frameworks interleaved run by run."""
    runs = {}

    def keep(row, mode, where, figs, err):
        if err:
            errors.append(err)
        if figs:
            runs.setdefault(row, {}).setdefault(f"{mode}.{where}", []).append(figs)

    for where in args.where:
        for _, fw in harness.interleaved(frameworks, args.repeat):
            rows = [fw] + (["ray_fast_poll"] if fw == "ray" and "report" in modes else [])
            cluster = where == "cluster"
            roots, before, since = [], proctree.pids(), time.time()
            try:
                if cluster:
                    roots, before, since = start_cluster(fw, workdir)
                for mode in modes:
                    for row in rows if mode == "report" else [fw]:
                        keep(row, mode, where, *run_scenario(row, mode, cluster, args, workdir, roots))
            except (OSError, subprocess.SubprocessError) as e:
                errors.append(f"{fw} {where}: {e!r}")
                log(f"{fw} {where} failed: {e!r}")
            finally:
                if cluster:
                    stop_cluster(fw, workdir, before, since)
    return runs


def memory_runs(frameworks, args, workdir, errors):
    """Peak PSS of a cold startup run, in runs of their own."""
    runs = {}
    for _, fw in harness.interleaved(frameworks, args.repeat):
        figs, err = run_scenario(fw, "startup", False, args, workdir, memory=True)
        if err:
            errors.append(err)
        if figs:
            runs.setdefault(fw, {}).setdefault("memory.cold", []).append(figs)
    return runs


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=sorted(FW))
    p.add_argument("--modes", nargs="+", default=["startup", "report", "kill"],
                   choices=["startup", "report", "kill"])
    p.add_argument("--where", nargs="+", default=["cold", "cluster"], choices=["cold", "cluster"],
                   help="cold: fit() starts the framework; cluster: against a running node/cluster")
    p.add_argument("--repeat", type=int, default=5, help="runs per figure (medians of fewer than 5 say little)")
    p.add_argument("--reports-ray", type=int, default=5,
                   help="back-to-back reports timed on Ray (about 2 s each at its default poll)")
    p.add_argument("--reports-outlast", type=int, default=2000)
    p.add_argument("--timeout", type=int, default=420, help="seconds per scenario run")
    p.add_argument("--no-floor", action="store_true")
    p.add_argument("--no-memory", action="store_true", help="skip the memory runs")
    p.add_argument("--out", help="also write the JSON document here (bench/results/...)")
    args = p.parse_args()
    frameworks, workdir = harness.prepare_both(args.only, "outlast-bench-")
    log(f"logs and events in {workdir}")
    if "outlast" in frameworks:
        byte_compile()
    started, load_before = time.time(), harness.load()
    errors = []
    floor = {} if args.no_floor else run_floors(args.repeat, workdir, errors)
    runs = timing_runs(frameworks, args.modes, args, workdir, errors)
    if not args.no_memory:
        for row, figs in memory_runs(frameworks, args, workdir, errors).items():
            runs.setdefault(row, {}).update(figs)

    figures = {}
    for row, by_key in runs.items():
        for prefix, per_run in by_key.items():
            for k, v in harness.summarize_runs(per_run).items():
                figures.setdefault(f"{prefix}.{k}", {})[row] = v
    for k, rows in figures.items():
        if "outlast" in rows:
            for other in ("ray", "ray_fast_poll"):
                if other in rows and not k.endswith("load1"):
                    rows[f"ratio_{other}"] = harness.ratio(rows[other], rows["outlast"])
    doc = {
        "benchmark": "core",
        "date": harness.stamp(),
        "figures": dict(sorted(figures.items())),
        "floor": floor,
        "machine": harness.machine({fw: versions(fw) for fw in frameworks}),
        "load": {"before": load_before, "after": harness.load(),
                 "note": "a shared machine: each figure carries load1, the 1-min load average at each run"},
        "settings": {"repeat": args.repeat, "modes": args.modes, "where": args.where, "ray_fast_poll_s": FAST_POLL_S,
                     "reports_ray": args.reports_ray, "reports_outlast": args.reports_outlast,
                     "memory_in_separate_runs": not args.no_memory, "outlast_byte_compiled": "outlast" in frameworks},
        "wall_s": round(time.time() - started, 1),
        "errors": errors,
        "logs": workdir,
    }
    harness.publish(doc, args.out)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
