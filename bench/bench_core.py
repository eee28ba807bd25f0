"""Core-runtime benchmark: outlast vs Ray Train V2 on the same script.

    python3 bench/bench_core.py [--only ray|outlast] [--modes startup report kill]
                                [--repeat N]

Runs bench/core_scenario.py for each framework, cold (the framework starts
its own node inside fit()) and against a running cluster/agent, plus the
bare torch floor (bench/floor.py). Prints one JSON document on stdout;
progress goes to stderr. Every figure is lower-is-better, so
ratio = ray / outlast and a ratio above 1 means outlast is better.
"""
import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
OUTLAST_VENV = os.path.join(ROOT, ".venv", "bin")
RAY_VENV = os.path.join(BENCH, ".ray-venv", "bin")

try:
    import psutil  # noqa: F401
except ImportError:
    # The project venv has psutil; prefer it to installing into a stranger's python.
    alt = os.path.join(OUTLAST_VENV, "python")
    if os.path.exists(alt) and os.path.realpath(sys.prefix) != os.path.dirname(OUTLAST_VENV):
        os.execv(alt, [alt, os.path.abspath(__file__), *sys.argv[1:]])
    subprocess.check_call([sys.executable, "-m", "pip", "install", "psutil"])

import psutil  # noqa: E402
import proctree  # noqa: E402  (needs psutil, ensured above)

FW = {
    "ray": {"python": os.path.join(RAY_VENV, "python"), "cli": os.path.join(RAY_VENV, "ray"),
            "start": ["start", "--head", "--num-cpus=2", "--disable-usage-stats"],
            "stop": ["stop", "--force"], "keyword": "ray"},
    "outlast": {"python": os.path.join(OUTLAST_VENV, "python"),
                "cli": os.path.join(OUTLAST_VENV, "outlast"),
                "start": ["start"], "stop": ["stop"], "keyword": "outlast"},
}


def log(msg):
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def env_for(fw):
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_TRAIN_V2_ENABLED="1")
    if fw == "outlast":
        # A source checkout runs without outlast installed; harmless once it is.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    return env


def read_events(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_measured(cmd, env, logfile, timeout, cluster_roots=()):
    """Runs cmd; returns (rc or 'timeout', Popen time, peak PSS in bytes,
    number of processes the PSS covered)."""
    with open(logfile, "w") as out:
        t0 = time.time()
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    sampler = proctree.PssSampler(cluster_roots)
    try:
        sampler.add_root(psutil.Process(proc.pid))
    except psutil.NoSuchProcess:
        pass
    sampler.start()
    rc = "timeout"
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proctree.killpg(proc.pid)
    finally:
        peak = sampler.stop()
        # The run's own leftovers only; a running cluster's workers stay.
        own = [p for p in sampler.alive() if not _in_cluster(p, cluster_roots)]
        if own and rc != "timeout":
            # A cold node shuts itself down after its driver; give it the chance.
            _, own = psutil.wait_procs(own, timeout=10)
        proctree.kill_all(own)
        proctree.killpg(proc.pid)
        proc.wait()
    return rc, t0, peak, len(sampler.seen)


def _in_cluster(proc, roots):
    try:
        lineage = {proc.pid} | {p.pid for p in proc.parents()}
    except psutil.Error:
        return False
    return any(r.pid in lineage for r in roots)


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


def run_scenario(fw, mode, cluster, args, workdir, cluster_roots):
    tag = f"{fw}-{mode}-{'cluster' if cluster else 'cold'}-{time.time_ns()}"
    events = os.path.join(workdir, tag + ".jsonl")
    reports = args.reports_ray if fw == "ray" else args.reports_outlast
    cmd = [FW[fw]["python"], os.path.join(BENCH, "core_scenario.py"), "--framework", fw,
           "--mode", mode, "--events", events, "--reports", str(reports)]
    if cluster:
        cmd += ["--address", "auto"]
    rc, t0, peak, nprocs = run_measured(cmd, env_for(fw), os.path.join(workdir, tag + ".log"),
                                args.timeout, cluster_roots)
    figs = scenario_figures(mode, read_events(events), t0)
    figs["peak_pss_gib"] = peak / 2**30
    ok = rc == 0 and len(figs) > 1
    log(f"{tag}: rc={rc} {json.dumps({k: round(v, 3) for k, v in figs.items()})}"
        f" ({nprocs} processes sampled)")
    if ok:
        return figs, None
    # A failed run's partial figures (e.g. memory up to a timeout) would mislead.
    return {}, f"{tag}: rc={rc}, figures={figs}, see {os.path.join(workdir, tag + '.log')}"


def start_cluster(fw, workdir, before, since):
    logfile = os.path.join(workdir, f"{fw}-cluster-start.log")
    with open(logfile, "w") as out:
        subprocess.run([FW[fw]["cli"], *FW[fw]["start"]], env=env_for(fw), cwd=ROOT,
                       stdout=out, stderr=subprocess.STDOUT, timeout=180, check=True)
    roots = proctree.new_processes(before, since, FW[fw]["keyword"])
    log(f"{fw} cluster up: {len(roots)} processes")
    return roots


def stop_cluster(fw, workdir, before, since, roots):
    with open(os.path.join(workdir, f"{fw}-cluster-stop.log"), "w") as out:
        try:
            subprocess.run([FW[fw]["cli"], *FW[fw]["stop"]], env=env_for(fw), cwd=ROOT,
                           stdout=out, stderr=subprocess.STDOUT, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            log(f"{fw} stop failed: {e}")
    leftovers = proctree.PssSampler(roots)
    leftovers.sample()
    procs = leftovers.alive()
    if fw == "ray":
        # `ray stop --force` already kills every ray process on the machine,
        # so sweeping new ray-looking processes adds no new risk.
        procs += proctree.new_processes(before, since, "ray")
    if procs:
        log(f"{fw}: killing {proctree.kill_all(procs)} leftover processes")


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


def median_figures(runs):
    keys = {k for r in runs for k in r}
    return {k: statistics.median([r[k] for r in runs if k in r]) for k in sorted(keys)}


def run_floor(repeat, workdir, errors):
    # Either venv will do: both carry the same torch.
    python = next(FW[fw]["python"] for fw in ("outlast", "ray")
                  if os.path.exists(FW[fw]["python"]))
    runs = []
    for i in range(repeat):
        events = os.path.join(workdir, f"floor-{i}.jsonl")
        cmd = [python, os.path.join(BENCH, "floor.py"), "--events", events]
        rc, t0, peak, _ = run_measured(cmd, dict(os.environ),
                                       os.path.join(workdir, f"floor-{i}.log"), 120)
        step = next((e for e in read_events(events) if e.get("ev") == "step"), None)
        if rc != 0 or step is None:
            errors.append(f"floor-{i}: rc={rc}")
            continue
        runs.append({"start_to_first_step_s": step["t"] - t0, "peak_pss_gib": peak / 2**30})
        log(f"floor-{i}: {json.dumps({k: round(v, 3) for k, v in runs[-1].items()})}")
    return median_figures(runs)


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=sorted(FW))
    p.add_argument("--modes", nargs="+", default=["startup", "report", "kill"],
                   choices=["startup", "report", "kill"])
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--reports-ray", type=int, default=5,
                   help="back-to-back reports timed on Ray (about 2 s each)")
    p.add_argument("--reports-outlast", type=int, default=2000)
    p.add_argument("--timeout", type=int, default=420, help="seconds per scenario run")
    p.add_argument("--no-floor", action="store_true")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    frameworks = [args.only] if args.only else ["outlast", "ray"]
    if "ray" in frameworks and not os.path.exists(FW["ray"]["python"]):
        log("creating bench/.ray-venv")
        subprocess.run(["bash", os.path.join(BENCH, "setup_ray_venv.sh")], check=True,
                       stdout=sys.stderr)
    workdir = tempfile.mkdtemp(prefix="outlast-bench-")
    log(f"logs and events in {workdir}")
    # A private outlast state dir: the benchmark's agent must not be found by
    # anything else on the machine, nor may its runs join someone else's agent.
    os.environ["OUTLAST_HOME"] = os.path.join(workdir, "outlast-home")
    figures = {fw: {} for fw in frameworks}
    floor, errors = {}, []

    if not args.no_floor:
        floor = run_floor(args.repeat, workdir, errors)

    for fw in frameworks:
        for cluster in (False, True):
            where = "cluster" if cluster else "cold"
            before, since, cluster_roots = proctree.pids(), time.time(), []
            try:
                if cluster:
                    cluster_roots = start_cluster(fw, workdir, before, since)
                for mode in args.modes:
                    runs = []
                    for _ in range(args.repeat):
                        figs, err = run_scenario(fw, mode, cluster, args, workdir, cluster_roots)
                        if figs:
                            runs.append(figs)
                        if err:
                            errors.append(err)
                    for k, v in median_figures(runs).items():
                        figures[fw][f"{mode}.{where}.{k}"] = v
            except (OSError, subprocess.SubprocessError) as e:
                errors.append(f"{fw} {where}: {e!r}")
                log(f"{fw} {where} failed: {e!r}")
            finally:
                if cluster:
                    stop_cluster(fw, workdir, before, since, cluster_roots)

    keys = sorted({k for fw in frameworks for k in figures[fw]})
    table = {}
    for k in keys:
        o, r = figures.get("outlast", {}).get(k), figures.get("ray", {}).get(k)
        table[k] = {"outlast": o, "ray": r, "ratio": r / o if o and r is not None else None}
    mem = psutil.virtual_memory().total / 2**30
    doc = {
        "figures": table,
        "floor": floor,
        "machine": {"nproc": os.cpu_count(), "mem_gib": round(mem, 1),
                    "platform": platform.platform(), "python": platform.python_version(),
                    "versions": {fw: versions(fw) for fw in frameworks}},
        "settings": {"repeat": args.repeat, "modes": args.modes,
                     "reports_ray": args.reports_ray, "reports_outlast": args.reports_outlast},
        "errors": errors,
        "logs": workdir,
    }
    print(json.dumps(doc, indent=2))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
