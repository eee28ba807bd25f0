"""Preemption on Slurm: outlast (`outlast slurm`) beside Ray 2.60 (Ray's Slurm recipe), same allocation.

    python3 -m bench.slurm [--repeats 2] [--frameworks outlast,ray]

On a local Slurm cluster (3 nodes on this host, started here unless one of this benchmark's
is running; needs root and ./scripts/setup-slurm), each repetition submits bench/lib/slurm_train.py
as a 2-node job of the low partition, lets it train, then submits a 2-node job of the high
partition, which preempts it (PreemptMode=REQUEUE, GraceTime=30). The figures, from the high
job's submission:

- outlast: `exec outlast slurm -- python -m bench.lib.slurm_train` with `--signal=B:USR1@30`;
  USR1 -> every node drained -> get_preemption_info() on every rank -> just-in-time checkpoint
  committed -> `scontrol requeue`.
- Ray: Ray's documented recipe (`ray start --head` on the first node, `ray start --address`
  on the other, by srun, then the driver); Slurm's SIGTERM after the grace time ends it and
  Slurm requeues it; Ray Train resumes from storage with the same RunConfig(name).

Also: first step after the requeue, steps lost (steps trained before the preemption that the
resumed run trains again); and, outlast only, the same from `scontrol update nodename=X
state=drain` on the job's batch host. One JSON document on stdout; progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from bench.lib.events import read_events
from bench.lib.harness import summarize_runs
from bench.lib.venvs import OUTLAST_PY, RAY_PY, ROOT
from outlast.slurm.local_cluster import Layout, LocalSlurm

FIGURES = ("signal_s", "preemption_info_all_ranks_s", "jit_checkpoint_committed_s", "first_step_after_requeue_s",
           "steps_lost")


def log(msg: str) -> None:
    print(f"[slurm {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def outlast_script(d: Path) -> str:
    # The job runs in the repository root (sbatch --chdir), where `-m bench.lib.slurm_train` imports.
    py = OUTLAST_PY
    return f"""#!/bin/bash
#SBATCH -N 2 --requeue --signal=B:USR1@30 --open-mode=append
exec {py} -m outlast.cli.main slurm -- {py} -m bench.lib.slurm_train --framework outlast \\
    --storage {d / 'storage'} --name run --events {d / 'events.jsonl'}
"""


def ray_script(d: Path) -> str:
    """Ray's recipe for Slurm (docs: "Deploying on Slurm"), with the nodes of this one host told apart by port."""
    bin_ = os.path.dirname(RAY_PY)
    return f"""#!/bin/bash
#SBATCH -N 2 --requeue --open-mode=append
export PATH={bin_}:$PATH RAY_TMPDIR=/tmp/rb-$SLURM_JOB_ID-$SLURM_RESTART_COUNT RAY_TRAIN_V2_ENABLED=1 RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled
mkdir -p $RAY_TMPDIR
nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
port=$((9379 + SLURM_RESTART_COUNT))  # below Ray's worker ports (10002-19999)
head_ip=$(hostname -I | cut -d" " -f1)
srun --nodes=1 --ntasks=1 -w "${{nodes[0]}}" --overlap ray start --head --node-ip-address=$head_ip --port=$port \\
    --num-cpus=1 --temp-dir=$RAY_TMPDIR --block &
for _ in $(seq 120); do ray status --address=$head_ip:$port >/dev/null 2>&1 && break; sleep 1; done
for node in "${{nodes[@]:1}}"; do
  srun --nodes=1 --ntasks=1 -w "$node" --overlap ray start --address=$head_ip:$port --num-cpus=1 --block &
done
for _ in $(seq 120); do [ "$(ray status --address=$head_ip:$port 2>/dev/null | grep -c node_)" -ge 2 ] && break; sleep 1; done
python -m bench.lib.slurm_train --framework ray --address $head_ip:$port \\
    --storage {d / 'storage'} --name run --events {d / 'events.jsonl'}
"""


def wait(cond, timeout_s: float, what: str) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.2)
    log(f"gave up after {timeout_s:.0f} s waiting for {what}")
    return False


def signal_time(out: Path) -> float | None:
    """When `outlast slurm` got USR1 (its log line's local time)."""
    for line in out.read_text(errors="replace").splitlines() if out.exists() else []:
        if "got SIGUSR1 from Slurm" in line:
            return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return None


def jit_commit_time(storage: Path) -> float | None:
    try:
        state = json.loads((storage / "run" / "run_state.json").read_text())
    except (OSError, ValueError):
        return None
    times = [c["committed_at"] for c in state.get("checkpoints", []) if c.get("metrics", {}).get("jit")]
    return min(times) if times else None


def scenario(slurm: LocalSlurm, framework: str, warm_steps: int, trigger: str = "preempt") -> dict:
    d = Path(tempfile.mkdtemp(prefix=f"bench-slurm-{framework}-"))
    script = d / "job.sbatch"
    script.write_text(outlast_script(d) if framework == "outlast" else ray_script(d))
    env = {**os.environ, **slurm.layout.env}
    out, events = d / "job.out", d / "events.jsonl"
    job = subprocess.run(["sbatch", "--parsable", "-o", str(out), "--chdir", str(ROOT), str(script)], env=env,
                         capture_output=True, text=True, check=True).stdout.strip()
    result: dict = {"job": job}
    try:
        if not wait(lambda: any(e["ev"] == "step" and e["step"] >= warm_steps for e in read_events(events)), 300,
                    f"{framework} to train {warm_steps} steps"):
            result["error"] = "did not train"
            return result
        t0 = time.time()
        if trigger == "drain":
            drained = slurm._slurm(["scontrol", "show", "job", "-o", job]).split("BatchHost=")[1].split()[0]
            slurm._slurm(["scontrol", "update", f"nodename={drained}", "state=drain", "reason=bench"])
            log(f"{framework}: job {job}: node {drained} drained by scontrol")
        else:
            high = subprocess.run(["sbatch", "--parsable", "-p", "high", "-N", "2", "-o", "/dev/null", "--wrap",
                                   "sleep 1"], env=env, capture_output=True, text=True, check=True).stdout.strip()
            log(f"{framework}: job {job} preempted by high job {high}")

        def resumed():
            return [e for e in read_events(events) if e["ev"] == "step" and e["t"] > t0 and
                    any(a["ev"] == "attempt_start" and a["restored_from"] is not None and a["t"] > t0 and
                        a["t"] <= e["t"] for a in read_events(events))]
        if not wait(lambda: bool(resumed()), 300, f"{framework} to resume after the requeue"):
            state = slurm._slurm(["scontrol", "show", "job", "-o", job], check=False) or ""
            fields = dict(f.split("=", 1) for f in state.split() if "=" in f)
            result["error"] = (f"did not resume: the job is {fields.get('JobState', '?')} after "
                               f"{fields.get('Restarts', '?')} requeue(s)")
            return result
        evs = read_events(events)
        starts = [a for a in evs if a["ev"] == "attempt_start" and a["restored_from"] is not None and a["t"] > t0]
        restart_t = min(a["t"] for a in starts)
        notices = {}
        for e in evs:
            if e["ev"] == "notice" and e["t"] > t0:
                notices.setdefault(e["rank"], e["t"])
        sig = signal_time(out)
        commit = jit_commit_time(d / "storage")
        before = max(e["step"] for e in evs if e["ev"] == "step" and e["t"] < restart_t)
        restored = starts[0]["restored_from"]
        result.update({
            "signal_s": sig - t0 if sig else None,
            "preemption_info_all_ranks_s": max(notices.values()) - t0 if len(notices) == 2 else None,
            "jit_checkpoint_committed_s": commit - t0 if commit else None,
            "first_step_after_requeue_s": min(e["t"] for e in resumed()) - t0,
            "steps_lost": before - restored,
            "restored_step": restored,
            "last_step_before_preemption": before,
        })
        return result
    finally:
        subprocess.run(["scancel", job], env=env, capture_output=True)
        wait(lambda: job not in slurm.jobs(), 60, f"job {job} to end")
        if trigger == "drain":
            slurm._slurm(["scontrol", "update", f"nodename={','.join(slurm.layout.node_names)}", "state=resume"],
                         check=False)


def summary(runs: list[dict]) -> dict:
    return summarize_runs([{k: r.get(k) for k in FIGURES} for r in runs])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--frameworks", default="outlast,ray")
    p.add_argument("--warm-steps", type=int, default=30)
    p.add_argument("--drain-repeats", type=int, default=2,
                   help="outlast only: a node of the job drained with scontrol (Ray's recipe does not watch Slurm's "
                        "node states: its job trains on until the node goes)")
    args = p.parse_args()
    frameworks = [f for f in args.frameworks.split(",") if f]
    if "ray" in frameworks and not os.path.exists(RAY_PY):
        log("bench/.ray-venv is missing (bench/setup_ray_venv.sh): the Ray side is left out")
        frameworks.remove("ray")
    slurm = LocalSlurm(Layout(root=Path(f"/tmp/outlast-slurm-bench-{os.getuid()}"), ctld_port=17317,
                              first_node_port=17401))
    started = not slurm.ping()
    slurm.start()
    try:
        runs = {f: [] for f in frameworks}
        for i in range(args.repeats):
            for f in frameworks:
                log(f"{f}, repetition {i + 1}/{args.repeats}")
                runs[f].append(scenario(slurm, f, args.warm_steps))
                log(json.dumps(runs[f][-1]))
        drains = []
        for i in range(args.drain_repeats):
            log(f"outlast, node drained by scontrol, repetition {i + 1}/{args.drain_repeats}")
            drains.append(scenario(slurm, "outlast", args.warm_steps, trigger="drain"))
            log(json.dumps(drains[-1]))
    finally:
        if started:
            slurm.stop()
    result = {"machine": {"cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]},
              "slurm": "22.05, local: 3 nodes on this host, low partition GraceTime=30, preempt_send_user_signal",
              "runs": runs, "summary": {f: summary(r) for f, r in runs.items()},
              "outlast_node_drained_by_scontrol": {"runs": drains, "summary": summary(drains) if drains else None}}
    if "outlast" in runs and "ray" in runs:
        o, r = result["summary"]["outlast"], result["summary"]["ray"]
        result["ratio_ray_over_outlast"] = {
            k: r[k]["median"] / o[k]["median"] for k in ("first_step_after_requeue_s",)
            if o.get(k) and r.get(k) and o[k]["median"] > 0}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
