"""Durability benchmark: outlast vs Ray Train V2 on the same scripts.

    python3 -m bench.durable [--only ray|outlast] [--parts 1,2,3] [--repeat N]

1  kill:     SIGKILL the driver of a 2-worker DDP run after step ~25, launch
             the same command again, time kill -> first step of the relaunch
             and count the steps lost; cold (the framework starts inside the
             driver) and against a running cluster/node. Floor: bench/lib/floor.py.
2  overhead: training time with a ~20 MB checkpoint every 10 steps, uploaded
             synchronously and asynchronously, against no checkpoints.
3  upload:   MB/s of a ~500 MB checkpoint directory into storage, against a
             plain copy of the same files (local file system, and S3 on a
             loopback moto server).

Prints one JSON document on stdout; progress goes to stderr. Every figure
has outlast, ray and ratio, where ratio > 1 means outlast is better
(ray / outlast for times and percentages, outlast / ray for throughputs).
Medians over --repeat runs.
"""
import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

from bench.lib import venvs
from bench.lib.venvs import OUTLAST_PY, OUTLAST_VENV, RAY_PY, RAY_VENV, ROOT

venvs.in_project_venv(__spec__.name, "psutil")

import psutil  # noqa: E402  (ensured above)

from bench.lib import harness, proctree  # noqa: E402
from bench.lib.events import read_events  # noqa: E402
from bench.lib.proctree import alive  # noqa: E402

FW = {
    "ray": {"python": RAY_PY, "cli": os.path.join(RAY_VENV, "ray"),
            "start": ["start", "--head", "--num-cpus=2", "--disable-usage-stats"],
            # Not `ray stop --force`: it kills every Ray process of this user on
            # the machine, other people's included. Ours are found by PRIVATE.
            "stop": None},
    "outlast": {"python": OUTLAST_PY,
                "cli": os.path.join(OUTLAST_VENV, "outlast"), "start": ["start"], "stop": ["stop"]},
}
# The private state directory of each framework, set in main(). Whatever we
# start inherits it, so it also tells our processes from anyone else's: Ray
# keeps ray_current_cluster (what ray.init() and address='auto' join) under
# RAY_TMPDIR, outlast its node file under OUTLAST_HOME.
PRIVATE = {"ray": "RAY_TMPDIR", "outlast": "OUTLAST_HOME"}
KILL_STEP = 25  # the driver dies once rank 0 has logged this step; checkpoints every 10
LAST_STEP = 45
# How long the killed run's processes get, after the relaunch ends, to go
# away by themselves before we count (and kill) them.
ORPHAN_GRACE_S = 10
UPLOAD_FILES, UPLOAD_FILE_MB = 4, 125
S3_FILES = 2  # moto runs at ~50 MB/s here; half the files keep part 3 short


def log(msg):
    print(f"[durable {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def env_for(fw, **extra):
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_TRAIN_V2_ENABLED="1", **extra)
    return venvs.with_root(env) if fw == "outlast" else env


def launch(cmd, env, logfile):
    with open(logfile, "w") as out:
        # Own session: the driver is killed alone, and its group is ours to sweep.
        return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def wait_for(pred, proc, timeout, poll=0.01):
    """pred() polled until it returns something truthy, the process exits, or time is up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        if proc.poll() is not None:
            return pred()
        time.sleep(poll)
    return None


def tree(pid):
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


class OrphanWatch:
    """When the last of a killed run's processes went away, watched from the kill on."""

    def __init__(self, procs, t_kill):
        self.procs, self.t_kill, self.gone_s = procs, t_kill, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.05):
            if not alive(self.procs):
                self.gone_s = time.time() - self.t_kill
                return

    def stop(self, grace):
        """Waits up to `grace` seconds more; returns how many are still alive."""
        self._thread.join(grace)
        self._stop.set()
        self._thread.join()
        return len(alive(self.procs))


def sweep(procs, *popens):
    """Kills what is left of runs we started: listed processes and our sessions."""
    proctree.kill_all(alive(procs))
    for popen in popens:
        if popen is not None:
            proctree.killpg(popen.pid)
            try:
                popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def local_dir(workdir, tag):
    # A killed worker leaves its half-written checkpoint directory behind.
    path = os.path.join(workdir, tag + "-local")
    os.makedirs(path)
    return path


def median_figures(runs):
    keys = {k for r in runs for k in r}
    return {k: statistics.median([r[k] for r in runs if k in r]) for k in sorted(keys)}


# -- part 1: driver kill -9 and relaunch ------------------------------------------

def kill_once(fw, where, workdir, args, errors, notes):
    tag = f"kill-{fw}-{where}-{time.time_ns()}"
    base = venvs.module(FW[fw]["python"], "bench.lib.durable_scenario", "--framework", fw, "--mode", "kill",
                        "--storage", os.path.join(workdir, tag + "-storage"), "--name", "durable-kill",
                        "--steps", str(LAST_STEP), "--local-dir", local_dir(workdir, tag))
    if where == "cluster":
        base += ["--address", "auto"]
    ev1, ev2 = (os.path.join(workdir, f"{tag}-{i}.jsonl") for i in (1, 2))
    env = env_for(fw)
    first = second = watch = None
    old = []
    try:
        first = launch(base + ["--events", ev1], env, os.path.join(workdir, tag + "-1.log"))

        def reached():
            return any(e.get("ev") == "step" and e["rank"] == 0 and e["step"] >= KILL_STEP
                       for e in read_events(ev1))
        if not wait_for(reached, first, args.timeout):
            errors.append(f"{tag}: step {KILL_STEP} never came (rc={first.poll()}), see {tag}-1.log")
            return {}
        # Snapshot before the kill: afterwards the orphans have no parent to find them by.
        old = tree(first.pid)
        os.kill(first.pid, signal.SIGKILL)
        t_kill = time.time()
        first.wait()
        second = launch(base + ["--events", ev2], env, os.path.join(workdir, tag + "-2.log"))

        before = read_events(ev1)
        # Workers of a running cluster are not the driver's children; the
        # pids they logged find them.
        for pid in {e["pid"] for e in before if e.get("ev") == "step"}:
            try:
                old.append(psutil.Process(pid))
            except psutil.Error:
                pass
        watch = OrphanWatch(old, t_kill)
        at_kill = max(e["step"] for e in before
                      if e.get("ev") == "step" and e["rank"] == 0 and e["t"] <= t_kill)

        def first_step():
            return min((e for e in read_events(ev2) if e.get("ev") == "step"),
                       key=lambda e: e["t"], default=None)
        step = wait_for(first_step, second, args.timeout)
        orphans = len(alive(old))
        if step is None:
            errors.append(f"{tag}: the relaunch never stepped (rc={second.poll()}), see {tag}-2.log")
            return {}
        try:
            rc = second.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout"
        if rc != 0:
            errors.append(f"{tag}: the relaunch exited rc={rc}, see {tag}-2.log")
        left = watch.stop(ORPHAN_GRACE_S)
        driver = next(e["t"] for e in read_events(ev2) if e.get("ev") == "driver_start")
        restored = step["restored_from"] or 0
        if step["restored_from"] is None:
            notes.append(f"{fw} {where}: the relaunch did not resume; it started from step 1")
        figs = {"kill_to_first_step_s": step["t"] - t_kill,
                "relaunch_start_to_first_step_s": step["t"] - driver,
                "steps_lost": at_kill - restored,
                "restored_from_step": restored,
                "orphans_at_first_step": orphans,
                "orphans_left_at_end": left}
        if watch.gone_s is not None:
            figs["orphans_gone_after_kill_s"] = watch.gone_s
        if left:
            names = sorted({p.name() for p in alive(old)})
            notes.append(f"{fw} {where}: {left} processes of the killed run still alive "
                         f"{ORPHAN_GRACE_S} s after the relaunch ended: {names}")
        log(f"{tag}: killed at step {at_kill}, restored from {step['restored_from']}: "
            + json.dumps({k: round(v, 3) for k, v in figs.items()}))
        return figs
    finally:
        if watch is not None:
            watch.stop(0)
        sweep(old, first, second)


def cluster_procs(fw, before, since):
    """The processes our `ray start` / `outlast start` left behind, with their children."""
    roots = proctree.ours(PRIVATE[fw], os.environ[PRIVATE[fw]], before, since)
    procs = {p.pid: p for p in roots}
    for p in roots:
        try:
            procs.update({c.pid: c for c in p.children(recursive=True)})
        except psutil.Error:
            pass
    return list(procs.values())


def cli(fw, verb, workdir, timeout, extra=()):
    with open(os.path.join(workdir, f"{fw}-{verb}.log"), "a") as out:
        return subprocess.run([FW[fw]["cli"], *FW[fw][verb], *extra], env=env_for(fw), cwd=ROOT,
                              stdout=out, stderr=subprocess.STDOUT, timeout=timeout,
                              check=False).returncode


def start_cluster(fw, workdir):
    # Ray's fixed default ports may belong to someone else's cluster here.
    extra = [f"--{flag}={free_port()}" for flag in (
        "port", "dashboard-port", "dashboard-agent-listen-port")
    ] if fw == "ray" else []
    return cli(fw, "start", workdir, 180, extra) == 0


def stop_cluster(fw, workdir, before, since, errors):
    procs = cluster_procs(fw, before, since)
    if FW[fw]["stop"]:
        try:
            cli(fw, "stop", workdir, 120)
        except (OSError, subprocess.SubprocessError) as e:
            errors.append(f"{fw} stop: {e!r}")
    n = len(alive(procs))
    proctree.kill_all(alive(procs))
    if fw == "ray":
        # What `ray stop` would remove: else the next ray.init() joins the dead cluster.
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(os.environ["RAY_TMPDIR"], "ray", "ray_current_cluster"))
    log(f"{fw} cluster stopped ({n} processes left to kill)")


def with_retry(measure, errors, notes):
    """One more try after a failure; the machine is shared, and another
    user's `ray stop --force` kills every Ray process on it. A failure that
    a retry recovers from is kept as a note."""
    failed = []
    got = measure(failed)
    if not got:
        got = measure(failed)
        (notes if got else errors).extend(f"retried after: {e}" if got else e for e in failed)
    else:
        errors.extend(failed)
    return got


def part_kill(frameworks, workdir, args, errors, notes):
    figures = {fw: {} for fw in frameworks}
    for fw in frameworks:
        for where in ("cold", "cluster"):
            before, since = proctree.pids(), time.time()
            try:
                if where == "cluster" and not start_cluster(fw, workdir):
                    errors.append(f"{fw} start failed, see {workdir}/{fw}-start.log")
                    continue
                def measure(err, fw=fw, where=where):
                    return kill_once(fw, where, workdir, args, err, notes)
                runs = [with_retry(measure, errors, notes) for _ in range(args.repeat)]
                for k, v in median_figures([r for r in runs if r]).items():
                    figures[fw][f"kill.{where}.{k}"] = v
            except (OSError, subprocess.SubprocessError) as e:
                errors.append(f"kill {fw} {where}: {e!r}")
            finally:
                if where == "cluster":
                    stop_cluster(fw, workdir, before, since, errors)
    return figures


def run_floor(repeat, workdir, errors):
    runs = []
    for i in range(repeat):
        events = os.path.join(workdir, f"floor-{i}.jsonl")
        t0 = time.time()
        proc = launch(venvs.module(OUTLAST_PY, "bench.lib.floor", "--events", events), dict(os.environ),
                      os.path.join(workdir, f"floor-{i}.log"))
        try:
            rc = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            rc = "timeout"
        sweep([], proc)
        step = next((e for e in read_events(events) if e.get("ev") == "step"), None)
        if rc != 0 or step is None:
            errors.append(f"floor-{i}: rc={rc}")
            continue
        runs.append({"start_to_first_step_s": step["t"] - t0})
    return median_figures(runs)


# -- part 2: checkpoint overhead on training time ---------------------------------

def part_overhead(frameworks, workdir, args, errors, notes):
    figures = {fw: {} for fw in frameworks}
    for fw in frameworks:
        figures[fw] = with_retry(lambda err, fw=fw: overhead_once(fw, workdir, args, err),
                                 errors, notes)
    return figures


def overhead_once(fw, workdir, args, errors):
    tag = f"overhead-{fw}-{time.time_ns()}"
    events = os.path.join(workdir, tag + ".jsonl")
    cmd = venvs.module(FW[fw]["python"], "bench.lib.durable_scenario", "--framework", fw, "--mode", "overhead",
                       "--events", events, "--storage", os.path.join(workdir, tag + "-storage"),
                       "--name", "durable-overhead", "--repeat", str(args.repeat),
                       "--local-dir", local_dir(workdir, tag))
    proc = launch(cmd, env_for(fw), os.path.join(workdir, tag + ".log"))
    try:
        # Ray takes ~150 s a round here (start-up, then ~2 s per report).
        rc = proc.wait(timeout=120 + 150 * args.repeat)
    except subprocess.TimeoutExpired:
        rc = "timeout"
    finally:
        sweep(tree(proc.pid), proc)
    by = {(e["rep"], e["phase"]): e for e in read_events(events) if e.get("ev") == "phase"}
    runs = []
    for rep in range(args.repeat):
        got = {ph: by.get((rep, ph)) for ph in ("bare", "metrics", "sync", "async")}
        if not all(got.values()):
            continue
        bare = got["bare"]["elapsed_s"]

        def pct(t, bare=bare):
            return 100 * (t - bare) / bare
        sync, asyn = got["sync"], got["async"]
        runs.append({
            "overhead.bare.ms_per_step": 1000 * bare / got["bare"]["steps"],
            "overhead.metrics_only.pct": pct(got["metrics"]["elapsed_s"]),
            "overhead.sync.pct": pct(sync["elapsed_s"]),
            "overhead.async.pct": pct(asyn["elapsed_s"]),
            # torch.save is the training script's, the same on both; what is
            # left is the framework's.
            "overhead.sync.pct_beyond_save": pct(sync["elapsed_s"] - sync["save_total_s"]),
            "overhead.async.pct_beyond_save": pct(asyn["elapsed_s"] - asyn["save_total_s"]),
            "overhead.sync.report_call_ms": 1000 * sync["report_s"],
            "overhead.async.report_call_ms": 1000 * asyn["report_s"],
            "overhead.torch_save_ms": 1000 * statistics.median([sync["save_s"], asyn["save_s"]]),
        })
    figs = median_figures(runs)
    log(f"{tag}: rc={rc} " + json.dumps({k: round(v, 2) for k, v in figs.items()}))
    if rc != 0 or len(runs) < args.repeat:
        errors.append(f"{tag}: rc={rc}, {len(by)} phase events, see {tag}.log")
        return {}
    return figs


# -- part 3: upload throughput ----------------------------------------------------

def probe(method, src, dest, workdir, env, errors):
    python = FW["ray" if method == "ray" else "outlast"]["python"]
    os.sync()  # the previous run's writeback must not land in this one's time
    logfile = os.path.join(workdir, f"probe-{method}.log")
    try:
        r = subprocess.run(venvs.module(python, "bench.lib.upload_probe", "--method", method, "--src", src,
                                        "--dest", dest),
                           env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
                           check=False)
        with open(logfile, "a") as f:
            f.write(r.stdout + r.stderr)
        out = json.loads(r.stdout.strip().splitlines()[-1])
        return out["bytes"] / out["s"] / 1e6
    except (OSError, subprocess.SubprocessError, ValueError, IndexError, KeyError) as e:
        errors.append(f"upload {method} -> {dest}: {e!r}, see {logfile}")
        return None


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def part_upload(frameworks, workdir, args, errors):
    src = os.path.join(workdir, "upload-src")
    os.makedirs(src)
    for i in range(UPLOAD_FILES):
        with open(os.path.join(src, f"shard-{i}.bin"), "wb") as f:
            # Incompressible, like trained weights.
            f.writelines(os.urandom(2**20) for _ in range(UPLOAD_FILE_MB))
    s3_src = os.path.join(workdir, "upload-src-s3")
    os.makedirs(s3_src)
    for i in range(S3_FILES):
        os.link(os.path.join(src, f"shard-{i}.bin"), os.path.join(s3_src, f"shard-{i}.bin"))
    mb = {"local": UPLOAD_FILES * UPLOAD_FILE_MB * 2**20 / 1e6, "s3": S3_FILES * UPLOAD_FILE_MB * 2**20 / 1e6}

    results = {}  # (where, method) -> [MB/s]
    methods = {"local": ["copytree"] + frameworks, "s3": ["fsspec"] + frameworks}
    dest_root = os.path.join(workdir, "upload-dest")
    # Cheap, and noisy on a small shared machine: never fewer than 5 (S3: 2).
    for i in range(max(5, args.repeat)):
        for m in methods["local"]:
            dest = os.path.join(dest_root, f"{m}-{i}")
            results.setdefault(("local", m), []).append(
                probe(m, src, dest, workdir, env_for(m), errors))
            shutil.rmtree(dest_root, ignore_errors=True)

    moto = None
    try:
        moto, url = harness.start_moto(workdir, OUTLAST_PY)
        s3env = {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "testing",
                 "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
        subprocess.run([FW["outlast"]["python"], "-c",
                        "import boto3; boto3.client('s3').create_bucket(Bucket='bench')"],
                       env=env_for("outlast", **s3env), check=True, timeout=60)
        for i in range(max(2, args.repeat)):
            for m in methods["s3"]:
                results.setdefault(("s3", m), []).append(
                    probe(m, s3_src, f"s3://bench/{m}-{i}", workdir, env_for(m, **s3env), errors))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        errors.append(f"s3: {e!r}")
    finally:
        sweep([], moto)

    figures = {fw: {} for fw in frameworks}
    limits = {}
    for (where, m), vals in results.items():
        vals = [v for v in vals if v]
        if not vals:
            continue
        v = statistics.median(vals)
        if m in FW:
            figures[m][f"upload.{where}.MBps"] = v
        else:
            limits[f"upload.{where}.plain_{m}_MBps"] = v
    for where, plain in (("local", "copytree"), ("s3", "fsspec")):
        limit = limits.get(f"upload.{where}.plain_{plain}_MBps")
        for fw in frameworks:
            got = figures[fw].get(f"upload.{where}.MBps")
            if limit and got:
                figures[fw][f"upload.{where}.fraction_of_plain"] = got / limit
    limits["upload.local.MB"], limits["upload.s3.MB"] = mb["local"], mb["s3"]
    log("upload: " + json.dumps({fw: {k: round(v, 2) for k, v in f.items()}
                                 for fw, f in figures.items()}) + " " + json.dumps(limits))
    return figures, limits


# -- the document -----------------------------------------------------------------

def versions(fw):
    code = ("import importlib.metadata as m, json, torch\n"
            f"print(json.dumps({{'torch': torch.__version__, '{fw}': m.version('{fw}')}}))")
    try:
        r = subprocess.run([FW[fw]["python"], "-c", code], env=env_for(fw),
                           capture_output=True, text=True, timeout=120, check=False)
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return {fw: None}


def higher_is_better(key):
    return key.endswith(("MBps", "fraction_of_plain", "restored_from_step"))


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=sorted(FW))
    p.add_argument("--parts", default="1,2,3", help="comma-separated: 1 kill, 2 overhead, 3 upload")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--timeout", type=int, default=240,
                   help="seconds for one launch to reach its step (Ray's cold start is ~30 s)")
    args = p.parse_args()
    parts = {int(x) for x in args.parts.split(",") if x.strip()}
    frameworks, workdir = harness.prepare_both(args.only, "outlast-durable-")
    log(f"logs and events in {workdir}")
    load_before = os.getloadavg()
    started = time.time()
    figures = {fw: {} for fw in frameworks}
    floor, limits, errors, notes = {}, {}, [], []
    try:
        if 1 in parts:
            floor = run_floor(args.repeat, workdir, errors)
            log(f"floor: {floor}")
            for fw, f in part_kill(frameworks, workdir, args, errors, notes).items():
                figures[fw].update(f)
        if 2 in parts:
            for fw, f in part_overhead(frameworks, workdir, args, errors, notes).items():
                figures[fw].update(f)
        if 3 in parts:
            got, limits = part_upload(frameworks, workdir, args, errors)
            for fw, f in got.items():
                figures[fw].update(f)
    finally:
        # The checkpoints are big; the logs and events stay for reading.
        for name in os.listdir(workdir):
            if name.endswith(("-storage", "-local")) or name.startswith("upload-"):
                shutil.rmtree(os.path.join(workdir, name), ignore_errors=True)

    table = {}
    for k in sorted({k for fw in frameworks for k in figures[fw]}):
        o, r = figures.get("outlast", {}).get(k), figures.get("ray", {}).get(k)
        hib = higher_is_better(k)
        num, den = (o, r) if hib else (r, o)
        ratio = num / den if num is not None and den and den > 0 and num >= 0 else None
        table[k] = {"outlast": o, "ray": r, "ratio": ratio, "better": "higher" if hib else "lower"}
    mem = psutil.virtual_memory().total / 2**30
    doc = {
        "figures": table,
        "floor": floor,
        "limits": limits,
        "machine": {"nproc": os.cpu_count(), "mem_gib": round(mem, 1),
                    "platform": platform.platform(), "python": platform.python_version(),
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                    "versions": {fw: versions(fw) for fw in frameworks}},
        "settings": {"repeat": args.repeat, "parts": sorted(parts), "kill_step": KILL_STEP,
                     "ckpt_every": 10, "overhead_steps": 200, "ckpt_mb": 20,
                     "step_s": 0.05},
        "wall_s": round(time.time() - started, 1),
        "notes": notes,
        "errors": errors,
        "logs": workdir,
    }
    print(json.dumps(doc, indent=2))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
