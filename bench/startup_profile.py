"""Where a cold start's memory and time go, per process: the core scenario's startup run on outlast.

    python3 -m bench.startup_profile [--repeat N] [--out bench/results/startup-profile.json]

Runs bench/lib/core_scenario.py (--mode startup, cold: fit() starts the node) with OUTLAST_TRACE_FILE
set, and samples /proc/PID/smaps_rollup of every process of the run every 50 ms. At the moment of the
run's largest total PSS (what bench/core.py reports), it keeps each process's PSS split into anonymous and
file-backed pages, its own pages (USS: private clean + private dirty), and the largest mappings of
/proc/PID/smaps (read again whenever the total reaches a new peak). Each process gets its role: the driver,
the agent, the fork server, a rank (a child the fork server forked for a ForkChild), a spare, a standby.
The timeline is the trace's marks, in seconds from the driver's Popen. Then `python -X importtime` of
what each process imports on the way (the driver's script, the agent, the fork server's preload), the
import's total and the part that is outlast's own modules. Last, what a rank's first full collection
costs it (bench/lib/fork_collect.py), forked from a server that froze its objects and from one that did not;
what each module of the fork server's preload adds to its memory (`preload_memory`); and the CPU time of
that preload with its full collections held off, as the server does, and not (`preload_cpu`).
"""
import argparse
import collections
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

from bench.lib import venvs
from bench.lib.venvs import OUTLAST_PY, ROOT

venvs.in_project_venv(__spec__.name, "psutil")

import psutil  # noqa: E402  (ensured above)

from bench.lib import harness, proctree  # noqa: E402
from bench.lib.events import read_events  # noqa: E402

MiB = 1024 * 1024
TOP_MAPPINGS = 8
MAPS_EVERY_S = 0.5


def rollup(pid):
    """{field: bytes} of /proc/PID/smaps_rollup."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


def mappings(pid):
    """PSS, anonymous and private bytes by mapping name (a file's base name, [heap], [anon], [stack])."""
    by = collections.defaultdict(collections.Counter)
    name = None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            parts = line.split()
            if not parts[0].endswith(":"):
                name = os.path.basename(parts[5]) if len(parts) > 5 else "[anon]"
            elif len(parts) == 3 and parts[0] in ("Pss:", "Anonymous:", "Private_Dirty:", "Private_Clean:"):
                by[name][parts[0].rstrip(":")] += int(parts[1]) * 1024
    top = sorted(by.items(), key=lambda kv: -kv[1]["Pss"])[:TOP_MAPPINGS]
    return [{"mapping": n, "pss_mib": c["Pss"] / MiB, "anon_mib": c["Anonymous"] / MiB,
             "own_mib": (c["Private_Dirty"] + c["Private_Clean"]) / MiB} for n, c in top]


def figures(r):
    return {"pss_mib": r.get("Pss", 0) / MiB, "pss_anon_mib": r.get("Pss_Anon", 0) / MiB,
            "pss_file_mib": r.get("Pss_File", 0) / MiB,
            "uss_mib": (r.get("Private_Clean", 0) + r.get("Private_Dirty", 0)) / MiB,
            "shared_mib": (r.get("Shared_Clean", 0) + r.get("Shared_Dirty", 0)) / MiB,
            "rss_mib": r.get("Rss", 0) / MiB}


class Sampler:
    def __init__(self, root_pid, interval=0.05):
        self.root = psutil.Process(root_pid)
        self.interval = interval
        self.peak_total = 0
        self.peak = {}  # pid -> {"cmdline", "ppid", figures, "mappings"}
        self.peak_t = None
        self.seen = {}  # pid -> (ppid, cmdline)
        self._maps_at = 0.0
        self.maps_t = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _procs(self):
        try:
            return [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            return []

    def _run(self):
        while not self._stop.is_set():
            started = time.monotonic()
            rolls = {}
            for p in self._procs():
                try:
                    rolls[p.pid] = rollup(p.pid)
                    if p.pid not in self.seen:
                        self.seen[p.pid] = (p.ppid(), p.cmdline())
                except (OSError, psutil.Error):
                    continue
            total = sum(r.get("Pss", 0) for r in rolls.values())
            if total > self.peak_total:
                self.peak_total, self.peak_t = total, time.time()
                # Reading every mapping of a process with torch imported takes a core for tens of ms: only
                # at a new peak, and at most every MAPS_EVERY_S (the mappings may be that much older).
                fresh = time.monotonic() - self._maps_at >= MAPS_EVERY_S
                if fresh:
                    self._maps_at = time.monotonic()
                    self.maps_t = self.peak_t
                peak = {}
                for pid, r in rolls.items():
                    maps = self.peak.get(pid, {}).get("mappings", [])
                    if fresh:
                        try:
                            maps = mappings(pid)
                        except OSError:
                            maps = []
                    peak[pid] = {**figures(r), "mappings": maps}
                self.peak = peak
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def start(self):
        self._thread.start()

    def stop(self):
        self._stop.set()
        self._thread.join()


def roles(sampler, trace):
    """pid -> role, from the process tree and the fork server's trace marks."""
    forked = {e["child"]: e["phase"] for e in trace if e["phase"] in ("zygote.fork", "zygote.spare", "zygote.standby")}
    out = {}
    # A forked child keeps its server's command line: the trace says what it is.
    for pid, (_, cmd) in sampler.seen.items():
        line = " ".join(cmd)
        if pid == sampler.root.pid:
            out[pid] = "driver"
        elif forked.get(pid) == "zygote.fork":
            out[pid] = "rank"
        elif forked.get(pid) == "zygote.spare":
            out[pid] = "spare"
        elif forked.get(pid) == "zygote.standby":
            out[pid] = "standby fork server"
        elif "outlast.agent.zygote" in line:
            out[pid] = "fork server"
        elif "-m outlast.agent" in line:
            out[pid] = "standby agent" if "--standby-fd" in line else "agent"
        else:
            out[pid] = "other: " + line[:80]
    return out


def one_run(workdir, i):
    events = os.path.join(workdir, f"startup-{i}.jsonl")
    trace_file = os.path.join(workdir, f"trace-{i}.jsonl")
    env = venvs.with_root(dict(os.environ, OUTLAST_TRACE_FILE=trace_file))
    cmd = venvs.module(OUTLAST_PY, "bench.lib.core_scenario", "--framework", "outlast", "--mode", "startup",
                       "--events", events)
    before, since = proctree.pids(), time.time()
    with open(os.path.join(workdir, f"startup-{i}.log"), "w") as log:
        t0 = time.time()
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    sampler = Sampler(proc.pid)
    sampler.start()
    try:
        rc = proc.wait(timeout=300)
    finally:
        sampler.stop()
        proctree.killpg(proc.pid)
        proc.wait()
    left = proctree.ours("OUTLAST_HOME", os.environ["OUTLAST_HOME"], before, since)
    if left:
        proctree.kill_all(left)
    trace = read_events(trace_file)
    steps = [e for e in read_events(events) if e.get("ev") == "step" and e["rank"] == 0]
    role = roles(sampler, trace)
    per_process = sorted(({"pid": pid, "role": role.get(pid, "?"), **figs} for pid, figs in sampler.peak.items()),
                         key=lambda d: -d["pss_mib"])
    by_role = collections.defaultdict(float)
    for d in per_process:
        by_role[d["role"]] += d["pss_mib"]
    # The controller's polls repeat every second: their first and last are enough.
    timeline = [{"t": round(e["t"] - t0, 3), "role": role.get(e["pid"], "?"), "phase": e["phase"]}
                for e in trace if not e["phase"].startswith(("controller.query", "controller.table", "storage."))]
    return {"rc": rc, "peak_pss_mib": sampler.peak_total / MiB,
            "peak_at_s": round(sampler.peak_t - t0, 3) if sampler.peak_t else None,
            "mappings_at_s": round(sampler.maps_t - t0, 3) if sampler.maps_t else None,
            "first_step_s": round(steps[0]["t"] - t0, 3) if steps else None,
            "pss_mib_by_role": dict(by_role), "processes": per_process, "timeline": timeline}


IMPORTS = {
    # What each process imports before it does its work (a driver's script imports outlast.train).
    "driver": "import bench.lib.core_scenario, outlast.train, outlast.train.torch",
    "agent": "import outlast.agent.__main__",
    "fork server": "import outlast.agent.zygote; outlast.agent.zygote.preload(__import__('outlast.client.preload')"
                   ".client.preload.default_preload())",
}


def import_times():
    out = {}
    for who, code in IMPORTS.items():
        r = subprocess.run([OUTLAST_PY, "-X", "importtime", "-c", code], env=venvs.with_root(dict(os.environ)),
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
        total = outlast_self = torch_cum = 0
        for line in r.stderr.splitlines():
            if not line.startswith("import time:") or "self [us]" in line:
                continue
            self_us, cum_us, name = line[len("import time:"):].split("|")
            top = name.strip().split(".")[0]
            if not name[1:].startswith(" "):  # a top-level import: "| name", not "|   name"
                total += int(cum_us)
                if top == "torch":
                    torch_cum += int(cum_us)
            if top == "outlast":
                outlast_self += int(self_us)
        out[who] = {"total_s": total / 1e6, "torch_s": torch_cum / 1e6, "outlast_own_s": outlast_self / 1e6}
    return out


PRELOAD_MEMORY = """
import importlib, json, sys, tracemalloc
from outlast.agent import zygote
from outlast.client.preload import default_preload
def rollup():
    with open("/proc/self/smaps_rollup") as f:
        return {l.split(":")[0]: int(l.split()[1]) / 1024 for l in f if l.rstrip().endswith("kB")}
traced = sys.argv[1] == "traced"
if traced:
    tracemalloc.start()
steps, before = [], rollup()
for name in [*default_preload(), zygote.WORKER_ENTRY, zygote.TASK_ENTRY]:
    importlib.import_module(name)
    now = rollup()
    steps.append({"module": name, "python_objects_mib": tracemalloc.get_traced_memory()[0] / 2**20} if traced else
                 {"module": name, "rss_mib": now["Rss"] - before["Rss"], "anon_mib": now["Anonymous"] - before["Anonymous"]})
    before = now
print(json.dumps({"steps": steps, "rss_mib": before["Rss"], "anon_mib": before["Anonymous"]}))
"""


def preload_memory():
    """What each module of the fork server's preload adds, in order: resident and anonymous MiB (smaps_rollup);
    and, in a second Python (tracemalloc's own bookkeeping would swell the first's), the Python objects allocated
    by then (tracemalloc's running total)."""
    out = {}
    for how in ("resident", "traced"):
        r = subprocess.run([OUTLAST_PY, "-c", PRELOAD_MEMORY, how], env=venvs.with_root(dict(os.environ)), cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
        out[how] = harness.last_document(r.stdout) or {"error": r.stderr[-2000:]}
    return out


PRELOAD_CPU = """
import importlib, json, resource, sys
from outlast.agent import zygote
from outlast.client.preload import default_preload
if sys.argv[1] == "held-off":
    zygote.preload(default_preload())  # what the fork server runs: no full collection while it imports
else:  # the same imports with the collector as it is
    for name in [*default_preload(), zygote.WORKER_ENTRY, zygote.TASK_ENTRY]:
        importlib.import_module(name)
ru = resource.getrusage(resource.RUSAGE_SELF)
with open("/proc/self/smaps_rollup") as f:
    rss = next(int(l.split()[1]) / 1024 for l in f if l.startswith("Rss:"))
print(json.dumps({"cpu_s": ru.ru_utime + ru.ru_stime, "rss_mib": rss}))
"""


def preload_cpu(repeat):
    """The CPU time of a Python that imports the fork server's preload, with full collections held off (as
    zygote.preload does) and not, interleaved; CPU rather than wall time, which the machine's load moves more."""
    out = {"held-off": [], "default": []}
    for _ in range(repeat):
        for how in out:
            r = subprocess.run([OUTLAST_PY, "-c", PRELOAD_CPU, how], env=venvs.with_root(dict(os.environ)), cwd=ROOT,
                               capture_output=True, text=True, timeout=300)
            doc = harness.last_document(r.stdout)
            if doc:
                out[how].append(doc)
    return out


def collections_after_fork(repeat):
    """bench/lib/fork_collect.py, frozen and unfrozen, interleaved."""
    out = {"frozen": [], "unfrozen": []}
    for _ in range(repeat):
        for mode in out:
            r = subprocess.run(venvs.module(OUTLAST_PY, "bench.lib.fork_collect", mode),
                               env=venvs.with_root(dict(os.environ)), cwd=ROOT, capture_output=True, text=True,
                               timeout=180)
            doc = harness.last_document(r.stdout)
            if doc:
                out[mode].append(doc)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out")
    args = p.parse_args()
    workdir = tempfile.mkdtemp(prefix="outlast-startup-profile-")
    os.environ["OUTLAST_HOME"] = os.path.join(workdir, "home")
    runs = []
    for i in range(args.repeat):
        load = harness.load()
        run = one_run(workdir, i)
        run["load1"] = load[0]
        print(f"run {i}: peak {run['peak_pss_mib']:.0f} MiB at {run['peak_at_s']} s, first step "
              f"{run['first_step_s']} s, {json.dumps({k: round(v) for k, v in run['pss_mib_by_role'].items()})}",
              file=sys.stderr, flush=True)
        runs.append(run)
    # Whether outlast's modules had their bytecode (bench/core.py compiles them first; a checkout with
    # PYTHONDONTWRITEBYTECODE=1 compiles them at every import otherwise).
    compiled = importlib.util.cache_from_source(os.path.join(ROOT, "outlast", "agent", "zygote.py"))
    doc = {"benchmark": "startup_profile", "date": harness.stamp(), "outlast_byte_compiled": os.path.exists(compiled),
           "runs": runs, "imports": import_times(),
           "rank_full_collection": collections_after_fork(args.repeat), "preload_memory": preload_memory(),
           "preload_cpu": preload_cpu(args.repeat),
           "machine": harness.machine({}), "logs": workdir}
    harness.publish(doc, args.out)
    return 0 if all(r["rc"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
